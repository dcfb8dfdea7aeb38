"""The lock contract, on every backend: the database (SQLite, MariaDB, PostgreSQL), Redis, Redlock, ZooKeeper and LocMem."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import distlocks
from distlocks.handler import locks
from distlocks.owner import current_owner
from distlocks.signals import lock_acquire_failed, lock_acquired, lock_lost, lock_released

from .conftest import DB, LEASE_ALIASES, PROCESS_ALIASES

pytestmark = DB


def in_thread(func):
    """Run ``func`` in another thread (another owner) and return its result."""
    result = {}

    def run():
        try:
            result["value"] = func()
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in result:
        raise result["error"]
    return result["value"]


def info(lk):
    """What the backend shows of the lock (as the admin does), or None if it is not held."""
    return next((held for held in locks[lk.alias].held() if held.key == lk.key), None)


def token_in_thread(make_lock):
    """Acquire in another thread and return its token, releasing again."""

    def take():
        with make_lock() as lk:
            return lk.token

    return in_thread(take)


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_processes_do_not_lose_updates(alias, name, workers, tmp_path):
    counter = tmp_path / "counter"
    counter.write_text("0")
    running = [workers("counter", alias, name, counter, 25, 4) for _ in range(4)]
    for worker in running:
        assert worker.finish() == ["done"]
    assert int(counter.read_text()) == 100


def test_without_the_lock_processes_do_lose_updates(name, workers, tmp_path):
    # The control for the test above: the race it guards against is real.
    counter = tmp_path / "counter"
    counter.write_text("0")
    running = [workers("counter", "default", name, counter, 25, 4, 0) for _ in range(4)]
    for worker in running:
        worker.finish()
    assert int(counter.read_text()) < 100


def test_reentrant_per_thread(lock_factory):
    outer, inner = lock_factory(), lock_factory()
    with outer:
        token = outer.token
        with inner:
            assert inner.token == token
            assert outer.hold_count == inner.hold_count == 2
            assert info(outer).hold_count == 2
            assert info(outer).token == token
        assert outer.hold_count == 1
        assert in_thread(lambda: lock_factory().acquire(wait=0)) is False
    assert outer.hold_count == 0
    assert in_thread(lambda: lock_factory().acquire(wait=0)) is True


def test_one_object_shared_by_threads(lock_factory):
    shared = lock_factory(wait=0)
    assert shared.acquire()
    assert in_thread(shared.acquire) is False
    assert in_thread(lambda: shared.hold_count) == 0
    shared.release()


def test_wait_zero_and_bounded_wait(lock_factory):
    holder = lock_factory()
    assert holder.acquire(wait=0)

    def contender(wait):
        started = time.monotonic()
        acquired = lock_factory().acquire(wait=wait)
        return acquired, time.monotonic() - started

    acquired, took = in_thread(lambda: contender(0))
    assert not acquired
    assert took < 1
    acquired, took = in_thread(lambda: contender(0.5))
    assert not acquired
    assert 0.5 <= took < 3

    def as_context_manager():
        with lock_factory(wait=0.1):
            pass

    with pytest.raises(distlocks.LockNotAcquired, match="not acquired within 0.1s"):
        in_thread(as_context_manager)
    holder.release()


def test_waiter_gets_the_lock_once_released(lock_factory):
    holder = lock_factory()
    holder.acquire()
    done = threading.Event()

    def wait_for_it():
        started = time.monotonic()
        with lock_factory(wait=10):
            done.set()
            return time.monotonic() - started

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    time.sleep(0.3)
    assert not done.is_set()
    holder.release()
    waiter.join(10)
    assert done.is_set()


def test_release_by_non_owner(lock_factory):
    lk = lock_factory()
    with pytest.raises(distlocks.LockNotOwned):
        lk.release()
    lk.acquire()
    with pytest.raises(distlocks.LockNotOwned, match="not held by this thread"):
        in_thread(lk.release)
    with pytest.raises(distlocks.LockNotOwned):
        in_thread(lambda: lk.token)
    assert in_thread(lambda: lock_factory().acquire(wait=0)) is False
    lk.release()


@pytest.mark.parametrize("alias", LEASE_ALIASES, indirect=True)
def test_expiry_and_takeover(lock_factory):
    old = lock_factory(ttl=0.5, renew=False)
    assert old.acquire(wait=0)
    old_token = old.token
    time.sleep(0.8)
    new_token = in_thread(lambda: (lk := lock_factory(renew=False)).acquire(wait=0) and lk.token)
    assert new_token > old_token
    with pytest.raises(distlocks.LockLost):
        old.release()
    assert old.hold_count == 0
    # The new holder's lock is untouched by the old holder's failed release.
    assert info(old).token == new_token


@pytest.mark.parametrize("alias", LEASE_ALIASES, indirect=True)
def test_expired_lease_is_lost_even_if_nobody_took_it(lock_factory):
    lk = lock_factory(ttl=0.3, renew=False)
    lk.acquire()
    time.sleep(0.5)
    with pytest.raises(distlocks.LockLost):
        lk.release()
    assert info(lk) is None


@pytest.mark.parametrize("alias", LEASE_ALIASES, indirect=True)
def test_leaving_with_block_after_loss_raises_lock_lost(lock_factory):
    with pytest.raises(distlocks.LockLost), lock_factory(ttl=0.3, renew=False):
        time.sleep(0.5)


def test_watchdog_keeps_the_lock_past_its_ttl(lock_factory):
    # Renewed every half second, each renewal with a second to spare: a 0.6 s lease (0.4 s to spare) was lost
    # to a renewal late on a machine at load 10, as it should be.
    lk = lock_factory(ttl=1.5)
    with lk:
        time.sleep(2)  # past the lease the acquire took
        assert in_thread(lambda: lock_factory().acquire(wait=0)) is False
        assert not lk.lost
    assert in_thread(lambda: lock_factory().acquire(wait=0)) is True


def test_watchdog_reports_a_lost_lock(lock_factory):
    lost = []

    def on_lost(sender, name, alias, token, **kwargs):
        lost.append((name, alias, token))

    lock_lost.connect(on_lost)
    try:
        lk = lock_factory(ttl=0.6)
        lk.acquire()
        assert locks[lk.alias].force_release(lk.key)
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lk.lost
        assert lost == [(lk.name, lk.alias, lk.token)]
        with pytest.raises(distlocks.LockLost):
            lk.acquire()
        with pytest.raises(distlocks.LockLost):
            lk.release()
        assert lk.hold_count == 0
        with pytest.raises(distlocks.LockNotOwned):
            lk.release()
    finally:
        lock_lost.disconnect(on_lost)


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_sigkilled_holder_frees_the_lock_after_its_ttl(alias, name, workers):
    holder = workers("hold", alias, name, 1)
    assert holder.line()[0] == "acquired"
    assert workers("take", alias, name, 0).finish() == ["busy"]
    holder.kill()
    killed = time.monotonic()
    answer = workers("take", alias, name, 10).finish()
    assert answer[0] == "acquired"
    assert time.monotonic() - killed < 10


@pytest.mark.parametrize("alias", LEASE_ALIASES, indirect=True)
def test_fencing_tokens_strictly_increase(alias, name, lock_factory, workers):
    tokens = []
    lk = lock_factory()
    for _ in range(3):
        with lk:
            tokens.append(lk.token)
    if alias in PROCESS_ALIASES:
        _, token = workers("take", alias, name, 5).finish()
        tokens.append(int(token))
    else:  # LocMem's locks live in one process: another thread is the other owner
        tokens.append(token_in_thread(lock_factory))
    short = lock_factory(ttl=0.2, renew=False)
    short.acquire()
    tokens.append(short.token)
    time.sleep(0.4)
    # Cleanup deletes what expired; the next token is still larger.
    locks[alias].clear_expired()
    tokens.append(token_in_thread(lock_factory))
    with pytest.raises(distlocks.LockLost):
        short.release()
    # A takeover of an expired lease gets a larger token too.
    short.acquire()
    tokens.append(short.token)
    time.sleep(0.4)
    tokens.append(token_in_thread(lock_factory))
    with pytest.raises(distlocks.LockLost):
        short.release()
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


def test_function_decorator(lock_factory):
    calls = []

    @lock_factory(wait=0)
    def job():
        calls.append(in_thread(lambda: lock_factory().acquire(wait=0)))

    job()
    job()
    assert calls == [False, False]


@pytest.fixture
def no_receivers():
    """The lock's signals with nobody listening (as without distlocks.metrics and .tracing), restored after."""
    signals = [lock_acquired, lock_released, lock_lost, lock_acquire_failed]
    saved = [signal.receivers[:] for signal in signals]
    for signal in signals:
        signal.receivers.clear()
        signal.sender_receivers_cache.clear()
    yield
    for signal, receivers in zip(signals, saved, strict=True):
        signal.receivers[:] = receivers
        signal.sender_receivers_cache.clear()


@pytest.mark.usefixtures("no_receivers")
def test_a_receiver_connected_after_the_lock_was_used_unheard_hears_what_follows(name):
    """A lock sends nothing while nobody listens (sending costs even to nobody); one connected later hears all."""
    lk = distlocks.lock(name, using="locmem")
    with lk:  # nobody listens: nothing to hear
        assert not in_thread(lambda: distlocks.lock(name, using="locmem").acquire(wait=0))
    heard = []

    def record(signal, **kwargs):
        heard.append((signal, kwargs["name"]))

    for signal in (lock_acquired, lock_released, lock_acquire_failed):
        signal.connect(record)
    with lk:
        assert not in_thread(lambda: distlocks.lock(name, using="locmem").acquire(wait=0))
    assert heard == [(lock_acquired, name), (lock_acquire_failed, name), (lock_released, name)]
    for signal in (lock_acquired, lock_released, lock_acquire_failed):
        signal.disconnect(record)
    with lk:
        pass
    assert len(heard) == 3


def test_signals_and_logs_keep_the_secret(lock_factory, caplog):
    seen = []

    def record(sender, name, alias, token, signal, **kwargs):
        seen.append(signal)

    lock_acquired.connect(record)
    lock_released.connect(record)
    try:
        with caplog.at_level(logging.DEBUG, logger="distlocks"), lock_factory():
            secret = current_owner().secret
    finally:
        lock_acquired.disconnect(record)
        lock_released.disconnect(record)
    assert seen == [lock_acquired, lock_released]
    assert "Acquired lock" in caplog.text
    assert secret not in caplog.text
