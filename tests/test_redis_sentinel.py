"""The Redis backend on a Sentinel group (``OPTIONS["SENTINELS"]`` and ``["SERVICE"]``): every kind, on the master.

The fixture ``redis_sentinel`` starts a master, two replicas and three
sentinels (``localservers.SentinelServers``), once per test session; lock
alias "sentinel". Failovers are in ``tests/faults/test_redis_sentinel.py``.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
from django.core.exceptions import ImproperlyConfigured

import distlocks
from distlocks.backends.redis import handover
from distlocks.backends.redis.aiowait import loop_releases
from distlocks.backends.redis.keys import keys_of_lock, lock_hash
from distlocks.checks import check_distlocks
from distlocks.handler import locks
from distlocks.inspection import force_release, held_locks
from localservers import SENTINEL_PORTS, SENTINEL_SERVICE

from .conftest import DB, Holder, guarded_events, taken_by_another_thread, wait_until
from .test_read_write import intervals, overlaps
from .test_semaphore import concurrency

pytestmark = [DB, pytest.mark.servers("sentinel"), pytest.mark.usefixtures("sentinel_alias")]

ALIAS = "sentinel"
REDIS = "distlocks.backends.redis.RedisBackend"
SENTINELS = [f"127.0.0.1:{port}" for port in SENTINEL_PORTS]


def test_a_lock_is_on_the_master_with_one_holder_and_growing_tokens(redis_sentinel, name):
    master = redis_sentinel.client(redis_sentinel.master())
    lk = distlocks.lock(name, using=ALIAS)
    assert lk.acquire(wait=0)
    first = lk.token
    assert master.hget(lock_hash(lk.key), "token") == str(first).encode()
    assert not taken_by_another_thread(distlocks.lock(name, using=ALIAS))
    assert lk.acquire(wait=0)  # re-entered
    lk.release()
    assert not taken_by_another_thread(distlocks.lock(name, using=ALIAS))
    lk.release()
    assert not master.exists(lock_hash(lk.key))
    with distlocks.lock(name, using=ALIAS, wait=0) as other:
        assert other.token > first
    with pytest.raises(distlocks.LockNotOwned):
        lk.release()


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"SENTINELS": "127.0.0.1:26379", "SERVICE": "s"}, "['OPTIONS']['SENTINELS'] must be a list of sentinels"),
        ({"SENTINELS": [], "SERVICE": "s"}, "['OPTIONS']['SENTINELS'] must be a list of sentinels"),
        ({"SENTINELS": ["127.0.0.1"], "SERVICE": "s"}, "['OPTIONS']['SENTINELS'] has '127.0.0.1', which is not"),
        (
            {"SENTINELS": ["redis://:secret@127.0.0.1:26379"], "SERVICE": "s"},
            "['OPTIONS']['SENTINELS'] has 'redis://:***@127.0.0.1:26379', which is not \"host:port\"",
        ),
        ({"SENTINELS": ["127.0.0.1:26379"]}, "['OPTIONS']['SERVICE'] must be the name of the master"),
        ({"SENTINELS": ["127.0.0.1:26379"], "SERVICE": ""}, "['OPTIONS']['SERVICE'] must be the name of the master"),
        ({"SERVICE": "s"}, "['OPTIONS'] sets SERVICE without SENTINELS"),
        ({"SENTINEL_OPTIONS": {"password": "x"}}, "['OPTIONS'] sets SENTINEL_OPTIONS without SENTINELS"),
        ({"SENTINELS": ["h:1"], "SERVICE": "s", "CACHE": "redis"}, "['OPTIONS'] sets both CACHE and SENTINELS"),
        ({"SENTINELS": ["h:1"], "SERVICE": "s", "CLUSTER": ["h:2"]}, "['OPTIONS'] sets both CLUSTER and SENTINELS"),
        (
            {"SENTINELS": ["h:1"], "SERVICE": "s", "SENTINEL_OPTIONS": [("password", "secret")]},
            "['OPTIONS']['SENTINEL_OPTIONS'] must be a dict of redis-py's keyword arguments (password, ssl, "
            "socket_timeout...); it is a list",
        ),
        (
            {"SENTINELS": ["h:1"], "SERVICE": "s", "SENTINEL_OPTIONS": {"sentinel_kwargs": "secret"}},
            "['OPTIONS']['SENTINEL_OPTIONS']['sentinel_kwargs'] must be a dict",
        ),
        (
            {"SENTINELS": ["h:1"], "SERVICE": "s", "SENTINEL_OPTIONS": {"decode_responses": True}},
            "['OPTIONS']['SENTINEL_OPTIONS'] has 'decode_responses', which the backend cannot pass to redis-py.",
        ),
        (
            {"SENTINELS": ["h:1"], "SERVICE": "s", "SENTINEL_OPTIONS": {"sentinel_kwargs": {"pasword": "x"}}},
            "['OPTIONS']['SENTINEL_OPTIONS']['sentinel_kwargs'] has 'pasword', which the backend cannot pass to "
            "redis-py. Did you mean 'password'?",
        ),
        (
            {"SENTINELS": ["h:1"], "SERVICE": "s", "SENTINEL_OPTIONS": {"min_other_sentinel": 1}},
            "['OPTIONS']['SENTINEL_OPTIONS'] has 'min_other_sentinel', which the backend cannot pass to redis-py. "
            "Did you mean 'min_other_sentinels'?",
        ),
    ],
)
def test_a_bad_sentinel_option_is_an_error_naming_it(settings, options, text):
    settings.DISTLOCKS = {"bad": {"BACKEND": REDIS, "OPTIONS": options}}
    [message] = check_distlocks()
    assert message.id == "distlocks.E002"
    assert f"DISTLOCKS['bad']{text}" in message.msg
    assert "secret" not in message.msg
    started = time.monotonic()
    with pytest.raises(ImproperlyConfigured, match=re.escape(text)):
        distlocks.lock("x", using="bad").acquire(wait=0)
    assert time.monotonic() - started < 1  # at once, not at a connection's timeout


def test_wait_replicas_goes_with_sentinels_and_options_reach_redis_py(settings, redis_sentinel, name):
    settings.DISTLOCKS = {
        "acked": {
            "BACKEND": REDIS,
            "OPTIONS": {
                "SENTINELS": SENTINELS,
                "SERVICE": SENTINEL_SERVICE,
                "SENTINEL_OPTIONS": {"socket_timeout": 3, "sentinel_kwargs": {"socket_timeout": 1}},
                "WAIT_REPLICAS": 2,
                "WAIT_TIMEOUT": 2,
            },
        }
    }
    assert check_distlocks() == []
    client = locks["acked"].client
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 3
    assert client.connection_pool.connection_kwargs["socket_connect_timeout"] == 2  # the default
    sentinel = client.connection_pool.sentinel_manager.sentinels[0]
    assert sentinel.connection_pool.connection_kwargs["socket_timeout"] == 1
    assert sentinel.connection_pool.connection_kwargs["socket_connect_timeout"] == 1  # the sentinels' default
    with distlocks.lock(name, using="acked", wait=0) as lk:  # on both replicas when acquire returns
        for replica in redis_sentinel.replicas():
            assert redis_sentinel.client(replica).hget(lock_hash(lk.key), "token") == str(lk.token).encode()


def test_sentinels_that_do_not_answer_are_backend_unavailable_without_the_password(settings):
    options = {"password": "secret", "sentinel_kwargs": {"password": "secret2"}}
    settings.DISTLOCKS = {
        "down": {
            "BACKEND": REDIS,
            "OPTIONS": {"SENTINELS": ["127.0.0.1:1", "127.0.0.1:2"], "SERVICE": "s", "SENTINEL_OPTIONS": options},
        }
    }
    started = time.monotonic()
    with pytest.raises(distlocks.BackendUnavailable) as info:
        distlocks.lock("x", using="down").acquire(wait=0)
    assert time.monotonic() - started < 1  # each sentinel asked twice (a retry), each refusing at once
    assert str(info.value).startswith(
        "Redis Sentinel 127.0.0.1:1, 127.0.0.1:2 (service 's') for locks on 'down' is unavailable: No master found"
    )
    [warning] = check_distlocks()
    assert warning.id == "distlocks.W004"
    assert "Is it running at Sentinel 127.0.0.1:1, 127.0.0.1:2 (service 's')?" in warning.hint
    for text in (str(info.value), repr(info.value.__cause__), warning.msg, repr(locks["down"].remote)):
        assert "secret" not in text


def test_one_sentinel_listed_is_a_warning(settings, redis_sentinel, name):
    settings.DISTLOCKS = {
        "one": {"BACKEND": REDIS, "OPTIONS": {"SENTINELS": SENTINELS[:1], "SERVICE": SENTINEL_SERVICE}}
    }
    [warning] = check_distlocks()
    assert (warning.id, warning.msg) == (
        "distlocks.W015",
        "DISTLOCKS['one']['OPTIONS']['SENTINELS'] lists one sentinel: while it is down or unreachable, no new "
        "connection finds the master, and locks raise BackendUnavailable.",
    )
    with distlocks.lock(name, using="one", wait=0):  # it works
        pass


def test_a_service_the_sentinels_do_not_watch_is_backend_unavailable(settings, redis_sentinel):
    settings.DISTLOCKS = {"other": {"BACKEND": REDIS, "OPTIONS": {"SENTINELS": SENTINELS, "SERVICE": "nope"}}}
    with pytest.raises(distlocks.BackendUnavailable, match="No master found for 'nope'"):
        distlocks.lock("x", using="other").acquire(wait=0)


def test_a_waiter_is_handed_the_lock_at_the_release(redis_sentinel, name):
    holder = distlocks.lock(name, using=ALIAS, ttl=30)
    holder.acquire()
    held = holder.token
    master = redis_sentinel.client(redis_sentinel.master())
    got = {}

    def wait_for_it():
        with distlocks.lock(name, using=ALIAS, wait=20) as lk:
            got["at"], got["token"] = time.monotonic(), lk.token

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    wait_until(lambda: master.zcard(keys_of_lock(holder.key)[2]) == 1)
    released = time.monotonic()
    holder.release()
    thread.join(20)
    assert got["token"] > held
    assert got["at"] - released < 0.5  # told at the release: its lease was 30 s


def test_a_task_is_handed_the_lock_at_the_release(redis_sentinel, name):
    master = redis_sentinel.client(redis_sentinel.master())

    async def main():
        holder = distlocks.alock(name, using=ALIAS, ttl=30)
        assert await holder.acquire(wait=0)
        waiter = asyncio.create_task(distlocks.alock(name, using=ALIAS, ttl=30).acquire(wait=20))
        while not master.zcard(keys_of_lock(locks[ALIAS].make_key(name))[2]):
            await asyncio.sleep(0.01)
        released = time.monotonic()
        await holder.release()
        assert await waiter
        return time.monotonic() - released

    assert asyncio.run(asyncio.wait_for(main(), 30)) < 0.5


@pytest.fixture
def channel_kept():
    """The hand-over channel stays where a test put it until the test calls the result (it then moves, if off the
    master, once silent for ``PING_AFTER`` while a waiter waits): on a loaded machine a second may pass before the
    test's release."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(handover, "PING_AFTER", 60.0)
        yield patch.undo


def test_a_hand_over_read_on_a_replica_is_not_trusted_and_the_channel_moves_to_the_master(
    redis_sentinel, name, caplog, channel_kept
):
    # A demoted master that kept this process's channel (Sentinel drops its connections, but a window or an
    # operator's REPLICAOF may not) gets every message published on the master by replication, while the
    # release counts the master's listeners alone: it skips the waiter, and the waiter reads "you have it".
    releases = locks[ALIAS]._releases()
    releases.discharge(releases.enlist("x"))  # subscribed now, if it was not
    replica = redis_sentinel.replicas()[0]
    releases.pubsub.connection.disconnect()
    releases.pubsub.connection.connect_to(("127.0.0.1", replica.port))  # redis-py subscribes there again
    assert redis_sentinel.client(replica).pubsub_numsub(releases.channel) == [(releases.channel.encode(), 1)]
    holder = distlocks.lock(name, using=ALIAS, ttl=30)
    holder.acquire()
    master = redis_sentinel.client(redis_sentinel.master())
    inside = []

    def wait_for_it():
        with distlocks.lock(name, using=ALIAS, ttl=30, wait=20) as lk:
            inside.append(("waiter in", time.monotonic(), lk.token))
            time.sleep(0.2)
            inside.append(("waiter out", time.monotonic(), lk.token))

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    wait_until(lambda: master.zcard(keys_of_lock(holder.key)[2]) == 1)
    with caplog.at_level("INFO", logger="distlocks.backends.redis.backend"):
        holder.release()  # nobody listens on the master: the lock is free, and the message reaches the replica
        # It reads the message (the replica had it), and takes nothing on its word: the renewal finds no hold.
        wait_until(lambda: "A lock handed over to a waiter was gone when it woke: queueing again" in caplog.messages)
        # The channel may move now: a message for nobody wakes its reader, which then reads for a second at most.
        channel_kept()
        redis_sentinel.client(replica).publish(releases.channel, "0 nobody nothing")
        other = distlocks.lock(name, using=ALIAS, ttl=30)
        if other.acquire(wait=0):  # another owner takes it (unless the waiter, which queued anew, has it)
            inside.append(("other in", time.monotonic(), other.token))
            time.sleep(0.5)
            inside.append(("other out", time.monotonic(), other.token))
            other.release()
        thread.join(20)
    assert [event for event, _, _ in inside] in (
        ["other in", "other out", "waiter in", "waiter out"],
        ["waiter in", "waiter out"],
    )
    assert inside[-1][2] > holder.token if len(inside) == 2 else inside[2][2] > inside[0][2]
    # Its channel moves to the master once silent for a second while a waiter waits.
    with distlocks.lock(name, using=ALIAS, ttl=30):
        thread = threading.Thread(target=wait_for_it)
        thread.start()
        wait_until(lambda: releases.pubsub.connection.port == redis_sentinel.master().port, timeout=10)
    thread.join(10)
    assert inside[-1][0] == "waiter out"


def test_a_task_too_trusts_no_hand_over_read_on_a_replica_and_its_loops_channel_moves(
    redis_sentinel, name, caplog, channel_kept
):
    master = redis_sentinel.client(redis_sentinel.master())
    replica = redis_sentinel.replicas()[0]
    backend = locks[ALIAS]
    queue = keys_of_lock(backend.make_key(name))[2]

    async def take(wait):
        async with distlocks.alock(name, using=ALIAS, ttl=30, wait=wait):
            return True

    async def main():
        releases = loop_releases(backend.server, backend.new_loop_releases)  # its reader waits for a waiter
        await releases.pubsub.subscribe(releases.channel)
        await releases.pubsub.connection.disconnect()
        await releases.pubsub.connection.connect_to(("127.0.0.1", replica.port))  # subscribed there again
        assert redis_sentinel.client(replica).pubsub_numsub(releases.channel) == [(releases.channel.encode(), 1)]
        holder = distlocks.lock(name, using=ALIAS, ttl=30)
        assert await asyncio.to_thread(holder.acquire, wait=0)
        waiter = asyncio.create_task(take(wait=20))
        while not master.zcard(queue):
            await asyncio.sleep(0.01)
        await asyncio.to_thread(holder.release)  # the master skips the waiter; the replica has the message
        assert await waiter
        # Its channel moves to the master once silent for a second while a task waits.
        channel_kept()
        async with distlocks.alock(name, using=ALIAS, ttl=30, wait=0):
            other = asyncio.create_task(take(wait=10))
            while releases.pubsub.connection.port != redis_sentinel.master().port:
                await asyncio.sleep(0.05)
        assert await other

    with caplog.at_level("INFO", logger="distlocks.backends.redis.backend"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert "A lock handed over to a waiter was gone when it woke: queueing again" in caplog.messages
    assert taken_by_another_thread(distlocks.lock(name, using=ALIAS))


@pytest.mark.parametrize("alias", [ALIAS], indirect=True)
def test_processes_contending_never_hold_together(alias, name, workers, tmp_path):
    log = tmp_path / "log"
    running = [workers("locked", ALIAS, name, 1.5, log) for _ in range(3)]
    for worker in running:
        done, taken, timeouts = worker.finish()
        assert (done, int(timeouts)) == ("done", 0)
        assert int(taken) > 0
    events = guarded_events(log)  # checked: one holder at a time, tokens growing
    exits = [float(e[2]) for e in events if e[0] == "exit"]
    enters = [float(e[2]) for e in events if e[0] == "enter"]
    assert len(enters) > 10
    assert max(enter - left for left, enter in zip(exits, enters[1:], strict=False)) < 5  # handed on, not the lease


@pytest.mark.parametrize("alias", [ALIAS], indirect=True)
def test_a_writer_excludes_readers_and_writers_across_processes(alias, leave_nothing, name, workers, tmp_path):
    log = tmp_path / "events"
    running = [workers("rw_guarded", ALIAS, name, "write", 1.5, 0.01, log) for _ in range(2)]
    running += [workers("rw_guarded", ALIAS, name, "read", 1.5, 0.02, log) for _ in range(2)]
    results = [worker.finish() for worker in running]
    held = intervals(log)
    assert [pair for pair in overlaps(held) if "write" in (pair[0][2], pair[1][2])] == []
    writes = [token for _, _, mode, _, token in held if mode == "write"]
    assert writes == sorted(writes)
    assert len(set(writes)) == len(writes) > 10
    for done, taken, timeouts in results:
        assert (done, int(timeouts)) == ("done", 0)
        assert int(taken) > 0


@pytest.mark.parametrize("alias", [ALIAS], indirect=True)
def test_never_more_than_permits_processes_inside(alias, leave_nothing, name, workers, tmp_path):
    log = tmp_path / "events"
    running = [workers("permits", ALIAS, name, 2, 1.5, log) for _ in range(3)]
    results = [worker.finish() for worker in running]
    most, entries = concurrency(log)
    assert most == 2
    assert len(entries) == 3
    for done, taken, timeouts in results:
        assert (done, int(timeouts)) == ("done", 0)
        assert int(taken) > 0


@pytest.mark.parametrize("alias", [ALIAS], indirect=True)
def test_a_multi_lock_is_all_or_none_and_never_deadlocks(alias, leave_nothing, name, workers, tmp_path):
    a, b, c = f"{name}-a", f"{name}-b", f"{name}-c"
    log = tmp_path / "events"
    running = [workers("multi", ALIAS, f"{a},{b},{c}", 1.5, log), workers("multi", ALIAS, f"{c},{b}", 1.5, log)]
    for worker in running:
        done, taken, timeouts = worker.finish()
        assert (done, int(timeouts)) == ("done", 0)
        assert int(taken) > 0
    guarded_events(log)  # c, in both sets: one holder at a time, tokens growing
    assert workers("hold", ALIAS, b, 30).line()[0] == "acquired"
    lk = distlocks.multi_lock([c, a, b], using=ALIAS, wait=0.5)
    assert not lk.acquire()
    assert workers("take", ALIAS, a, 0).finish()[0] == "acquired"  # a was taken, then given back


@pytest.mark.parametrize("kind", ["lock", "semaphore", "multi", "write"])
def test_async_kinds_across_processes(redis_sentinel, name, workers, tmp_path, kind):
    path = tmp_path / "log"
    path.write_text("" if kind == "semaphore" else "0")
    if kind == "lock":
        running = [workers("async_counter", ALIAS, name, path, 3, 5, 2) for _ in range(2)]
    else:
        running = [workers("async_kind", kind, ALIAS, name, path, 3, 5, 2) for _ in range(2)]
    assert [worker.finish() for worker in running] == [["done"], ["done"]]
    if kind == "semaphore":
        most, entries = concurrency(path)
        assert most == 2
        assert sum(entries.values()) == 30
    else:
        assert path.read_text() == "30"  # 2 processes x 3 tasks x 5 rounds, no update lost


def test_the_admin_lists_and_force_releases_locks(redis_sentinel, name):
    holder = Holder(name, ALIAS, ttl=30)
    reader = Holder(name, lock=distlocks.read_write_lock(name, using=ALIAS, ttl=30).read())
    listed = {(info.key, info.kind): info for info in held_locks([ALIAS]).locks}
    assert listed[(holder.lock.key, "lock")].token == holder.token
    assert listed[(f"rw:{name}", "read")].token == reader.token
    assert force_release(ALIAS, holder.lock.key, token=holder.token)
    assert isinstance(holder.release(), distlocks.LockLost)
    assert force_release(ALIAS, f"rw:{name}", kind="read")
    assert isinstance(reader.release(), distlocks.LockLost)
    assert not [info for info in held_locks([ALIAS]).locks if name in info.key]
