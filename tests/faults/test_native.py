"""Native database locks (GET_LOCK, advisory locks) under faults: killed and frozen holders, killed sessions, the queue."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
import weakref
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connections

import distlocks
from distlocks.backends.db import close_connections
from distlocks.backends.db.connections import open_like
from distlocks.backends.mysql import server_name
from distlocks.exceptions import LockLost
from distlocks.handler import locks
from distlocks.signals import lock_lost
from tests.conftest import DB, NATIVE_ALIASES, Holder, queue_waiters, taken_by_another_thread
from tests.faults.conftest import behind_proxy
from tests.faults.test_db import kill_session, session_alive
from tests.test_db import places_queued

pytestmark = DB
native = pytest.mark.parametrize("alias", NATIVE_ALIASES, indirect=True)

DATABASE = {"mariadb_native": "mariadb", "postgresql_native": "postgresql"}


def until(condition, seconds=15, what="the condition"):
    """Poll ``condition`` until it is true, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds}s"
        time.sleep(0.01)


def queued(alias, name):
    """How many sessions wait in the server's queue for the lock ``name``."""
    key = locks[alias].make_key(name)
    database = DATABASE[alias]
    with connections[database].cursor() as cursor:
        if connections[database].vendor == "mysql":
            lock = server_name(str(connections[database].settings_dict["NAME"]), key)
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE STATE = 'User lock' AND INFO LIKE %s",
                [f"%{lock}%"],
            )
            return cursor.fetchone()[0]
    info = locks[alias].holder(key)
    return info.waiters if info else 0


def holding_session(alias, name):
    """The server session that holds ``name``, as its lease row says."""
    with connections[DATABASE[alias]].cursor() as cursor:
        cursor.execute("SELECT session FROM distlocks_native_lease WHERE lock_name = %s", [locks[alias].make_key(name)])
        return cursor.fetchone()[0]


def lease_left(alias, name):
    """Seconds until the lease of ``name`` runs out, on the server's clock."""
    with connections[DATABASE[alias]].cursor() as cursor:
        if connections[DATABASE[alias]].vendor == "mysql":
            left = "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1e6"
        else:
            left = "EXTRACT(EPOCH FROM expires_at - STATEMENT_TIMESTAMP())"
        cursor.execute(f"SELECT {left} FROM distlocks_native_lease WHERE lock_name = %s", [locks[alias].make_key(name)])
        return float(cursor.fetchone()[0])


@native
def test_a_sigkilled_holders_lock_is_free_once_its_lease_ends(alias, name, workers):
    # The server frees the lock with the session, at once; but it cannot tell a holder that died from one
    # whose session alone ended, which goes on holding until told: the lock waits for the lease.
    holder = workers("hold", alias, name, 3)
    assert holder.line()[0] == "acquired"
    waiter = workers("take", alias, name, 20)
    until(lambda: queued(alias, name) == 1, what="the waiter queueing")
    holder.kill()
    killed = time.monotonic()
    left = lease_left(alias, name)
    assert waiter.finish()[0] == "acquired"
    took = time.monotonic() - killed
    assert left - 0.1 < took < left + 3, (left, took)


@native
def test_frozen_holder_loses_the_lock_after_its_ttl_and_is_told_on_waking(alias, name, workers):
    holder = workers("hold_until_lost", alias, name, 1.5)
    answer = holder.line()
    assert answer[0] == "acquired"
    frozen_token = int(answer[1])
    os.kill(holder.process.pid, signal.SIGSTOP)
    try:
        frozen = time.monotonic()
        lk = distlocks.lock(name, using=alias, wait=20)
        assert lk.acquire()
        took = time.monotonic() - frozen
        assert 1.0 < took < 10, took
        assert lk.token > frozen_token
    finally:
        os.kill(holder.process.pid, signal.SIGCONT)
    assert holder.finish() == ["lost", "LockLost"]
    assert lk.hold_count == 1
    assert not lk.lost
    assert locks[alias].holder(lk.key).token == lk.token
    lk.release()


@native
def test_a_waiter_frozen_when_the_server_hands_it_the_lock_loses_it_after_the_timeout(alias, name, workers):
    # The server hands the lock to the stopped waiter's session, which cannot write the lease that others
    # would end it by: it held the lock for as long as it stayed stopped.
    holder = Holder(name, alias)
    waiter = workers("hold", alias, name, 30)
    until(lambda: queued(alias, name) == 1, what="the waiter queueing")
    os.kill(waiter.process.pid, signal.SIGSTOP)
    try:
        assert holder.release() is None
        released = time.monotonic()
        lk = distlocks.lock(name, using=alias, wait=20)
        assert lk.acquire(), "the stopped waiter keeps the lock it was handed"
        took = time.monotonic() - released
        assert took < locks[alias].timeout + 3, took
        token = lk.token
        assert token > holder.token
    finally:
        os.kill(waiter.process.pid, signal.SIGCONT)
    lk.release()
    # Resumed, the waiter finds its session ended: it was not given the lock, and waits on for it.
    answer = waiter.line()
    assert answer[0] == "acquired"
    assert int(answer[1]) > token


@native
def test_holder_is_told_when_its_database_session_is_killed(alias, name):
    lost = []

    def on_lost(sender, name, alias, token, **kwargs):
        lost.append(token)

    lock_lost.connect(on_lost)
    try:
        holder = Holder(name, alias, ttl=1.5)
        kill_session(DATABASE[alias], holding_session(alias, name))
        assert not taken_by_another_thread(distlocks.lock(name, using=alias)), "free while its lease lives"
        until(lambda: lost, seconds=5, what="lock_lost")
        assert lost == [holder.token]
        assert isinstance(holder.release(), distlocks.LockLost)
        assert taken_by_another_thread(distlocks.lock(name, using=alias)), (
            "the lease outlived the release of a hold whose session ended"
        )
    finally:
        lock_lost.disconnect(on_lost)


@native
def test_a_lock_connection_whose_idle_session_was_ended_serves_the_next_acquisition(alias, name):
    # The connection keeps its cursor (and on PostgreSQL its prepared statements) for as long as its
    # session lasts: a new session gets new ones, and an acquisition on it works and is fenced as before.
    lk = distlocks.lock(name, using=alias, renew=False)
    tokens = []
    for _ in range(3):
        with lk:
            tokens.append(lk.token)
            session = holding_session(alias, name)
        kill_session(DATABASE[alias], session)  # now idle in this thread's pool
    with lk:
        tokens.append(lk.token)
        assert holding_session(alias, name) != session
    assert tokens == sorted(set(tokens)), tokens
    assert taken_by_another_thread(distlocks.lock(name, using=alias))


@pytest.mark.parametrize("alias", ["postgresql_native"], indirect=True)
def test_a_lock_connection_keeps_nothing_of_its_ended_sessions(alias, name):
    # What the backend keeps per session (its cursors, the prepared statements) goes with the
    # session: a process whose lock sessions end (threads that end, sessions ended by the
    # server) does not pile up their driver connections.
    lk = distlocks.lock(name, using=alias, renew=False)
    ended = []
    for _ in range(3):
        with lk:
            session = holding_session(alias, name)
        ended.append(weakref.ref(locks[alias]._idle[-1].connection))  # back in this thread's pool
        kill_session(DATABASE[alias], session)
    with lk:  # on a new session
        pass
    gc.collect()
    assert [ref() for ref in ended] == [None, None, None]


def test_a_lock_connection_has_a_session_of_its_own_on_a_pooled_database():
    # With Django's connection pool (OPTIONS["pool"]) a close() gives the session back to the
    # pool, and the advisory locks and LISTENs it holds to the pool's next user: a lock
    # connection must end its session when closed (what frees a hold whose owner was interrupted).
    base = connections["postgresql"]
    options = {**base.settings_dict["OPTIONS"], "pool": {"min_size": 1, "max_size": 2}}
    pooled = type(base)({**base.settings_dict, "OPTIONS": options}, alias="pooled")
    connection = open_like(pooled, "distlocks:pooled", 5, 5)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid(), pg_advisory_lock(1)")
            session = cursor.fetchone()[0]
        connection.close()
        until(lambda: not session_alive("postgresql", session), what=f"the end of session {session}")
    finally:
        connection.close()
        with contextlib.suppress(Exception):
            connection.close_pool()


@pytest.mark.parametrize("alias", ["postgresql_native"], indirect=True)
def test_acquisitions_add_no_index_entries(alias, name):
    # Migration 0007: no index covers a column that an acquisition changes (the token was the primary
    # key), so PostgreSQL updates the lease row without a new entry in every index each time (a HOT
    # update), entries that only a vacuum would remove (autovacuum is off on the tests' server).
    def index_bytes():
        with connections["postgresql"].cursor() as cursor:
            cursor.execute("SELECT pg_indexes_size('distlocks_native_lease')")
            return cursor.fetchone()[0]

    lk = distlocks.lock(name, using=alias, renew=False)
    with lk:
        first = lk.token
    before = index_bytes()
    for _ in range(1000):
        with lk:
            last = lk.token
    assert last > first
    assert index_bytes() - before <= 8192, "the lease table's indexes grew by more than a page in 1000 acquisitions"


@native
def test_waiters_are_served_first_come_first_served(alias, name, workers, tmp_path):
    holder = Holder(name, alias)
    waiters = [workers("take_when", alias, name, 20, tmp_path / f"go-{i}") for i in range(4)]
    for waiter in waiters:
        assert waiter.line() == ["ready"]
    for i in range(len(waiters)):
        (tmp_path / f"go-{i}").touch()
        until(lambda i=i: queued(alias, name) == i + 1, what=f"waiter {i} queueing")
    assert holder.release() is None
    tokens = [int(waiter.finish()[1]) for waiter in waiters]
    assert tokens == sorted(tokens), f"served out of order: {tokens}"


@native
def test_cleanup_deletes_expired_leases_and_ends_their_sessions(alias, name):
    live = distlocks.lock(f"{name}-live", using=alias)
    expired = [distlocks.lock(f"{name}-{i}", using=alias, ttl=0.2, renew=False) for i in range(3)]
    with live:
        for lk in expired:
            assert lk.acquire(wait=0)
        time.sleep(0.4)
        assert len(list(locks[alias].held())) == 4  # the expired leases' sessions still hold the server's locks
        assert call("distlocks_cleanup", "--using", alias, "--dry-run") == f"{alias}: would delete 3 expired locks\n"
        assert call("distlocks_cleanup", "--using", alias) == f"{alias}: deleted 3 expired locks\n"
        assert call("distlocks_cleanup", "--using", alias) == f"{alias}: deleted 0 expired locks\n"
        until(
            lambda: all(taken_by_another_thread(distlocks.lock(lk.name, using=alias)) for lk in expired),
            what="the hung sessions ending",
        )
        assert [info.key for info in locks[alias].held()] == [live.key]
        for lk in expired:
            with pytest.raises(distlocks.LockLost):
                lk.release()


def call(command, *args):
    out = StringIO()
    call_command(command, *args, stdout=out)
    return out.getvalue()


@pytest.mark.parametrize("alias", ["postgresql_native"], indirect=True)
def test_check_warns_when_postgresql_is_reached_through_a_proxy(alias):
    with behind_proxy(alias):
        assert [message.id for message in locks[alias].ping()] == []
        assert [message.id for message in locks["proxied"].ping()] == ["distlocks.W012"]


@pytest.mark.parametrize("alias", ["mariadb_native"], indirect=True)
def test_a_full_memory_lease_table_makes_room_from_the_rows_of_freed_locks(alias, name):
    # MariaDB keeps the leases in a MEMORY table, which a size limit can fill with the rows of freed locks.
    with connections["mariadb"].cursor() as cursor:
        cursor.execute("ALTER TABLE distlocks_native_lease MAX_ROWS = 4")
    try:
        tokens = []
        with distlocks.lock(f"{name}-held", using=alias):
            for i in range(12):
                with distlocks.lock(f"{name}-{i}", using=alias) as held:
                    tokens.append(held.token)
            assert tokens == sorted(set(tokens))  # every one taken, tokens growing
            assert [info.key for info in locks[alias].held()] == [locks[alias].make_key(f"{name}-held")]
            # A lock taken while the table was full is held by no other session: the failed statement's lock was freed.
            assert all(taken_by_another_thread(distlocks.lock(f"{name}-{i}", using=alias)) for i in range(12))
    finally:
        with connections["mariadb"].cursor() as cursor:
            cursor.execute("ALTER TABLE distlocks_native_lease MAX_ROWS = 0")


@contextlib.contextmanager
def extra_alias(settings, alias, database, backend):
    """Lock alias ``alias`` with ``backend`` on a database of the test's own (``DATABASES`` entry ``database``)."""
    connections.settings[alias] = database
    settings.DISTLOCKS = {**settings.DISTLOCKS, alias: {"BACKEND": backend, "OPTIONS": {"DATABASE": alias}}}
    try:
        yield locks[alias]
    finally:
        close_connections()
        connections[alias].close()
        del connections[alias]  # the wrapper, with these settings, would outlive them in this thread
        del connections.settings[alias]


def connect_unguarded(alias):
    """Connect Django's connection ``alias`` to a database of the test's own, which Django's tests guard against.

    The guard refuses a new connection under an alias the test did not declare:
    connect under another name first, then serve as ``alias``.
    """
    connections[alias].close()
    connection = type(connections[alias])(connections[alias].settings_dict, alias=f"unguarded:{alias}")
    connection.ensure_connection()
    connection.alias = alias
    connections[alias] = connection
    return connection


def behind_pgbouncer(port):
    return {**connections["postgresql"].settings_dict, "HOST": "127.0.0.1", "PORT": str(port)}


@pytest.mark.parametrize("alias", ["postgresql_native"], indirect=True)
def test_check_refuses_advisory_locks_behind_pgbouncer_in_transaction_pooling_mode(alias, settings, pgbouncer):
    backend = "distlocks.backends.postgresql.AdvisoryLockBackend"
    with extra_alias(settings, "pooled", behind_pgbouncer(pgbouncer), backend) as pooled:
        assert "distlocks.E008" in [message.id for message in pooled.ping()]
    assert [message.id for message in locks[alias].ping()] == []


@pytest.mark.parametrize("alias", ["postgresql"], indirect=True)
def test_the_table_backend_serves_waiters_in_turn_behind_pgbouncer_in_transaction_pooling_mode(
    alias, settings, pgbouncer, name
):
    backend = "distlocks.backends.db.DatabaseBackend"
    with extra_alias(settings, "pooled", behind_pgbouncer(pgbouncer), backend) as pooled:
        assert pooled.ping() == []  # no warning: its tables are there
        holder = Holder(name, "pooled")
        threads, order = queue_waiters(
            name, "pooled", "AB", gap=0, hold=0.01, queued=lambda started: places_queued(alias, name) == started
        )
        assert holder.release() is None
        for thread in threads:
            thread.join(30)
        assert order == ["A", "B"]
        assert places_queued(alias, name) == 0  # the same database, reached directly
        assert list(pooled.held()) == []


@pytest.mark.parametrize("alias", ["postgresql_native"], indirect=True)
def test_tokens_keep_growing_and_leases_are_gone_after_the_server_crashes(alias, settings, own_postgresql, name):
    # The lease table is UNLOGGED (its rows, like the advisory locks, end with
    # the crash) and the tokens come from a logged, uncached sequence.
    database = {**connections["postgresql"].settings_dict, "NAME": "postgres", "USER": "postgres", "PASSWORD": ""}
    database.update(HOST="127.0.0.1", PORT=str(own_postgresql.port))
    with extra_alias(settings, "crashed", database, "distlocks.backends.postgresql.AdvisoryLockBackend") as backend:
        call_command("migrate", "distlocks", database=connect_unguarded("crashed").alias, verbosity=0)
        with connections["crashed"].cursor() as cursor:
            cursor.execute(
                "SELECT c.relname, c.relpersistence, s.seqcache FROM pg_class c LEFT JOIN pg_sequence s"
                " ON s.seqrelid = c.oid WHERE c.relname IN ('distlocks_native_lease', 'distlocks_native_token') ORDER BY 1"
            )
            assert cursor.fetchall() == [("distlocks_native_lease", "u", None), ("distlocks_native_token", "p", 1)]
        tokens = []
        for _ in range(40):  # past the sequence's second WAL record (one every 32 values)
            with distlocks.lock(name, using="crashed") as taken:
                tokens.append(taken.token)
        held = distlocks.lock(f"{name}-held", using="crashed")
        assert held.acquire()
        tokens.append(held.token)
        own_postgresql.crash()  # at once: the WAL writer has had no time to write the last commits
        own_postgresql.start()
        with pytest.raises(LockLost):
            held.release()
        with connect_unguarded("crashed").cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM distlocks_native_lease")
            assert cursor.fetchone()[0] == 0
        after = []
        for lock_name in (name, f"{name}-held", name):
            with distlocks.lock(lock_name, using="crashed") as taken:
                after.append(taken.token)
        assert max(tokens) < after[0] < after[1] < after[2], (tokens, after)
        assert [info.key for info in backend.held()] == []


@pytest.mark.parametrize("alias", ["mariadb_native"], indirect=True)
def test_check_warns_that_get_lock_is_local_to_a_galera_node(alias, settings, galera):
    # A one-node Galera cluster reports wsrep_on ON; the tests' plain MariaDB reports it OFF.
    database = {**connections["mariadb"].settings_dict, "NAME": "mysql", "HOST": galera, "PORT": "", "USER": "root"}
    with extra_alias(settings, "galera", database, "distlocks.backends.mysql.MySQLLockBackend") as on_galera:
        # W014 too: the node's "mysql" database has no distlocks tables.
        assert [message.id for message in on_galera.ping()] == ["distlocks.W013", "distlocks.W014"]
    assert [message.id for message in locks[alias].ping()] == []


def lease_sessions(alias, name):
    """The server sessions of the lease rows of the locks whose name contains ``name``, by lock name."""
    with connections[DATABASE[alias]].cursor() as cursor:
        cursor.execute("SELECT lock_name, session FROM distlocks_native_lease WHERE lock_name LIKE %s", [f"%{name}%"])
        return dict(cursor.fetchall())


def take_as_another(kind, alias, name, wait):
    """Try to take what ``kind`` of ``tests.worker hold_kind_until_lost`` holds (the multi-lock: its member ``-a``)
    as another owner within ``wait`` seconds; return the monotonic time it was taken, or None."""
    if kind == "semaphore":
        lk = distlocks.semaphore(name, 1, using=alias, renew=False)
    else:
        lk = distlocks.lock(f"{name}-a" if kind == "multi" else name, using=alias, renew=False)
    if not lk.acquire(wait=wait):
        return None
    taken = time.monotonic()
    lk.release()
    return taken


@native
@pytest.mark.parametrize("kind", ["lock", "semaphore", "multi", "alock"])
@pytest.mark.parametrize("ended", ["kill", "idle_timeout"])
def test_a_hold_whose_session_the_server_ends_is_not_taken_before_its_holder_is_told(alias, name, workers, kind, ended):
    # The server's lock goes with the session (a DBA's KILL / pg_terminate_backend, wait_timeout,
    # idle_session_timeout, a proxy resetting an idle connection), but the lease row lives on: nobody
    # else gets the lock before it ends (or the holder, told at its next renewal, lets go of it).
    holder = workers("hold_kind_until_lost", kind, alias, name, 3, *(["1"] if ended == "idle_timeout" else []))
    assert holder.line() == ["acquired"]
    member = f"{name}-a" if kind == "multi" else ""
    sessions = lease_sessions(alias, member or name)
    assert len(sessions) == 1, sessions
    [session] = sessions.values()
    if ended == "kill":
        kill_session(DATABASE[alias], session)
    else:
        until(lambda: not session_alive(DATABASE[alias], session), seconds=10, what="the idle session's end")
    # At once (the server's lock is free: before, this took it), or once the lease has ended or the holder,
    # told, has let go of it.
    taken = take_as_another(kind, alias, name, wait=0) or take_as_another(kind, alias, name, wait=20)
    assert taken is not None
    answer = holder.line()
    assert answer[0] == "lost"
    assert float(answer[1]) < taken, "the lock was taken before its holder was told it lost it"
    assert holder.finish() == ["LockLost"]


@pytest.mark.parametrize("alias", ["mariadb_native"], indirect=True)
def test_a_hung_holder_that_moves_on_while_a_waiter_ends_its_session_keeps_its_next_hold(alias, name, monkeypatch):
    # MariaDB reads who to end (an expired lease whose session holds the lock) and ends it (KILL) in two
    # statements. A holder that releases and takes the lock again on the same session in between must not
    # lose its new hold for its old lease: its statements wait until the waiter is done.
    go, moved_on, waited, outcome = threading.Event(), threading.Event(), threading.Event(), {}

    def holder():
        lk = distlocks.lock(name, using=alias, ttl=0.3, renew=False)
        assert lk.acquire(wait=0)
        go.wait(30)  # until the waiter is about to end its session
        try:
            lk.release()
        except distlocks.LockLost:
            outcome["released"] = "LockLost"
        # On the same session, with a lease that outlasts the wait below (0.3 s ran out on a loaded machine).
        again = distlocks.lock(name, using=alias, ttl=30, renew=False)
        outcome["again"] = again.acquire(wait=0)
        moved_on.set()
        if outcome["again"]:
            waited.wait(30)  # held until the waiter is done
            try:
                again.release()
                outcome["second release"] = "ok"
            except distlocks.LockLost:
                outcome["second release"] = "LockLost"

    backend = locks[alias]
    kill = backend._kill

    def kill_once_the_holder_moved_on(cursor, session):
        go.set()
        moved_on.wait(2)  # it cannot, if its statements wait for this one
        kill(cursor, session)

    thread = threading.Thread(target=holder)
    thread.start()
    until(lambda: lease_sessions(alias, name) and lease_left(alias, name) < 0, what="the holder's lease running out")
    monkeypatch.setattr(backend, "_kill", kill_once_the_holder_moved_on)
    other = distlocks.lock(name, using=alias, renew=False)
    taken = other.acquire(wait=5)
    waited.set()
    thread.join(30)
    assert outcome["released"] == "LockLost"  # its lease had run out
    if outcome["again"]:
        assert outcome["second release"] == "ok", "a hold taken after its lease ran out was ended for that lease"
    else:
        assert taken
        other.release()


@native
def test_a_lease_whose_session_ended_is_listed_and_force_released_by_its_token(alias, name):
    # It holds the lock until it ends: the admin and distlocks_list show it, and force-release frees it.
    holder = Holder(name, alias, ttl=30)
    key = locks[alias].make_key(name)
    try:
        kill_session(DATABASE[alias], holding_session(alias, name))
        listed = locks[alias].holder(key)
        assert listed is not None
        assert listed.token == holder.token
        assert [info.token for info in locks[alias].held() if info.key == key] == [holder.token]
        assert not locks[alias].force_release(key, holder.token - 1)  # not that acquisition
        assert not taken_by_another_thread(distlocks.lock(name, using=alias))
        assert locks[alias].force_release(key, holder.token)
        assert locks[alias].holder(key) is None
        assert taken_by_another_thread(distlocks.lock(name, using=alias))
    finally:
        released = holder.release()
    assert isinstance(released, distlocks.LockLost)
