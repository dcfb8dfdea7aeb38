"""The read-write lock on every backend that has one: many readers or one writer, across processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import distlocks
from distlocks.inspection import clear_expired, force_release, held_locks
from distlocks.owner import current_owner

from .conftest import DB, wait_until
from .test_lock import in_thread

pytestmark = DB
RW_ALIASES = ["default", "mariadb", "postgresql", "redis", "zookeeper", "locmem"]
# Backends that lock across processes (LocMem keeps its locks in one process).
RW_PROCESS_ALIASES = [alias for alias in RW_ALIASES if alias != "locmem"]
# Backends without read-write locks: they say so when one is made.
NO_RW_ALIASES = ["mariadb_native", "postgresql_native", "redlock"]


def intervals(log):
    """Each process's holds from the events of ``tests.worker rw_guarded``: (start, end, mode, pid, token)."""
    entered = {}
    held = []
    for line in log.read_text().splitlines():
        event, mode, pid, at, *token = line.split()
        if event == "enter":
            entered[pid] = (float(at), mode, int(token[0]))
        else:
            start, mode, token_ = entered.pop(pid)
            held.append((start, float(at), mode, pid, token_))
    return sorted(held)


def overlaps(held):
    """The pairs of holds by two processes that were inside at once."""
    return [
        (first, second)
        for i, first in enumerate(held)
        for second in held[i + 1 :]
        if second[0] < first[1] and first[3] != second[3]
    ]


def side(alias, name, mode, **kwargs):
    rw = distlocks.read_write_lock(name, using=alias, **kwargs)
    return rw.read() if mode == "read" else rw.write()


def takes(alias, name, mode, wait=0):
    """Whether another thread gets the ``mode`` side within ``wait`` seconds (it gives it back at once)."""

    def take():
        taken = side(alias, name, mode).acquire(wait=wait)
        if taken:
            side(alias, name, mode).release()
        return taken

    return in_thread(take)


@pytest.mark.parametrize("alias", RW_PROCESS_ALIASES, indirect=True)
def test_readers_are_inside_together_across_processes(alias, leave_nothing, name, workers, tmp_path):
    folder = tmp_path / "inside"
    folder.mkdir()
    readers = [workers("read_together", alias, name, 4, folder) for _ in range(4)]
    # Each reader holds the read side until all four say they hold it: only if they overlap do they all get in.
    assert [reader.finish() for reader in readers] == [["together"]] * 4


@pytest.mark.parametrize("alias", RW_PROCESS_ALIASES, indirect=True)
def test_a_writer_excludes_readers_and_writers_across_processes(alias, leave_nothing, name, workers, tmp_path):
    log = tmp_path / "events"
    running = [workers("rw_guarded", alias, name, "write", 4, 0.01, log) for _ in range(2)]
    running += [workers("rw_guarded", alias, name, "read", 4, 0.02, log) for _ in range(3)]
    results = [worker.finish() for worker in running]
    held = intervals(log)
    both = overlaps(held)
    assert [pair for pair in both if "write" in (pair[0][2], pair[1][2])] == []
    # (Whether the readers met inside depends on the writers, which keep queueing and so keep new
    # readers out: test_readers_are_inside_together_across_processes shows that they do share.)
    writes = [token for _, _, mode, _, token in held if mode == "write"]
    assert writes == sorted(writes)
    assert len(set(writes)) == len(writes)
    for done, taken, timeouts in results:
        assert done == "done"
        assert int(taken) > 0
        assert int(timeouts) == 0


@pytest.mark.parametrize("alias", RW_PROCESS_ALIASES, indirect=True)
def test_a_stream_of_readers_does_not_starve_a_writer(alias, leave_nothing, name, workers, tmp_path):
    log = tmp_path / "events"
    # Three readers that each hold the read side 0.2 s and take it again at once: some reader
    # is always inside, so a writer that waited for none to be inside would wait until they stop.
    readers = [workers("rw_guarded", alias, name, "read", 12, 0.2, log) for _ in range(3)]
    while len(log.read_text().splitlines()) < 6 if log.exists() else True:
        time.sleep(0.05)
    answer = workers("rw_take", alias, name, "write", 8).finish()
    assert answer[0] == "acquired"
    assert float(answer[2]) < 8
    for reader in readers:
        reader.kill()


@pytest.mark.parametrize("alias", RW_PROCESS_ALIASES, indirect=True)
@pytest.mark.parametrize(("killed", "then"), [("read", "write"), ("write", "read"), ("write", "write")])
def test_a_sigkilled_holders_side_frees_itself(alias, leave_nothing, name, workers, killed, then):
    holder = workers("rw_hold", alias, name, killed, 1)
    token = int(holder.line()[1])
    assert workers("rw_take", alias, name, then, 0).finish() == ["busy"]
    holder.kill()
    answer = workers("rw_take", alias, name, then, 20).finish()
    assert answer[0] == "acquired"
    assert int(answer[1]) > token


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_the_lock_api_on_both_sides(alias, leave_nothing, name):
    rw = distlocks.read_write_lock(name, using=alias, wait=0)
    reading, writing = rw.read(), rw.write()
    with pytest.raises(distlocks.LockNotOwned):
        reading.token  # noqa: B018
    with reading as held:
        assert held is reading
        with reading:  # reentrant
            assert reading.hold_count == 2
        assert takes(alias, name, "read", 0)
        assert takes(alias, name, "write", 0.2) is False
        shown = [info for info in held_locks([alias]).locks if info.key.endswith(f"rw:{name}")]
        assert [(info.kind, info.token, info.hold_count) for info in shown] == [("read", reading.token, 1)]
    with writing:
        assert takes(alias, name, "read", 0.2) is False
        assert takes(alias, name, "write", 0) is False
        shown = [info for info in held_locks([alias]).locks if info.key.endswith(f"rw:{name}")]
        assert [(info.kind, info.token) for info in shown] == [("write", writing.token)]
    with pytest.raises(distlocks.LockNotOwned):
        writing.release()

    @rw.read()
    def inside():
        return reading.hold_count

    assert inside() == 1


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_the_writer_may_read_and_a_reader_may_not_write(alias, leave_nothing, name):
    rw = distlocks.read_write_lock(name, using=alias, wait=0)
    with rw.write():
        with rw.read():  # downgrade: the writer reads too
            assert rw.read().token > rw.write().token
        assert rw.read().acquire()
    # Write side released: the thread goes on reading, and others may read with it.
    assert takes(alias, name, "read", 0)
    with pytest.raises(ValueError, match="holds its read side"):
        rw.write().acquire()
    rw.read().release()
    assert rw.write().acquire()
    rw.write().release()


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_a_waiting_writer_blocks_new_readers_until_it_gives_up(alias, leave_nothing, name):
    rw = distlocks.read_write_lock(name, using=alias)
    assert rw.read().acquire(wait=0)
    waiting = threading.Event()
    outcome = []

    def writer():
        waiting.set()
        outcome.append(side(alias, name, "write").acquire(wait=3))

    thread = threading.Thread(target=writer)
    thread.start()
    waiting.wait(10)
    # A new reader is refused while the writer waits (it asks for a second: the writer waits 3 s).
    deadline = time.monotonic() + 2
    refused = False
    while not refused and time.monotonic() < deadline:
        refused = not takes(alias, name, "read", 0)
    assert refused
    thread.join(30)
    assert outcome == [False]  # the reader still holds it
    # The writer gave up: readers come in again at once.
    assert takes(alias, name, "read", 0)
    rw.read().release()


@pytest.mark.parametrize("alias", ["default"], indirect=True)
def test_a_table_reader_may_wait_longer_than_a_thousand_polls(alias, leave_nothing, name, monkeypatch):
    # At the 1024th poll a backoff of 1 ms * 2**attempt (before its exponent was capped) is too
    # large for a float. The table backend pauses 10-20 ms between polls: that is 10-20 s of
    # waiting, so the pauses are cut to at most 1 ms here, and the polls counted.
    from distlocks.backends.db import backend

    polls = []
    pause = backend.sleep

    def short_pause(delay, deadline):
        polls.append(delay)
        return pause(min(delay, 0.001), deadline)

    monkeypatch.setattr(backend, "sleep", short_pause)
    writer = side(alias, name, "write")
    assert writer.acquire(wait=0)
    result = {}

    def read():
        try:
            result["read"] = (reader := side(alias, name, "read")).acquire(wait=120)
            reader.release()
        except Exception as exc:
            result["read"] = exc

    thread = threading.Thread(target=read)
    thread.start()
    wait_until(lambda: len(polls) > 1100 or not thread.is_alive(), timeout=120)
    assert "read" not in result  # still waiting, past its 1100th poll
    writer.release()
    thread.join(30)
    assert result["read"] is True
    assert len(polls) > 1100


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_a_force_released_reader_finds_its_hold_lost(alias, leave_nothing, name):
    rw = distlocks.read_write_lock(name, using=alias, ttl=1.5, wait=0)
    for mode in ("read", "write"):
        held = rw.read() if mode == "read" else rw.write()
        assert held.acquire()
        assert force_release(alias, distlocks.handler.locks[alias].make_key(f"rw:{name}"), held.token, kind=mode)
        deadline = time.monotonic() + 20
        while not held.lost and time.monotonic() < deadline:  # the watchdog's next renewal finds it gone
            time.sleep(0.02)
        assert held.lost
        with pytest.raises(distlocks.LockLost):
            held.release()
        assert held.acquire()  # free again
        held.release()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"name": ""}, "name"),
        ({"name": 7}, "name"),
        ({"ttl": 0}, "ttl"),
        ({"wait": -1}, "wait"),
        ({"using": 3}, "using"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, named):
    arguments = {"name": "doc", "using": "locmem", **kwargs}
    with pytest.raises(ValueError, match=named):
        distlocks.read_write_lock(arguments.pop("name"), **arguments)
    rw = distlocks.read_write_lock("doc", using="locmem")
    with pytest.raises(ValueError, match="wait"):
        rw.read().acquire(wait=-1)


@pytest.mark.parametrize("backend", NO_RW_ALIASES)
def test_backends_without_read_write_locks_say_so(backend):
    with pytest.raises(NotImplementedError, match=backend):
        distlocks.read_write_lock("doc", using=backend)


@pytest.mark.parametrize("alias", RW_ALIASES, indirect=True)
def test_a_downgrade_passes_a_waiting_writer_which_then_waits_for_it(alias, leave_nothing, name):
    rw = distlocks.read_write_lock(name, using=alias, wait=0)
    assert rw.write().acquire()
    waiting = threading.Event()
    outcome = []

    def writer():
        waiting.set()
        other = side(alias, name, "write")
        outcome.append(other.acquire(wait=30))
        outcome.append(time.monotonic())
        other.release()

    thread = threading.Thread(target=writer)
    thread.start()
    waiting.wait(10)
    time.sleep(0.3)  # let it queue: the downgrade must not wait behind it either way
    assert rw.read().acquire()  # the write holder reads at once
    rw.write().release()
    assert not outcome  # still reading: the other writer waits
    assert takes(alias, name, "write", 0.5) is False
    released = time.monotonic()
    rw.read().release()
    thread.join(30)
    assert outcome[0] is True
    assert outcome[1] >= released


def leftovers(alias, key):
    """Whether the read-write lock ``key`` left state on ``alias``'s server that cleanup is for."""
    backend = distlocks.handler.locks[alias]
    if alias == "locmem":
        from distlocks.backends.locmem import store

        return key in store(backend.store_name).rw
    if alias == "redis":
        from distlocks.backends.redis.keys import lock_hash

        return bool(backend.client.exists(f"{lock_hash(key)}:rw:fence"))
    from distlocks.models import ReadWriteHold

    return ReadWriteHold.objects.using(alias).filter(lock_name=key).exclude(mode="gate").exists()


@pytest.mark.parametrize("alias", ["default", "postgresql", "redis", "locmem"], indirect=True)
def test_cleanup_clears_what_expired_holds_left(alias, leave_nothing, name):
    rw = distlocks.read_write_lock(name, using=alias, ttl=0.3, renew=False)
    assert rw.read().acquire(wait=0)
    assert leftovers(alias, rw.key)
    deadline = time.monotonic() + 10
    while rw.read().holder() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rw.read().holder() is None  # expired
    assert clear_expired(alias)[0] >= 1
    assert not leftovers(alias, rw.key)
    with pytest.raises(distlocks.LockLost):
        rw.read().release()


@pytest.mark.parametrize("alias", ["default", "postgresql", "redis"], indirect=True)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_frozen_holder_loses_its_side_after_its_ttl_and_is_told_on_waking(alias, leave_nothing, name, workers, mode):
    holder = workers("rw_hold_until_lost", alias, name, mode, 1.5)
    answer = holder.line()
    assert answer[0] == "acquired"
    os.kill(holder.process.pid, signal.SIGSTOP)  # a GC pause, a VM migration: no renewal
    try:
        frozen = time.monotonic()
        writer = side(alias, name, "write", wait=20)
        assert writer.acquire()
        assert 1.0 < time.monotonic() - frozen < 15
        assert writer.token > int(answer[1])
    finally:
        os.kill(holder.process.pid, signal.SIGCONT)
    assert holder.finish() == ["lost", "LockLost"]
    assert not writer.lost
    writer.release()


def closed_port():
    """A loopback port that nothing listens on."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("server", ["mariadb", "postgresql", "redis", "zookeeper"])
def test_an_unreachable_server_gives_backend_unavailable_in_bounded_time(settings, server):
    port = closed_port()
    if server == "redis":
        settings.CACHES = {
            **settings.CACHES,
            "down": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://127.0.0.1:{port}/0",
                "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 2},
            },
        }
        entry = {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "down"}}
    elif server == "zookeeper":
        entry = {
            "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
            "LOCATION": f"127.0.0.1:{port}",
            "OPTIONS": {"CONNECT_TIMEOUT": 2},
        }
    else:
        entry = {
            "BACKEND": "distlocks.backends.db.DatabaseBackend",
            "OPTIONS": {"DATABASE": f"{server}_down", "CONNECT_TIMEOUT": 2},
        }
    settings.DISTLOCKS = {"down": entry}
    rw = distlocks.read_write_lock("doc", using="down", wait=None)
    for held in (rw.read(), rw.write()):
        started = time.monotonic()
        with pytest.raises(distlocks.BackendUnavailable) as info:
            held.acquire()
        assert time.monotonic() - started < 15
        assert info.value.alias == "down"
        assert held.hold_count == 0


# -- Redis: waiters in a queue, served in turn -------------------------------------------------


def rw_queue(name):
    """The Redis client and the key of the read-write lock ``name``'s waiters' queue."""
    from distlocks.backends.redis.keys import keys_of_read_write_lock

    backend = distlocks.handler.locks["redis"]
    return backend.client, keys_of_read_write_lock(backend.make_key(f"rw:{name}"))[2]


def until(condition, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("alias", ["redis"], indirect=True)
def test_waiters_are_served_in_the_order_they_queued(alias, leave_nothing, name, workers, tmp_path):
    log = tmp_path / "events"
    client, queue = rw_queue(name)
    holder = side(alias, name, "write")
    assert holder.acquire(wait=0)
    # Each waiter is a process of its own, started once the one before is in the queue.
    order = [("W1", "write"), ("R1", "read"), ("R2", "read"), ("W2", "write"), ("R3", "read")]
    waiting = []
    for queued, (label, mode) in enumerate(order, 1):
        waiting.append(workers("rw_turn", alias, name, mode, label, 0.3, log))
        until(lambda queued=queued: client.zcard(queue) == queued)
    holder.release()
    assert [worker.finish() for worker in waiting] == [["done"]] * len(order)
    spans = {}
    for line in log.read_text().splitlines():
        event, label, at = line.split()
        spans.setdefault(label, {})[event] = float(at)
    entered = sorted(spans, key=lambda label: spans[label]["enter"])
    # The writer queued first goes first, alone; then the two readers queued together, together;
    # then the second writer, and the reader that queued after it.
    assert entered[0] == "W1"
    assert set(entered[1:3]) == {"R1", "R2"}
    assert entered[3:] == ["W2", "R3"]
    assert spans["R1"]["enter"] < spans["R2"]["exit"]
    assert spans["R2"]["enter"] < spans["R1"]["exit"]
    assert spans["W1"]["exit"] <= min(spans["R1"]["enter"], spans["R2"]["enter"])
    assert max(spans["R1"]["exit"], spans["R2"]["exit"]) <= spans["W2"]["enter"]
    assert spans["W2"]["exit"] <= spans["R3"]["enter"]
    assert client.zcard(queue) == 0


@pytest.mark.parametrize("alias", ["redis"], indirect=True)
@pytest.mark.parametrize("held", ["write", "read"])
def test_a_sigkilled_queued_writer_does_not_block_the_queue(alias, leave_nothing, name, workers, held):
    """A killed writer at the head is skipped by the release; while readers hold on, its entry runs out with its lease."""
    client, queue = rw_queue(name)
    holder = side(alias, name, held)
    assert holder.acquire(wait=0)
    dead = workers("rw_take", alias, name, "write", 60, 2)  # its lease: 2 s
    until(lambda: client.zcard(queue) == 1)
    dead.kill()
    reader = workers("rw_take", alias, name, "read", 20)
    if held == "write":
        until(lambda: client.zcard(queue) == 2)
        released = time.monotonic()
        holder.release()
        answer = reader.finish()
        # Handed straight past the dead writer, not after its lease (or the reader's 20 s).
        assert answer[0] == "acquired"
        assert time.monotonic() - released < 5
    else:
        # The reader that holds on keeps the dead writer at the head: the new reader waits for
        # the writer's entry to run out (2 s), not for the holder, which never lets go here.
        answer = reader.finish()
        assert answer[0] == "acquired"
        assert float(answer[2]) < 10
        holder.release()
    until(lambda: client.zcard(queue) == 0)


@pytest.mark.parametrize("alias", ["redis"], indirect=True)
def test_a_side_handed_to_a_waiter_its_process_forgot_is_given_back(alias, leave_nothing, name):
    client, queue = rw_queue(name)
    holder = side(alias, name, "write")
    assert holder.acquire(wait=0)

    def forgotten_reader():
        backend = distlocks.handler.locks[alias]
        key = backend.make_key(f"rw:{name}")
        reading = backend.read_write_side("read")
        reading.wait(key + "#read", 0, 1.0)  # subscribes the process's channel
        assert reading.try_acquire(key + "#read", current_owner(), 30.0) is None  # queued
        # As if Redis had been unreachable when it gave up: it is still queued.
        from distlocks.backends.redis.keys import keys_of_read_write_lock

        slot = keys_of_read_write_lock(key)[0]
        backend._releases().discharge(backend._waiting.pop(slot))

    thread = threading.Thread(target=forgotten_reader)
    thread.start()
    thread.join(10)
    assert client.zcard(queue) == 1
    result = []
    writer = threading.Thread(target=lambda: result.append(side(alias, name, "write").acquire(wait=20)))
    writer.start()
    until(lambda: client.zcard(queue) == 2)
    released = time.monotonic()
    holder.release()  # hands the read side to the forgotten reader; its process gives it back, to the writer
    writer.join(20)
    assert result == [True]
    assert time.monotonic() - released < 5
