"""What is particular to the Redis backend: pub/sub wake-up, scripts, keys, restarts."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import datetime, timezone

import pytest
from django_redis import get_redis_connection

import distlocks
from distlocks.backends.redis import backend as redis_backend
from distlocks.backends.redis import strays
from distlocks.backends.redis.keys import acquire_keys, rw_acquire_keys
from distlocks.handler import locks
from distlocks.owner import acting_as, current_owner, task_owner
from localservers import REDIS_PORT, RedisServer, answers

from .conftest import DB, Holder, queue_waiters

pytestmark = [DB, pytest.mark.servers("redis")]


def test_a_waiter_wakes_within_milliseconds_of_the_release(name):
    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    woke = []
    waiting = threading.Event()

    def wait_for_it():
        lk = distlocks.lock(name, using="redis", wait=10)
        waiting.set()
        lk.acquire()
        woke.append(time.monotonic())
        lk.release()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    waiting.wait()
    time.sleep(0.5)  # well into its wait: a poller would sleep now
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert woke
    assert woke[0] - released < 0.05


def test_a_waiter_wakes_when_a_dead_holders_lease_runs_out(name):
    # The holder never releases (renew=False stands for a crashed process): no
    # release is published, and the waiter wakes when the lease ends.
    holder = distlocks.lock(name, using="redis", ttl=0.5, renew=False)
    holder.acquire()
    started = time.monotonic()
    result = []
    thread = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="redis").acquire(wait=5)))
    thread.start()
    thread.join(10)
    assert result == [True]
    assert 0.3 < time.monotonic() - started < 2
    with pytest.raises(distlocks.LockLost):
        holder.release()


def test_keys_share_one_cluster_slot(name):
    lk = distlocks.lock(name, using="redis")
    with lk:
        client = get_redis_connection("redis")
        keys = [k.decode() for k in client.scan_iter(match=f"distlocks:{{{lk.key}}}*")]
        assert sorted(keys) == [f"distlocks:{{{lk.key}}}", f"distlocks:{{{lk.key}}}:fence"]
        # Every key hashes on the part between the braces: the lock's key.
        assert all(key[key.index("{") + 1 : key.index("}")] == lk.key for key in keys)


def test_scripts_are_reloaded_after_a_script_flush(name):
    lk = distlocks.lock(name, using="redis")
    with lk:
        pass
    get_redis_connection("redis").script_flush()
    with lk:
        assert lk.hold_count == 1


def test_force_release_wakes_waiters_and_the_holder_loses_it(name):
    holder = distlocks.lock(name, using="redis", ttl=0.6)
    holder.acquire()
    assert locks["redis"].force_release(holder.key)
    with pytest.raises(distlocks.LockLost):  # re-entering a lost hold
        holder.acquire()
    result = []
    thread = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="redis").acquire(wait=0)))
    thread.start()
    thread.join()
    assert result == [True]
    with pytest.raises(distlocks.LockLost):
        holder.release()


def test_unreachable_redis(settings):
    settings.DISTLOCKS = {
        "down": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis_down"}}
    }
    started = time.monotonic()
    with pytest.raises(distlocks.BackendUnavailable, match="for locks on 'down' is unavailable") as info:
        distlocks.lock("x", using="down").acquire()
    assert time.monotonic() - started < 5
    assert info.value.__cause__ is not None


@pytest.fixture
def solo_redis(settings):
    """Return ``start(port)``: a Redis server of the test's own as lock alias "solo" (restarting it disturbs no other test)."""
    servers = []

    def start(port):
        assert not answers(port)
        servers.append(RedisServer(port).start())
        settings.CACHES = {
            **settings.CACHES,
            "solo": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://127.0.0.1:{port}/0",
                "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 2},
            },
        }
        settings.DISTLOCKS = {
            "solo": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "solo"}}
        }
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_a_restart_without_persistence_forgets_the_lock(solo_redis, name):
    server = solo_redis(REDIS_PORT + 20)
    lost = []
    lk = distlocks.lock(name, using="solo", ttl=0.6)
    lk.acquire()
    before = lk.token
    server.restart()
    # What the README says: the lock is forgotten, the holder's next renewal
    # fails, others can take it at once, and tokens still grow.
    other = []
    thread = threading.Thread(target=lambda: other.append(_take(name)))
    thread.start()
    thread.join()
    assert other
    assert other[0] > before
    deadline = time.monotonic() + 5
    while not lk.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    lost.append(lk.lost)
    assert lost == [True]
    with pytest.raises(distlocks.LockLost):
        lk.release()


def test_waiters_try_again_when_redis_restarts(solo_redis, name):
    # The restart forgets the lock and its queue: the waiter learns it from its
    # channel's resubscription, not from the end of the forgotten 30 s lease.
    server = solo_redis(REDIS_PORT + 21)
    holder = distlocks.lock(name, using="solo", ttl=30)
    holder.acquire()
    client, queue = _queue(name, "solo")
    result = []
    waiter = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="solo").acquire(wait=25)))
    waiter.start()
    _until(lambda: client.zcard(queue) == 1)
    server.restart()
    restarted = time.monotonic()
    waiter.join(25)
    assert result == [True]
    assert time.monotonic() - restarted < 10


def _take(name):
    lk = distlocks.lock(name, using="solo")
    for _ in range(50):  # the client reconnects after the restart
        try:
            with lk:
                return lk.token
        except distlocks.BackendUnavailable:
            time.sleep(0.1)
    return None


def test_waiters_get_the_lock_first_come_first_served(name):
    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    threads, order = queue_waiters(name, "redis", "ABCD", gap=0.1, hold=0.01)
    holder.release()
    # The releaser asks again at once, but the release handed the lock to the
    # first waiter: the releaser waits its turn.
    holder.acquire(wait=10)
    holder.release()
    for thread in threads:
        thread.join(10)
    assert order == ["A", "B", "C", "D"]


def _queue(name, alias="redis"):
    """The Redis client and the key of the lock's waiters' queue."""
    return locks[alias].client, f"distlocks:{{{locks[alias].make_key(name)}}}:queue"


def _until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _assert_handed_past_the_dead_waiter(name, holder, client, queue):
    """A new waiter queues behind a dead one; ``holder``'s release hands the lock to it, not after the dead one's lease."""
    result = []
    waiter = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="redis").acquire(wait=20)))
    waiter.start()
    _until(lambda: client.zcard(queue) == 2)
    released = time.monotonic()
    holder.release()
    waiter.join(20)
    assert result == [True]
    assert time.monotonic() - released < 5  # not the dead waiter's 30 s lease


def test_a_killed_waiter_is_skipped_when_the_lock_is_handed_on(name, workers):
    holder = distlocks.lock(name, using="redis", ttl=30)
    holder.acquire()
    client, queue = _queue(name)
    dead = workers("take", "redis", name, 60)
    _until(lambda: client.zcard(queue) == 1)
    channel = client.zrange(queue, 0, 0)[0].decode().split("|")[0]
    dead.kill()
    _until(lambda: client.pubsub_numsub(channel)[0][1] == 0)
    _assert_handed_past_the_dead_waiter(name, holder, client, queue)
    assert client.zcard(queue) == 0


def test_a_waiter_that_gives_up_leaves_the_queue(name):
    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    client, queue = _queue(name)
    result = []

    def give_up():
        result.append(distlocks.lock(name, using="redis").acquire(wait=0.5))
        result.append(client.zcard(queue))

    thread = threading.Thread(target=give_up)
    thread.start()
    _until(lambda: client.zcard(queue) == 1)
    thread.join(10)
    assert result == [False, 0]
    # Nobody waits: the release hands the lock to nobody and it is free.
    holder.release()
    thread = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="redis").acquire(wait=0)))
    thread.start()
    thread.join(10)
    assert result == [False, 0, True]


def _queued_waiter(name, steps):
    """In a thread of its own, queue a waiter for ``name`` through the backend, then run ``steps(backend, key)``."""
    result = []

    def run():
        backend, owner = locks["redis"], current_owner()
        key = backend.make_key(name)
        backend.wait(key, 0, 1.0)  # subscribes the process's channel
        assert backend.try_acquire(key, owner, 30.0) is None  # held: queued
        result.append(steps(backend, key, owner))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_a_lock_handed_to_a_waiter_that_gives_up_is_passed_on(name):
    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    client, queue = _queue(name)
    handed = threading.Event()

    def give_up(backend, key, owner):
        handed.wait(10)  # the release handed the lock over; this waiter never reads it
        backend.end_wait(key, acquired=False)

    thread, _ = _queued_waiter(name, give_up)
    _until(lambda: client.zcard(queue) == 1)
    holder.release()
    handed.set()
    thread.join(10)
    result = []
    taker = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="redis").acquire(wait=0)))
    taker.start()
    taker.join(10)
    assert result == [True]


def test_a_waiter_that_asks_again_takes_the_lock_handed_to_it(name):
    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    client, queue = _queue(name)
    handed = threading.Event()

    def ask_again(backend, key, owner):
        handed.wait(10)
        token = backend.try_acquire(key, owner, 30.0)
        backend.end_wait(key, acquired=token is not None)
        return token, backend.release(key, owner)

    thread, result = _queued_waiter(name, ask_again)
    _until(lambda: client.zcard(queue) == 1)
    token = int(client.hget(f"distlocks:{{{locks['redis'].make_key(name)}}}", "token") or 0)
    holder.release()
    handed.set()
    thread.join(10)
    [(handed_token, released)] = result
    assert handed_token > token
    assert released


def test_the_queue_outlives_the_lease_a_waiter_sleeps_through(name):
    # Waiters sleep until the holder's lease ends: a queue that expired first
    # would forget them, and the release would hand the lock to nobody.
    holder = distlocks.lock(name, using="redis", ttl=120)
    holder.acquire()
    client, queue = _queue(name)
    waiter = threading.Thread(target=lambda: distlocks.lock(name, using="redis", ttl=1).acquire(wait=0.5))
    waiter.start()
    _until(lambda: client.zcard(queue) == 1)
    assert client.pttl(queue) > 120_000
    waiter.join(10)
    holder.release()


@pytest.mark.parametrize("waiter", ["sync", "async"])
def test_a_forked_child_does_not_keep_a_dead_waiter_listening(name, workers, waiter):
    holder = distlocks.lock(name, using="redis", ttl=30)
    holder.acquire()
    client, queue = _queue(name)
    parent = workers("queue_and_fork", "redis", name, waiter)
    event, child = parent.line()
    assert event == "forked"
    try:
        channel = client.zrange(queue, 0, 0)[0].decode().split("|")[0]
        parent.kill()  # its child lives on, with a copy of the parent's sockets
        _until(lambda: client.pubsub_numsub(channel)[0][1] == 0)
        _assert_handed_past_the_dead_waiter(name, holder, client, queue)
    finally:
        os.kill(int(child), signal.SIGKILL)


def test_a_hand_over_is_for_one_waiter_not_for_its_owner(name):
    # Two threads acting as one owner (a Celery task's shared secret): the lock
    # handed to the first is not the second's to take or give back.
    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    client, queue = _queue(name)
    owner = task_owner("task-1", shared=True)
    first_holds, second_done = threading.Event(), threading.Event()
    result = []

    def first():
        with acting_as(owner):
            lk = distlocks.lock(name, using="redis", wait=10)
            result.append(("first", lk.acquire()))
            first_holds.set()
            second_done.wait(10)
            lk.release()

    def second():
        with acting_as(owner):
            result.append(("second", distlocks.lock(name, using="redis").acquire(wait=0.5)))
            second_done.set()

    thread = threading.Thread(target=first)
    thread.start()
    _until(lambda: client.zcard(queue) == 1)
    holder.release()  # handed to the first waiter, told by its message
    assert first_holds.wait(10)
    other = threading.Thread(target=second)
    other.start()
    other.join(10)
    thread.join(10)
    assert result == [("first", True), ("second", False)]


def test_a_hand_over_to_a_waiter_its_process_forgot_is_given_back(name):
    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    client, queue = _queue(name)

    def forget(backend, key, owner):
        # As if Redis had been unreachable when it gave up: it is still queued.
        backend._releases().discharge(backend._waiting.pop(key))

    thread, _ = _queued_waiter(name, forget)
    thread.join(10)
    assert client.zcard(queue) == 1
    result = []
    waiter = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="redis").acquire(wait=20)))
    waiter.start()
    _until(lambda: client.zcard(queue) == 2)
    released = time.monotonic()
    holder.release()  # handed to the forgotten waiter; its process gives it back to the next
    waiter.join(20)
    assert result == [True]
    assert time.monotonic() - released < 5


def test_a_thread_that_waited_lately_queues_at_its_first_attempt(name):
    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    client, queue = _queue(name)
    seen = []

    def attempt(backend, key, owner):
        backend.begin_wait(key)
        assert backend.try_acquire(key, owner, 30.0) is None
        seen.append(client.zcard(queue))
        backend.end_wait(key, acquired=False)

    def run():
        backend, owner = locks["redis"], current_owner()
        key = backend.make_key(name)
        attempt(backend, key, owner)  # a thread that never waited tries plainly: not queued
        backend.wait(key, 0, 1.0)  # it waits (and subscribes the process's channel)
        backend.end_wait(key, acquired=False)
        attempt(backend, key, owner)  # now it joins the queue at once
        backend._waited_at -= redis_backend.WAITED_LATELY
        attempt(backend, key, owner)  # long ago: plainly again

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    holder.release()
    assert seen == [0, 1, 0]
    assert client.zcard(queue) == 0


def test_inspection_shows_when_a_lock_was_taken_and_handed_over(name):
    def acquired_at():
        (info,) = [i for i in locks["redis"].held() if i.key == locks["redis"].make_key(name)]
        return info.acquired_at

    holder = distlocks.lock(name, using="redis")
    holder.acquire()
    taken = acquired_at()

    def take_the_hand_over(backend, key, owner):
        backend.wait(key, 1, 5.0)
        token = backend.try_acquire(key, owner, 30.0)
        backend.end_wait(key, acquired=token is not None)
        handed_over = acquired_at()
        backend.release(key, owner)
        return handed_over

    thread, result = _queued_waiter(name, take_the_hand_over)
    client, queue = _queue(name)
    _until(lambda: client.zcard(queue) == 1)
    holder.release()
    thread.join(10)
    now = datetime.now(timezone.utc)
    assert abs((now - taken).total_seconds()) < 5
    assert abs((now - result[0]).total_seconds()) < 5  # the server's clock, for a hand-over


def _lost_attempt_scripts(name):
    """The lock's acquire keys, a call of the alias's scripts, and an owner's secret: attempts whose answer is lost."""
    backend = locks["redis"]
    keys = acquire_keys(backend.make_key(name))
    return keys, lambda script, args: backend.call(script, keys, args), current_owner().secret


def test_an_acquire_voided_before_it_runs_takes_nothing(name):
    keys, call, secret = _lost_attempt_scripts(name)
    attempt = strays.attempt_id()
    assert call("void", [attempt, secret, 30_000, ""]) == 0  # the void reached the server first
    assert call("acquire", [attempt, secret, 30_000, "1 late"]) < 0
    assert not locks["redis"].client.exists(keys[0])
    assert call("acquire", [strays.attempt_id(), secret, 30_000, "1 next"]) > 0  # another attempt takes it
    assert call("void", [attempt, secret, 30_000, ""]) == 0  # a void of the first leaves it
    assert call("release", [secret]) == 0


def test_a_void_gives_back_only_what_its_attempt_took_and_nobody_re_entered(name):
    keys, call, secret = _lost_attempt_scripts(name)
    client = locks["redis"].client
    taken = strays.attempt_id()
    assert call("acquire", [taken, secret, 30_000, "1 lost"]) > 0
    assert call("reenter", [secret, 30_000]) == 1  # re-entered: the owner holds it, knowingly
    assert call("void", [taken, secret, 30_000, ""]) == 0
    assert int(client.hget(keys[0], "count")) == 2
    assert call("release", [secret]) == 1
    assert call("void", [strays.attempt_id(), secret, 30_000, ""]) == 0  # another attempt's
    assert call("void", [taken, "another owner's secret", 30_000, ""]) == 0
    assert call("void", [taken, secret, 30_000, ""]) == 1
    assert not client.exists(keys[0])


def test_a_lock_handed_over_to_a_waiter_whose_attempt_was_lost_is_given_back(name):
    keys, call, secret = _lost_attempt_scripts(name)
    client = locks["redis"].client
    listener = client.pubsub()
    listener.subscribe(f"test-channel-{name}")  # the release hands the lock over only to a waiter listened for
    try:
        for taken_by_attempt in (False, True):
            holder = Holder(name, "redis")
            entry = f"test-channel-{name}|w{taken_by_attempt}|{secret}|30000|a waiter"
            queued = strays.attempt_id()
            assert call("acquire", [queued, secret, 30_000, "1 waiter", entry]) < 0  # queued
            holder.release()  # hands it to the waiter
            assert client.hget(keys[0], "owner").decode() == secret
            lost = queued
            if taken_by_attempt:  # the waiter's next attempt took what was handed to it, and its answer was lost
                lost = strays.attempt_id()
                assert call("acquire", [lost, secret, 30_000, "1 waiter", entry, "queued"]) > 0
            assert call("void", [lost, secret, 30_000, entry]) == 1
            assert not client.exists(keys[0])
    finally:
        listener.close()


def test_a_read_write_void_takes_a_lost_writers_waiting_record_and_what_was_handed_to_it(name):
    """A writer's attempt that queued it (its entry blocks new readers), and whose answer was lost, is voided:
    its entry and record leave the queue, new readers read at once; a hold handed over to it is given back."""
    backend = locks["redis"]
    keys = rw_acquire_keys(backend.make_key(name))
    client = backend.client

    def call(script, *args):
        return backend.call(script, keys, list(args))

    listener = client.pubsub()
    listener.subscribe(f"test-channel-{name}")  # a release hands over only to a waiter listened for
    try:
        for handed_over in (False, True):
            assert call("rw_acquire", strays.attempt_id(), "read", "reader", 30_000, "1 reader") > 0
            entry = f"write|test-channel-{name}|w{handed_over}|writer|30000|a writer"
            lost = strays.attempt_id()
            assert call("rw_acquire", lost, "write", "writer", 30_000, "1 writer", entry) < 0  # queued: waiting
            assert call("rw_acquire", strays.attempt_id(), "read", "late", 30_000, "1 late") < 0  # behind it
            if handed_over:
                assert call("rw_release", "reader", "read") == 0  # hands the write side to the waiter
                assert client.hget(keys[0], "w") == b"writer"
            assert call("rw_void", lost, "write", "writer", 90_000, entry) == int(handed_over)
            assert not client.exists(keys[2])  # its entry left the queue
            assert not any(f.startswith(b"q:") or f in (b"w", b"gw") for f in client.hkeys(keys[0]))
            assert call("rw_acquire", strays.attempt_id(), "read", "late", 30_000, "1 late") > 0
            assert call("rw_acquire", lost, "write", "writer", 30_000, "1 writer", entry) == -1  # runs late: nothing
            for reader in ("reader", "late")[handed_over:]:
                assert call("rw_release", reader, "read") == 0
            assert not any(f.startswith(b"r:") for f in client.hkeys(keys[0]))
    finally:
        listener.close()
