"""A sync lock asked for inside a running event loop: refused at once, naming the async form, on every backend.

And what is no misuse goes on working: sync code in a thread the loop hands
it to, a loop in another thread, Django's DJANGO_ALLOW_ASYNC_UNSAFE.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.core.exceptions import SynchronousOnlyOperation

import distlocks
from distlocks.exceptions import SyncLockInAsyncContext

from .conftest import ALIASES, DB, Holder

pytestmark = DB

KINDS = {
    "lock": (lambda name, alias: distlocks.lock(name, using=alias, wait=5), r"distlocks\.alock\(\.\.\.\)"),
    "semaphore": (lambda name, alias: distlocks.semaphore(name, 1, using=alias, wait=5), r"asemaphore\(\.\.\.\)"),
    "multi": (lambda name, alias: distlocks.multi_lock([name, f"{name}-2"], using=alias, wait=5), r"amulti_lock"),
    "read": (
        lambda name, alias: distlocks.read_write_lock(name, using=alias, wait=5).read(),
        r"aread_write_lock\(\.\.\.\)\.read\(\)",
    ),
    "write": (
        lambda name, alias: distlocks.read_write_lock(name, using=alias, wait=5).write(),
        r"aread_write_lock\(\.\.\.\)\.write\(\)",
    ),
}


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


@pytest.mark.parametrize("alias", ALIASES, indirect=True)
def test_a_sync_lock_in_a_coroutine_is_refused_at_once_naming_alock(alias, name):
    """Another thread holds the lock: before, Redis and ZooKeeper blocked the loop for the whole wait (5 s), and
    the databases raised Django's bare SynchronousOnlyOperation from deep inside."""
    holder = Holder(name, alias)
    lk = distlocks.lock(name, using=alias, wait=5)

    async def main():
        started = time.monotonic()
        with pytest.raises(SyncLockInAsyncContext, match=r"use distlocks\.alock\(\.\.\.\)") as raised, lk:
            pass
        with pytest.raises(SyncLockInAsyncContext):
            lk.acquire(wait=0)
        assert time.monotonic() - started < 1
        return raised.value

    try:
        error = run(main())
    finally:
        assert holder.release() is None
    # Code that catches Django's error catches it too; it names the lock, and is no LockError (a caller's bug).
    assert isinstance(error, SynchronousOnlyOperation)
    assert not isinstance(error, distlocks.LockError)
    assert (error.name, error.alias) == (name, alias)
    assert str(error).startswith(f"Lock {name!r} on {alias!r} cannot be acquired by sync code inside a running")
    assert lk.hold_count == 0


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_refused_naming_its_own_async_form(alias, name, kind):
    make, names = KINDS[kind]
    sync = make(name, alias)

    async def main():
        with pytest.raises(SyncLockInAsyncContext, match=names):
            sync.acquire()
        with pytest.raises(SyncLockInAsyncContext, match=names), sync:
            pass

    run(main())
    assert sync.hold_count == 0


@pytest.mark.parametrize("alias", ["default", "postgresql", "redis", "zookeeper", "locmem"], indirect=True)
def test_sync_code_run_in_a_thread_by_the_loop_takes_the_sync_lock(alias, name):
    """As Django runs a sync view under ASGI: in sync_to_async's one thread, each request in a context of its own."""
    lk = distlocks.lock(name, using=alias, wait=5)

    def take():
        with lk as held:
            return held.token

    async def request():
        return [await sync_to_async(take)(), await asyncio.to_thread(take)]

    tokens = run(request()) + run(request())
    # A loop running in another thread (async_to_sync's) leaves this thread sync.
    tokens += [async_to_sync(sync_to_async(take))(), take()]
    assert tokens == sorted(set(tokens))


@pytest.mark.parametrize("alias", ALIASES, indirect=True)
def test_django_allow_async_unsafe_allows_it_as_it_allows_djangos_own(alias, name, monkeypatch):
    """The thread locks before, inside and after its loop (on the databases: on one connection of its own)."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    lk = distlocks.lock(name, using=alias, wait=5)

    def take():
        with lk as held:
            return held.token

    async def main():
        return take()

    before = take()
    inside = run(main())
    assert before < inside < take()
    assert lk.hold_count == 0


def test_a_sync_lock_cannot_decorate_a_coroutine_function():
    """Its call only makes the coroutine, which would run after the release: unprotected. Said at decoration."""

    async def report():
        pass

    with pytest.raises(TypeError, match=r"coroutine function .*report: use `async with distlocks\.alock"):
        distlocks.lock("report", using="locmem")(report)
    with pytest.raises(TypeError, match=r"async with distlocks\.asemaphore"):
        distlocks.semaphore("report", 2, using="locmem")(report)
