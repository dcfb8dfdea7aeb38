"""A release or renewal that reaches the server late must not touch the same thread's next acquisition.

A release stuck on a frozen connection (a proxy holding its bytes) times out;
the lease runs out; the same thread (the same owner, the same secret) takes the
lock again on another connection; then the proxy thaws and the old statement
or script runs. It names the acquisition it meant (its row id or token), so it
finds nothing to free: the new hold stays, and no other owner gets in.
"""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
from django.db import connections
from django_redis import get_redis_connection

import distlocks
from distlocks.aiokinds import aread_write_lock
from distlocks.backends.redis.keys import keys_of_read_write_lock
from distlocks.handler import locks
from distlocks.owner import current_owner
from localservers import REDIS_PORT
from tests.conftest import DB, NATIVE_ALIASES
from tests.faults.conftest import behind_proxy, scripts_run
from tests.faults.test_core import until
from tests.faults.test_redis import proxied_alias
from tests.test_lock import in_thread

pytestmark = DB

servers = pytest.mark.parametrize("alias", ["mariadb", "postgresql"], indirect=True)


def make(kind, name, alias, ttl):
    """A lock of ``kind`` on ``name``: a plain lock, a read-write lock's side, a 1-permit semaphore, a multi-lock."""
    if kind == "lock":
        return distlocks.lock(name, using=alias, ttl=ttl, renew=False)
    if kind in ("read", "write"):
        return getattr(distlocks.read_write_lock(name, using=alias, ttl=ttl, renew=False), kind)()
    if kind == "permit":
        return distlocks.semaphore(name, 1, using=alias, ttl=ttl, renew=False)
    return distlocks.multi_lock([f"{name}-a", f"{name}-b"], using=alias, ttl=ttl, renew=False)


def taken_by_another_owner(kind, name, alias):
    """Whether another thread takes at once what ``kind`` excludes (a writer, for a read hold); it gives it back."""

    def take():
        other = make("write" if kind == "read" else kind, name, alias, 30)
        if not other.acquire(wait=0):
            return False
        other.release()
        return True

    return in_thread(take)


def server_side_ports(proxy):
    """The ports of the proxy's connections to the server, as the server sees them (its sessions' client ports)."""
    return {sock.getsockname()[1] for sock in proxy.sockets[2::2]}


def session_ports(alias):
    """The client ports of the sessions open on ``alias``'s server."""
    with connections[alias].cursor() as cursor:
        if connections[alias].vendor == "mysql":
            cursor.execute("SELECT HOST FROM information_schema.PROCESSLIST")
            return {int(host.rsplit(":", 1)[1]) for (host,) in cursor.fetchall() if host and ":" in host}
        cursor.execute("SELECT client_port FROM pg_stat_activity WHERE client_port IS NOT NULL")
        return {port for (port,) in cursor.fetchall()}


@servers
@pytest.mark.parametrize("kind", ["lock", "write", "read", "permit", "member"])
def test_a_release_that_reaches_the_table_late_leaves_the_same_threads_next_hold(alias, leave_nothing, name, kind):
    with behind_proxy(alias) as proxy:
        first = make(kind, name, "proxied", ttl=1)
        again = make(kind, name, alias, ttl=30)
        assert first.acquire(wait=0)
        with proxy.frozen():
            with pytest.raises(distlocks.BackendUnavailable):
                first.release()  # sent, and held by the proxy; its client gives up on the connection
            stale = server_side_ports(proxy)
            assert again.acquire(wait=10)  # on another connection, once the first lease has run out
        # Thawed: the old release runs, then its session ends.
        until(lambda: not stale & session_ports(alias), seconds=15)
        assert not taken_by_another_owner(kind, name, alias)
        again.release()  # LockLost if the late release had deleted it


@servers
@pytest.mark.parametrize("kind", ["lock", "write"])
def test_a_renewal_that_reaches_the_table_late_leaves_the_same_threads_next_lease(alias, leave_nothing, name, kind):
    """A renewal that arrives late would set the new hold's lease to the old one's ttl: another owner would
    get in long before the holder's watchdog renews it."""
    with behind_proxy(alias) as proxy:
        first = make(kind, name, "proxied", ttl=1)
        again = make(kind, name, alias, ttl=30)
        assert first.acquire(wait=0)
        backend = first._backend
        with proxy.frozen():
            with pytest.raises(distlocks.BackendUnavailable):
                backend.extend_token(first.key, current_owner(), 1, first.token)  # what the watchdog sends
            stale = server_side_ports(proxy)
            assert again.acquire(wait=10)  # once the first lease has run out
        until(lambda: not stale & session_ports(alias), seconds=15)
        lease_left = again.holder().lease_left()
        assert lease_left > 20, lease_left
        assert not taken_by_another_owner(kind, name, alias)
        again.release()
        with pytest.raises(distlocks.LockLost):
            first.release()


@pytest.mark.parametrize("alias", NATIVE_ALIASES, indirect=True)
def test_a_renewal_that_reaches_the_lease_table_late_leaves_the_same_threads_next_lease(alias, leave_nothing, name):
    """On GET_LOCK and advisory locks the lease is a row too: cut short by a late renewal, it would let a waiter
    end the new holder's session and take the lock while the holder believes it holds it."""
    database = connections[alias.removesuffix("_native")]
    with behind_proxy(alias) as proxy:
        if database.vendor == "mysql":  # known: else the test thread asks the proxied database, not in the test's
            locks["proxied"].in_memory = locks[alias].in_memory
        first = distlocks.lock(name, using="proxied", ttl=1, renew=False)
        again = distlocks.lock(name, using=alias, ttl=30, renew=False)
        assert first.acquire(wait=0)
        renew = functools.partial(first._backend.extend_token, first.key, current_owner(), 1, first.token)
        assert renew()  # renewals run on another session than the hold's: now one is open, idle
        with proxy.frozen():
            with pytest.raises(distlocks.BackendUnavailable):
                renew()
            stale = server_side_ports(proxy)
            assert again.acquire(wait=10)  # its lease ran out: the first hold's session is ended
        until(lambda: not stale & session_ports(database.alias), seconds=15)
        lease_left = again.holder().lease_left()
        assert lease_left > 20, lease_left
        again.release()
        with pytest.raises(distlocks.LockLost):
            first.release()


# -- Redis read-write locks -------------------------------------------------------------------------------------


def rw_fields(side):
    """The hash of ``side``'s read-write lock, field by field."""
    return get_redis_connection("own").hgetall(keys_of_read_write_lock(side._backend.lock_key(side.key))[0])


def holds_token(side, token):
    """Whether the hash shows ``side``'s hold by the calling thread's owner with ``token``."""
    fields = rw_fields(side)
    if side._backend.mode == "write":
        return fields.get(b"wt") == str(token).encode()
    entry = fields.get(f"r:{current_owner().secret}".encode(), b"").split()
    return len(entry) > 2 and entry[2] == str(token).encode()


@pytest.mark.servers("redis")
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_side_release_that_reaches_redis_late_leaves_the_same_threads_next_hold(own_redis, settings, name, mode):
    server = own_redis(REDIS_PORT + 76 + (mode == "write"), SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    proxy = proxied_alias(settings, server)
    first = make(mode, name, "proxied", ttl=1)
    again = make(mode, name, "own", ttl=30)
    try:
        with again:
            pass  # the release script is loaded: the old release will run, not fail with NOSCRIPT
        assert first.acquire(wait=0)
        with proxy.frozen():
            with pytest.raises(distlocks.BackendUnavailable):
                first.release()
            assert again.acquire(wait=10)
            before = scripts_run(server)
        until(lambda: scripts_run(server) > before)  # thawed: the old release has run
        assert holds_token(again, again.token)
        assert not taken_by_another_owner(mode, name, "own")
        again.release()
    finally:
        proxy.close()


@pytest.mark.servers("redis")
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_side_renewal_that_reaches_redis_late_leaves_the_same_threads_next_lease(own_redis, settings, name, mode):
    server = own_redis(REDIS_PORT + 78 + (mode == "write"), SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    proxy = proxied_alias(settings, server)
    first = make(mode, name, "proxied", ttl=1)
    again = make(mode, name, "own", ttl=30)
    try:
        assert not again.extend_detached(1)  # the renewal's script is loaded: it will run late, not fail
        assert first.acquire(wait=0)
        with proxy.frozen():
            with pytest.raises(distlocks.BackendUnavailable):
                first._backend.extend_token(first.key, current_owner(), 1, first.token)
            assert again.acquire(wait=10)
            before = scripts_run(server)
        until(lambda: scripts_run(server) > before)  # thawed: the old renewal has run
        assert again.holder().lease_left() > 20
        assert not taken_by_another_owner(mode, name, "own")
        again.release()
        with pytest.raises(distlocks.LockLost):
            first.release()
    finally:
        proxy.close()


@pytest.mark.servers("redis")
def test_an_async_side_release_that_reaches_redis_late_leaves_the_same_tasks_next_hold(own_redis, settings, name):
    """``aread_write_lock`` releases on the event loop's own client, with the side's script: the same fault."""
    server = own_redis(REDIS_PORT + 86, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    proxy = proxied_alias(settings, server)

    async def scenario():
        first = aread_write_lock(name, using="proxied", ttl=1, renew=False).write()
        again = aread_write_lock(name, using="own", ttl=30, renew=False).write()
        async with again:
            pass
        assert await first.acquire(wait=0)
        with proxy.frozen():
            with pytest.raises(distlocks.BackendUnavailable):
                await first.release()
            assert await again.acquire(wait=10)
            before = scripts_run(server)
        deadline = time.monotonic() + 15
        while scripts_run(server) == before:  # thawed: the old release runs
            assert time.monotonic() < deadline, "the old release never ran"
            await asyncio.sleep(0.02)
        assert holds_token(again.lock, again.token)
        assert not taken_by_another_owner("write", name, "own")
        await again.release()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        proxy.close()
