"""A native PostgreSQL wait in the server's queue whose statement is cancelled after the server granted the lock."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from django.db import connections

import distlocks
from distlocks.backends.postgresql import advisory_key
from distlocks.handler import locks
from tests.conftest import DB, Holder, taken_by_another_thread
from tests.faults.test_native import until

pytestmark = DB

# A lock alias whose statements (and so each wait in the server's queue) last at most TIMEOUT seconds.
TIMEOUT = 1


@pytest.fixture
def bounded(request, settings):
    request.getfixturevalue("transactional_db")
    settings.DISTLOCKS = {
        **settings.DISTLOCKS,
        "bounded": {
            "BACKEND": "distlocks.backends.postgresql.AdvisoryLockBackend",
            "OPTIONS": {"DATABASE": "postgresql", "TIMEOUT": TIMEOUT},
        },
    }
    return "bounded"


def _advisory(key, granted):
    """The sessions with (or waiting for) the advisory lock of ``key``."""
    number = advisory_key(key)
    with connections["postgresql"].cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted = %s"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid::bigint = ((%s::bigint >> 32) & 4294967295) AND objid::bigint = (%s::bigint & 4294967295)",
            [granted, number, number],
        )
        return {row[0] for row in cursor.fetchall()}


def _lease_session(key):
    with connections["postgresql"].cursor() as cursor:
        cursor.execute("SELECT session FROM distlocks_native_lease WHERE lock_name = %s", [key])
        return cursor.fetchone()[0]


def _waited_for(session, seconds):
    """Whether ``session``'s statement began more than ``seconds`` ago (on the server's clock)."""
    with connections["postgresql"].cursor() as cursor:
        cursor.execute(
            "SELECT clock_timestamp() - query_start > %s * INTERVAL '1 second' FROM pg_stat_activity WHERE pid = %s",
            [seconds, session],
        )
        return cursor.fetchone()[0]


def stop_waiting(key):
    """SIGSTOP the backend process (one, on this machine's server) of the session waiting for ``key``; its pid."""
    while True:
        until(lambda: _advisory(key, granted=False), what="a session waiting for the lock")
        [waiter] = _advisory(key, granted=False)
        os.kill(waiter, signal.SIGSTOP)
        try:
            if waiter in _advisory(key, granted=False):  # stopped as it waits, not between two waits
                return waiter
        except BaseException:
            os.kill(waiter, signal.SIGCONT)
            raise
        os.kill(waiter, signal.SIGCONT)


def granted_while_stopped(key, holder, past):
    """In a thread: once a session waits in the server's queue for ``key``, SIGSTOP its backend process, let
    ``holder`` release (the server grants the waiter the lock as it frees it), and SIGCONT it once its
    statement has run for ``past`` seconds: its statement timeout (or lock timeout) then cancels it."""
    done = {}

    def freeze():
        try:
            stop_and_release()
        except BaseException as exc:
            done["error"] = exc
            raise
        finally:
            connections.close_all()

    def stop_and_release():
        waiter = stop_waiting(key)
        try:
            holder.release()
            until(lambda: waiter in _advisory(key, granted=True), what="the server granting the stopped waiter")
            until(lambda: _waited_for(waiter, past), what="the waiter's timeout passing")
            done["waiter"] = waiter
        finally:
            os.kill(waiter, signal.SIGCONT)

    thread = threading.Thread(target=freeze)
    thread.start()
    return thread, done


def test_a_lock_granted_as_its_wait_is_cancelled_is_held_once_and_freed_by_its_release(bounded, name):
    # The wait (lock_timeout TIMEOUT) ends as the statement timeout (TIMEOUT) cancels it: 57014, after
    # the server granted the lock. The session keeps a session-level advisory lock whatever ended its statement.
    holder = Holder(name, bounded)
    lk = distlocks.lock(name, using=bounded, renew=False)
    freezer, done = granted_while_stopped(lk.key, holder, TIMEOUT + 0.2)
    try:
        assert lk.acquire(wait=10)
    finally:
        freezer.join(30)
    assert "error" not in done
    assert done["waiter"] in _advisory(lk.key, granted=True)
    assert _lease_session(lk.key) == done["waiter"]  # the wait's session holds it: it won
    assert lk.token > holder.token
    assert locks[bounded].holder(lk.key).token == lk.token
    lk.release()
    # The waiter's session (back in this thread's pool) keeps nothing: the lock is free, and listed nowhere.
    assert _advisory(lk.key, granted=True) == set()
    assert locks[bounded].holder(lk.key) is None
    assert taken_by_another_thread(distlocks.lock(name, using=bounded))


def test_a_permit_granted_as_its_wait_is_cancelled_is_held_once_and_freed_by_its_release(bounded, name):
    # The first in a semaphore's queue waits on a permit for short spells (lock_timeout 50 to 400 ms,
    # below the statement timeout): here the lock timeout cancels the wait (55P03) after the grant.
    sem = distlocks.semaphore(name, 1, using=bounded, renew=False)
    holder = Holder(name, bounded, lock=sem)
    permit = sem.slots[0]
    # Past the longest spell (0.4 s), within the statement timeout.
    freezer, done = granted_while_stopped(permit.key, holder, 0.6)
    try:
        assert sem.acquire(wait=10)
    finally:
        freezer.join(30)
    assert "error" not in done
    assert done["waiter"] in _advisory(permit.key, granted=True)
    assert sem.token > holder.token
    sem.release()
    assert _advisory(permit.key, granted=True) == set()
    assert locks[bounded].holder(permit.key) is None
    assert taken_by_another_thread(distlocks.semaphore(name, 1, using=bounded))
