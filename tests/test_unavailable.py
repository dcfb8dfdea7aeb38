"""An unreachable database gives BackendUnavailable in bounded time; one that refuses, naming what it said."""

from __future__ import annotations

import time

import pytest
from django.db import DatabaseError

import distlocks
from distlocks.checks import check_distlocks

pytestmark = pytest.mark.django_db

DB = "distlocks.backends.db.DatabaseBackend"


@pytest.mark.parametrize(
    ("backend", "database"),
    [
        (DB, "mariadb_down"),
        (DB, "postgresql_down"),
        ("distlocks.backends.mysql.MySQLLockBackend", "mariadb_down"),
        ("distlocks.backends.postgresql.AdvisoryLockBackend", "postgresql_down"),
    ],
)
def test_unreachable_database(settings, backend, database):
    settings.DISTLOCKS = {"down": {"BACKEND": backend, "OPTIONS": {"DATABASE": database, "CONNECT_TIMEOUT": 2}}}
    lk = distlocks.lock("x", using="down", wait=None)
    started = time.monotonic()
    # The host and port tried: mysqlclient's own message names the host only.
    where = rf"^Database '{database}' \(127\.0\.0\.1:1 nowhere\) for locks on 'down' is unavailable: "
    with pytest.raises(distlocks.BackendUnavailable, match=where) as info:
        lk.acquire()
    assert time.monotonic() - started < 10
    assert info.value.__cause__ is not None
    assert info.value.alias == "down"
    assert lk.hold_count == 0


@pytest.mark.parametrize(
    ("database", "said"),
    [
        ("mariadb_denied", "Access denied for user 'distlocks_nobody'"),
        ("mariadb_missing", "Unknown database 'distlocks_missing_"),
        ("postgresql_missing", 'database "distlocks_missing_'),
    ],
)
@pytest.mark.parametrize("backend", [DB, "native"])
def test_a_database_that_refuses_names_what_it_said(settings, backend, database, said):
    if backend == "native":
        backend = f"distlocks.backends.{'mysql.MySQLLockBackend' if database.startswith('mariadb') else 'postgresql.AdvisoryLockBackend'}"
    settings.DISTLOCKS = {"refused": {"BACKEND": backend, "OPTIONS": {"DATABASE": database, "CONNECT_TIMEOUT": 2}}}
    with pytest.raises(distlocks.BackendUnavailable) as info:
        distlocks.lock("x", using="refused").acquire(wait=0)
    assert said in str(info.value)
    assert str(info.value).startswith(f"Database '{database}' (127.0.0.1:")
    assert isinstance(info.value.__cause__, DatabaseError)
    assert "hunter2-s3cret" not in str(info.value)
    [warning] = check_distlocks()
    assert warning.id == "distlocks.W004"
    assert said in warning.msg
