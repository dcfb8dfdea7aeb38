"""The Redis backend on Django's own cache (``django.core.cache.backends.redis.RedisCache``): every kind, the hand-over.

The alias "redis_django" reaches the tests' Redis through Django's RedisCache,
"redis" the same server through django-redis: both must see the same locks.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
import redis

import distlocks
from distlocks.backends.redis.keys import keys_of_lock, keys_of_read_write_lock
from distlocks.inspection import force_release, held_locks
from localservers import REDIS_PORT

from .conftest import DB, Holder, taken_by_another_thread, wait_until

pytestmark = [DB, pytest.mark.servers("redis")]

ALIAS = "redis_django"
RS = "distlocks.backends.redis.RedisBackend"


def queued(key, rw=False):
    """Whether a waiter is in the queue of the lock ``key`` (of the read-write lock's name), as the server has it."""
    queue = keys_of_read_write_lock(f"rw:{key}")[2] if rw else keys_of_lock(key)[2]
    with redis.Redis(port=REDIS_PORT) as client:
        return client.zcard(queue) >= 1


def test_a_lock_through_djangos_cache_is_the_same_lock_as_through_django_redis(name):
    lk = distlocks.lock(name, using=ALIAS)
    assert lk.acquire(wait=0)
    first = lk.token
    assert lk.acquire(wait=0)  # re-entered
    assert lk.hold_count == 2
    assert not taken_by_another_thread(distlocks.lock(name, using=ALIAS))
    assert not taken_by_another_thread(distlocks.lock(name, using="redis"))  # the same server, through django-redis
    lk.release()
    assert not taken_by_another_thread(distlocks.lock(name, using="redis"))
    lk.release()
    with distlocks.lock(name, using="redis", wait=0) as other:
        assert other.token > first
    with pytest.raises(distlocks.LockNotOwned):
        lk.release()


def test_a_waiter_is_handed_the_lock_by_the_release(name):
    holder = distlocks.lock(name, using=ALIAS)
    holder.acquire()
    held = holder.token
    got = {}

    def wait_for_it():
        with distlocks.lock(name, using=ALIAS, wait=20) as lk:
            got["at"], got["token"] = time.monotonic(), lk.token

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    wait_until(lambda: queued(holder.key))
    released = time.monotonic()
    holder.release()
    thread.join(20)
    assert got["token"] > held
    assert got["at"] - released < 1  # handed over: the lease (30 s) did not run out


def test_read_write_lock(name):
    rw = distlocks.read_write_lock(name, using=ALIAS)
    readers = [Holder(name, lock=rw.read()) for _ in range(2)]  # two readers at once
    assert not taken_by_another_thread(rw.write())
    got = {}

    def write():
        with distlocks.read_write_lock(name, using=ALIAS, wait=20).write() as writer:
            got["at"], got["token"] = time.monotonic(), writer.token

    thread = threading.Thread(target=write)
    thread.start()
    wait_until(lambda: queued(name, rw=True))
    assert not taken_by_another_thread(rw.read())  # a waiting writer keeps new readers out
    for reader in readers:
        assert reader.release() is None
    released = time.monotonic()
    thread.join(20)
    assert got["at"] - released < 1
    assert got["token"] > max(reader.token for reader in readers)


def test_semaphore(name):
    sem = distlocks.semaphore(name, 2, using=ALIAS)
    holders = [Holder(name, lock=sem) for _ in range(2)]
    assert {holder.token for holder in holders} == {holders[0].token, holders[1].token}  # two permits
    assert not taken_by_another_thread(sem)
    assert holders[0].release() is None
    with distlocks.semaphore(name, 2, using=ALIAS, wait=0) as permit:
        assert permit.token > 0
    assert holders[1].release() is None


def test_multi_lock(name):
    names = [f"{name}-a", f"{name}-b"]
    with distlocks.multi_lock(names, using=ALIAS, wait=0) as both:
        assert len(both.token) == 2
        assert not taken_by_another_thread(distlocks.lock(names[1], using=ALIAS))
        assert not taken_by_another_thread(distlocks.lock(names[0], using="redis"))
    assert taken_by_another_thread(distlocks.lock(names[1], using=ALIAS))


def test_alock_excludes_a_thread_and_is_handed_the_lock(name):
    holder = Holder(name, ALIAS)

    async def take(lk):
        async with lk:  # ownership is the task's: it reads its token itself
            return time.monotonic(), lk.token

    async def main():
        lk = distlocks.alock(name, using=ALIAS, wait=20)
        assert not await lk.acquire(wait=0)
        waiting = asyncio.create_task(take(lk))
        await asyncio.to_thread(wait_until, lambda: queued(holder.lock.key))
        released = time.monotonic()
        await asyncio.to_thread(holder.release)
        took, token = await waiting
        return took - released, token

    took, token = asyncio.run(asyncio.wait_for(main(), 60))
    assert took < 1
    assert token > holder.token


def test_the_admin_lists_and_force_releases(name):
    lk = distlocks.lock(name, using=ALIAS)
    lk.acquire()
    [info] = [info for info in held_locks([ALIAS]).locks if info.key == lk.key]
    assert info.token == lk.token
    assert info.hold_count == 1
    assert force_release(ALIAS, lk.key)
    with distlocks.lock(name, using="redis", wait=0):
        pass
    with pytest.raises(distlocks.LockLost):
        lk.release()


def test_with_several_servers_locks_are_on_the_first(settings, name):
    first = f"redis://127.0.0.1:{REDIS_PORT}/3"
    settings.CACHES = {
        **settings.CACHES,
        "replicated": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": f"{first},redis://127.0.0.1:1/0",  # Django reads from the second, a replica (down here)
            "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 2},
        },
    }
    settings.DISTLOCKS = {"replicated": {"BACKEND": RS, "OPTIONS": {"CACHE": "replicated"}}}
    lk = distlocks.lock(name, using="replicated")
    with lk:
        assert [info.key for info in held_locks(["replicated"]).locks] == [lk.key]
        import redis

        with redis.Redis.from_url(first) as on_first:
            assert on_first.hget(keys_of_lock(lk.key)[0], "token") == str(lk.token).encode()


def test_no_django_redis_is_needed(settings, monkeypatch, name):
    from distlocks.checks import check_distlocks

    monkeypatch.setitem(sys.modules, "django_redis", None)  # what an interpreter without it does on import
    settings.DISTLOCKS = {ALIAS: settings.DISTLOCKS[ALIAS]}  # the checks ping this alias only
    assert check_distlocks() == []
    with distlocks.lock(name, using=ALIAS, wait=0) as lk:
        assert lk.token > 0


def test_no_password_shows_in_check_or_errors(settings):
    from io import StringIO

    from django.core.management import call_command

    secrets = ["hunter2-first", "hunter2-second", "hunter2-third"]
    settings.CACHES = {
        **settings.CACHES,
        "secret": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            # Nothing listens there. Django splits LOCATION at ';' or ','.
            "LOCATION": f"redis://:{secrets[0]}@127.0.0.1:1/0;redis://locks:{secrets[1]}@127.0.0.1:1/1"
            f",redis://127.0.0.1:1/2?password={secrets[2]}",
            "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
        },
    }
    settings.DISTLOCKS = {"secret": {"BACKEND": RS, "OPTIONS": {"CACHE": "secret"}}}
    out, err = StringIO(), StringIO()
    call_command("check", tags=["distlocks"], stdout=out, stderr=err)
    printed = out.getvalue() + err.getvalue()
    assert (
        "Is it running at redis://:***@127.0.0.1:1/0, redis://locks:***@127.0.0.1:1/1, "
        "redis://127.0.0.1:1/2?password=***?" in printed
    )
    with pytest.raises(distlocks.BackendUnavailable) as info:
        distlocks.lock("x", using="secret").acquire(wait=0)
    assert "Redis of cache 'secret' (redis://:***@127.0.0.1:1/0, " in str(info.value)
    assert not [secret for secret in secrets if secret in printed + str(info.value)]
