"""Faults in the core: receivers that raise, a hung server, a failed release, interrupted watchdog threads."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import pytest
from django.core.management import CommandError, call_command

import distlocks
from distlocks.handler import locks
from distlocks.inspection import force_release
from distlocks.owner import acting_as, task_owner
from distlocks.signals import lock_acquired, lock_lost
from tests.conftest import ALIASES, DB, LEASE_ALIASES, REDIS_PORT, Holder, taken_by_another_thread
from tests.faults.conftest import FreezableProxy, frozen

pytestmark = [DB, pytest.mark.servers("redis", "zookeeper")]


#: The lease of a lock a test needs kept renewed: renewals every half second, each with a second to spare. At a
#: load of 8-10 on two cores, a renewal was late by more than the 0.4 s a 0.6 s lease leaves.
RENEWED_TTL = 1.5


def until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def receiver_raising(exception):
    def receiver(sender, **kwargs):
        raise exception

    return receiver


@pytest.mark.parametrize("alias", LEASE_ALIASES, indirect=True)
def test_locks_are_still_renewed_after_a_lock_lost_receiver_raised(alias, name, lock_factory, caplog):
    receiver = receiver_raising(RuntimeError("a broken lock_lost receiver"))
    lock_lost.connect(receiver)
    try:
        first = lock_factory(f"{name}-first", ttl=0.6)
        first.acquire()
        second = lock_factory(ttl=RENEWED_TTL)
        second.acquire()
        assert locks[alias].force_release(first.key)
        until(lambda: "a broken lock_lost receiver" in caplog.text)
        assert first.lost
        time.sleep(RENEWED_TTL + 0.5)  # past a lease of the second lock
        assert not second.lost
        assert not taken_by_another_thread(distlocks.lock(name, using=alias))
        second.release()
        assert taken_by_another_thread(distlocks.lock(name, using=alias))
    finally:
        lock_lost.disconnect(receiver)


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_acquire_holds_the_lock_when_a_lock_acquired_receiver_raises(alias, name, lock_factory, caplog):
    receiver = receiver_raising(RuntimeError("a broken lock_acquired receiver"))
    lock_acquired.connect(receiver)
    try:
        lk = lock_factory()
        with lk:
            assert not taken_by_another_thread(distlocks.lock(name, using=alias))
        assert "a broken lock_acquired receiver" in caplog.text
        assert lk.hold_count == 0
        assert taken_by_another_thread(distlocks.lock(name, using=alias))
    finally:
        lock_acquired.disconnect(receiver)


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_an_interrupted_acquire_leaves_the_lock_free(alias, name, lock_factory):
    # KeyboardInterrupt is no Exception: send_robust lets it through.
    receiver = receiver_raising(KeyboardInterrupt)
    lock_acquired.connect(receiver)
    try:
        lk = lock_factory()
        with pytest.raises(KeyboardInterrupt):
            lk.acquire()
    finally:
        lock_acquired.disconnect(receiver)
    assert lk.hold_count == 0
    assert taken_by_another_thread(distlocks.lock(name, using=alias))


# The hung server's cache: django-redis's, or Django's own RedisCache (its client shared by the process's threads).
@pytest.mark.parametrize(
    ("alias", "cache"), [("default", "redis"), ("postgresql", "redis"), ("default", "redis_django")], indirect=["alias"]
)
def test_a_hung_server_stops_neither_other_renewals_nor_the_loss_of_its_own_locks(
    alias, name, lock_factory, own_redis, cache
):
    # No SOCKET_TIMEOUT: a renewal on the frozen server hangs until it wakes.
    server = own_redis(REDIS_PORT + 30, SOCKET_CONNECT_TIMEOUT=1, cache=cache)
    lost = []

    def on_lost(sender, name, alias, **kwargs):
        lost.append((alias, time.monotonic()))

    lock_lost.connect(on_lost)
    try:
        on_hung = distlocks.lock(f"{name}-hung", using="own", ttl=0.9)
        on_hung.acquire()
        elsewhere = lock_factory(ttl=RENEWED_TTL)
        elsewhere.acquire()
        with frozen(server):
            frozen_at = time.monotonic()
            until(lambda: on_hung.lost and lost, seconds=5)  # the hold is marked, then the signal is sent
            # Lost when its lease ended, while its renewal is still stuck.
            assert lost[0][0] == "own"
            assert lost[0][1] - frozen_at < 0.9 + 2  # the renewal hangs for good; a loaded machine took 0.9 s more
            time.sleep(RENEWED_TTL + 0.5)  # past a lease of the other lock
            assert not elsewhere.lost
            assert not taken_by_another_thread(distlocks.lock(name, using=alias))
        elsewhere.release()
        with pytest.raises(distlocks.LockLost):
            on_hung.release()
    finally:
        lock_lost.disconnect(on_lost)


def test_the_outer_hold_stays_renewed_when_an_inner_release_fails(name, own_redis):
    server = own_redis(REDIS_PORT + 31, SOCKET_CONNECT_TIMEOUT=0.2, SOCKET_TIMEOUT=0.2)
    lk = distlocks.lock(name, using="own", ttl=1.5)
    lk.acquire()
    lk.acquire()
    with frozen(server), pytest.raises(distlocks.BackendUnavailable):
        lk.release()
    assert lk.hold_count == 1
    time.sleep(3.5)  # more than two leases: the outer critical section goes on
    assert not lk.lost
    assert not taken_by_another_thread(distlocks.lock(name, using="own"))
    lk.release()
    assert taken_by_another_thread(distlocks.lock(name, using="own"))


def _interrupt(thread):
    """Raise SystemExit inside ``thread`` (it goes off when the thread next runs Python code)."""
    changed = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))
    assert changed == 1


@pytest.mark.parametrize("alias", ["redis"], indirect=True)
def test_renewals_go_on_when_the_watchdog_threads_are_interrupted(alias, name, lock_factory, caplog):
    lk = lock_factory(ttl=RENEWED_TTL)
    lk.acquire()
    until(lambda: any(t.name == f"distlocks-renew-{alias}" for t in threading.enumerate()))
    with caplog.at_level(logging.ERROR, logger="distlocks"):
        for thread in threading.enumerate():
            if thread.name in ("distlocks-watchdog", f"distlocks-renew-{alias}"):
                _interrupt(thread)
        time.sleep(RENEWED_TTL + 0.5)  # past a lease
    assert not lk.lost
    assert not taken_by_another_thread(distlocks.lock(name, using=alias))
    lk.release()
    assert taken_by_another_thread(distlocks.lock(name, using=alias))


@pytest.mark.parametrize("alias", ALIASES, indirect=True)
def test_a_force_release_for_a_lock_that_changed_hands_leaves_the_new_holder(alias, name):
    first = Holder(name, alias)
    chosen = first.token  # what the operator saw
    key = first.lock.key
    assert first.release() is None
    second = Holder(name, alias)
    assert not force_release(alias, key, chosen)
    with pytest.raises(CommandError, match=f"not held with token {chosen}"):
        call_command("distlocks_release", key, "--using", alias, "--token", str(chosen), "--yes")
    assert second.release() is None  # it still held it: no LockLost


@pytest.mark.parametrize("renew", [True, False])
def test_a_thread_that_ends_holding_a_zookeeper_lock_frees_it(name, renew):
    # A session outlives its threads: nobody else would ever delete the node.
    taken, end = threading.Event(), threading.Event()

    def take_and_end():
        distlocks.lock(name, using="zookeeper", ttl=0.6, renew=renew).acquire()
        taken.set()
        end.wait(30)

    thread = threading.Thread(target=take_and_end)
    thread.start()
    assert taken.wait(30)
    assert not taken_by_another_thread(distlocks.lock(name, using="zookeeper"))
    end.set()
    thread.join()
    until(lambda: taken_by_another_thread(distlocks.lock(name, using="zookeeper")), seconds=5)


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_lock_lost_is_sent_once_when_the_holder_finds_the_loss_itself(alias, name, lock_factory):
    told = []

    def on_lost(sender, name, **kwargs):
        told.append(name)

    lock_lost.connect(on_lost)
    try:
        lk = lock_factory(ttl=0.3, renew=False)  # no watchdog: the release finds the loss
        lk.acquire()
        time.sleep(0.5)
        with pytest.raises(distlocks.LockLost):
            lk.release()
        until(lambda: told)
        assert told == [name]
    finally:
        lock_lost.disconnect(on_lost)


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_reentering_with_a_shorter_ttl_does_not_cut_the_outer_lease(alias, name, lock_factory):
    outer = lock_factory(ttl=30, renew=False)
    outer.acquire()
    inner = lock_factory(ttl=0.3, renew=False)
    inner.acquire()
    inner.release()
    time.sleep(0.6)
    assert not taken_by_another_thread(distlocks.lock(name, using=alias))
    outer.release()


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_a_kept_lease_is_not_resumed_once_its_owner_took_the_lock_anew(alias, name):
    # Two copies of one Celery task share an owner: the first kept its lease
    # over a retry, the lease ran out, the second took the lock anew.
    owner = task_owner("task-1", shared=True)
    first = distlocks.lock(name, using=alias, ttl=5)
    with acting_as(owner):
        first.acquire()
        kept = first.detach(lease=0.3)
    time.sleep(0.5)
    taken, done = threading.Event(), threading.Event()
    errors = []

    def second_copy():
        with acting_as(owner):
            lk = distlocks.lock(name, using=alias, ttl=5)
            assert lk.acquire(wait=5)
            taken.set()
            done.wait(30)
            try:
                lk.release()
            except distlocks.LockError as exc:
                errors.append(exc)

    thread = threading.Thread(target=second_copy)
    thread.start()
    assert taken.wait(30)
    with acting_as(owner):
        assert not first.resume(kept)
    assert first.hold_count == 0
    done.set()
    thread.join(30)
    assert errors == []


def test_renewals_go_on_on_new_connections_when_a_renewal_is_stuck_on_a_black_holed_one(name, own_redis, settings):
    server = own_redis(REDIS_PORT + 32, SOCKET_CONNECT_TIMEOUT=1)  # no SOCKET_TIMEOUT: a stuck read never ends
    proxy = FreezableProxy(server.port)
    own = {**settings.CACHES["own"], "LOCATION": f"redis://127.0.0.1:{proxy.port}/0"}
    settings.CACHES = {**settings.CACHES, "own": own}
    lost = []

    def on_lost(sender, name, **kwargs):
        lost.append(name)

    lock_lost.connect(on_lost)
    try:
        first = Holder(f"{name}-first", "own", ttl=0.9)
        until(lambda: any(t.name == "distlocks-renew-own" for t in threading.enumerate()))
        proxy.stall()  # the connections open now (the holder's, the renewer's) go nowhere, for good
        until(lambda: lost == [f"{name}-first"], seconds=5)
        # Another thread, another connection, which flows: its lock must be
        # renewed, though the alias's renewer is stuck for good.
        second = Holder(name, "own", ttl=RENEWED_TTL)
        time.sleep(RENEWED_TTL + 0.5)  # past a lease
        assert lost == [f"{name}-first"]
        assert not taken_by_another_thread(distlocks.lock(name, using="own"))
        assert second.release() is None
    finally:
        lock_lost.disconnect(on_lost)
        proxy.close()  # ends the stuck reads
    assert isinstance(first.release(), distlocks.LockError)
