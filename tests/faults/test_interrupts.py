"""An exception raised by a signal handler while a lock is being taken or waited for.

Celery's soft time limit raises ``SoftTimeLimitExceeded`` from a signal
handler in the worker process, which goes on to run the next task; an alarm
set around a slow call does the same. The lock must not be left taken by the
abandoned request: a server session (or ZooKeeper node) nobody tracks would
hold it for as long as the process lives.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import pytest
from django.db import connections

import distlocks
from distlocks.handler import locks
from distlocks.signals import lock_lost
from tests.conftest import DB, NATIVE_ALIASES, Holder, taken_by_another_thread
from tests.faults import test_zookeeper
from tests.faults.conftest import behind_proxy, frozen
from tests.faults.test_db import OTHER_SIDE, is_commit, table_locked, take_side, voids_pending
from tests.faults.test_native import queued, until
from tests.faults.test_zookeeper import own_aliases
from tests.test_lock import in_thread

pytestmark = DB
zk_server = test_zookeeper.zk_server  # a ZooKeeper of the test's own, to freeze


class Interrupted(Exception):
    """What the signal handler raises (as Celery's SoftTimeLimitExceeded, an Exception)."""


@contextlib.contextmanager
def raising_on(signum, raised=Interrupted):
    """While the block runs, ``signum`` raises ``raised`` in the thread that handles it (the main thread)."""

    def handler(signum, frame):
        raise raised

    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def interrupt_main_when(condition, then=lambda: None):
    """In a thread: once ``condition()``, send the main thread SIGALRM, then call ``then()``."""
    main = threading.main_thread().ident

    def run():
        try:
            until(condition, what="the main thread waiting")
            signal.pthread_kill(main, signal.SIGALRM)
            then()
        finally:
            connections.close_all()  # this thread's, which the test databases' teardown would wait for

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("alias", NATIVE_ALIASES, indirect=True)
def test_a_waiter_interrupted_in_the_servers_queue_leaves_the_lock_free(alias, name):
    # The handler runs once the main thread is back in Python: after the server
    # gave its session the lock, which nothing tracks any more.
    holder = Holder(name, alias)
    with raising_on(signal.SIGALRM):
        helper = interrupt_main_when(lambda: queued(alias, name) == 1, then=holder.release)
        with pytest.raises(Interrupted):
            distlocks.lock(name, using=alias).acquire(wait=20)
        helper.join(30)
    assert holder.error is None
    until(lambda: taken_by_another_thread(distlocks.lock(name, using=alias)), seconds=10, what="the lock coming free")


@pytest.mark.parametrize("alias", NATIVE_ALIASES, indirect=True)
@pytest.mark.parametrize("raised", [Interrupted, KeyboardInterrupt])
def test_a_holder_whose_reentry_is_interrupted_is_told_at_once_that_the_lock_is_lost(alias, name, raised):
    # The re-entry's statement waits in the frozen proxy; interrupted (by an Exception, as Celery's soft time
    # limit, or by Ctrl-C), its session is ended (the server's lock with it): the holder must know now, not at
    # its next renewal. Its lease stays until it lets go of the hold: nobody else takes the lock before.
    lost = []

    def on_lost(sender, name, alias, token, **kwargs):
        lost.append(token)

    lock_lost.connect(on_lost)
    try:
        with behind_proxy(alias) as proxy:
            if connections["proxied"].vendor == "mysql":  # what Django asks the server once: it is the same one
                connections["proxied"].__dict__["mysql_server_data"] = connections["mariadb"].mysql_server_data
            lk = distlocks.lock(name, using="proxied", ttl=30)
            assert lk.acquire(wait=0)
            token = lk.token
            sent = []
            with raising_on(signal.SIGALRM, raised), proxy.frozen():
                helper = interrupt_main_when(lambda: sent and time.monotonic() - sent[0] > 0.2)
                sent.append(time.monotonic())
                with pytest.raises(raised):
                    lk.acquire(wait=0)
                helper.join(30)
            assert lk.lost, "the holder goes on as if it held the lock"
            until(lambda: lost == [token], seconds=5, what="lock_lost")
            assert not taken_by_another_thread(distlocks.lock(name, using=alias)), "free while the holder's lease lives"
            assert lk.hold_count == 1
            with pytest.raises(distlocks.LockLost):
                lk.release()
            assert taken_by_another_thread(distlocks.lock(name, using=alias)), "the lease outlived the release"
    finally:
        lock_lost.disconnect(on_lost)


def insert_waiting(alias):
    """Whether a table backend's INSERT of a lock waits for the lock table (see ``table_locked``)."""
    with connections[alias].cursor() as cursor:
        if connections[alias].vendor == "mysql":
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'INSERT INTO `distlocks_lock`%%'"
            )
        else:
            cursor.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE 'INSERT INTO \"distlocks_lock\"%%'"
            )
        return cursor.fetchone()[0] > 0


@pytest.mark.parametrize("alias", ["mariadb", "postgresql"], indirect=True)
def test_an_insert_interrupted_while_it_waits_for_the_lock_table_leaves_the_lock_free(alias, name):
    # The table is let go as the handler runs: the INSERT may take the lock after its caller was told it did not.
    table = contextlib.ExitStack()
    table.enter_context(table_locked(alias))
    with raising_on(signal.SIGALRM):
        helper = interrupt_main_when(lambda: insert_waiting(alias), then=table.close)
        with pytest.raises(Interrupted):
            distlocks.lock(name, using=alias, ttl=60).acquire(wait=0)
        helper.join(30)
    table.close()
    assert taken_by_another_thread(distlocks.lock(name, using=alias)), (
        "the lock is held, for its ttl, by an owner told it did not get it"
    )


@pytest.mark.parametrize("alias", ["mariadb", "postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_read_write_side_interrupted_as_its_commit_is_answered_leaves_the_lock_free(alias, name, mode):
    # The server commits the side's row while the answer waits in the frozen proxy; the handler raises then
    # (during the wait, or as soon as the answer is in, once the proxy thaws): the caller is told it did not get it.
    with behind_proxy(alias) as proxy:
        side = getattr(distlocks.read_write_lock(name, using="proxied", ttl=60), mode)()
        with side:
            pass  # its connection is open
        with raising_on(signal.SIGALRM), proxy.frozen_after(is_commit, most=30):
            helper = interrupt_main_when(lambda: not proxy.flowing.is_set(), then=proxy.flowing.set)
            with pytest.raises(Interrupted):
                side.acquire(wait=0)
            helper.join(30)
        assert side.hold_count == 0
        assert in_thread(lambda: take_side(name, alias, OTHER_SIDE[mode])), "held for its ttl, by nobody"


def is_lock_insert(data):
    """Whether a client's ``data`` is the table backend's INSERT of a lock (its parameters in, client-side)."""
    return b"INSERT INTO" in data and b"(lock_name, owner_host" in data


# The request after which the server has taken the lock: a lock's INSERT (in autocommit), a side's COMMIT.
TAKEN_BY = {"lock": is_lock_insert, "read": is_commit, "write": is_commit}


def lock_of(kind, name, using, **options):
    if kind == "lock":
        return distlocks.lock(name, using=using, **options)
    return getattr(distlocks.read_write_lock(name, using=using, **options), kind)()


def taken_elsewhere(kind, name, alias):
    """Whether another owner takes (and gives back) the lock, or a read-write lock's other side, at once."""
    if kind == "lock":
        return taken_by_another_thread(distlocks.lock(name, using=alias))
    return in_thread(lambda: take_side(name, alias, OTHER_SIDE[kind]))


@pytest.mark.parametrize("alias", ["mariadb", "postgresql"], indirect=True)
@pytest.mark.parametrize("kind", ["lock", "read", "write"])
def test_an_acquire_interrupted_while_the_server_is_frozen_is_voided_once_it_answers(alias, name, kind):
    # The server takes the lock while the answer waits in the frozen proxy; the handler raises during that wait,
    # and the proxy stays frozen while the interrupted acquire cleans up: it can neither end the session nor
    # delete the row. Once the server answers again, the lock must be given back, not held for its ttl.
    with behind_proxy(alias, CONNECT_TIMEOUT=1) as proxy:
        lk = lock_of(kind, name, "proxied", ttl=60)
        with lk:
            pass  # its connection is open
        with raising_on(signal.SIGALRM), proxy.frozen_after(TAKEN_BY[kind], most=30):
            helper = interrupt_main_when(lambda: not proxy.flowing.is_set())
            started = time.monotonic()
            with pytest.raises(Interrupted):
                lk.acquire(wait=0)
            # As long as before: a read the signal does not cut short (MariaDB's: TIMEOUT + 1), and a connection
            # to end the session on (CONNECT_TIMEOUT, 2 s at least for libpq); nothing more once that failed.
            assert time.monotonic() - started < 5
            assert not proxy.flowing.is_set(), "thawed before the interrupted acquire was over"
            helper.join(30)
        assert lk.hold_count == 0
        until(lambda: taken_elsewhere(kind, name, alias), seconds=10, what="another owner taking the lock")


@pytest.mark.parametrize("alias", ["mariadb", "postgresql"], indirect=True)
def test_an_acquire_interrupted_before_its_statement_was_sent_tries_nothing_more(alias, name):
    # Interrupted while its new connection waits for a frozen server: nothing was sent, there is nothing to
    # end, delete or void, and no second connection to wait for (CONNECT_TIMEOUT more, 2 s for libpq).
    with behind_proxy(alias, CONNECT_TIMEOUT=1) as proxy:
        lk = distlocks.lock(name, using="proxied", ttl=60)
        accepted = len(proxy.sockets)
        with raising_on(signal.SIGALRM), proxy.frozen(most=30):
            helper = interrupt_main_when(lambda: len(proxy.sockets) > accepted)
            started = time.monotonic()
            with pytest.raises(Interrupted):
                lk.acquire(wait=0)
            # At most the connection it was in (MariaDB's client lets no signal cut it short: 1 s).
            assert time.monotonic() - started < 1.6
            helper.join(30)
        assert not voids_pending(name)
        assert taken_by_another_thread(distlocks.lock(name, using=alias))


def create_in_flight(alias):
    """Whether the alias's ZooKeeper client sent a create that has no answer yet."""
    client = locks[alias]._session().client
    return any(type(request).__name__.startswith("Create") for request, _, _ in list(client._pending))


@pytest.mark.servers("zookeeper")
@pytest.mark.parametrize("kind", ["lock", "write"])
def test_a_create_interrupted_while_the_server_is_frozen_leaves_no_node(zk_server, settings, name, kind):
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=20, CONNECT_TIMEOUT=5)

    def lock(using):
        if kind == "lock":
            return distlocks.lock(name, using=using)
        return distlocks.read_write_lock(name, using=using).write()

    with frozen(zk_server), raising_on(signal.SIGALRM):
        helper = interrupt_main_when(lambda: create_in_flight(alias))
        with pytest.raises(Interrupted):
            lock(alias).acquire(wait=0)
        helper.join(30)
    # The server creates the node now, in a session that lives on: it must be deleted again.
    assert lock(other).acquire(wait=10)
    lock(other).release()
