"""Test settings: distlocks and the demo shop's app on SQLite, MariaDB and PostgreSQL at once.

They stand alone (the demo's settings follow its own environment variables):
every server a test reaches is named here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# What the demo's settings also have (the "as" keeps them: they are settings, not used here).
from demo_shop.common_settings import INSTALLED_APPS, database
from demo_shop.common_settings import MIDDLEWARE as MIDDLEWARE
from demo_shop.common_settings import TEMPLATES as TEMPLATES
from localservers import CLUSTER_PORTS, REDLOCK_PORTS, SENTINEL_PORTS, SENTINEL_SERVICE, ZK_PORT, redis_url

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "distlocks-tests-only"  # the tests serve nothing
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "demo_shop.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"


# Test databases of this run's own, so that two runs on one machine do not collide.
RUN = os.environ.setdefault("DISTLOCKS_TEST_RUN", str(os.getpid()))
DATABASES: dict[str, dict[str, Any]] = {
    "default": {
        **database("sqlite", os.environ.get("DISTLOCKS_DB_NAME") or str(BASE_DIR / "tests.sqlite3")),
        "TEST": {"NAME": str(BASE_DIR / f"test_distlocks_{RUN}.sqlite3")},
    },
    "mariadb": {**database("mariadb", "distlocks_tests"), "TEST": {"NAME": f"test_distlocks_{RUN}"}},
    "postgresql": {**database("postgresql", "distlocks_tests"), "TEST": {"NAME": f"test_distlocks_{RUN}"}},
    # Nothing listens there: for BackendUnavailable.
    "mariadb_down": {**database("mariadb", "nowhere"), "HOST": "127.0.0.1", "PORT": "1"},
    "postgresql_down": {**database("postgresql", "nowhere"), "HOST": "127.0.0.1", "PORT": "1"},
    # Servers that refuse: for BackendUnavailable naming what they said (no such user, no such database).
    "mariadb_denied": {
        **database("mariadb", "distlocks_tests"),
        "USER": "distlocks_nobody",
        "PASSWORD": "hunter2-s3cret",
    },
    "mariadb_missing": database("mariadb", f"distlocks_missing_{RUN}"),
    "postgresql_missing": database("postgresql", f"distlocks_missing_{RUN}"),
}
# Worker processes started by the tests use the test databases of their parent.
for _alias, _name in json.loads(os.environ.get("DISTLOCKS_TEST_DATABASES", "{}")).items():
    DATABASES[_alias]["NAME"] = _name
# The celery beat processes of tests/test_beat.py keep their schedule in another test database: a beat
# SIGSTOPped while it writes to SQLite would keep the file's one write lock from every other process.
if _default := os.environ.get("DISTLOCKS_TEST_DEFAULT_DATABASE"):
    DATABASES["default"] = DATABASES[_default]

CACHES: dict[str, dict[str, Any]] = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "redis": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": redis_url(),
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5},
    },
    # The same Redis through Django's own Redis cache (it passes OPTIONS to redis-py: lower-case names).
    "redis_django": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": redis_url(),
        "OPTIONS": {"socket_connect_timeout": 2, "socket_timeout": 5},
    },
    # Nothing listens there: for BackendUnavailable.
    "redis_down": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": "redis://127.0.0.1:1/0",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5},
    },
    **{
        f"r{i}": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": redis_url(port),
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 1},
        }
        for i, port in enumerate(REDLOCK_PORTS, 1)
    },
}

DB_BACKEND = "distlocks.backends.db.DatabaseBackend"
DISTLOCKS: dict[str, dict[str, Any]] = {
    "default": {"BACKEND": DB_BACKEND},
    "mariadb": {"BACKEND": DB_BACKEND, "OPTIONS": {"DATABASE": "mariadb"}},
    "postgresql": {"BACKEND": DB_BACKEND, "OPTIONS": {"DATABASE": "postgresql"}},
    "mariadb_native": {"BACKEND": "distlocks.backends.mysql.MySQLLockBackend", "OPTIONS": {"DATABASE": "mariadb"}},
    "postgresql_native": {
        "BACKEND": "distlocks.backends.postgresql.AdvisoryLockBackend",
        "OPTIONS": {"DATABASE": "postgresql"},
    },
    "redis": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis"}},
    "redis_django": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis_django"}},
    "redlock": {
        "BACKEND": "distlocks.backends.redlock.RedlockBackend",
        "OPTIONS": {"CACHES": [f"r{i}" for i in range(1, len(REDLOCK_PORTS) + 1)]},
    },
    "zookeeper": {
        "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
        "LOCATION": f"127.0.0.1:{ZK_PORT}",
        "OPTIONS": {"ROOT": f"/distlocks-tests-{RUN}", "SESSION_TIMEOUT": 4, "CONNECT_TIMEOUT": 5},
    },
    "locmem": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"},
}

# The 3-node ensemble of tests/test_zookeeper_ensemble.py, for its worker processes.
if ENSEMBLE := os.environ.get("DISTLOCKS_TEST_ZK_ENSEMBLE"):
    DISTLOCKS["zk_ensemble"] = {
        "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
        "LOCATION": ENSEMBLE,
        "OPTIONS": {"ROOT": f"/distlocks-tests-{RUN}", "SESSION_TIMEOUT": 4, "CONNECT_TIMEOUT": 5},
    }

# The Redis Cluster of the cluster tests (their fixture starts it and sets this), seeded with its first three nodes.
CLUSTER_LOCKS = {
    "BACKEND": "distlocks.backends.redis.RedisBackend",
    "OPTIONS": {"CLUSTER": [f"127.0.0.1:{port}" for port in CLUSTER_PORTS[:3]]},
}
if os.environ.get("DISTLOCKS_TEST_CLUSTER"):
    DISTLOCKS["cluster"] = CLUSTER_LOCKS

# The Sentinel group of the Sentinel tests (their fixture starts it and sets this): its three sentinels.
SENTINEL_LOCKS = {
    "BACKEND": "distlocks.backends.redis.RedisBackend",
    "OPTIONS": {"SENTINELS": [f"127.0.0.1:{port}" for port in SENTINEL_PORTS], "SERVICE": SENTINEL_SERVICE},
}
if os.environ.get("DISTLOCKS_TEST_SENTINEL"):
    DISTLOCKS["sentinel"] = SENTINEL_LOCKS

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DEMO_WORK_SECONDS = 0.01
DEMO_PAUSE_DIR = ""  # no pauses: the oversell command sets it for its own gunicorn only

# Worker processes of the metrics tests export metrics (prometheus-client's multiprocess mode).
if os.environ.get("DISTLOCKS_TEST_METRICS"):
    INSTALLED_APPS = [*INSTALLED_APPS, "distlocks.metrics"]

# django-celery-beat's tables, for tests/test_beat.py; the election of its beats.
INSTALLED_APPS = [*INSTALLED_APPS, "django_celery_beat"]
DISTLOCKS_BEAT = {
    "USING": os.environ.get("DISTLOCKS_TEST_BEAT_USING", "default"),
    "TTL": 2,
    "NAME": os.environ.get("DISTLOCKS_TEST_BEAT_NAME", "celery.beat:tests"),
}
