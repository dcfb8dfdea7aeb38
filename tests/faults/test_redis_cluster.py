"""A Redis Cluster's primary killed (SIGKILL) while processes contend: what its replica's takeover keeps, and loses."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from redis.crc import key_slot

import distlocks
from distlocks.backends.redis.keys import keys_of_lock, lock_hash
from distlocks.signals import lock_lost
from tests.conftest import DB, guarded_events, on_each_primary, wait_until
from tests.faults.conftest import frozen

pytestmark = [DB, pytest.mark.servers("cluster"), pytest.mark.usefixtures("cluster_alias")]

ALIAS = "cluster"


def entries(log):
    """The times (monotonic) of the entries in the ``tests.worker guarded`` log ``log``, checked: one holder at a
    time, tokens growing."""
    return [float(event[2]) for event in guarded_events(log) if event[0] == "enter"]


@pytest.mark.parametrize("alias", [ALIAS], indirect=True)
def test_a_primary_killed_mid_contention_loses_only_what_its_replica_lacked(
    alias, leave_nothing, redis_cluster, name, workers, tmp_path
):
    names = on_each_primary(redis_cluster, name)
    victim_port, survivor_port = sorted(names)[:2]
    [victim] = [server for server in redis_cluster.servers if server.port == victim_port]
    replica = redis_cluster.replica_of(victim)
    kept_name = on_each_primary(redis_cluster, f"{name}-kept")[victim_port]
    lost_name = on_each_primary(redis_cluster, f"{name}-lost")[victim_port]
    told = []

    def note_lost(sender, name, **kwargs):
        told.append((name, time.monotonic()))

    lock_lost.connect(note_lost)
    # A hold that the replica has: it must survive the failover.
    kept = distlocks.lock(kept_name, using=ALIAS, ttl=10)
    assert kept.acquire(wait=0)
    redis_cluster.wait_synced(victim)
    stop = tmp_path / "stop"
    logs = {port: tmp_path / f"{port}.log" for port in (victim_port, survivor_port)}
    running = [workers("guarded", ALIAS, names[port], 60, log, stop) for port, log in logs.items() for _ in range(2)]
    wait_until(lambda: all(log.exists() and log.read_text().count("enter") > 20 for log in logs.values()))
    try:
        # A hold that the replica never gets (its link to the primary is cut while it is frozen), then SIGKILL.
        with frozen(replica):
            redis.Redis(port=victim_port).client_kill_filter(_type="replica")
            lost = distlocks.lock(lost_name, using=ALIAS, ttl=10)
            assert lost.acquire(wait=0)
            lost_token, acquired = lost.token, time.monotonic()
            victim.process.kill()
            victim.process.wait()
            victim.process = None
        killed = time.monotonic()
        wait_until(lambda: redis.Redis(port=replica.port).info("replication")["role"] == "master", timeout=30)
        promoted = time.monotonic()

        # The lost hold: another process takes the lock, with a larger token, and its holder is told at its
        # next renewal, before its own lease would have ended.
        answer = workers("take", ALIAS, lost_name, 20).finish()
        assert answer[0] == "acquired"
        assert int(answer[1]) > lost_token
        wait_until(lambda: lost_name in dict(told), timeout=10)  # lock_lost, sent by the watchdog
        assert lost.lost
        assert dict(told)[lost_name] < acquired + 10
        with pytest.raises(distlocks.LockLost):
            lost.release()
        # The kept hold: nobody else gets it, and its holder still has it.
        assert workers("take", ALIAS, kept_name, 0).finish() == ["busy"]
        assert not kept.lost
        kept.release()
        assert kept_name not in [lock_name for lock_name, _ in told]

        # The contention goes on: on the promoted replica too, one holder at a time, tokens growing.
        wait_until(lambda: sum(at > promoted for at in entries(logs[victim_port])) > 20, timeout=20)
    finally:
        stop.touch()
        lock_lost.disconnect(note_lost)
        for worker in running:
            worker.finish()
        if victim.process is None:  # it rejoins as its old replica's replica: a whole cluster for the next tests
            victim.start()
            redis_cluster.wait_ready()
    # The other primaries' locks went on during the failover.
    assert sum(killed < at < promoted for at in entries(logs[survivor_port])) > 10
    victim_entries = entries(logs[victim_port])
    assert sum(at > promoted for at in victim_entries) > 20


@pytest.mark.parametrize("alias", [ALIAS], indirect=True)
def test_a_waiter_whose_locks_slot_moves_is_handed_the_lock_on_its_new_primary(alias, redis_cluster, name):
    holder = distlocks.lock(name, using=ALIAS, ttl=30)
    holder.acquire()
    held = holder.token
    hash_name, queue = lock_hash(holder.key), keys_of_lock(holder.key)[2]
    slot = key_slot(hash_name.encode())
    source = redis_cluster.primary_of(hash_name)
    target = next(s for s in redis_cluster.servers if s.port in redis_cluster.primaries() and s is not source)
    got = {}

    def wait_for_it():
        with distlocks.lock(name, using=ALIAS, wait=20) as lk:
            got["at"], got["token"] = time.monotonic(), lk.token

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    wait_until(lambda: redis.Redis(port=source.port).zcard(queue) == 1)
    try:
        redis_cluster.move_slot(slot, target)  # the lock, its counter and its queue go along
        time.sleep(0.5)  # the waiter learns of it (the source drops its subscription) and subscribes anew
        released = time.monotonic()
        holder.release()  # MOVED: redis-py runs the release on the target
        thread.join(20)
        assert got["token"] > held
        assert got["at"] - released < 0.5  # handed over on the target, not after the 30 s lease
    finally:
        redis_cluster.move_slot(slot, source)
