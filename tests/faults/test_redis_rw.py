"""A read-write lock's acquire on Redis whose answer was lost: its script, run after the client gave up, is voided."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from django_redis import get_redis_connection

import distlocks
from distlocks.backends.redis import strays
from localservers import REDIS_PORT
from tests.conftest import DB, taken_by_another_thread
from tests.faults.conftest import frozen

pytestmark = [DB, pytest.mark.servers("redis")]

OTHER = {"read": "write", "write": "read"}


def voided(name):
    """Wait until this process has voided every acquire of ``name`` whose answer it lost (the server answered)."""
    deadline = time.monotonic() + 30
    while any(name in stray.keys[0] for stray in strays.pending()):
        assert time.monotonic() < deadline, "the lost acquires were not voided"
        time.sleep(0.02)


def timed_out_acquire(server, side):
    """Send ``side``'s acquire to the frozen ``server``: the client gives up after its 0.5 s socket timeout,
    and the server runs the script once it goes on."""
    with frozen(server), pytest.raises(distlocks.BackendUnavailable):
        side.acquire(wait=0)
    assert side.hold_count == 0


def taken_elsewhere(name, mode, wait):
    """Whether another thread (another owner) takes the ``mode`` side within ``wait`` seconds; it gives it back."""
    return taken_by_another_thread(getattr(distlocks.read_write_lock(name, using="own", ttl=30), mode)(), wait)


def rw_hash(name):
    """The read-write lock's hash on the test's own server (the only one there)."""
    (found,) = get_redis_connection("own").keys(f"*{name}*:rw")
    return found


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_side_taken_by_an_acquire_run_after_its_client_gave_up_is_given_back(own_redis, name, mode):
    server = own_redis(REDIS_PORT + 64 + (mode == "write"), SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    side = getattr(distlocks.read_write_lock(name, using="own", ttl=30), mode)()
    with side:
        pass  # its connection is open: the frozen server's kernel takes the request, run when the server goes on
    timed_out_acquire(server, side)
    # Before the fix, the script took the side for 30 s for an owner told it did not get it.
    assert taken_elsewhere(name, OTHER[mode], wait=5)
    voided(name)
    assert side.acquire(wait=0)  # the same owner too
    side.release()


def test_a_task_whose_side_acquire_timed_out_leaves_no_hold_once_the_server_answers(own_redis, name):
    server = own_redis(REDIS_PORT + 66, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)

    async def main():
        write = distlocks.aread_write_lock(name, using="own", ttl=30).write()
        assert await write.acquire(wait=0)  # a connection is open: the frozen server's kernel takes the request
        await write.release()
        with frozen(server), pytest.raises(distlocks.BackendUnavailable):
            await write.acquire(wait=0)
        # Another owner (a thread: a task of this one shares its owner, and may read) reads.
        assert await asyncio.to_thread(taken_elsewhere, name, "read", 5)  # before the fix: after the 30 s lease

    asyncio.run(main())


def test_a_lost_downgrade_leaves_the_owners_write_hold(own_redis, name):
    """The writer's read acquire (a downgrade) is lost: its void gives back the read hold it took, and leaves the
    write hold the owner had, with its count and token."""
    server = own_redis(REDIS_PORT + 67, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    rw = distlocks.read_write_lock(name, using="own", ttl=30)
    write, read = rw.write(), rw.read()
    assert write.acquire(wait=0)
    write.acquire()  # held twice
    token = write.token
    timed_out_acquire(server, read)
    voided(name)
    fields = {k.decode(): v.decode() for k, v in get_redis_connection("own").hgetall(rw_hash(name)).items()}
    assert (fields["wt"], fields["wc"]) == (str(token), "2")
    assert not any(field.startswith("r:") for field in fields)  # the read hold it took is gone
    assert not taken_elsewhere(name, "read", wait=0)
    write.release()
    write.release()  # no LockLost: the hold was never taken away
    # Before the fix, the stray read hold kept writers out for 30 s.
    assert taken_elsewhere(name, "write", wait=5)


def test_a_lost_read_acquire_leaves_the_other_readers(own_redis, name):
    server = own_redis(REDIS_PORT + 68, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    rw = distlocks.read_write_lock(name, using="own", ttl=30)
    reader = distlocks.read_write_lock(name, using="own", ttl=30).read()
    holding, done = threading.Event(), threading.Event()

    def hold():
        with reader:
            holding.set()
            done.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(30)
        read = rw.read()
        assert read.acquire(wait=0)  # opens the connection
        read.release()
        timed_out_acquire(server, read)
        voided(name)
        readers = [f for f in get_redis_connection("own").hkeys(rw_hash(name)) if f.startswith(b"r:")]
        assert len(readers) == 1  # the other owner's
        assert not taken_elsewhere(name, "write", wait=0)
    finally:
        done.set()
        thread.join(30)
    assert taken_elsewhere(name, "write", wait=5)
