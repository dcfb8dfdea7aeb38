"""An unreachable database gives BackendUnavailable in bounded time."""

from __future__ import annotations

import time

import pytest

import distlocks

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
