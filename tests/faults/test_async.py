"""``alock()`` under faults: a frozen server while a task's attempt hangs, or while it waits in the queue."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

import distlocks
from distlocks.backends.redis.keys import lock_hash, lock_keys
from distlocks.handler import locks
from distlocks.signals import lock_acquired
from localservers import REDIS_PORT
from tests.faults.conftest import REDIS_CACHES, frozen
from tests.faults.test_redis import TIMED_OUT, handed_over_while_paused

pytestmark = pytest.mark.django_db(transaction=True)


async def ticker(ticks):
    """Note the time every 50 ms: a gap shows the loop stalled."""
    while True:
        await asyncio.sleep(0.05)
        ticks.append(time.monotonic())


async def each_unavailable_in_bounded_time(calls, ticks):
    """Each of ``calls`` on a frozen server raises BackendUnavailable in bounded time while the loop ticks on."""
    for call in calls:
        frozen_at = time.monotonic()
        with pytest.raises(distlocks.BackendUnavailable, match=TIMED_OUT):
            await call()
        took = time.monotonic() - frozen_at
        assert took < 15, f"BackendUnavailable only after {took:.1f}s"  # socket timeout 1 or 2 s
        assert ticks[-1] > time.monotonic() - 1, "the loop stalled"


def test_a_task_cancelled_while_its_attempt_hangs_leaves_no_lock_once_the_server_answers(own_redis, name):
    """The attempt goes on in the pool after the cancel; when it ends holding the lock, the lock is released."""
    server = own_redis(REDIS_PORT + 90, SOCKET_CONNECT_TIMEOUT=2, SOCKET_TIMEOUT=10)
    lk = distlocks.alock(name, using="own", ttl=60)

    async def main():
        assert await lk.acquire(wait=0)  # a connection is open: the frozen server's kernel takes the request
        await lk.release()
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            attempt = asyncio.create_task(lk.acquire(wait=30))
            await asyncio.sleep(0.5)  # its first attempt is waiting for the frozen server's answer
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20  # far less than the 60 s lease
        while (holder := await asyncio.to_thread(lk.lock.holder)) is not None:
            assert time.monotonic() < deadline, f"the cancelled task's attempt left the lock held: {holder}"
            await asyncio.sleep(0.05)
        assert lk.hold_count == 0

    asyncio.run(main())


def test_a_task_waiting_in_the_queue_of_a_frozen_redis_gets_backend_unavailable_in_bounded_time(own_redis, name):
    """The loop's wait ends with the lease it was told; the next attempt times out: no hang, and the loop runs on."""
    server = own_redis(REDIS_PORT + 91, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=2)
    backend = locks["own"]
    client, queue = backend.client, lock_keys(lock_hash(backend.make_key(name)))[2]
    holder = distlocks.lock(name, using="own", ttl=3, renew=False)
    assert holder.acquire(wait=0)
    ticks = []

    async def main():
        ticking = asyncio.create_task(ticker(ticks))
        # ttl=3: its attempt that timed out may still be run once Redis answers, taking the lock for nobody
        # until its lease ends (see the README's "Under faults").
        waiting = asyncio.create_task(distlocks.alock(name, using="own", ttl=3).acquire(wait=60))
        deadline = time.monotonic() + 30
        while client.zcard(queue) != 1:  # it waits in the lock's queue
            assert time.monotonic() < deadline, "the task did not queue"
            await asyncio.sleep(0.01)
        with frozen(server):
            frozen_at = time.monotonic()
            with pytest.raises(distlocks.BackendUnavailable):
                await waiting
            took = time.monotonic() - frozen_at
            assert took < 20, f"BackendUnavailable only after {took:.1f}s"  # lease 3 s, socket timeout 2 s
            assert ticks[-1] > time.monotonic() - 1, "the loop stalled"
        ticking.cancel()
        # Once Redis answers again, the lock is free to take (the holder's lease ran out, its entry is gone, and
        # what the timed-out attempt took, if it did, is given up within its 3 s lease).
        lk = distlocks.alock(name, using="own")
        assert await lk.acquire(wait=30)
        await lk.release()

    asyncio.run(main())


@pytest.mark.parametrize("cache", REDIS_CACHES)
def test_a_task_on_a_frozen_redis_gets_backend_unavailable_in_bounded_time_without_a_pool_thread(
    own_redis, name, monkeypatch, cache
):
    """The native path (redis.asyncio) keeps the cache's SOCKET_TIMEOUT: a held lock's release and a new acquire
    on a frozen server fail in bounded time, while the loop runs on; no call went through the pool."""
    from distlocks import aio

    server = own_redis(REDIS_PORT + 92, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=1, cache=cache)  # 1 s a call
    ticks = []

    async def main():
        ticking = asyncio.create_task(ticker(ticks))
        lk = distlocks.alock(name, using="own", ttl=30)
        assert await lk.acquire(wait=0)  # connections are open: the frozen server's kernel takes the requests
        with frozen(server):
            await each_unavailable_in_bounded_time(
                [lk.release, lambda: distlocks.alock(name + "-2", using="own").acquire(wait=0)], ticks
            )
        ticking.cancel()

    monkeypatch.setattr(aio, "_pool", aio._Pool())  # a pool of its own, started by the first call it runs
    asyncio.run(main())
    assert aio._pool.executor is None, "a call went through the thread pool"


@pytest.mark.parametrize("cache", REDIS_CACHES)
def test_a_tasks_acquire_run_after_it_timed_out_does_not_keep_the_lock_for_its_ttl(own_redis, name, cache):
    """The script the task gave up on runs once the server goes on: the lock is given back, not held for 30 s."""
    server = own_redis(REDIS_PORT + 63, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5, cache=cache)

    async def main():
        lk = distlocks.alock(name, using="own", ttl=30)
        assert await lk.acquire(wait=0)  # a connection is open: the frozen server's kernel takes the request
        await lk.release()
        with frozen(server), pytest.raises(distlocks.BackendUnavailable, match=TIMED_OUT):
            await lk.acquire(wait=0)
        other = distlocks.alock(name, using="own", ttl=30)
        assert await other.acquire(wait=5)  # before the fix: only after the 30 s lease
        await other.release()

    asyncio.run(main())


@pytest.mark.parametrize("side", ["read", "write"])
def test_a_read_write_side_on_a_frozen_redis_gets_backend_unavailable_in_bounded_time_without_a_pool_thread(
    own_redis, name, monkeypatch, side
):
    """A read-write lock's sides run their scripts natively too: a held side's release and an acquire of the same
    side on a frozen server fail in bounded time, while the loop runs on; no call went through the pool."""
    from distlocks import aio

    server = own_redis(REDIS_PORT + 93, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=2)
    ticks = []

    async def main():
        ticking = asyncio.create_task(ticker(ticks))
        held = getattr(distlocks.aread_write_lock(name, using="own", ttl=30), side)()
        other = getattr(distlocks.aread_write_lock(name + "-2", using="own", ttl=30), side)()
        assert await held.acquire(wait=0)  # connections are open: the frozen server's kernel takes the requests
        assert await held.acquire(wait=0)  # and re-entry, on the loop too
        await held.release()
        assert held.hold_count == 1
        with frozen(server):
            await each_unavailable_in_bounded_time([held.release, lambda: other.acquire(wait=0)], ticks)
        ticking.cancel()
        # Once Redis answers again, the other side's acquire and release go through, still on the loop.
        assert await other.acquire(wait=5)
        await other.release()

    monkeypatch.setattr(aio, "_pool", aio._Pool())  # a pool of its own, started by the first call it runs
    asyncio.run(main())
    assert aio._pool.executor is None, "a call went through the thread pool"


@pytest.mark.servers("redis")
@pytest.mark.parametrize("contended", [False, True])
@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_task_cancelled_at_any_turn_of_the_loop_after_its_take_leaves_the_lock_free(name, kind, contended):
    """A cancel that lands after the take but before ``acquire()`` returned (while it ends its wait, or leaves the
    semaphore's queue) gives the lock back: the task, told CancelledError, runs no ``async with`` body to release it."""
    if kind == "lock":
        lk, other = distlocks.alock(name, using="redis", ttl=60), distlocks.alock(name, using="redis", ttl=60)
        held = lk.lock
        queue = lock_keys(lock_hash(held.key))[2]
        waiting = lambda: locks["redis"].client.zcard(queue) == 1  # noqa: E731 - in the lock's queue on the server
    else:
        lk = distlocks.asemaphore(name, 1, using="redis", ttl=60)
        other = distlocks.asemaphore(name, 1, using="redis", ttl=60)
        held = lk.sync.slots[0]
        waiting = lambda: lk.sync.queue.holder() is not None  # noqa: E731 - first in the semaphore's queue
    taken_name = held.name
    taken = threading.Event()  # set on the loop, or in a pool thread (a semaphore's first try)

    def receiver(sender, name, **kwargs):
        if name == taken_name:
            taken.set()

    async def take():
        async with lk:
            await asyncio.sleep(3600)

    async def hold_until(event):
        async with other:
            await event.wait()

    async def until(condition, what):
        deadline = time.monotonic() + 30  # a wait that hangs fails here, naming itself
        while not await asyncio.to_thread(condition):
            assert time.monotonic() < deadline, f"{what}: not within 30 s"
            await asyncio.sleep(0.01)

    async def main():
        for turns in range(8):
            release = asyncio.Event()
            if contended:
                holding = asyncio.create_task(hold_until(release))
                await until(lambda: held.holder() is not None, "the other holder takes it")
            taken.clear()
            task = asyncio.create_task(take())
            if contended:
                await until(waiting, "the task queues")
                release.set()
                await asyncio.wait_for(holding, 30)
            deadline = time.monotonic() + 30
            while not taken.is_set():
                assert not task.done(), task
                assert time.monotonic() < deadline, f"the task is not handed it within 30 s ({turns} turns)"
                await asyncio.sleep(0)
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 5  # far less than the 60 s lease
            while (holder := await asyncio.to_thread(held.holder)) is not None:
                assert time.monotonic() < deadline, f"cancelled {turns} loop turns after the take, it left {holder}"
                await asyncio.sleep(0.02)

    lock_acquired.connect(receiver)
    try:
        asyncio.run(main())
    finally:
        lock_acquired.disconnect(receiver)


@pytest.mark.servers("redis")
@pytest.mark.parametrize("alias", ["redis"])
@pytest.mark.parametrize("kind", ["async-lock", "async-write"])
def test_a_task_whose_loop_is_blocked_before_it_reads_its_hand_over_counts_its_lease_from_before_it(
    workers, tmp_path, name, kind, leave_nothing
):
    """As a waiting thread paused by SIGSTOP (``handed_over_while_paused``), a task whose loop runs CPU work."""
    handed_over_while_paused(workers, tmp_path, name, kind)
