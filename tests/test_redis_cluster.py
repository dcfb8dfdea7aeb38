"""The Redis backend on a Redis Cluster (``OPTIONS["CLUSTER"]``): every kind, on every primary, with waiters anywhere.

The fixture ``redis_cluster`` starts three primaries and a replica each
(``localservers.ClusterServers``), once per test session; lock alias "cluster".
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured

import distlocks
from distlocks.backends.redis.keys import keys_of_lock, lock_hash
from distlocks.checks import check_distlocks
from distlocks.handler import locks
from distlocks.inspection import clear_expired, force_release, held_locks

from .conftest import DB, Holder, guarded_events, on_each_primary, taken_by_another_thread, wait_until
from .test_read_write import intervals, overlaps
from .test_semaphore import concurrency

pytestmark = [DB, pytest.mark.servers("cluster"), pytest.mark.usefixtures("cluster_alias")]

ALIAS = "cluster"
REDIS = "distlocks.backends.redis.RedisBackend"


def test_a_lock_on_each_primary_has_one_holder_and_growing_tokens(redis_cluster, name):
    names = on_each_primary(redis_cluster, name)
    assert len(names) == 3
    for port, lock_name in names.items():
        lk = distlocks.lock(lock_name, using=ALIAS)
        assert lk.acquire(wait=0)
        first = lk.token
        node = redis.Redis(port=port)
        assert node.hget(lock_hash(lk.key), "token") == str(first).encode()  # on the primary of its slot
        assert not taken_by_another_thread(distlocks.lock(lock_name, using=ALIAS))
        assert lk.acquire(wait=0)  # re-entered
        lk.release()
        assert not taken_by_another_thread(distlocks.lock(lock_name, using=ALIAS))
        lk.release()
        assert not node.exists(lock_hash(lk.key))
        with distlocks.lock(lock_name, using=ALIAS, wait=0) as other:
            assert other.token > first
        with pytest.raises(distlocks.LockNotOwned):
            lk.release()


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"CLUSTER": "127.0.0.1:7000"}, "['OPTIONS']['CLUSTER'] must be a list of seed nodes"),
        ({"CLUSTER": []}, "['OPTIONS']['CLUSTER'] must be a list of seed nodes"),
        ({"CLUSTER": ["127.0.0.1"]}, "['OPTIONS']['CLUSTER'] has '127.0.0.1', which is not \"host:port\""),
        ({"CLUSTER": ["127.0.0.1:70000"]}, "['OPTIONS']['CLUSTER'] has '127.0.0.1:70000'"),
        ({"CLUSTER": [("127.0.0.1", 7000)]}, "['OPTIONS']['CLUSTER'] has ('127.0.0.1', 7000)"),
        ({"CLUSTER": ["127.0.0.1:7000"], "CACHE": "redis"}, "['OPTIONS'] sets both CACHE and CLUSTER"),
        ({"CLUSTER": ["127.0.0.1:7000"], "WAIT_REPLICAS": 1}, "['OPTIONS'] sets both WAIT_REPLICAS and CLUSTER"),
        ({"CLUSTER_OPTIONS": {"password": "x"}}, "['OPTIONS'] sets CLUSTER_OPTIONS without CLUSTER"),
        (
            {"CLUSTER": ["127.0.0.1:7000"], "CLUSTER_OPTIONS": ["password"]},
            "['OPTIONS']['CLUSTER_OPTIONS'] must be a dict",
        ),
    ],
)
def test_a_bad_cluster_option_is_an_error_naming_it(settings, options, text):
    settings.DISTLOCKS = {"bad": {"BACKEND": REDIS, "OPTIONS": options}}
    [message] = check_distlocks()
    assert message.id == "distlocks.E002"
    assert f"DISTLOCKS['bad']{text}" in message.msg
    started = time.monotonic()
    with pytest.raises(ImproperlyConfigured, match=re.escape(text)):
        distlocks.lock("x", using="bad").acquire(wait=0)
    assert time.monotonic() - started < 1  # at once, not at a connection's timeout


def test_an_unknown_redis_py_option_is_named(settings):
    settings.DISTLOCKS = {
        "bad": {"BACKEND": REDIS, "OPTIONS": {"CLUSTER": ["127.0.0.1:1"], "CLUSTER_OPTIONS": {"pasword": "x"}}}
    }
    text = (
        "DISTLOCKS['bad']['OPTIONS']['CLUSTER_OPTIONS'] has 'pasword', which the backend cannot pass to RedisCluster."
    )
    assert [(m.id, m.msg) for m in check_distlocks()] == [("distlocks.E002", f"{text} Did you mean 'password'?")]
    with pytest.raises(ImproperlyConfigured, match=re.escape(text)):
        distlocks.lock("x", using="bad").acquire(wait=0)


def test_a_cluster_that_does_not_answer_is_backend_unavailable(settings):
    settings.DISTLOCKS = {"down": {"BACKEND": REDIS, "OPTIONS": {"CLUSTER": ["127.0.0.1:1", "127.0.0.1:2"]}}}
    started = time.monotonic()
    with pytest.raises(
        distlocks.BackendUnavailable, match=r"Redis cluster 127.0.0.1:1, 127.0.0.1:2 for locks on 'down'"
    ):
        distlocks.lock("x", using="down").acquire(wait=0)
    assert time.monotonic() - started < 5
    [warning] = check_distlocks()
    assert warning.id == "distlocks.W004"


def test_a_waiter_is_handed_the_lock_at_the_release_on_each_primary(redis_cluster, name):
    for port, lock_name in on_each_primary(redis_cluster, name).items():
        holder = distlocks.lock(lock_name, using=ALIAS, ttl=30)
        holder.acquire()
        held = holder.token
        queue = keys_of_lock(holder.key)[2]
        got = {}

        def wait_for_it(lock_name=lock_name, got=got):
            with distlocks.lock(lock_name, using=ALIAS, wait=20) as lk:
                got["at"], got["token"] = time.monotonic(), lk.token

        thread = threading.Thread(target=wait_for_it)
        thread.start()
        wait_until(lambda queue=queue, port=port: redis.Redis(port=port).zcard(queue) == 1)
        released = time.monotonic()
        holder.release()
        thread.join(20)
        assert got["token"] > held
        assert got["at"] - released < 0.5  # told at the release: its lease was 30 s


def handovers(log):
    """The holds in ``log`` (checked: one holder at a time, growing tokens), and the longest wait between a release
    and the next entry."""
    events = guarded_events(log)
    exits = [float(e[2]) for e in events if e[0] == "exit"]
    enters = [float(e[2]) for e in events if e[0] == "enter"]
    return len(enters), max(enter - left for left, enter in zip(exits, enters[1:], strict=False))


@pytest.mark.parametrize("alias", [ALIAS], indirect=True)
def test_processes_contending_on_every_primary_never_hold_together(alias, redis_cluster, name, workers, tmp_path):
    logs = {port: tmp_path / f"{port}.log" for port in on_each_primary(redis_cluster, name)}
    names = on_each_primary(redis_cluster, name)
    running = [workers("locked", ALIAS, names[port], 1.5, log) for port, log in logs.items() for _ in range(2)]
    for worker in running:
        done, taken, timeouts = worker.finish()
        assert (done, int(timeouts)) == ("done", 0)
        assert int(taken) > 0
    for log in logs.values():
        entries, longest = handovers(log)
        assert entries > 10
        # A waiter that missed its hand-over would wait for the 30 s lease (its acquire gives up after 10 s);
        # here each release handed the lock on at once (a few seconds: a process the machine stalled).
        assert longest < 5


def test_tasks_and_threads_of_two_processes_take_turns_on_the_cluster(redis_cluster, name, workers, tmp_path):
    names = on_each_primary(redis_cluster, name)
    for lock_name in names.values():
        path = tmp_path / lock_name
        path.write_text("0")
        running = [workers("async_counter", ALIAS, lock_name, path, 3, 10, 2) for _ in range(2)]
        assert [worker.finish() for worker in running] == [["done"], ["done"]]
        assert path.read_text() == "60"  # 2 processes x 3 tasks x 10 rounds, no update lost


def test_a_hand_over_is_taken_only_once_the_locks_primary_confirms_it(redis_cluster, name):
    # A message that no release sent (as a release that miscounted its listeners would leave one) wakes the
    # waiter, which asks the lock's primary and finds the lock still held.
    holder = distlocks.lock(name, using=ALIAS, ttl=30)
    holder.acquire()
    held = holder.token
    hash_name, queue = lock_hash(holder.key), keys_of_lock(holder.key)[2]
    primary = redis.Redis(port=redis_cluster.primary_of(hash_name).port)
    got = {}

    def wait_for_it():
        with distlocks.lock(name, using=ALIAS, wait=20) as lk:
            got["at"], got["token"] = time.monotonic(), lk.token

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    wait_until(lambda: primary.zcard(queue) == 1)
    [entry] = primary.zrange(queue, 0, 0)
    channel, waiter_id = entry.decode().split("|")[:2]
    assert channel.startswith(":w:")  # the lock's hash goes before it: a sharded channel in the lock's slot
    assert primary.spublish(hash_name + channel, f"{held + 1} {waiter_id} {hash_name}") == 1  # it listens there
    time.sleep(0.3)
    assert got == {}
    assert primary.zcard(queue) == 1  # it is still queued
    released = time.monotonic()
    holder.release()
    thread.join(20)
    assert got["token"] > held + 1
    assert released < got["at"] < released + 0.5


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
    folder = tmp_path / "inside"
    folder.mkdir()
    readers = [workers("read_together", ALIAS, name, 3, folder) for _ in range(3)]
    assert [reader.finish() for reader in readers] == [["together"]] * 3


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
def test_a_multi_lock_across_primaries_is_all_or_none_and_never_deadlocks(
    alias, leave_nothing, redis_cluster, name, workers, tmp_path
):
    a, b, c = sorted(on_each_primary(redis_cluster, name).values())  # one member on each primary
    log = tmp_path / "events"
    # The two sets share b and c, named in opposite orders: each set is taken in sorted order.
    running = [workers("multi", ALIAS, f"{a},{b},{c}", 1.5, log), workers("multi", ALIAS, f"{c},{b}", 1.5, log)]
    for worker in running:
        done, taken, timeouts = worker.finish()
        assert (done, int(timeouts)) == ("done", 0)
        assert int(taken) > 0
    events = guarded_events(log)  # c, in both sets: one holder at a time, tokens growing
    assert {event[1] for event in events} == {str(worker.process.pid) for worker in running}
    assert workers("hold", ALIAS, b, 30).line()[0] == "acquired"
    lk = distlocks.multi_lock([c, a, b], using=ALIAS, wait=1)
    assert not lk.acquire()
    assert lk.hold_count == 0
    assert workers("take", ALIAS, a, 0).finish()[0] == "acquired"  # a was taken, then given back
    assert workers("take", ALIAS, c, 0).finish()[0] == "acquired"


@pytest.mark.parametrize("kind", ["semaphore", "multi", "write"])
def test_async_kinds_across_processes(redis_cluster, name, workers, tmp_path, kind):
    path = tmp_path / "log"
    path.write_text("" if kind == "semaphore" else "0")
    running = [workers("async_kind", kind, ALIAS, name, path, 3, 5, 2) for _ in range(2)]
    assert [worker.finish() for worker in running] == [["done"], ["done"]]
    if kind == "semaphore":
        most, entries = concurrency(path)
        assert most == 2
        assert sum(entries.values()) == 30
    else:
        assert path.read_text() == "30"  # 2 processes x 3 tasks x 5 rounds, no update lost


def test_the_admin_lists_and_force_releases_locks_on_every_primary(redis_cluster, name):
    names = on_each_primary(redis_cluster, name)
    holders = [Holder(lock_name, ALIAS, ttl=30) for lock_name in names.values()]
    reader = Holder(name, lock=distlocks.read_write_lock(name, using=ALIAS, ttl=30).read())
    listed = {(info.key, info.kind): info for info in held_locks([ALIAS]).locks}  # a SCAN of every primary
    for holder in holders:
        assert listed[(holder.lock.key, "lock")].token == holder.token
    assert listed[(f"rw:{name}", "read")].token == reader.token
    for holder in holders:
        assert force_release(ALIAS, holder.lock.key, token=holder.token)
        assert isinstance(holder.release(), distlocks.LockLost)
    assert force_release(ALIAS, f"rw:{name}", kind="read")
    assert isinstance(reader.release(), distlocks.LockLost)
    assert not [info for info in held_locks([ALIAS]).locks if name in info.key]
    # The fencing counters of the locks no longer held, on every primary, go in one call.
    cleared, noun = clear_expired(ALIAS)
    assert cleared >= 4
    assert noun == "unused fencing counters"
    for port, lock_name in names.items():
        fence = keys_of_lock(locks[ALIAS].make_key(lock_name))[1]
        assert not redis.Redis(port=port).exists(fence)
