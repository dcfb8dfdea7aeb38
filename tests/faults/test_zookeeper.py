"""ZooKeeper under faults: a frozen server, deleted nodes, strangers on the ensemble, odd names.

A test that stops a server uses one of its own (``zk_server``), never the
session's; each fault is injected for real (SIGSTOP/SIGCONT of the server
process, a second client that deletes or adds nodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import make_digest_acl

import distlocks
from distlocks.backends.zookeeper.session import _sessions
from distlocks.handler import locks
from distlocks.owner import current_owner
from distlocks.signals import lock_lost
from localservers import ZK_PORT, ZooKeeperServer
from tests.faults.conftest import frozen

pytestmark = pytest.mark.servers("zookeeper")

# Ports for servers of these tests' own.
OWN_PORTS = range(ZK_PORT + 300, ZK_PORT + 350)


def _free_port():
    for port in OWN_PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {OWN_PORTS}")


class OwnServer(ZooKeeperServer):
    def freeze(self):
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self):
        os.kill(self.process.pid, signal.SIGCONT)


def assert_free_for(alias, name):
    """Another session, ``alias``, takes and gives back the lock ``name`` within 10 s."""
    lk = distlocks.lock(name, using=alias)
    assert lk.acquire(wait=10)
    lk.release()


@pytest.fixture
def zk_server(tmp_path):
    """A standalone ZooKeeper of this test's own, thawed, its clients closed and stopped at the end."""
    server = OwnServer(_free_port(), str(tmp_path)).start()
    yield server
    server.thaw()
    location = f"127.0.0.1:{server.port}"
    for index in [index for index in _sessions if index[1] == location]:
        client = _sessions.pop(index).client
        client.stop()
        client.close()
    server.stop()


def own_aliases(settings, server, *aliases, **options):
    """Point ``aliases`` (separate sessions) at ``server``; return them."""
    entries = dict(settings.DISTLOCKS)
    for alias in aliases:
        entries[alias] = {
            "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
            "LOCATION": f"127.0.0.1:{server.port}",
            "OPTIONS": {"ROOT": "/distlocks", **options},
        }
    settings.DISTLOCKS = entries
    for alias in aliases:
        connect(alias)
    return aliases


def connect(alias, within=30):
    """Open the alias's session: a fresh server may take longer than a short CONNECT_TIMEOUT to answer."""
    deadline = time.monotonic() + within
    while True:
        try:
            return locks[alias].ping()
        except distlocks.BackendUnavailable:
            if time.monotonic() > deadline:
                raise


def stranger(location):
    """A client of the ensemble that distlocks knows nothing about (an operator's zkCli, another app)."""
    client = KazooClient(hosts=location)
    client.start(timeout=10)
    return client


def holder_node(alias, key):
    """The path of the node that holds ``key`` (the first of the queue)."""
    backend = locks[alias]
    parent = backend._parent(key)
    ours = [child for child in backend._session().client.get_children(parent) if child.startswith("lock-")]
    return f"{parent}/{min(ours, key=lambda child: child[-10:])}"


@pytest.fixture
def lost_names():
    """The names ``lock_lost`` was sent for, as an event per name."""
    events = {}

    def on_lost(sender, name, alias, token, **kwargs):
        events.setdefault(name, threading.Event()).set()

    lock_lost.connect(on_lost, weak=False)
    yield lambda name: events.setdefault(name, threading.Event())
    lock_lost.disconnect(on_lost)


# -- 5: a suspended holder learns its loss before its session can have expired --


def test_loss_is_signalled_within_the_session_timeout_when_the_server_freezes(zk_server, settings, name, lost_names):
    session_timeout = 3
    (alias,) = own_aliases(settings, zk_server, "own", SESSION_TIMEOUT=session_timeout)
    holder = distlocks.lock(name, using=alias, ttl=30)
    assert holder.acquire(wait=5)
    lost = lost_names(name)
    with frozen(zk_server):
        frozen_at = time.monotonic()
        # The session expires session_timeout after the server last heard from us, which was before the freeze.
        assert lost.wait(session_timeout + 5), "lock_lost not sent while the server was frozen"
        assert time.monotonic() - frozen_at < session_timeout + 2  # and not at the end of ttl=30
        assert holder.lost
    with pytest.raises(distlocks.LockLost):
        holder.release()
    # Its node is gone (the session expired, or it was deleted on reconnection): the lock is free. The
    # other client connects after the thaw: one that rode out the freeze may itself be reconnecting.
    (other,) = own_aliases(settings, zk_server, "other")
    assert distlocks.lock(name, using=other).acquire(wait=15)
    distlocks.lock(name, using=other).release()


def test_the_session_timeout_the_server_negotiated_is_the_one_that_bounds_a_hold(settings):
    # The tests' servers allow 1 to 60 s: asking for 120 s gets 60, and a hold must give up after 60.
    entry = dict(settings.DISTLOCKS["zookeeper"])
    entry["OPTIONS"] = {**entry["OPTIONS"], "SESSION_TIMEOUT": 120}
    settings.DISTLOCKS = {**settings.DISTLOCKS, "long": entry}
    locks["long"].ping()
    index = ("long", locks["long"].location)
    try:
        assert _sessions[index].timeout == 60
    finally:
        client = _sessions.pop(index).client
        client.stop()
        client.close()


# -- 11: re-entering a lock whose node is gone --


def test_reentering_raises_lock_lost_when_the_node_was_deleted_by_another_client(name):
    lk = distlocks.lock(name, using="zookeeper")
    lk.acquire()
    client = stranger(locks["zookeeper"].location)
    try:
        client.delete(holder_node("zookeeper", lk.key))
    finally:
        client.stop()
        client.close()
    with pytest.raises(distlocks.LockLost):
        lk.acquire()
    with pytest.raises(distlocks.LockLost):
        lk.release()
    assert lk.acquire(wait=5)  # and the name works again
    lk.release()


# -- 12: no "let it expire" on a backend without leases --


def test_the_outermost_release_frees_the_lock_when_a_reentry_met_a_frozen_server(zk_server, settings, name):
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=20, CONNECT_TIMEOUT=1)
    lk = distlocks.lock(name, using=alias)
    assert lk.acquire(wait=5)
    with frozen(zk_server), pytest.raises(distlocks.BackendUnavailable):
        lk.acquire()
    assert lk.hold_count == 1
    lk.release()
    assert_free_for(other, name)


def test_the_outermost_release_frees_the_lock_when_an_inner_release_met_a_frozen_server(zk_server, settings, name):
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=20, CONNECT_TIMEOUT=1)
    lk = distlocks.lock(name, using=alias)
    assert lk.acquire(wait=5)
    assert lk.acquire(wait=5)
    with frozen(zk_server):
        lk.release()  # inner: only the count shown to operators could not be written
    assert lk.hold_count == 1
    lk.release()
    assert_free_for(other, name)


def test_a_last_release_that_met_a_frozen_server_frees_the_lock_once_it_answers(zk_server, settings, name):
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=20, CONNECT_TIMEOUT=1)
    lk = distlocks.lock(name, using=alias)
    assert lk.acquire(wait=5)
    with frozen(zk_server), pytest.raises(distlocks.BackendUnavailable):
        lk.release()
    assert_free_for(other, name)


def test_a_reentered_hold_given_up_under_a_frozen_server_frees_the_lock_at_its_last_release(
    zk_server, settings, name, lost_names
):
    # The holder gives the hold up once its session may have expired (SESSION_TIMEOUT after the server last
    # heard from it); the session (and the node) may live on all the same.
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=3, CONNECT_TIMEOUT=1)
    lk = distlocks.lock(name, using=alias)
    assert lk.acquire(wait=5)
    assert lk.acquire(wait=5)
    with frozen(zk_server):
        assert lost_names(name).wait(10)
        assert lk.lost
    for _ in range(2):
        with pytest.raises(distlocks.LockLost):
            lk.release()
    assert_free_for(other, name)


# -- 28.6: ttl is no lease on ZooKeeper; an acquire's time is bounded; kazoo's messages --


def test_a_hold_outlives_its_ttl_while_the_server_is_frozen_for_less_than_the_session_timeout(
    zk_server, settings, name, lost_names
):
    # The README: ``ttl`` is not a lease here, the session is. A freeze longer than ttl (1 s) but shorter than
    # the session timeout (8 s) loses nothing: no other session can have taken the lock meanwhile.
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=8, CONNECT_TIMEOUT=1)
    lk = distlocks.lock(name, using=alias, ttl=1)
    assert lk.acquire(wait=5)
    lost = lost_names(name)
    with frozen(zk_server):
        time.sleep(3)
        assert not lk.lost
    # Renewals go on once the server answers; the hold was never given up.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert not lk.lost
        time.sleep(0.1)
    assert not lost.is_set()
    assert not distlocks.lock(name, using=other).acquire(wait=0)
    lk.release()
    assert_free_for(other, name)


def _queued_nodes(alias, key, count):
    backend = locks[alias]
    client = backend._session().client
    deadline = time.monotonic() + 20
    while len(client.get_children(backend._parent(key))) < count:
        assert time.monotonic() < deadline, "the waiter did not queue"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_acquire_ends_within_its_wait_and_the_connect_timeout_when_the_server_freezes_while_it_waits(
    zk_server, settings, name, kind
):
    # A long session timeout: kazoo does not notice the freeze (no ConnectionLoss ends the requests early).
    wait, connect_timeout = 1, 3
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=30, CONNECT_TIMEOUT=connect_timeout)
    holder = distlocks.lock(name, using=other)
    assert holder.acquire(wait=5)
    outcome = []

    def waiter():
        started = time.monotonic()
        try:
            if kind == "sync":
                outcome.append(distlocks.lock(name, using=alias).acquire(wait=wait))
            else:
                outcome.append(asyncio.run(distlocks.alock(name, using=alias).acquire(wait=wait)))
        except distlocks.BackendUnavailable as exc:
            outcome.append(exc)
        outcome.append(time.monotonic() - started)

    thread = threading.Thread(target=waiter)
    thread.start()
    _queued_nodes(other, holder.key, 2)
    with frozen(zk_server):
        thread.join(30)
        # Before: each request had CONNECT_TIMEOUT of its own (the waiter's next look, then its leaving the
        # queue): wait + 2 * CONNECT_TIMEOUT, 7 s here.
        assert outcome[-1] < wait + connect_timeout + 1.0, outcome
    assert outcome[0] is False or isinstance(outcome[0], distlocks.BackendUnavailable)
    holder.release()
    # The waiter's node, which it could not delete while the server was frozen, is deleted now.
    assert_free_for(other, name)


def test_a_first_acquire_against_a_frozen_server_ends_within_the_connect_timeout(zk_server, settings, name):
    # No session yet: kazoo's start(timeout) stopped a client that did not connect in time and waited for its
    # connection attempt to end (up to the session timeout, 10 s here) before it raised.
    connect_timeout = 1
    entries = dict(settings.DISTLOCKS)
    entries["fresh"] = {
        "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
        "LOCATION": f"127.0.0.1:{zk_server.port}",
        "OPTIONS": {"ROOT": "/distlocks", "SESSION_TIMEOUT": 10, "CONNECT_TIMEOUT": connect_timeout},
    }
    settings.DISTLOCKS = entries
    with frozen(zk_server):
        started = time.monotonic()
        with pytest.raises(distlocks.BackendUnavailable, match="not connected within"):
            distlocks.lock(name, using="fresh").acquire(wait=1)
        assert time.monotonic() - started < 1 + connect_timeout + 1.0
    # Another try once the server answers connects anew.
    connect("fresh")
    assert_free_for("fresh", name)


def test_kazoos_connection_messages_go_to_a_distlocks_logger_and_not_to_stderr(
    zk_server, settings, name, caplog, capfd, monkeypatch
):
    # As in a process whose logging is not configured (the root logger has no handler), where Python's
    # last-resort handler printed kazoo's warnings to stderr: the records must reach "distlocks" instead.
    monkeypatch.setattr(logging.root, "handlers", [])
    distlocks_logger = logging.getLogger("distlocks")
    distlocks_logger.addHandler(caplog.handler)
    try:
        (alias,) = own_aliases(settings, zk_server, "own", SESSION_TIMEOUT=2, CONNECT_TIMEOUT=1)
        with frozen(zk_server):
            # The session timeout is short: kazoo misses its ping answer and drops the connection.
            deadline = time.monotonic() + 10
            while not any("Connection dropped" in record.getMessage() for record in caplog.records):
                assert time.monotonic() < deadline, "no 'Connection dropped' reached the distlocks logger"
                time.sleep(0.1)
        connect(alias)
    finally:
        distlocks_logger.removeHandler(caplog.handler)
    dropped = [record for record in caplog.records if "Connection dropped" in record.getMessage()]
    assert all(record.name.startswith("distlocks.") for record in dropped)
    assert "Connection dropped" not in capfd.readouterr().err


def test_drop_frees_the_lock_of_a_thread_that_ended_holding_it_without_blocking_when_the_server_freezes(
    zk_server, settings, name
):
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=20, CONNECT_TIMEOUT=1)
    held = []

    def hold_twice_and_end():
        lk = distlocks.lock(name, using=alias, renew=False)
        lk.acquire()
        lk.acquire()
        held.append((lk.key, current_owner()))

    thread = threading.Thread(target=hold_twice_and_end)
    thread.start()
    thread.join(30)
    key, owner = held[0]
    backend = locks[alias]
    with frozen(zk_server):
        started = time.monotonic()
        assert backend.drop(key, owner) is True
        assert time.monotonic() - started < 0.5
    assert_free_for(other, name)
    assert backend.drop(key, owner) is False


# -- 13: a create answered after its time-out --


def test_a_create_answered_after_its_time_out_leaves_no_node_when_the_server_freezes(zk_server, settings, name):
    alias, other = own_aliases(settings, zk_server, "own", "other", SESSION_TIMEOUT=20, CONNECT_TIMEOUT=1)
    # Connected before the freeze (own_aliases): the create is sent, and waits in the server's socket.
    with frozen(zk_server), pytest.raises(distlocks.BackendUnavailable):
        distlocks.lock(name, using=alias).acquire(wait=0)
    # The server creates the node now; it must be deleted again, or it blocks the lock for the session's life.
    assert_free_for(other, name)


# -- 18: AUTH, ACLs and strangers' nodes --


def test_a_client_without_the_credentials_cannot_release_or_block_a_lock_with_auth(zk_server, settings, name):
    alias, colleague = own_aliases(settings, zk_server, "own", "colleague", AUTH=[("digest", "distlocks:secret")])
    lk = distlocks.lock(name, using=alias)
    lk.acquire()
    parent = locks[alias]._parent(lk.key)
    client = stranger(locks[alias].location)
    try:
        (child,) = client.get_children(parent)  # others may look
        with pytest.raises(NoAuthError):
            client.delete(f"{parent}/{child}")
        with pytest.raises(NoAuthError):
            client.create(f"{parent}/lock-", sequence=True)
    finally:
        client.stop()
        client.close()
    lk.release()
    # The same identity in another session (another process, the admin) may.
    lk.acquire()
    assert locks[colleague].force_release(lk.key)
    with pytest.raises(distlocks.LockLost):
        lk.release()


def test_lock_nodes_get_the_configured_acl(zk_server, settings, name):
    acl = [make_digest_acl("distlocks", "secret", all=True), make_digest_acl("ops", "pw", read=True)]
    (alias,) = own_aliases(settings, zk_server, "own", AUTH=[("digest", "distlocks:secret")], ACL=acl)
    with distlocks.lock(name, using=alias) as lk:
        client = locks[alias]._session().client
        node = holder_node(alias, lk.key)
        assert sorted(client.get_acls(node)[0]) == sorted(acl)
        anyone = stranger(locks[alias].location)
        try:
            with pytest.raises(NoAuthError):
                anyone.get_children(locks[alias]._parent(lk.key))
        finally:
            anyone.stop()
            anyone.close()


def test_a_strangers_child_neither_blocks_nor_holds_the_lock(name):
    backend = locks["zookeeper"]
    parent = backend._parent(name)
    client = stranger(backend.location)
    try:
        client.create(f"{parent}/other-", sequence=True, makepath=True)  # sequence 0: below ours
        client.create(f"{parent}/note")
        lk = distlocks.lock(name, using="zookeeper")
        assert lk.acquire(wait=0)
        info = next(info for info in backend.held() if info.key == name)
        assert info.token == lk.token
        assert info.waiters == 0
        lk.release()
        assert not any(info.key == name for info in backend.held())
    finally:
        client.stop()
        client.close()


# -- 22: names ZooKeeper refuses as node names --


def test_names_dot_dotdot_and_slash_are_distinct_working_locks_listed_as_given():
    names = [".", "..", "a/b"]
    backend = locks["zookeeper"]
    held = [distlocks.lock(lock_name, using="zookeeper") for lock_name in names]
    for lk in held:
        assert lk.acquire(wait=0)
    try:
        listed = {info.key for info in backend.held()}
        assert set(names) <= listed
        out = StringIO()
        call_command("distlocks_list", "--using", "zookeeper", "--json", stdout=out)
        assert set(names) <= {row["key"] for row in json.loads(out.getvalue())}
        # Each is its own lock: another thread finds each taken.
        taken = []

        def try_each():
            taken.extend(distlocks.lock(lock_name, using="zookeeper").acquire(wait=0) for lock_name in names)

        thread = threading.Thread(target=try_each)
        thread.start()
        thread.join(30)
        assert taken == [False, False, False]
    finally:
        for lk in held:
            lk.release()
    assert not set(names) & {info.key for info in backend.held()}


# -- 20: force-release of one acquisition --


def test_force_release_with_a_stale_token_leaves_the_new_holder_alone(name):
    backend = locks["zookeeper"]
    with distlocks.lock(name, using="zookeeper") as first:
        stale = first.token
    thread_ready, thread_done = threading.Event(), threading.Event()
    tokens = []

    def hold():
        second = distlocks.lock(name, using="zookeeper")
        second.acquire()
        tokens.append(second.token)
        thread_ready.set()
        thread_done.wait(30)
        with contextlib.suppress(distlocks.LockLost):  # force-released below
            second.release()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert thread_ready.wait(30)
        assert tokens[0] > stale
        assert backend.force_release(name, token=stale) is False
        assert any(info.key == name and info.token == tokens[0] for info in backend.held())
        assert backend.force_release(name, token=tokens[0]) is True
        assert not any(info.key == name for info in backend.held())
    finally:
        thread_done.set()
        thread.join(30)
