"""``WAIT_REPLICAS`` on a Redis master and replica of the tests' own: an acquisition counts once the replica has it.

The replica reaches its master through a proxy, so that a test can block the
link as well as freeze the replica (SIGSTOP). Alias "acked" waits for one
replica (``WAIT_TIMEOUT`` 0.2 s); "plain", on the same master, waits for none:
it shows what another owner finds on the master meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

import pytest
import redis

import distlocks
from distlocks.backends.redis import strays
from distlocks.backends.redis.keys import acquire_keys, rw_acquire_keys
from distlocks.backends.redis.scripts import registered
from distlocks.handler import locks
from distlocks.inspection import held_locks
from distlocks.owner import current_owner
from localservers import REDIS_PORT, RedisServer, answers
from tests.conftest import wait_until
from tests.faults.conftest import FreezableProxy, frozen

# The test's own ports: the first of each range that a server can bind (see ``start_on``).
MASTER_PORTS, REPLICA_PORTS = range(REDIS_PORT + 40, REDIS_PORT + 50), range(REDIS_PORT + 50, REDIS_PORT + 60)
TIMEOUT = 0.2  # the "acked" alias's WAIT_TIMEOUT
KINDS = ["lock", "read", "write", "permit", "member", "alock"]


@dataclass
class Pair:
    master: RedisServer
    replica: RedisServer
    link: FreezableProxy  # the replica's connection to its master passes here

    def client(self, server):
        return redis.Redis(port=server.port, socket_timeout=5)

    def in_sync(self):
        """Whether the replica is linked to its master and has every write the master has."""
        with self.client(self.master) as master, self.client(self.replica) as replica:
            mine = replica.info("replication")
            return (
                mine["master_link_status"] == "up"
                and mine["slave_repl_offset"] >= master.info("replication")["master_repl_offset"]
            )


def start_on(ports, *options):
    """A redis-server on the first of ``ports`` it can bind.

    A port of the ephemeral range may be held for a minute by a connection
    that another process opened from it (TIME_WAIT), which no server can bind.
    """
    for port in ports:
        if not answers(port):
            with contextlib.suppress(RuntimeError):
                return RedisServer(port, *options).start()
    raise RuntimeError(f"no redis-server could start on any of the ports {ports}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    master = start_on(MASTER_PORTS, "--repl-diskless-sync-delay", "0")  # no wait for more replicas: 5 s
    link = FreezableProxy(master.port)
    try:  # a replica keeps what a full sync sends it on disk: in a directory of the test's own
        directory = str(tmp_path_factory.mktemp("replica"))
        replica = start_on(REPLICA_PORTS, "--replicaof", "127.0.0.1", str(link.port), "--dir", directory)
    except BaseException:
        link.close()
        master.stop()
        raise
    yield Pair(master, replica, link)
    with contextlib.suppress(ProcessLookupError):
        os.kill(replica.process.pid, signal.SIGCONT)
    replica.stop()
    link.close()
    master.stop()


@pytest.fixture
def acked(pair, settings):
    """The aliases "acked" (WAIT_REPLICAS 1) and "plain" on the pair's master, the replica in sync; the pair."""
    wait_until(pair.in_sync)
    settings.CACHES = {
        **settings.CACHES,
        "primary": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{pair.master.port}/0",
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 2},
        },
    }
    backend = "distlocks.backends.redis.RedisBackend"
    settings.DISTLOCKS = {
        "acked": {
            "BACKEND": backend,
            "OPTIONS": {"CACHE": "primary", "WAIT_REPLICAS": 1, "WAIT_TIMEOUT": TIMEOUT},
        },
        "plain": {"BACKEND": backend, "OPTIONS": {"CACHE": "primary"}},
    }
    return pair


@contextlib.contextmanager
def broken(pair, fault):
    """The replica frozen (SIGSTOP), or its link to the master blocked, while the block runs."""
    with frozen(pair.replica) if fault == "sigstop" else pair.link.frozen():
        yield


def shows(client, tokens):
    """Whether the lock hashes on ``client``'s server show every hold token of ``tokens``."""
    wanted = {str(token).encode() for token in tokens}
    for key in client.scan_iter(match="distlocks:{*", count=1000):
        if client.type(key) == b"hash":
            for value in client.hgetall(key).values():
                wanted -= set(value.split(b" "))
    return not wanted


def holding(kind, name, alias, inside):
    """Hold one ``kind`` of ``name`` on ``alias`` (wait=0) and call ``inside(tokens)`` meanwhile; return what it returned."""
    if kind == "alock":

        async def hold():
            async with distlocks.alock(name, using=alias, wait=0) as lk:
                return await asyncio.to_thread(inside, [lk.token])

        return asyncio.run(asyncio.wait_for(hold(), 60))
    if kind in ("read", "write"):
        rw = distlocks.read_write_lock(name, using=alias, wait=0)
        lk = rw.read() if kind == "read" else rw.write()
    elif kind == "permit":
        lk = distlocks.semaphore(name, 1, using=alias, wait=0)
    elif kind == "member":
        lk = distlocks.multi_lock([f"{name}-a", f"{name}-b"], using=alias, wait=0)
    else:
        lk = distlocks.lock(name, using=alias, wait=0)
    with lk:
        tokens = list(lk.token) if kind == "member" else [lk.token]
        return inside(tokens)


def free_to_another_owner(kind, name):
    """Whether another thread takes at once, on "plain" (no acknowledgement asked), what ``kind`` of ``name`` holds."""
    if kind in ("read", "write"):
        taken = [("write", name)]  # the write side: no reader holds it either
    elif kind == "permit":
        taken = [("lock", f"sem:{name}#0")]  # the semaphore's one permit, a lock of its own
    elif kind == "member":
        taken = [("lock", f"{name}-a"), ("lock", f"{name}-b")]
    else:
        taken = [("lock", name)]
    result = []

    def take():
        result.extend(holding(other, lock_name, "plain", lambda tokens: True) for other, lock_name in taken)

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(30)
    return result == [True] * len(taken)


def nothing_held(name):
    """Whether the master lists no hold of ``name`` (a semaphore's permits marker is no hold: left out)."""
    return [info.key for info in held_locks(["plain"]).locks if name in info.key and "#permits" not in info.key] == []


@pytest.mark.parametrize("kind", KINDS)
def test_with_the_replica_healthy_a_hold_is_on_the_replica_when_acquire_returns(acked, kind, name):
    # The link holds the master's writes for 0.15 s (less than WAIT_TIMEOUT): acquire returns once they passed,
    # where without WAIT_REPLICAS it would return with the hold on the master alone.
    with acked.client(acked.replica) as replica:
        with acked.link.frozen(most=0.15):
            started = time.monotonic()
            assert holding(kind, name, "acked", lambda tokens: shows(replica, tokens))
        assert time.monotonic() - started >= 0.1
    assert nothing_held(name)


def agreed(kind, name):
    """A semaphore's users agree on its permits first (a marker, taken once a ttl): its permit is what is tried."""
    if kind == "permit":
        with distlocks.semaphore(name, 1, using="acked", wait=0):
            pass


@pytest.mark.parametrize("fault", ["sigstop", "link"])
@pytest.mark.parametrize("kind", KINDS)
def test_without_the_replicas_acknowledgement_acquire_raises_and_leaves_nothing(acked, kind, fault, name):
    agreed(kind, name)
    with broken(acked, fault):
        started = time.monotonic()
        with pytest.raises(distlocks.BackendUnavailable) as info:
            holding(kind, name, "acked", lambda tokens: pytest.fail("acquired without the replica"))
        took = time.monotonic() - started
        assert info.value.alias == "acked"
        assert (
            "for locks on 'acked': 0 of the 1 replicas asked for (WAIT_REPLICAS) acknowledged the acquisition of "
            in str(info.value)
        )
        assert f"within {TIMEOUT:g}s (WAIT_TIMEOUT): it was given back" in str(info.value)
        assert TIMEOUT * 0.9 <= took < TIMEOUT + 1.5
        assert nothing_held(name)
        assert free_to_another_owner(kind, name)  # at once, the replica still away
    assert not [stray for stray in strays.pending() if name in stray.keys[0]]  # nothing to give back later


def test_once_the_replica_goes_on_acquisitions_count_again(acked, name):
    lk = distlocks.lock(name, using="acked", wait=0)
    with frozen(acked.replica), pytest.raises(distlocks.BackendUnavailable):
        lk.acquire()
    wait_until(acked.in_sync)
    with acked.client(acked.replica) as replica, lk:
        assert shows(replica, [lk.token])
    assert nothing_held(name)


def waiter_for(name, queued):
    """A thread waiting for the lock on "acked" until it is handed over; its result ("took" or the error) in a list."""
    result = []

    def wait():
        try:
            with distlocks.lock(name, using="acked", wait=20):
                result.append("took")
        except distlocks.LockError as exc:
            result.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(queued)
    return thread, result


@pytest.mark.parametrize("replica", ["healthy", "frozen"])
def test_a_hand_over_counts_once_the_waiter_saw_the_replica_acknowledge_it(acked, replica, name):
    holder = distlocks.lock(name, using="acked")
    holder.acquire()
    queue = acquire_keys(holder.key)[2]
    with acked.client(acked.master) as master:
        thread, result = waiter_for(name, lambda: master.zcard(queue) == 1)
    with frozen(acked.replica) if replica == "frozen" else contextlib.nullcontext():
        holder.release()  # no acknowledgement asked: it hands the lock to the waiter, which renews it and waits
        thread.join(20)
        if replica == "healthy":
            assert result == ["took"]
        else:
            [error] = result
            assert isinstance(error, distlocks.BackendUnavailable)
            assert "0 of the 1 replicas asked for" in str(error)
            assert free_to_another_owner("lock", name)
    assert nothing_held(name)


@pytest.mark.parametrize("script", ["acquire", "rw_acquire"])
def test_an_acquire_sent_again_writes_so_that_a_wait_after_it_covers_its_hold(acked, script, name):
    # redis-py sends a script again on a new connection when the answer was lost, and WAIT waits for the writes
    # of its own connection (a server may count only the commands that wrote): the second run must write too.
    backend = locks["plain"]
    key = backend.make_key(name)
    attempt, secret = strays.attempt_id(), current_owner().secret
    if script == "acquire":
        keys, args = acquire_keys(key), [attempt, secret, 30_000, "info"]
    else:
        keys, args = rw_acquire_keys(f"rw:{key}"), [attempt, "write", secret, 30_000, "info"]
    with acked.client(acked.master) as first, acked.client(acked.master) as again:
        token = registered(first)[script](keys=keys, args=args)
        assert token > 0
        offset = first.info("replication")["master_repl_offset"]
        assert registered(again)[script](keys=keys, args=args) == token
        assert again.info("replication")["master_repl_offset"] > offset
        if script == "acquire":
            assert registered(first)["release"](keys=keys[:3], args=[secret, token]) == 0
        else:
            assert registered(first)["rw_release"](keys=keys[:3], args=[secret, "write", token]) == 0
