"""The async semaphore, multi-lock and read-write lock on every backend that has the kind: tasks exclude each other
as the kind says, on one loop and across processes; cancellation leaves nothing; the loop never stalls."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import pytest

import distlocks
from distlocks.aio import POOL_SIZE
from distlocks.backends.redis.keys import keys_of_read_write_lock
from distlocks.handler import locks
from distlocks.inspection import held_locks, holder

from .conftest import ALIASES, DB, PROCESS_ALIASES, Holder
from .test_async import cancel_inside, run, ticker
from .test_read_write import RW_ALIASES, RW_PROCESS_ALIASES, takes
from .test_semaphore import concurrency

pytestmark = DB


def held_here(alias, name):
    """The locks held on ``alias`` whose name contains ``name`` (permits, members, sides), from a thread."""
    return [info for info in held_locks([alias]).locks if name in info.key]


async def held_now(alias, name):
    return await asyncio.to_thread(held_here, alias, name)


def member_free(alias, lock_name):
    return holder(alias, distlocks.lock(lock_name, using=alias).key) is None


async def until_true(check, timeout=30.0):
    """Wait on the loop until ``check()``, run in a thread (Django's connections are per thread), is true."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# -- the semaphore ---------------------------------------------------------------


def test_three_permits_let_three_tasks_in_and_the_fourth_waits_for_one(alias, leave_nothing, name):
    async def main():
        sem = distlocks.asemaphore(name, 3, using=alias, wait=30)
        inside, go = asyncio.Event(), asyncio.Event()
        slots = {}

        async def hold(label):
            async with sem as held:
                assert held is sem
                slots[label] = sem.slot
                assert sem.token > 0
                if len(slots) == 3:
                    inside.set()
                await go.wait()

        holders = [asyncio.create_task(hold(label)) for label in "abc"]
        await inside.wait()
        assert sorted(slots.values()) == [0, 1, 2]

        async def fourth():
            assert not await sem.acquire(wait=0)
            assert await sem.acquire(wait=30)
            try:
                return sem.slot
            finally:
                await sem.release()

        waiting = asyncio.create_task(fourth())
        await asyncio.sleep(0.3)
        assert not waiting.done()  # it waits: every permit is held
        go.set()
        assert await waiting in (0, 1, 2)
        await asyncio.gather(*holders)
        assert await held_now(alias, name) == []

    run(main())


def test_a_task_waiting_for_a_permit_is_cancelled_and_leaves_no_permit_and_no_queue_lock(alias, leave_nothing, name):
    async def main():
        taken = Holder(name, alias, lock=distlocks.semaphore(name, 1, using=alias))
        sem = distlocks.asemaphore(name, 1, using=alias)
        waiting = asyncio.create_task(sem.acquire(wait=60))
        await until_true(lambda: waiting.done() or len(held_here(alias, name)) == 2)  # the permit, and its queue lock
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert taken.release() is None
        await until_true(lambda: held_here(alias, name) == [])  # no permit taken after the cancel, no queue lock left
        await asyncio.sleep(0.3)
        assert await held_now(alias, name) == []
        assert await sem.acquire(wait=0)
        await sem.release()

    run(main())


def test_cancelling_a_task_inside_async_with_a_semaphore_gives_its_permit_back(alias, leave_nothing, name):
    async def main():
        sem = distlocks.asemaphore(name, 1, using=alias, wait=5)
        await cancel_inside(sem)
        assert await held_now(alias, name) == []
        assert await sem.acquire(wait=0)
        await sem.release()

    run(main())


# -- the multi-lock --------------------------------------------------------------


def test_tasks_locking_overlapping_sets_in_opposite_orders_never_overlap_nor_deadlock(alias, leave_nothing, name):
    a, b, c = f"{name}-a", f"{name}-b", f"{name}-c"
    inside, overlaps = [], []

    async def take(names, label):
        lk = distlocks.amulti_lock(names, using=alias, wait=30)
        for _ in range(4):
            async with lk:
                assert set(lk.tokens) == set(names)
                if inside:
                    overlaps.append((label, list(inside)))
                inside.append(label)
                await asyncio.sleep(0.01)
                inside.remove(label)
            assert lk.hold_count == 0

    async def main():
        await asyncio.gather(take([a, b, c], "abc"), take([c, b], "cb"), take([b, a], "ba"))

    run(main())
    assert overlaps == []
    assert all(member_free(alias, lock_name) for lock_name in (a, b, c))


def test_a_task_waiting_for_the_last_member_is_cancelled_and_gives_back_the_ones_it_took(alias, leave_nothing, name):
    a, b = f"{name}-a", f"{name}-b"

    async def main():
        busy = Holder(b, alias)
        lk = distlocks.amulti_lock([b, a], using=alias)
        waiting = asyncio.create_task(lk.acquire(wait=60))
        await until_true(lambda: waiting.done() or not member_free(alias, a))  # it took a, and waits for b
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await until_true(lambda: member_free(alias, a))
        assert busy.release() is None
        await asyncio.sleep(0.3)
        assert await asyncio.to_thread(member_free, alias, a)
        assert await asyncio.to_thread(member_free, alias, b)
        assert await lk.acquire(wait=0)
        await lk.release()

    run(main())


def test_cancelling_a_task_inside_async_with_a_multi_lock_releases_every_member(alias, leave_nothing, name):
    names = [f"{name}-a", f"{name}-b"]

    async def main():
        lk = distlocks.amulti_lock(names, using=alias, wait=5)
        await cancel_inside(lk)
        assert all(await asyncio.gather(*(asyncio.to_thread(member_free, alias, n) for n in names)))

    run(main())


# -- the read-write lock ---------------------------------------------------------


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_reader_tasks_are_inside_together_and_a_writer_task_excludes_them(alias, leave_nothing, name):
    async def main():
        rw = distlocks.aread_write_lock(name, using=alias, wait=30)
        readers_in, go = asyncio.Event(), asyncio.Event()
        reading = []

        async def read():
            async with rw.read():
                reading.append(rw.read().token)
                if len(reading) == 3:
                    readers_in.set()
                await go.wait()

        readers = [asyncio.create_task(read()) for _ in range(3)]
        await readers_in.wait()  # three readers hold it at once

        async def write():
            writer = rw.write()
            assert not await writer.acquire(wait=0)
            async with writer:
                assert not await asyncio.create_task(rw.read().acquire(wait=0))  # no reader while it writes
                assert not await asyncio.create_task(rw.write().acquire(wait=0))  # nor another writer
                async with rw.read():  # the writer may read (a downgrade)
                    pass
                return writer.token

        writing = asyncio.create_task(write())
        await asyncio.sleep(0.3)
        assert not writing.done()
        go.set()
        await asyncio.gather(*readers)
        assert await writing > max(reading)
        assert await held_now(alias, name) == []

    run(main())


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_a_reader_task_asking_for_the_write_side_gets_value_error(alias, leave_nothing, name):
    async def main():
        rw = distlocks.aread_write_lock(name, using=alias)
        async with rw.read():
            with pytest.raises(ValueError, match="holds its read side"):
                await rw.write().acquire(wait=0)

    run(main())


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_a_waiting_writer_task_blocks_new_readers_and_cancelling_it_lets_them_in(alias, leave_nothing, name):
    async def main():
        rw = distlocks.aread_write_lock(name, using=alias)
        reader = Holder(name, alias, lock=distlocks.read_write_lock(name, using=alias).read())
        writing = asyncio.create_task(rw.write().acquire(wait=60))

        async def a_new_reader_gets_in():
            async def read():
                if not await rw.read().acquire(wait=0):
                    return False
                await rw.read().release()
                return True

            return await asyncio.create_task(read())

        deadline = time.monotonic() + 10
        while await a_new_reader_gets_in():  # until the writer is recorded waiting
            assert time.monotonic() < deadline, "the waiting writer task never blocked new readers"
            await asyncio.sleep(0.05)
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        # Its record goes with it (once an attempt under way at the cancel has ended), not left to run out its lease.
        deadline = time.monotonic() + 5  # the record's lease is the default ttl, 30 s
        while not await a_new_reader_gets_in():
            assert time.monotonic() < deadline, "the cancelled writer task still blocks new readers"
            await asyncio.sleep(0.05)
        assert reader.release() is None
        await asyncio.sleep(0.3)
        assert await held_now(alias, name) == []

    run(main())


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_cancelling_a_task_inside_async_with_a_side_releases_it(alias, leave_nothing, name):
    async def main():
        rw = distlocks.aread_write_lock(name, using=alias, wait=5)
        await cancel_inside(rw.write())
        assert await held_now(alias, name) == []
        assert await rw.read().acquire(wait=0)
        await rw.read().release()

    run(main())


# -- every kind ------------------------------------------------------------------


def kinds(aliases, rw_aliases):
    """(alias, kind) for each alias: the semaphore and the multi-lock everywhere, the write side where there is one."""
    return [
        (alias, kind)
        for alias in aliases
        for kind in ("semaphore", "multi", "write")
        if kind != "write" or alias in rw_aliases
    ]


@pytest.mark.parametrize(("alias", "kind"), kinds(ALIASES, RW_ALIASES), indirect=["alias"])
def test_a_ticker_never_stalls_while_tasks_wait_for_a_held_kind(alias, leave_nothing, name, kind):
    """More waiters than pool threads, for seconds: the loop keeps ticking (the bound is generous)."""
    sync, make = {
        "semaphore": (
            lambda: distlocks.semaphore(name, 1, using=alias),
            lambda: distlocks.asemaphore(name, 1, using=alias),
        ),
        "multi": (
            lambda: distlocks.lock(f"{name}-b", using=alias),
            lambda: distlocks.amulti_lock([f"{name}-a", f"{name}-b"], using=alias),
        ),
        "write": (
            lambda: distlocks.read_write_lock(name, using=alias).read(),
            lambda: distlocks.aread_write_lock(name, using=alias).write(),
        ),
    }[kind]
    gaps = []

    async def main():
        taken = Holder(name, alias, lock=sync())
        stop = asyncio.Event()
        ticking = asyncio.create_task(ticker(gaps, stop))
        waiters = [asyncio.create_task(make().acquire(wait=2)) for _ in range(POOL_SIZE * 2)]
        assert not any(await asyncio.gather(*waiters))
        stop.set()
        await ticking
        assert taken.release() is None

    run(main())
    assert statistics.mean(gaps) < 0.04  # ticks every 10 ms asked for: the loop is mostly free
    assert max(gaps) < 1.0, f"the loop stalled for {max(gaps):.3f}s"


@pytest.mark.parametrize(("alias", "kind"), kinds(PROCESS_ALIASES, RW_PROCESS_ALIASES), indirect=["alias"])
def test_tasks_in_several_processes_exclude_each_other_as_the_kind_says(
    alias, leave_nothing, name, tmp_path, workers, kind
):
    path = tmp_path / "shared"
    path.write_text("" if kind == "semaphore" else "0")
    processes, tasks, rounds = 3, 3, 4
    started = [workers("async_kind", kind, alias, name, path, tasks, rounds, processes) for _ in range(processes)]
    for worker in started:
        assert worker.finish() == ["done"]
    if kind == "semaphore":
        most, entries = concurrency(path)
        assert most == 2  # never 3, and the two permits were used together
        assert sum(entries.values()) == processes * tasks * rounds
    else:
        assert int(path.read_text()) == processes * tasks * rounds  # no lost update: one task inside at a time


@pytest.mark.parametrize("alias", ["redis"], indirect=True)
def test_on_redis_a_waiting_writer_task_joins_the_queue_and_cancelling_it_takes_it_out(alias, leave_nothing, name):
    rw = distlocks.aread_write_lock(name, using=alias)
    client, queue = locks[alias].client, keys_of_read_write_lock(rw.rw.key)[2]

    async def main():
        reader = Holder(name, alias, lock=distlocks.read_write_lock(name, using=alias).read())
        writing = asyncio.create_task(rw.write().acquire(wait=60))
        await until_true(lambda: client.zcard(queue) == 1)  # queued as a waiting thread is, handed its turn on the loop
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        await until_true(lambda: client.zcard(queue) == 0, timeout=5)
        assert reader.release() is None
        assert await rw.write().acquire(wait=0)  # nothing was handed to the cancelled writer
        await rw.write().release()

    run(main())


async def a_task_reads(rw, wait):
    """Whether a new task on the loop gets ``rw``'s read side within ``wait`` seconds (it gives it back at once)."""

    async def read():
        if not await rw.read().acquire(wait=wait):
            return False
        await rw.read().release()
        return True

    return await asyncio.create_task(read())


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_new_readers_wait_behind_a_waiting_writer_task_until_it_has_written(
    alias, leave_nothing, name, workers, tmp_path
):
    """A reader holds, a writer task waits: new readers (a task on its loop, a thread, a process) keep out, between
    its attempts too, and get in only once the writer has written."""
    log = tmp_path / "events"
    log.touch()

    def note(event, label):
        with log.open("a") as events:
            events.write(f"{event} {label} {time.monotonic():.6f}\n")

    def read_in_a_thread(asking):
        asking.set()
        with distlocks.read_write_lock(name, using=alias, wait=60).read():
            note("enter", "thread")

    async def main():
        rw = distlocks.aread_write_lock(name, using=alias, wait=60)
        first = Holder(name, alias, lock=distlocks.read_write_lock(name, using=alias).read())

        async def write():
            async with rw.write():
                note("enter", "writer")
                await asyncio.sleep(0.3)  # the readers that wait keep out while it writes
                note("exit", "writer")

        writing = asyncio.create_task(write())
        await until_true(lambda: not takes(alias, name, "read"))  # the writer is queued
        # For 2 s (attempts of the writer, and waits between them) no new reader gets in, here or elsewhere.
        if alias in RW_PROCESS_ALIASES:
            elsewhere = asyncio.to_thread(lambda: workers("rw_take", alias, name, "read", 2).finish())
            busy = ["busy"]
        else:
            elsewhere, busy = asyncio.to_thread(takes, alias, name, "read", 2), False
        assert await asyncio.gather(elsewhere, a_task_reads(rw, 2)) == [busy, False]

        async def read_later():
            async with rw.read():
                note("enter", "task")

        reading = asyncio.create_task(read_later())
        asking = threading.Event()
        thread = threading.Thread(target=read_in_a_thread, args=(asking,))
        thread.start()
        assert await asyncio.to_thread(asking.wait, 30)
        later = None
        if alias in RW_PROCESS_ALIASES:
            later = workers("rw_turn", alias, name, "read", "process", 0, log, "ready")
            assert await asyncio.to_thread(later.line) == ["ready"]
        await asyncio.sleep(0.3)  # they ask for the read side meanwhile
        assert not writing.done()
        assert not reading.done()
        assert await asyncio.to_thread(first.release) is None
        await asyncio.gather(writing, reading)
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive()
        if later is not None:
            assert await asyncio.to_thread(later.finish) == ["done"]
        assert await held_now(alias, name) == []

    run(main())
    entered, left = {}, {}
    for line in log.read_text().splitlines():
        event, label, at = line.split()
        (entered if event == "enter" else left)[label] = float(at)
    readers = ["task", "thread"] + (["process"] if alias in RW_PROCESS_ALIASES else [])
    assert sorted(entered) == sorted(["writer", *readers])
    assert all(left["writer"] <= entered[reader] for reader in readers), (entered, left)


def zk_nodes(name):
    """The names of the children of a read-write lock's node on ZooKeeper: its readers' and writers' nodes."""
    from kazoo.exceptions import NoNodeError

    backend = locks["zookeeper"]
    try:
        children = backend._request(
            "get_children", backend._parent(distlocks.read_write_lock(name, using="zookeeper").key)
        )
    except NoNodeError:
        return []
    return sorted(children, key=lambda child: child[-10:])


@pytest.mark.parametrize("alias", ["zookeeper"], indirect=True)
def test_on_zookeeper_a_waiting_writer_task_keeps_one_node_queued_and_cancelling_it_deletes_the_node(
    alias, leave_nothing, name
):
    async def main():
        rw = distlocks.aread_write_lock(name, using=alias)
        first = Holder(name, alias, lock=distlocks.read_write_lock(name, using=alias).read())
        assert [node.partition("-")[0] for node in zk_nodes(name)] == ["read"]
        writing = asyncio.create_task(rw.write().acquire(wait=60))
        await until_true(lambda: len(zk_nodes(name)) == 2)
        queued = zk_nodes(name)
        assert queued[1].startswith("write-")
        # Its node stays queued, the same one, across its attempts (it looks again every second), and keeps
        # new readers out: one on the loop and one in a thread try meanwhile and give up.
        seen = set()
        watch_until = time.monotonic() + 2.5
        while time.monotonic() < watch_until:
            seen.add(tuple(await asyncio.to_thread(zk_nodes, name)))
            assert not await a_task_reads(rw, 0)
            assert not await asyncio.to_thread(takes, alias, name, "read")
        assert seen == {tuple(queued)}
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        await until_true(lambda: zk_nodes(name) == queued[:1], timeout=5)  # only the reader's node is left
        assert await a_task_reads(rw, 0)  # a new reader gets in at once
        assert await asyncio.to_thread(first.release) is None
        await until_true(lambda: zk_nodes(name) == [], timeout=5)

    run(main())
