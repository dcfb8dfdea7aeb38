"""A Sentinel group's master killed (SIGKILL) or failed over (``SENTINEL FAILOVER``), and its sentinels gone.

Each test takes the group through ``sentinel_group``, which makes it whole
again afterwards (the old master back, as a replica of the new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest

import distlocks
from distlocks.backends.redis import failover
from distlocks.backends.redis.aiowait import loop_releases
from distlocks.checks import check_distlocks
from distlocks.handler import locks
from distlocks.signals import lock_lost
from localservers import SENTINEL_SERVICE
from tests.conftest import DB, guarded_events, wait_until
from tests.faults.conftest import frozen
from tests.settings import SENTINEL_LOCKS

pytestmark = [DB, pytest.mark.servers("sentinel"), pytest.mark.usefixtures("sentinel_alias")]

ALIAS = "sentinel"
KINDS = ["lock", "alock", "write", "permit", "member"]


def entries(log):
    """The times of the entries in a ``tests.worker guarded`` log, checked: one holder at a time, tokens growing."""
    return [float(event[2]) for event in guarded_events(log) if event[0] == "enter"]


def promoted(group, old):
    """Wait until the sentinels name a master other than ``old``; return it."""
    found = []

    def switched():
        try:
            master = group.master()
        except Exception:  # the sentinels disagree for a moment
            return False
        found.append(master)
        return master is not old

    wait_until(switched, timeout=20)
    return found[-1]


def errors(log):
    """The names of the errors ``tests.worker guarded`` processes logged."""
    return {line.split()[0].removeprefix("error:") for line in log.read_text().splitlines() if line.startswith("error")}


@pytest.fixture
def acked(settings):
    """The alias "acked": the Sentinel group's master, each acquisition acknowledged by one replica."""
    options = {**SENTINEL_LOCKS["OPTIONS"], "WAIT_REPLICAS": 1, "WAIT_TIMEOUT": 1}
    settings.DISTLOCKS = {**settings.DISTLOCKS, "acked": {**SENTINEL_LOCKS, "OPTIONS": options}}
    return "acked"


@pytest.mark.parametrize("alias", [ALIAS], indirect=True)
def test_a_killed_master_loses_only_what_no_replica_had_and_locks_go_on(
    alias, leave_nothing, acked, sentinel_group, name, workers, tmp_path
):
    told = []

    def note_lost(sender, name, **kwargs):
        told.append(name)

    lock_lost.connect(note_lost)
    old = sentinel_group.master()
    # Acknowledged by a replica (WAIT_REPLICAS): it survives the failover.
    kept = distlocks.lock(f"{name}-kept", using=acked, ttl=10)
    assert kept.acquire(wait=0)
    stop = tmp_path / "stop"
    log = tmp_path / "log"
    running = [workers("guarded", ALIAS, name, 60, log, stop) for _ in range(2)]
    # This process too, taking and giving back another lock without a pause: what each call raises, and how long.
    calls = []

    def hammer():
        lk = distlocks.lock(f"{name}-hammer", using=ALIAS, ttl=5)
        while not stop.exists():
            started = time.monotonic()
            try:
                if lk.acquire(wait=0):
                    lk.release()
                calls.append((None, time.monotonic() - started, started))
            except Exception as exc:
                calls.append((exc, time.monotonic() - started, started))
                time.sleep(0.05)

    thread = threading.Thread(target=hammer)
    try:
        wait_until(lambda: log.exists() and log.read_text().count("enter") > 20)
        thread.start()
        # A hold that no replica gets (their links to the master cut while they are frozen), then SIGKILL.
        with frozen(sentinel_group.replicas()[0]), frozen(sentinel_group.replicas()[1]):
            sentinel_group.client(old).client_kill_filter(_type="replica")
            lost = distlocks.lock(f"{name}-lost", using=ALIAS, ttl=10)
            assert lost.acquire(wait=0)
            lost_token, acquired = lost.token, time.monotonic()
            sentinel_group.kill(old)
        killed = time.monotonic()
        promoted(sentinel_group, old)
        switched = time.monotonic()
        assert switched - killed < 10

        # The lost hold: another process takes the lock, with a larger token; its holder is told at its next
        # renewal, before its own lease would have ended, and its release raises LockLost.
        answer = workers("take", ALIAS, f"{name}-lost", 20).finish()
        assert answer[0] == "acquired"
        assert int(answer[1]) > lost_token
        wait_until(lambda: f"{name}-lost" in told, timeout=10)
        assert lost.lost
        assert time.monotonic() < acquired + 10
        with pytest.raises(distlocks.LockLost):
            lost.release()
        # The acknowledged hold: nobody else gets it, and its holder still has it and gives it back.
        assert workers("take", ALIAS, f"{name}-kept", 0).finish() == ["busy"]
        assert not kept.lost
        kept.release()
        assert workers("take", ALIAS, f"{name}-kept", 0).finish()[0] == "acquired"
        assert f"{name}-kept" not in told

        # The contention goes on, on the new master: one holder at a time, tokens growing.
        wait_until(lambda: sum(at > switched for at in entries(log)) > 20, timeout=20)
    finally:
        stop.touch()
        lock_lost.disconnect(note_lost)
        if thread.ident:
            thread.join(30)
        results = [worker.finish() for worker in running]
    assert results == [["done"], ["done"]]  # a raw redis-py error would have ended a worker with a traceback
    assert errors(log) <= {"BackendUnavailable", "LockLost"}
    # In this process: distlocks' errors only, each in bounded time, and calls that work again soon after.
    assert {type(exc) for exc, _, _ in calls if exc is not None} <= {distlocks.BackendUnavailable, distlocks.LockLost}
    assert max(took for _, took, _ in calls) < 10
    assert any(exc is None and at > switched for exc, _, at in calls)
    failed = [at for exc, _, at in calls if exc is not None]
    assert not failed or max(failed) < switched + 5


def lock_of(kind, name, **options):
    """A lock of ``kind`` (not "alock") of ``name``: a lock, a write side, a permit or a multi-lock of two."""
    if kind == "write":
        return distlocks.read_write_lock(name, using=ALIAS, ttl=30, **options).write()
    if kind == "permit":
        return distlocks.semaphore(name, 1, using=ALIAS, ttl=30, **options)
    if kind == "member":
        return distlocks.multi_lock([f"{name}-a", f"{name}-b"], using=ALIAS, ttl=30, **options)
    return distlocks.lock(name, using=ALIAS, ttl=30, **options)


def waiting(kind, name, waited):
    """A thread waiting (wait=30) for ``kind`` of ``name``; it appends when it got it (monotonic) to ``waited``."""

    def wait():
        if kind == "alock":

            async def take():
                async with distlocks.alock(name, using=ALIAS, ttl=30, wait=30):
                    waited.append(time.monotonic())

            asyncio.run(take())
            return
        with lock_of(kind, name, wait=30):
            waited.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def held_against(kind, name):
    """What keeps a waiter of ``kind`` of ``name`` waiting: a reader for a writer, the permit, a member..."""
    if kind == "write":
        return distlocks.read_write_lock(name, using=ALIAS, ttl=30).read()
    if kind == "member":
        return distlocks.lock(f"{name}-b", using=ALIAS, ttl=30)
    return lock_of(kind, name)


def queued(group, name):
    """Whether the master has a waiter in a queue of ``name``'s locks."""
    client = group.client(group.master())
    return any(
        client.type(key) == b"zset" and client.zcard(key) > 0 for key in client.scan_iter(match=f"*{name}*", count=1000)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_after_a_failover_a_waiter_is_handed_the_lock_on_the_new_master(sentinel_group, kind, name):
    holder = held_against(kind, name)
    assert holder.acquire(wait=0)
    waited = []
    thread = waiting(kind, name, waited)
    try:
        wait_until(lambda: queued(sentinel_group, name))
        sentinel_group.wait_ready()  # the replicas have the hold and the queue
        old = sentinel_group.master()
        sentinel_group.sentinel(sentinel_group.sentinels[0]).execute_command("SENTINEL FAILOVER", SENTINEL_SERVICE)
        promoted(sentinel_group, old)
        sentinel_group.wait_ready()  # the old master follows the new one
        wait_until(lambda: queued(sentinel_group, name))  # the waiter queues on the new master (again)
        released = time.monotonic()
        holder.release()  # on the new master, which tells the waiter on its channel there
        thread.join(30)
    finally:
        thread.join(30)
    [got] = waited
    assert got - released < 2  # handed over, not found at the end of the 30 s lease


def taking(kind, name):
    """A lock of ``kind`` of ``name``, as a coroutine function for "alock", or else an ``acquire(wait=0)`` to call."""
    if kind == "alock":

        async def take():
            async with distlocks.alock(name, using=ALIAS, wait=0) as lk:
                return lk.token > 0

        return lambda: asyncio.run(take())
    lk = lock_of(kind, name)

    def acquire():
        got = lk.acquire(wait=0)
        lk.release()
        return got

    return acquire


@contextlib.contextmanager
def demoted_for(group, seconds):
    """The master made a replica (of a port where nothing listens: it keeps its data) for ``seconds``, as in a
    failover's first moments, when it answers READONLY while the sentinels still name it; then master again.

    Keep it well under 1.3 s (down-after-milliseconds and two INFO periods): the sentinels would see it down.
    """
    master = group.master()
    group.client(master).replicaof("127.0.0.1", 1)
    back = threading.Timer(seconds, lambda: group.client(master).replicaof("NO", "ONE"))
    back.start()
    try:
        yield master
    finally:
        back.join()


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_that_meets_a_demoted_master_waits_out_the_failover(sentinel_group, kind, name):
    take = taking(kind, name)
    assert take()  # connected to the master
    with demoted_for(sentinel_group, 0.3) as master:
        started = time.monotonic()
        assert take()  # READONLY, asked again until it writes: no BackendUnavailable
        took = time.monotonic() - started
        assert sentinel_group.master() is master  # the sentinels named it all along
    assert 0.2 < took < 0.3 + 2


def test_a_master_demoted_longer_than_the_failover_wait_is_backend_unavailable(sentinel_group, name, monkeypatch):
    # One pause and a try: a master that says it is a replica for 5 s would be failed over by the sentinels first.
    monkeypatch.setattr(failover, "FAILOVER_WAIT", 2 * failover.PAUSE)
    take = taking("lock", name)
    assert take()
    with demoted_for(sentinel_group, 0.4):
        started = time.monotonic()
        with pytest.raises(distlocks.BackendUnavailable, match="The previous master is now a slave"):
            take()
        took = time.monotonic() - started
    assert failover.PAUSE <= took < 0.4
    sentinel_group.wait_ready()  # master again, as the sentinels see it
    assert take()


def test_a_connection_left_on_a_demoted_master_writes_on_the_master_at_once(redis_sentinel, name):
    # Sentinel closes a demoted master's clients, but not an operator's REPLICAOF, nor a connection made in between.
    # READONLY: the connection asks the sentinels again, who name the master (redis-py 8 would reconnect it to the
    # replica). A connection of the alias's client held by itself: back in the pool, the pool drops it.
    import redis

    pool = locks[ALIAS].client.connection_pool
    with redis.Redis(connection_pool=pool, single_connection_client=True) as client:
        client.connection.disconnect()
        client.connection.connect_to(("127.0.0.1", redis_sentinel.replicas()[0].port))
        started = time.monotonic()
        assert client.set(f"{name}-written", 1)
        took = time.monotonic() - started
        assert client.connection.port == redis_sentinel.master().port
    assert took < 1  # not the 5 s a call waits for a demoted master to be master again


def test_a_tasks_connection_left_on_a_demoted_master_takes_the_lock_on_the_master_at_once(redis_sentinel, name):
    backend = locks[ALIAS]

    async def twice():
        async with distlocks.alock(name, using=ALIAS, wait=0):  # the loop's client connects
            pass
        pool = loop_releases(backend.server, backend.new_loop_releases).client.connection_pool
        connection = await pool.get_connection()
        await connection.disconnect()
        await connection.connect_to(("127.0.0.1", redis_sentinel.replicas()[0].port))
        await pool.release(connection)  # kept: the asyncio pool does not check where its connections are
        started = time.monotonic()
        async with distlocks.alock(name, using=ALIAS, wait=0) as lk:
            assert lk.token > 0
        return time.monotonic() - started

    assert asyncio.run(twice()) < 1


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_with_every_sentinel_down_a_new_client_is_backend_unavailable_in_bounded_time(
    sentinel_group, settings, fault, name
):
    # An alias of its own: a new client, with no connection to the master yet (one that has keeps using it).
    # Sentinels that hang are passed over after their socket timeout: half a second here.
    fresh = f"fresh-{fault}"
    options = {**SENTINEL_LOCKS["OPTIONS"], "SENTINEL_OPTIONS": {"sentinel_kwargs": {"socket_timeout": 0.5}}}
    settings.DISTLOCKS = {**settings.DISTLOCKS, fresh: {**SENTINEL_LOCKS, "OPTIONS": options}}
    with distlocks.lock(f"{name}-connected", using=ALIAS, wait=0):  # this alias's connection to the master opens
        pass
    for sentinel in sentinel_group.sentinels:
        if fault == "killed":
            sentinel.stop()
        else:
            os.kill(sentinel.process.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(distlocks.BackendUnavailable, match=f"for locks on '{fresh}' is unavailable: No master found"):
        distlocks.lock(name, using=fresh).acquire(wait=0)
    took = time.monotonic() - started
    # Refused at once; frozen: each sentinel's socket timeout, at each of redis-py's four tries (its connect and its
    # command each try twice: RETRIES).
    assert took < (1 if fault == "killed" else 3 * 0.5 * 4 + 2)
    started = time.monotonic()
    [warning] = [message for message in check_distlocks() if f"'{fresh}'" in message.msg]
    assert warning.id == "distlocks.W004"
    assert time.monotonic() - started < 5  # the check waits 3 s for an answer, then warns
    with distlocks.lock(f"{name}-connected", using=ALIAS, wait=0) as lk:  # an open connection needs no sentinel
        assert lk.token > 0
