"""``alock()`` on every backend: tasks on one loop, tasks in several processes, cancellation, a loop that never stalls."""

from __future__ import annotations

import asyncio
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

import distlocks
from demo_shop.shop.models import Stock
from distlocks.aio import POOL_SIZE
from distlocks.backends.redis.keys import lock_hash, lock_keys
from distlocks.handler import locks
from distlocks.models import LockWaiter

from .conftest import DB, DB_ALIASES, LEASE_ALIASES, PROCESS_ALIASES, ROOT, Holder, worker_env

pytestmark = DB


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


async def until(condition, timeout=30.0):
    """Wait on the loop until ``condition()`` is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def waited_for_a_cpu():
    """Seconds this thread has spent runnable but not running (Linux's schedstat "run delay")."""
    with open("/proc/thread-self/schedstat") as stat:
        return int(stat.read().split()[1]) / 1e9


async def ticker(gaps, stop):
    """Tick every 10 ms on the loop until ``stop`` is set, noting each gap between ticks in ``gaps``.

    A gap leaves out the time the loop's thread waited for a CPU: on a loaded
    machine that is the machine's stall, not the loop's (a blocking call, or
    CPU work on the loop, still counts).
    """
    last, waited = time.monotonic(), waited_for_a_cpu()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now, now_waited = time.monotonic(), waited_for_a_cpu()
        gaps.append(now - last - (now_waited - waited))
        last, waited = now, now_waited


async def cancel_inside(holdable, while_inside=None):
    """Cancel a task that sleeps inside ``async with holdable``, once it is in; it must end cancelled.

    ``while_inside`` (a coroutine function) runs while the task is inside, before the cancel.
    """
    entered = asyncio.Event()

    async def hold_forever():
        async with holdable:
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(hold_forever())
    await entered.wait()
    if while_inside is not None:
        await while_inside()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def holder_of(lk):
    """Who holds the lock, asked from a thread (Django's connections are per context on the loop)."""
    return await asyncio.to_thread(lk.lock.holder)


def test_two_tasks_on_one_loop_exclude_each_other_and_each_reenters_its_own(alias, name):
    lk = distlocks.alock(name, using=alias, wait=30)
    inside = []
    overlaps = []

    async def critical(label):
        for _ in range(3):
            async with lk as held:
                assert held is lk
                async with lk:  # the task re-enters its own hold
                    assert lk.hold_count == 2
                if inside:
                    overlaps.append((label, list(inside)))
                inside.append(label)
                token = lk.token
                await asyncio.sleep(0.02)  # the other task runs meanwhile, and must wait
                assert lk.token == token
                inside.remove(label)
            assert lk.hold_count == 0

    async def main():
        await asyncio.gather(critical("a"), critical("b"), critical("c"))

    run(main())
    assert overlaps == []
    assert lk.lock.holder() is None


def test_an_alock_and_a_lock_of_the_same_name_exclude_each_other(alias, name):
    async def main():
        lk = distlocks.alock(name, using=alias)
        holder = Holder(name, alias)
        assert not await lk.acquire(wait=0)
        assert holder.release() is None
        assert await lk.acquire(wait=0)
        taken = await asyncio.get_running_loop().run_in_executor(
            None, lambda: distlocks.lock(name, using=alias).acquire(wait=0)
        )
        assert not taken
        await lk.release()

    run(main())


def test_a_tasks_tokens_grow_and_a_task_that_does_not_hold_cannot_release(alias, name):
    async def main():
        lk = distlocks.alock(name, using=alias)
        assert await lk.acquire(wait=0)
        first = lk.token

        async def other():
            with pytest.raises(distlocks.LockNotOwned):
                await lk.release()
            assert lk.hold_count == 0

        await asyncio.create_task(other())
        await lk.release()
        assert await lk.acquire(wait=0)
        assert lk.token > first
        await lk.release()

    run(main())


def test_bad_arguments_raise_value_error_at_once():
    with pytest.raises(ValueError, match="wait"):
        distlocks.alock("x", using="locmem", wait=-1)
    with pytest.raises(ValueError, match="ttl"):
        distlocks.alock("x", using="locmem", ttl=0)


def test_cancelling_a_waiting_task_leaves_no_trace(alias, name):
    async def main():
        holder = Holder(name, alias)
        lk = distlocks.alock(name, using=alias)
        waiting = asyncio.create_task(lk.acquire(wait=60))
        await asyncio.sleep(0.5)  # it has tried, and waits
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert holder.release() is None
        await asyncio.sleep(0.5)  # an attempt still under way would have taken it by now
        assert await holder_of(lk) is None, "the cancelled waiter took the lock"
        other = distlocks.alock(name, using=alias)
        assert await other.acquire(wait=0)
        await other.release()

    run(main())


def test_cancelling_a_task_that_holds_inside_async_with_releases(alias, name):
    async def main():
        lk = distlocks.alock(name, using=alias, wait=5)

        async def is_held():
            assert await holder_of(lk) is not None

        await cancel_inside(lk, is_held)
        assert await holder_of(lk) is None
        assert await lk.acquire(wait=0)
        await lk.release()

    run(main())


def test_a_ticker_never_stalls_while_tasks_wait_for_a_held_lock(alias, name):
    """More waiters than pool threads, for seconds: the loop keeps ticking (the bound is generous)."""
    gaps = []

    async def main():
        holder = Holder(name, alias)
        stop = asyncio.Event()

        ticking = asyncio.create_task(ticker(gaps, stop))
        waiters = [
            asyncio.create_task(distlocks.alock(name, using=alias).acquire(wait=2)) for _ in range(POOL_SIZE * 3)
        ]
        assert not any(await asyncio.gather(*waiters))
        stop.set()
        await ticking
        assert holder.release() is None

    run(main())
    assert statistics.mean(gaps) < 0.04  # ticks every 10 ms asked for: the loop is mostly free
    assert max(gaps) < 1.0, f"the loop stalled for {max(gaps):.3f}s"


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_tasks_in_several_processes_count_without_losing_an_update(alias, name, tmp_path, workers):
    counter = tmp_path / "counter"
    counter.write_text("0")
    processes, tasks, rounds = 3, 4, 5
    started = [workers("async_counter", alias, name, counter, tasks, rounds, processes) for _ in range(processes)]
    for worker in started:
        assert worker.finish() == ["done"]
    assert int(counter.read_text()) == processes * tasks * rounds


@pytest.mark.parametrize("alias", LEASE_ALIASES, indirect=True)
def test_a_loop_blocked_past_the_lease_keeps_its_lock_renewed(alias, name):
    async def main():
        lk = distlocks.alock(name, using=alias, ttl=2)  # renewals with 1.3 s to spare (0.7 s were late at load 10)
        assert await lk.acquire(wait=0)
        token = lk.token
        time.sleep(2.5)  # the loop is blocked past the lease: the watchdog's threads renew
        assert not lk.lost
        holder = await holder_of(lk)
        assert holder is not None
        assert holder.token == token
        assert not await asyncio.create_task(distlocks.alock(name, using=alias).acquire(wait=0))  # another task
        await lk.release()

    run(main())


@pytest.mark.parametrize("alias", LEASE_ALIASES, indirect=True)
def test_a_loop_blocked_past_an_unrenewed_lease_learns_it_lost_the_lock(alias, name):
    async def main():
        lk = distlocks.alock(name, using=alias, ttl=1, renew=False)
        assert await lk.acquire(wait=0)
        time.sleep(1.5)  # the loop is blocked past the lease; another takes the lock
        taken = threading.Event()

        def take():
            other = distlocks.lock(name, using=alias, wait=10)
            if other.acquire():
                taken.set()
                other.release()

        thread = threading.Thread(target=take)
        thread.start()
        thread.join(30)
        assert taken.is_set()
        with pytest.raises(distlocks.LockLost):
            await lk.release()

    run(main())


def test_used_outside_a_task_it_says_so():
    lk = distlocks.alock("x", using="locmem")
    with pytest.raises(RuntimeError, match="task"):
        _ = lk.hold_count


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def asgi_server(tmp_path):
    """``tests.asgi_shop`` under uvicorn, in a process of its own, on the test databases; its base URL."""
    port = free_port()
    log = tmp_path / "uvicorn.log"
    with log.open("w") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "tests.asgi_shop:application", "--port", str(port), "--lifespan", "off"],
            cwd=ROOT,
            env=worker_env(),
            stdout=subprocess.DEVNULL,
            stderr=output,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            assert server.poll() is None, log.read_text()
            try:
                httpx.get(f"{base}/threads/", timeout=1).raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "uvicorn did not answer"
                time.sleep(0.1)
        yield base
    finally:
        server.terminate()
        server.wait(30)


def test_the_async_view_under_concurrent_load_sells_exactly_the_stock_with_a_bounded_pool(
    alias, name, asgi_server, capsys
):
    """50 concurrent requests for 30 items: 30 sold, none oversold, and no thread or connection per request."""
    requests, items = 50, 30
    product = name[-15:]
    Stock.objects.create(product_id=product, count=items)
    Stock.objects.create(product_id=f"{product}-warm", count=0)

    async def load():
        async with httpx.AsyncClient(base_url=asgi_server, timeout=120) as client:
            # One request first: the backend's own threads (Redlock's per node, the watchdog's) start once.
            assert (await client.post(f"/buy/{alias}/{product}-warm/")).status_code == 409
            before = (await client.get("/threads/")).json()
            answers = await asyncio.gather(*(client.post(f"/buy/{alias}/{product}/") for _ in range(requests)))
            return before, [answer.status_code for answer in answers], (await client.get("/threads/")).json()

    before, statuses, after = asyncio.run(load())
    assert sorted(statuses) == [200] * items + [409] * (requests - items)
    assert Stock.objects.get(product_id=product).count == 0
    with capsys.disabled():
        print(
            f"\n{alias}: threads at most {after['threads']} (distlocks's: {before['lock_threads_now']} before,"
            f" at most {after['lock_threads']}); lock connections at most {after['connections']}"
        )
    # Before alock, each waiting request held a thread of distlocks's (and on a
    # database backend a connection) of its own: 50 here. Now the pool's, and
    # the watchdog's few (a renewer per alias, its timer).
    assert after["lock_threads"] - before["lock_threads_now"] <= POOL_SIZE + 4
    # A native backend's pool thread opens a connection only when it has no idle one: then it has its new
    # attempt's, and at most two holds' it took (one held, one whose release has freed the server's lock for
    # a waiter but not yet brought the connection home). The renewer has one.
    assert after["connections"] <= 3 * POOL_SIZE + 1, after["connection_threads"]


@pytest.mark.parametrize("alias", ["zookeeper", "mariadb_native", "postgresql_native"], indirect=True)
def test_a_task_that_ends_holding_a_session_bound_lock_frees_it(alias, name):
    """The session outlives the task (and the pool's threads): the watchdog frees what the ended task held."""

    async def main():
        async def take_and_end():
            assert await distlocks.alock(name, using=alias).acquire(wait=0)

        await asyncio.create_task(take_and_end())
        other = distlocks.alock(name, using=alias)
        assert not await other.acquire(wait=0)
        assert await other.acquire(wait=10)  # the watchdog looks for ended holders every second
        await other.release()

    run(main())


def test_async_with_raises_lock_not_acquired_when_the_wait_runs_out(alias, name):
    async def main():
        holder = Holder(name, alias)
        try:
            with pytest.raises(distlocks.LockNotAcquired, match="not acquired within 0.3s"):
                async with distlocks.alock(name, using=alias, wait=0.3):
                    pytest.fail("the body ran without the lock")
        finally:
            assert holder.release() is None

    run(main())


def redis_queue(name):
    """The Redis client of the "redis" alias and the key of the lock's waiters' queue there."""
    backend = locks["redis"]
    return backend.client, lock_keys(lock_hash(backend.make_key(name)))[2]


@pytest.mark.parametrize("alias", ["redis"], indirect=True)
def test_on_redis_a_waiting_task_is_queued_and_cancelling_it_takes_it_out_of_the_queue(alias, name):
    client, queue = redis_queue(name)

    async def main():
        holder = Holder(name, alias)
        lk = distlocks.alock(name, using=alias)
        waiting = asyncio.create_task(lk.acquire(wait=60))
        await until(lambda: client.zcard(queue) == 1)  # it waits for its turn, in the lock's queue
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # Cancelled during an attempt, it leaves the queue as that attempt ends: soon, not before the task ends.
        await until(lambda: client.zcard(queue) == 0)
        assert holder.release() is None
        assert await holder_of(lk) is None, "the lock was handed to the cancelled waiter"
        assert await lk.acquire(wait=0)
        await lk.release()

    run(main())


def queued(alias, name):
    """How many waiters are in the lock's queue: a ZSET on Redis, nodes on ZooKeeper (but the holder's), rows of the
    waiters' table on a database."""
    if alias == "redis":
        client, queue = redis_queue(name)
        return client.zcard(queue)
    if alias == "zookeeper":
        backend = locks[alias]
        return len(backend._request("get_children", backend._parent(backend.make_key(name)))) - 1
    return LockWaiter.objects.using(alias).filter(lock_name=locks[alias].make_key(name)).count()


@pytest.mark.parametrize("alias", ["redis", "zookeeper", *DB_ALIASES], indirect=True)
def test_tasks_and_threads_of_several_processes_are_served_in_the_order_they_queued(alias, name, tmp_path, workers):
    """Each waiter starts once the one before it is in the lock's queue; the release hands the lock on in that order.

    On Redis the release hands it over; on ZooKeeper a waiter's node stays
    queued, a task's too; on a database, a waiter takes it only if no live
    waiter queued before it (async tasks queue too, not only threads).
    """
    log = tmp_path / "order"
    log.touch()
    here = []

    def take_here(kind, label):
        def note():
            with log.open("a") as file:
                file.write(f"{label}\n")

        async def take_async():
            async with distlocks.alock(name, using=alias, wait=120):
                note()

        def take():
            if kind == "async":
                asyncio.run(take_async())
            else:
                with distlocks.lock(name, using=alias, wait=120):
                    note()

        thread = threading.Thread(target=take)
        thread.start()
        here.append(thread)

    plan = [("async", "A", "worker"), ("sync", "B", "here"), ("async", "C", "here"), ("sync", "D", "worker")]
    plan += [("async", "E", "worker"), ("async", "F", "here")]
    holder = Holder(name, alias)
    started = []
    for place, (kind, label, where) in enumerate(plan, 1):
        if where == "here":
            take_here(kind, label)
        else:
            started.append(workers("take_in_turn", alias, name, kind, label, log))
        deadline = time.monotonic() + 60
        while queued(alias, name) < place:
            assert time.monotonic() < deadline, f"{label} did not queue"
            time.sleep(0.01)
    assert holder.release() is None
    for worker in started:
        assert worker.finish() == ["done"]
    for thread in here:
        thread.join(60)
    assert log.read_text().split() == [label for _, label, _ in plan]


@pytest.mark.parametrize("alias", ["redis"], indirect=True)
def test_on_redis_fifty_tasks_on_one_loop_take_turns_while_a_ticker_keeps_ticking(alias, name):
    gaps, inside, overlaps, served = [], [], [], []

    async def main():
        lk = distlocks.alock(name, using=alias, wait=120)
        stop = asyncio.Event()

        async def critical(number):
            async with lk:
                if inside:
                    overlaps.append((number, list(inside)))
                inside.append(number)
                await asyncio.sleep(0.005)
                inside.remove(number)
                served.append(number)

        ticking = asyncio.create_task(ticker(gaps, stop))
        await asyncio.gather(*(critical(number) for number in range(50)))
        stop.set()
        await ticking
        assert await holder_of(lk) is None

    run(main())
    assert sorted(served) == list(range(50))
    assert overlaps == []
    assert max(gaps) < 1.0, f"the loop stalled for {max(gaps):.3f}s"
