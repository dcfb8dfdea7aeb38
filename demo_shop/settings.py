"""Settings of the demo shop.

The database comes from the environment: ``DISTLOCKS_DB`` is ``sqlite`` (the
default, no server needed), ``mariadb`` or ``postgresql``; ``DISTLOCKS_DB_NAME``
overrides the database name. Server hosts, users and passwords come from the
usual ``MYSQL_*`` / ``PG*`` variables; ``DEMO_ATOMIC_REQUESTS=1`` turns on
``ATOMIC_REQUESTS``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.core.management.utils import get_random_secret_key

# The apps, middleware and templates the tests' settings share.
from demo_shop.common_settings import INSTALLED_APPS as INSTALLED_APPS
from demo_shop.common_settings import MIDDLEWARE as MIDDLEWARE
from demo_shop.common_settings import TEMPLATES as TEMPLATES
from demo_shop.common_settings import database

BASE_DIR = Path(__file__).resolve().parent.parent


def _secret_key() -> str:
    # Never committed: from the environment, or made once per checkout.
    if key := os.environ.get("DJANGO_SECRET_KEY"):
        return key
    path = BASE_DIR / ".secret_key"
    if not path.exists():
        path.write_text(get_random_secret_key())
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

ROOT_URLCONF = "demo_shop.urls"
WSGI_APPLICATION = "demo_shop.wsgi.application"

DATABASES = {"default": database(os.environ.get("DISTLOCKS_DB", "sqlite"), os.environ.get("DISTLOCKS_DB_NAME"))}
# DEMO_ATOMIC_REQUESTS=1: every view in a transaction; the lock:<alias> views still commit before releasing.
DATABASES["default"]["ATOMIC_REQUESTS"] = os.environ.get("DEMO_ATOMIC_REQUESTS") == "1"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# DEMO_LOCK_TTL: every lock alias's lease in seconds (oversell --pause-every sets it to --lease).
DEMO_LOCK_TTL = float(os.environ.get("DEMO_LOCK_TTL", "30"))
DISTLOCKS: dict[str, dict[str, Any]] = {
    "default": {"BACKEND": "distlocks.backends.db.DatabaseBackend", "TTL": DEMO_LOCK_TTL}
}
# On MariaDB or PostgreSQL, the "native" lock alias: the server's own lock
# (GET_LOCK, advisory locks) on the same database.
NATIVE_LOCKS = {
    "mariadb": "distlocks.backends.mysql.MySQLLockBackend",
    "postgresql": "distlocks.backends.postgresql.AdvisoryLockBackend",
}
if _native := NATIVE_LOCKS.get(os.environ.get("DISTLOCKS_DB", "sqlite")):
    DISTLOCKS["native"] = {"BACKEND": _native}

CACHES: dict[str, dict[str, Any]] = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}


def redis_cache(url: str) -> dict[str, Any]:
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": url,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5},
    }


# DISTLOCKS_REDIS_URL=redis://127.0.0.1:6379/0 adds the "redis" lock alias.
if REDIS_URL := os.environ.get("DISTLOCKS_REDIS_URL"):
    CACHES["default"] = redis_cache(REDIS_URL)
    DISTLOCKS["redis"] = {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "default"}}

# DISTLOCKS_REDLOCK_URLS=redis://host1:6379/0,redis://host2:6379/0,... adds the
# "redlock" lock alias over those independent servers.
if REDLOCK_URLS := os.environ.get("DISTLOCKS_REDLOCK_URLS"):
    nodes = {f"redlock-{i}": redis_cache(url.strip()) for i, url in enumerate(REDLOCK_URLS.split(","), 1)}
    CACHES.update(nodes)
    DISTLOCKS["redlock"] = {"BACKEND": "distlocks.backends.redlock.RedlockBackend", "OPTIONS": {"CACHES": list(nodes)}}

# DISTLOCKS_ZOOKEEPER=127.0.0.1:2181 adds the "zookeeper" lock alias.
if ZOOKEEPER := os.environ.get("DISTLOCKS_ZOOKEEPER"):
    DISTLOCKS["zookeeper"] = {"BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend", "LOCATION": ZOOKEEPER}
for _entry in DISTLOCKS.values():
    _entry.setdefault("TTL", DEMO_LOCK_TTL)

# Celery (demo_shop/celery.py): the broker and result store from the environment.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/1")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6379/2")

# How long a buy "works" between reading the stock and writing it back: the
# window in which unsafe strategies race (the stock decrement of jdxhb's CSDN
# article on distributed locks, https://blog.csdn.net/jdxhb/article/details/146148374).
DEMO_WORK_SECONDS = float(os.environ.get("DEMO_WORK_MS", "5")) / 1000
# Where a worker told to pause (oversell --pause-every) leaves its pid for the command, which continues it; unset: no pauses.
DEMO_PAUSE_DIR = os.environ.get("DEMO_PAUSE_DIR", "")

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"distlocks": {"handlers": ["console"], "level": os.environ.get("DISTLOCKS_LOG_LEVEL", "WARNING")}},
}
