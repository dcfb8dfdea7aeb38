"""Settings of the benchmarks: distlocks and django-db-mutex on databases of their own."""

from __future__ import annotations

import os

from demo_shop.common_settings import BASE_DIR, database

# Another name lets two checkouts run the benchmarks at once (each run drops and recreates its databases).
NAME = os.environ.get("DISTLOCKS_BENCH_DATABASE", "distlocks_bench")

SECRET_KEY = "distlocks-bench-only"  # the benchmarks serve nothing
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "distlocks", "db_mutex"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": database("sqlite", str(BASE_DIR / f"{NAME}.sqlite3")),
    "mariadb": database("mariadb", NAME),
    "postgresql": database("postgresql", NAME),
}
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
# The scripts of Redis and ZooKeeper set their own aliases, on the servers they start.
DB_BACKEND = "distlocks.backends.db.DatabaseBackend"
NATIVE_BACKENDS = {
    "mariadb": "distlocks.backends.mysql.MySQLLockBackend",
    "postgresql": "distlocks.backends.postgresql.AdvisoryLockBackend",
}
DISTLOCKS = {
    "default": {"BACKEND": DB_BACKEND},
    **{database: {"BACKEND": DB_BACKEND, "OPTIONS": {"DATABASE": database}} for database in NATIVE_BACKENDS},
    **{
        f"{database}_native": {"BACKEND": path, "OPTIONS": {"DATABASE": database}}
        for database, path in NATIVE_BACKENDS.items()
    },
}
