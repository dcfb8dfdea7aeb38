"""Settings of the benchmarks: distlocks and django-db-mutex on databases of their own."""

from __future__ import annotations

from demo_shop.databases import BASE_DIR, database

SECRET_KEY = "distlocks-bench-only"  # the benchmarks serve nothing
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "distlocks", "db_mutex"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": database("sqlite", str(BASE_DIR / "bench.sqlite3")),
    "mariadb": database("mariadb", "distlocks_bench"),
    "postgresql": database("postgresql", "distlocks_bench"),
}
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
# The scripts of Redis and ZooKeeper set their own aliases, on the servers they start.
DB_BACKEND = "distlocks.backends.db.DatabaseBackend"
DISTLOCKS = {
    "default": {"BACKEND": DB_BACKEND},
    "mariadb": {"BACKEND": DB_BACKEND, "OPTIONS": {"DATABASE": "mariadb"}},
    "postgresql": {"BACKEND": DB_BACKEND, "OPTIONS": {"DATABASE": "postgresql"}},
    "mariadb_native": {"BACKEND": "distlocks.backends.mysql.MySQLLockBackend", "OPTIONS": {"DATABASE": "mariadb"}},
    "postgresql_native": {
        "BACKEND": "distlocks.backends.postgresql.AdvisoryLockBackend",
        "OPTIONS": {"DATABASE": "postgresql"},
    },
}
