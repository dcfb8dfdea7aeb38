"""What is particular to the ZooKeeper backend: sessions, order, reaping, unavailability."""

from __future__ import annotations

import threading
import time

import pytest
from django.core.exceptions import ImproperlyConfigured
from kazoo.client import KazooClient

import distlocks
from distlocks.backends.zookeeper.session import _sessions
from distlocks.handler import locks
from distlocks.signals import lock_lost

from .conftest import DB, queue_waiters, wait_until

pytestmark = [DB, pytest.mark.servers("zookeeper")]


def expire_session(alias="zookeeper"):
    """Expire this process's ZooKeeper session, as a partition longer than its timeout would."""

    client = _sessions[alias, locks[alias].location].client
    session_id, password = client.client_id
    twin = KazooClient(hosts=locks[alias].location, client_id=(session_id, password))
    twin.start()
    twin.stop()  # closing the twin's connection ends the shared session
    twin.close()


def test_an_expired_session_loses_the_lock_and_the_next_token_is_larger(name):
    lost = []

    def on_lost(sender, name, alias, token, **kwargs):
        lost.append(token)

    lock_lost.connect(on_lost)
    try:
        holder = distlocks.lock(name, using="zookeeper", ttl=3)
        holder.acquire()
        old = holder.token
        expire_session()
        # The hold is marked lost first; the notifier thread then sends lock_lost.
        wait_until(lambda: holder.lost and lost, timeout=10)
        assert lost == [old]
        taken = []
        thread = threading.Thread(target=lambda: taken.append(_token(name)))
        thread.start()
        thread.join(30)
        assert taken[0] > old
        with pytest.raises(distlocks.LockLost):
            holder.release()
    finally:
        lock_lost.disconnect(on_lost)


def _token(name):
    with distlocks.lock(name, using="zookeeper", wait=20) as lk:
        return lk.token


def test_waiters_get_the_lock_in_the_order_they_asked(name):
    holder = distlocks.lock(name, using="zookeeper")
    holder.acquire()
    threads, order = queue_waiters(name, "zookeeper", "ABCD", gap=0.2)
    held = next(info for info in locks["zookeeper"].held() if info.key == holder.key)
    assert held.waiters == 4
    holder.release()
    for thread in threads:
        thread.join(20)
    assert order == ["A", "B", "C", "D"]


def test_a_failed_try_leaves_no_node_behind(name):
    with distlocks.lock(name, using="zookeeper"):
        result = []
        thread = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="zookeeper").acquire(wait=0)))
        thread.start()
        thread.join()
        assert result == [False]
        held = next(info for info in locks["zookeeper"].held() if info.key == name)
        assert held.waiters == 0


@pytest.mark.parametrize("include_data", [False, True])  # a lock's listing, and a read-write lock's side's
def test_a_listing_that_does_not_show_our_new_node_is_asked_again(name, include_data):
    """An acquire sends its listing right behind the create of its node (``FollowUp``). When kazoo sends the create
    again after the listing (``makepath``: the lock's parent was missing, and someone made it meanwhile), the
    listing does not show the node: it must be asked again, or the acquire queues a second node of its own."""
    from distlocks.backends.zookeeper.session import FollowUp
    from distlocks.owner import current_owner

    backend = locks["zookeeper"]
    parent = backend._parent(name)
    client = backend._session().client
    client.ensure_path(parent)
    early = FollowUp("get_children", parent, include_data=include_data)
    early.send(client)  # answered before the node exists, as in that race
    node, _ = backend._create(name, current_owner())
    try:
        children = backend._children(early, node, parent, include_data=include_data)
        names = children[0] if include_data else children
        assert node.rsplit("/", 1)[1] in names
    finally:
        client.delete(node)


def test_empty_lock_nodes_are_reaped_but_not_held_ones(name):
    backend = locks["zookeeper"]
    for i in range(3):
        with distlocks.lock(f"{name}-{i}", using="zookeeper"):
            pass
    with distlocks.lock(f"{name}-held", using="zookeeper") as held:
        assert backend.clear_expired(dry_run=True) >= 3
        assert backend.clear_expired() >= 3
        assert backend.clear_expired() == 0
        names = {info.key for info in backend.held()}
        assert held.key in names
        token = held.token
    # A name whose node was reaped works again, with a larger token.
    with distlocks.lock(f"{name}-0", using="zookeeper") as again:
        assert again.token > token


def test_unreachable_ensemble(settings):
    settings.DISTLOCKS = {
        "down": {
            "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
            "LOCATION": "127.0.0.1:1,127.0.0.1:2",
            "OPTIONS": {"CONNECT_TIMEOUT": 2},
        }
    }
    started = time.monotonic()
    with pytest.raises(distlocks.BackendUnavailable, match="ZooKeeper '127.0.0.1:1,127.0.0.1:2' for locks on 'down'"):
        distlocks.lock("x", using="down").acquire()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({}, "needs LOCATION"),
        ({"LOCATION": "127.0.0.1:2181", "OPTIONS": {"ROOT": "locks"}}, "'ROOT'\\] must start with '/'"),
        ({"LOCATION": "127.0.0.1:2181", "OPTIONS": {"SESSION_TIMEOUT": 0}}, "SESSION_TIMEOUT must be"),
        ({"LOCATION": "127.0.0.1:2181", "OPTIONS": {"CONNECT_TIMEOUT": "5"}}, "CONNECT_TIMEOUT must be"),
        ({"LOCATION": "127.0.0.1:2181", "OPTIONS": {"ACL": "open"}}, "'ACL'\\] must be a non-empty list"),
        ({"LOCATION": "127.0.0.1:2181", "OPTIONS": {"ACL": []}}, "'ACL'\\] must be a non-empty list"),
    ],
)
def test_bad_settings(settings, entry, message):
    settings.DISTLOCKS = {"zk": {"BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend", **entry}}
    with pytest.raises(ImproperlyConfigured, match=message):
        distlocks.lock("x", using="zk")


def test_a_forked_child_gets_a_client_of_its_own(workers, name):
    assert workers("fork", "zookeeper", name).finish() == ["child", "0"]


def _queued(rw, count):
    """Wait until ``count`` nodes are queued under the read-write lock ``rw`` (another client's among them)."""
    backend = locks["zookeeper"]
    parent = backend._parent(rw.key)
    client = backend._session().client
    deadline = time.monotonic() + 20
    while len(client.get_children(parent)) < count:
        assert time.monotonic() < deadline, "the other writer did not queue"
        time.sleep(0.02)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_writer_let_in_after_a_downgrade_gets_a_larger_token_than_the_downgrades_read(name, workers, where):
    # W1 writes; W2 queues for the write side; W1 reads too (a downgrade, let in before W2), then lets go
    # of both: W2's acquisition comes after the downgrade's, so its token must be larger (issue 28, item 4).
    rw = distlocks.read_write_lock(name, using="zookeeper", wait=0)
    assert rw.write().acquire()
    written = rw.write().token
    got, holding, done = [], threading.Event(), threading.Event()

    def second_writer():
        other = distlocks.read_write_lock(name, using="zookeeper").write()
        assert other.acquire(wait=30)
        got.append(other.token)
        holding.set()
        done.wait(30)
        other.release()

    if where == "thread":
        thread = threading.Thread(target=second_writer)
        thread.start()
    else:
        worker = workers("rw_take", "zookeeper", name, "write", 30)
    try:
        _queued(rw, 2)
        assert rw.read().acquire()  # the downgrade: let in at once, ahead of the queued writer
        downgrade = rw.read().token
        assert downgrade > written
        rw.write().release()
        rw.read().release()
        if where == "thread":
            assert holding.wait(30)
            # The admin shows the token the holder has.
            shown = [info.token for info in locks["zookeeper"].held() if info.key == rw.key and info.kind == "write"]
            assert shown == got
        else:
            answer = worker.line()
            assert answer[0] == "acquired"
            got.append(int(answer[1]))
    finally:
        done.set()
        if where == "thread":
            thread.join(30)
    assert got[0] > downgrade


def test_the_polling_handler_answers_as_kazoos_own_select():
    """kazoo's connection thread reads and writes only what ``select`` says is ready, and learns of a dropped
    connection from it: readable and writable sockets, a peer that hung up, a timeout, a closed socket."""
    import socket

    from kazoo.handlers.utils import selector_select

    from distlocks.backends.zookeeper.polling import PollingHandler

    handler = PollingHandler()
    ours, theirs = socket.socketpair()
    try:
        for select in (handler.select, selector_select):
            assert select([ours], [], [], 0.05) == ([], [], [])  # nothing to read yet
            assert select([], [ours], [], 0.05) == ([], [ours], [])  # room to write
        theirs.sendall(b"x")
        for select in (handler.select, selector_select):
            assert select([ours, theirs], [], [], 1) == ([ours], [], [])
        ours.recv(1)
        theirs.close()  # the peer hangs up: the read that follows finds the end
        for select in (handler.select, selector_select):
            assert select([ours], [], [], 1)[0] == [ours]
        assert ours.recv(1) == b""
        ours.close()
        for select in (handler.select, selector_select):
            with pytest.raises((ValueError, TypeError)):
                select([ours], [], [], 0)
        with pytest.raises(ValueError, match="non-negative"):
            handler.select([], [], [], -1)
    finally:
        ours.close()
        theirs.close()
