"""Database backend faults: session time zones, forks, killed sessions, locked tables, hung servers, collations, NUL names, stale force-releases."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

import distlocks
from distlocks.backends.db import voids
from distlocks.handler import locks
from distlocks.owner import acting_as, current_owner, task_owner
from tests.conftest import DB, DB_ALIASES, NATIVE_ALIASES, Holder
from tests.faults.conftest import HandshakeOnlyProxy, behind_proxy
from tests.faults.test_core import until
from tests.test_lock import in_thread

pytestmark = DB

# The databases with a server: sessions that can be killed, tables that can be locked.
servers = pytest.mark.parametrize("alias", ["mariadb", "postgresql"], indirect=True)


def lock_connection(alias):
    """The calling thread's lock connection on ``alias`` (opened, not yet connected, if new)."""
    return connections[locks[alias]._using()]


def session_id(connection):
    """The server's id of ``connection``'s session (it connects if needed)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT CONNECTION_ID()" if connection.vendor == "mysql" else "SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def session_alive(alias, session):
    with connections[alias].cursor() as cursor:
        if connections[alias].vendor == "mysql":
            cursor.execute("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s", [session])
        else:
            cursor.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = %s", [session])
        return cursor.fetchone()[0] > 0


def kill_session(alias, session):
    """End a session on the server, as ``wait_timeout`` or an operator would, and wait until it is gone."""
    with connections[alias].cursor() as cursor:
        if connections[alias].vendor == "mysql":
            cursor.execute(f"KILL {int(session)}")
        else:
            cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [session])
    deadline = time.monotonic() + 10
    while session_alive(alias, session):
        assert time.monotonic() < deadline, f"session {session} still alive"
        time.sleep(0.01)


def take(name, alias, wait=0):
    """Acquire and release ``name`` in the calling thread; return whether it was acquired."""
    lk = distlocks.lock(name, using=alias, renew=False)
    if not lk.acquire(wait=wait):
        return False
    lk.release()
    return True


def take_side(name, alias, mode, wait=0):
    """Acquire and release side ``mode`` of read-write lock ``name`` in the calling thread; return whether acquired."""
    side = getattr(distlocks.read_write_lock(name, using=alias, renew=False), mode)()
    if not side.acquire(wait=wait):
        return False
    side.release()
    return True


def is_commit(data):
    """Whether a client's ``data`` is a COMMIT: mysqlclient's COM_QUERY packet, psycopg's Query message (NUL-ended)."""
    return data.rstrip(b"\x00").upper().endswith(b"COMMIT")


def voids_pending(name):
    """The voids of this process's lost acquires of ``name`` not yet done."""
    return [where for where in list(voids._pending) if name in where[1]]


def held_row(alias, key):
    return next(info for info in locks[alias].held() if info.key == key)


def set_time_zone(connection, zone):
    with connection.cursor() as cursor:
        cursor.execute("SET time_zone = %s", [zone])


# -- 6: MySQL/MariaDB leases in UTC, whatever the session's time zone -----------


@pytest.mark.parametrize("alias", ["mariadb"], indirect=True)
def test_lease_is_utc_and_lasts_ttl_when_session_time_zone_changes(alias, name):
    connection = lock_connection(alias)
    set_time_zone(connection, "+05:00")
    lk = distlocks.lock(name, using=alias, ttl=2, renew=False)
    before = datetime.now(timezone.utc)
    assert lk.acquire(wait=0)
    row = held_row(alias, lk.key)
    assert before - timedelta(seconds=5) < row.acquired_at < datetime.now(timezone.utc) + timedelta(seconds=5)
    assert (row.expires_at - row.acquired_at).total_seconds() == pytest.approx(2, abs=0.1)

    # A DST jump forward (+5 h) between acquire and renewal: the lease is still ours...
    set_time_zone(connection, "+10:00")
    extended = time.monotonic()
    assert locks[alias].extend(lk.key, current_owner(), 2)
    # ...and a jump back (-15 h) neither stretches it (another session gets the lock within its wait, not in
    # hours) nor cuts it short (not before the 2 s renewed).
    set_time_zone(connection, "-05:00")
    assert in_thread(lambda: take(name, alias, wait=10))
    assert time.monotonic() - extended > 1.9
    with pytest.raises(distlocks.LockLost):
        lk.release()


# -- 14: a forked child never closes its parent's lock connections ---------------


@servers
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_parent_keeps_its_lock_connections_when_forked_child_takes_a_lock(alias, name):
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def parent_holder():
        lk = distlocks.lock(name, using=alias, renew=False)
        assert lk.acquire(wait=0)
        seen["before"] = session_id(lock_connection(alias))
        ready.set()
        go.wait(30)
        try:
            lk.release()
            seen["released"] = True
        except distlocks.LockError as exc:
            seen["released"] = exc
        seen["after"] = session_id(lock_connection(alias))
        done.set()

    thread = threading.Thread(target=parent_holder)
    thread.start()
    assert ready.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: take a lock of its own, let go of everything, exit
        code = 1
        try:
            code = 0 if take(f"{name}-child", alias) else 2
            gc.collect()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    go.set()
    thread.join(30)
    assert done.is_set()
    assert seen["released"] is True
    assert seen["after"] == seen["before"], "the parent's lock session was closed by its child"
    assert in_thread(lambda: take(name, alias))


# -- 15: a session the server dropped while idle is reopened ---------------------


@servers
def test_operations_succeed_when_server_ended_idle_lock_session(alias, name):
    lk = distlocks.lock(name, using=alias, renew=False)
    kill_session(alias, session_id(lock_connection(alias)))
    assert lk.acquire(wait=0)
    kill_session(alias, session_id(lock_connection(alias)))
    assert locks[alias].extend(lk.key, current_owner(), 30)
    kill_session(alias, session_id(lock_connection(alias)))
    lk.release()
    assert in_thread(lambda: take(name, alias))


# -- 3: every statement is bounded in time ---------------------------------------


@contextlib.contextmanager
def table_locked(alias, most=10):
    """Hold a table lock on the lock table from another session, for at most ``most`` seconds."""
    locked, stop = threading.Event(), threading.Event()
    errors = []

    def hold():
        connection = connections.create_connection(alias)
        try:
            with connection.cursor() as cursor:
                if connection.vendor == "mysql":
                    cursor.execute("LOCK TABLES distlocks_lock WRITE")
                    locked.set()
                    stop.wait(most)
                    cursor.execute("UNLOCK TABLES")
                else:
                    cursor.execute("BEGIN")
                    cursor.execute("LOCK TABLE distlocks_lock IN ACCESS EXCLUSIVE MODE")
                    locked.set()
                    stop.wait(most)
                    cursor.execute("ROLLBACK")
        except Exception as exc:
            errors.append(exc)
            locked.set()
        finally:
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    assert locked.wait(10)
    assert not errors, errors
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def timed(call):
    """Run ``call``; return (its result or the LockError it raised, seconds it took)."""
    started = time.monotonic()
    try:
        outcome = call()
    except distlocks.LockError as exc:
        outcome = exc
    return outcome, time.monotonic() - started


@servers
def test_acquire_and_extend_end_within_timeout_when_lock_table_is_locked(alias, name):
    bounded = {"BACKEND": settings.DISTLOCKS[alias]["BACKEND"], "OPTIONS": {"DATABASE": alias, "TIMEOUT": 1}}
    with override_settings(DISTLOCKS={**settings.DISTLOCKS, "bounded": bounded}):
        held = distlocks.lock(name, using="bounded", ttl=30, renew=False)
        assert held.acquire(wait=0)
        other = distlocks.lock(f"{name}-other", using="bounded", renew=False)
        with table_locked(alias):
            outcome, seconds = timed(lambda: other.acquire(wait=0))
            assert outcome is False or isinstance(outcome, distlocks.BackendUnavailable), outcome
            assert seconds < 5
            outcome, seconds = timed(lambda: locks["bounded"].extend(held.key, current_owner(), 30))
            assert isinstance(outcome, distlocks.BackendUnavailable), outcome
            assert seconds < 5
        # Once the table is free again, the same connection goes on.
        held.release()
        assert other.acquire(wait=0)
        other.release()


@servers
def test_extend_raises_within_timeout_when_server_hangs(alias, name):
    with behind_proxy(alias) as proxy:
        lk = distlocks.lock(name, using="proxied", ttl=30, renew=False)
        assert lk.acquire(wait=0)
        with proxy.frozen():
            outcome, seconds = timed(lambda: locks["proxied"].extend(lk.key, current_owner(), 30))
        assert isinstance(outcome, distlocks.BackendUnavailable), outcome
        assert seconds < 5
        # The server answers again: the next statement runs on a new connection.
        lk.release()


@servers
def test_an_acquire_whose_answer_was_lost_does_not_keep_the_lock_for_its_ttl(alias, name):
    # The INSERT waits in the frozen proxy while the client gives up; the server runs it at the thaw.
    # Frozen for longer than the client can wait: a new connection (the voided session's) may take
    # CONNECT_TIMEOUT (5 s) twice, and a thaw at 10 s let the second through on a loaded machine.
    with behind_proxy(alias) as proxy:
        lk = distlocks.lock(name, using="proxied", ttl=30)
        assert lk.acquire(wait=0)
        token = lk.token
        lk.release()
        with proxy.frozen(most=30):
            outcome, _ = timed(lambda: lk.acquire(wait=0))
        assert isinstance(outcome, distlocks.BackendUnavailable), outcome
        # Another owner gets the lock: a thread of this process voids the lost attempt once the server answers.
        until(lambda: in_thread(lambda: take(name, alias)), seconds=10)
        with proxy.frozen(most=30):
            outcome, _ = timed(lambda: lk.acquire(wait=0))
        assert isinstance(outcome, distlocks.BackendUnavailable), outcome
        # Its owner's next attempt voids it first, and the void does not come back for the new hold.
        assert lk.acquire(wait=0)
        assert lk.token > token
        time.sleep(2 * voids.RETRY_INTERVAL)  # nothing to poll for: the void thread must not delete it meanwhile
        assert not in_thread(lambda: take(name, alias))
        lk.release()


@servers
def test_a_lost_acquire_leaves_the_hold_of_another_copy_of_the_same_task(alias, name):
    # A Celery task's copies (a retry delivered twice) share the task's secret: a void deletes what the
    # lost attempt may have inserted, never the other copy's hold.
    held, done = threading.Event(), threading.Event()
    released = []

    def other_copy():
        with acting_as(task_owner("a-task", shared=True)):
            lk = distlocks.lock(name, using=alias, ttl=30)
            assert lk.acquire(wait=0)
            held.set()
            done.wait(30)
            try:
                lk.release()
                released.append(True)
            except distlocks.LockError as exc:
                released.append(exc)

    thread = threading.Thread(target=other_copy)
    thread.start()
    try:
        assert held.wait(30)
        with behind_proxy(alias) as proxy, acting_as(task_owner("a-task", shared=True)):
            lk = distlocks.lock(name, using="proxied", ttl=30)
            assert not lk.acquire(wait=0)  # held by the other copy; and the connection is open
            with proxy.frozen():
                outcome, _ = timed(lambda: lk.acquire(wait=0))
            assert isinstance(outcome, distlocks.BackendUnavailable), outcome
            until(lambda: not voids._pending, seconds=10)
        assert not in_thread(lambda: take(name, alias)), "the other copy's hold was deleted"
    finally:
        done.set()
        thread.join(30)
    assert released == [True]


# The sides of a read-write lock: a hold of either keeps the other out.
OTHER_SIDE = {"read": "write", "write": "read"}


@servers
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_read_write_side_whose_acquire_answer_was_lost_does_not_keep_the_lock_for_its_ttl(alias, name, mode):
    # A side's acquire is a transaction: frozen before its COMMIT, the server rolls it back when the client
    # gives up. So the proxy freezes once the COMMIT has gone on: the server takes the side, the client never hears.
    with behind_proxy(alias) as proxy:
        side = getattr(distlocks.read_write_lock(name, using="proxied", ttl=30), mode)()
        assert side.acquire(wait=0)
        token = side.token
        side.release()
        with proxy.frozen_after(is_commit, most=30):
            outcome, seconds = timed(lambda: side.acquire(wait=0))
        assert isinstance(outcome, distlocks.BackendUnavailable), outcome
        assert seconds < 5
        assert side.hold_count == 0
        # Another owner gets the other side: a thread of this process voids the lost attempt once the server answers.
        until(lambda: in_thread(lambda: take_side(name, alias, OTHER_SIDE[mode])), seconds=10)
        with proxy.frozen_after(is_commit, most=30):
            outcome, _ = timed(lambda: side.acquire(wait=0))
        assert isinstance(outcome, distlocks.BackendUnavailable), outcome
        # Its owner's next attempt voids it first, and no void is left to delete the new hold.
        assert side.acquire(wait=0)
        assert side.token > token
        assert not voids_pending(name)
        assert not in_thread(lambda: take_side(name, alias, OTHER_SIDE[mode]))
        side.release()


@servers
def test_a_writer_recorded_waiting_by_an_attempt_whose_answer_was_lost_does_not_keep_new_readers_out(alias, name):
    # A writer that waits is recorded on the server, and new readers wait for it. An acquire that raises deletes
    # the record it knows of; one made by the attempt whose answer was lost would stay for its 30 s lease.
    reader = Holder(name, lock=distlocks.read_write_lock(name, using=alias, ttl=30).read())
    try:
        with behind_proxy(alias) as proxy:
            writer = distlocks.read_write_lock(name, using="proxied", ttl=30).write()
            assert not writer.acquire(wait=0)  # not recorded (it does not wait); and its connection is open
            with proxy.frozen_after(is_commit, most=30):
                outcome, seconds = timed(lambda: writer.acquire(wait=10))
            assert isinstance(outcome, distlocks.BackendUnavailable), outcome
            assert seconds < 5
            until(lambda: in_thread(lambda: take_side(name, alias, "read")), seconds=10)
            until(lambda: not voids_pending(name))
    finally:
        assert reader.release() is None


@pytest.mark.parametrize("alias", ["mariadb", "postgresql", *NATIVE_ALIASES], indirect=True)
def test_a_new_lock_connection_raises_within_timeout_when_the_server_hangs_after_the_login(alias, name):
    # The connection's own first statements (Django's time zone, the timeouts set for the locks) are bounded too.
    vendor = connections[settings.DISTLOCKS[alias]["OPTIONS"]["DATABASE"]].vendor
    hangs_after_login = functools.partial(HandshakeOnlyProxy, vendor=vendor)
    with behind_proxy(alias, hangs_after_login):
        lk = distlocks.lock(name, using="proxied", renew=False)
        outcome = []
        attempt = threading.Thread(target=lambda: outcome.append(timed(lambda: lk.acquire(wait=0))), daemon=True)
        attempt.start()
        attempt.join(15)
        assert outcome, "the acquire still hangs"
        error, seconds = outcome[0]
        assert isinstance(error, distlocks.BackendUnavailable), error
        assert seconds < 5


# -- 19: names compare byte for byte ---------------------------------------------


@pytest.mark.parametrize("alias", DB_ALIASES + NATIVE_ALIASES, indirect=True)
@pytest.mark.parametrize("pair", [("Stock", "stock"), ("a", "a "), ("café", "cafe")])
def test_names_are_distinct_locks_when_they_differ_only_in_case_trailing_space_or_accent(alias, name, pair):
    first, second = (f"{name}:{suffix}" for suffix in pair)
    holder = Holder(first, alias)
    lk = distlocks.lock(second, using=alias, renew=False)
    try:
        assert lk.acquire(wait=0), f"{second!r} is taken by the holder of {first!r}"
        names = {info.key for info in locks[alias].held()}
        assert {first, second} <= names
        lk.release()
    finally:
        assert holder.release() is None


# -- 22: a NUL in a name is refused at once --------------------------------------


@pytest.mark.parametrize("alias", DB_ALIASES + NATIVE_ALIASES, indirect=True)
def test_value_error_names_the_argument_when_name_contains_nul(alias):
    with pytest.raises(ValueError, match=r"^name must not contain"):
        distlocks.lock("stock\x0042", using=alias)


# -- 20: force-release compares the token and deletes in one statement -----------


@pytest.mark.parametrize("alias", DB_ALIASES + NATIVE_ALIASES, indirect=True)
def test_new_holder_keeps_the_lock_when_force_release_has_a_stale_token(alias, name):
    first = distlocks.lock(name, using=alias, renew=False)
    assert first.acquire(wait=0)
    stale = first.token
    first.release()
    holder = Holder(name, alias, renew=False)
    backend = locks[alias]
    assert backend.force_release(first.key, token=stale) is False
    assert in_thread(lambda: take(name, alias)) is False
    assert backend.force_release(first.key, token=holder.token) is True
    assert isinstance(holder.release(), distlocks.LockLost)


def _two_queued_waiters(alias, name, workers):
    """A holder of ``name`` for 60 s, and two worker processes queued behind it in turn: (holder, first, second)."""
    from distlocks.models import LockWaiter

    queue = LockWaiter.objects.using(locks[alias].database).filter(lock_name=locks[alias].make_key(name))
    holder = Holder(name, alias, ttl=60)
    first = workers("take", alias, name, 60)
    until(lambda: queue.count() == 1, 30)
    second = workers("take", alias, name, 60)
    until(lambda: queue.count() == 2, 30)
    return holder, first, second


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_a_killed_waiter_does_not_hold_up_the_queue(alias, name, workers):
    from distlocks.backends.db.queue import WAITER_LEASE

    holder, first, second = _two_queued_waiters(alias, name, workers)
    first.kill()  # SIGKILL: its place stays in the table, ahead of the second waiter's
    assert holder.release() is None
    started = time.monotonic()
    answer = second.line()
    waited = time.monotonic() - started
    # Served once the dead waiter's place ran out, long before the 60 s it would wait.
    assert answer[0] == "acquired", answer
    assert waited < 30, f"the next waiter got the lock only after {waited:.1f} s (places last {WAITER_LEASE} s)"
    second.finish()


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_a_short_hold_taken_from_the_queue_frees_the_lock_when_its_lease_runs_out(alias, name):
    """A waiter that took the lock from the queue with a lease shorter than a place's (on MariaDB a holder may
    keep its place until its release) is out of the next waiter's way when that lease runs out, not later."""
    from distlocks.backends.db.queue import WAITER_LEASE
    from distlocks.models import LockWaiter

    queue = LockWaiter.objects.using(locks[alias].database).filter(lock_name=locks[alias].make_key(name))
    holder = Holder(name, alias, ttl=60)
    short = distlocks.lock(name, using=alias, ttl=0.3, renew=False)
    took = threading.Event()
    # It queues behind the holder, takes the lock from the queue and never releases it.
    threading.Thread(target=lambda: short.acquire(wait=30) and took.set()).start()
    until(lambda: queue.count() == 1, 30)
    assert holder.release() is None
    assert took.wait(30)
    started = time.monotonic()
    assert in_thread(lambda: take(name, alias, wait=10))
    waited = time.monotonic() - started
    # Before: its place, kept on MariaDB and renewed last before it took the lock, held the next one up
    # for 1.3-2 s (places last WAITER_LEASE).
    assert waited < 1.2, (
        f"the next waiter got the lock {waited:.2f} s after a 0.3 s hold began ({WAITER_LEASE} s places)"
    )


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_a_waiter_resumed_after_its_place_ran_out_queues_behind_those_that_came_meanwhile(alias, name, workers):
    from distlocks.backends.db.statements import sql_for
    from distlocks.models import LockWaiter

    key = locks[alias].make_key(name)
    queue = LockWaiter.objects.using(locks[alias].database).filter(lock_name=key)
    table = LockWaiter._meta.db_table

    def live():
        connection = connections[locks[alias].database]
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT COUNT(*) FROM {table} WHERE lock_name = %s AND expires_at > {sql_for(connection).now}", [key]
            )
            return cursor.fetchone()[0]

    holder = Holder(name, alias, ttl=60)
    first = workers("take", alias, name, 60)
    until(lambda: live() == 1, 30)
    os.kill(first.process.pid, signal.SIGSTOP)
    try:
        until(lambda: live() == 0, 30)  # its place ran out while it was stopped
        second = workers("take", alias, name, 60)
        until(lambda: live() == 1, 30)
    finally:
        os.kill(first.process.pid, signal.SIGCONT)
    until(lambda: live() == 2, 30)  # the first, resumed, is queued again
    assert holder.release() is None
    second_token, first_token = int(second.line()[1]), int(first.line()[1])
    # Its expired place kept no rank: the second, queued while it was stopped, is served first.
    assert second_token < first_token, (second_token, first_token, list(queue.values_list("id", flat=True)))
    second.finish()
    first.finish()


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_a_stopped_waiter_at_the_head_does_not_hold_up_the_queue(alias, name, workers):
    holder, first, second = _two_queued_waiters(alias, name, workers)
    os.kill(first.process.pid, signal.SIGSTOP)  # first in the queue; on PostgreSQL it LISTENs and reads nothing now
    try:
        # The release notifies a listener that reads nothing: it must not wait for it.
        assert holder.release() is None
        # Served once the stopped waiter's place ran out (it renews it no more).
        assert second.line()[0] == "acquired"
    finally:
        os.kill(first.process.pid, signal.SIGCONT)
    # Woken again, the first still gets the lock.
    assert first.line()[0] == "acquired"
    second.finish()
    first.finish()


@servers
def test_a_waiter_whose_session_was_ended_still_gets_the_lock(alias, name, workers):
    # On PostgreSQL the waiter LISTENs on that session: the release's NOTIFY is
    # lost with it, and the waiter must find the lock by looking (and listen again).
    from distlocks.models import LockWaiter

    queue = LockWaiter.objects.using(locks[alias].database).filter(lock_name=locks[alias].make_key(name))
    holder = Holder(name, alias, ttl=60)
    waiter = workers("take", alias, name, 60)
    until(lambda: queue.count() == 1, 30)
    with connections[alias].cursor() as cursor:
        mine = session_id(connections[alias])
        if connections[alias].vendor == "mysql":
            cursor.execute("SELECT ID FROM information_schema.PROCESSLIST WHERE DB = DATABASE()")
        else:
            cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        sessions = [row[0] for row in cursor.fetchall() if row[0] != mine]
    for session in sessions:  # the waiter's and the holder's lock sessions among them
        kill_session(alias, session)
    assert holder.release() is None
    assert waiter.line()[0] == "acquired"
    waiter.finish()


@pytest.mark.parametrize("alias", ["postgresql"], indirect=True)
def test_release_notifies_the_lock_channel_on_postgresql_only_while_a_waiter_is_queued(alias, name):
    from distlocks.backends.db.notify import channel
    from distlocks.models import LockWaiter

    backend = locks[alias]
    alone, awaited = distlocks.lock(f"{name}-alone", using=alias), distlocks.lock(name, using=alias)
    listener = connections.create_connection(alias)
    try:
        with listener.cursor() as cursor:
            for lk in (alone, awaited):
                cursor.execute(f'LISTEN "{channel(lk.key)}"')
        alone.acquire()
        awaited.acquire()
        later = datetime.now(timezone.utc) + timedelta(seconds=60)
        earlier = datetime.now(timezone.utc) - timedelta(seconds=1)
        queue = LockWaiter.objects.using(backend.database)
        queue.create(lock_name=awaited.key, expires_at=earlier)  # a place that ran out: not the first any more
        first = queue.create(lock_name=awaited.key, expires_at=later)
        queue.create(lock_name=awaited.key, expires_at=later)
        alone.release()
        awaited.release()
        # Notifications come in the order of the commits: the first is the awaited lock's,
        # and it names the first live place, the one waiter that is to try (the others sleep on).
        notifications = list(listener.connection.notifies(timeout=10, stop_after=1))
        assert [(n.channel, n.payload) for n in notifications][:1] == [(channel(awaited.key), str(first.pk))]
    finally:
        listener.close()
        backend.clear_expired()
        LockWaiter.objects.using(backend.database).filter(lock_name=awaited.key).delete()


@pytest.mark.parametrize("alias", ["postgresql"], indirect=True)
def test_waiters_listen_only_on_a_session_of_their_own_not_behind_pgbouncer_in_transaction_pooling_mode(
    alias, name, settings, pgbouncer
):
    # LISTEN would stay with a pooled server session that other clients get next.
    from distlocks.backends.db.connections import open_like
    from distlocks.backends.db.notify import own_session
    from tests.faults.test_native import behind_pgbouncer, extra_alias

    def opener(database):
        return lambda: open_like(connections[database], f"{database}:{name}", 5, 5)

    for database, own in [("postgresql", True), ("pooled", False)]:
        with extra_alias(settings, "pooled", behind_pgbouncer(pgbouncer), "distlocks.backends.db.DatabaseBackend"):
            connection = opener(database)()
            try:
                assert own_session(connection, f"{database}-{name}", opener(database)) is own
            finally:
                connection.close()
