"""An async lock's wait on Redis: queued as a thread waits, woken by the event loop's pub/sub reader.

The attempts run the same scripts as a thread's, in the async lock's pool;
only the wait is the loop's. An async waiter joins the lock's queue like a
waiting thread, so that a release hands the lock to threads and tasks in the
order they queued, and the loop reads the hand-over from a pub/sub connection
of its own (``redis.asyncio``): no thread and no polling while a task waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import weakref
from collections.abc import Callable
from typing import Any, cast

from distlocks.backends.base import AsyncTurn, BaseLockBackend
from distlocks.backends.redis.handover import Silence, Waiter, give_back, pass_on
from distlocks.backends.redis.keys import keys_of_read_write_lock, lock_hash
from distlocks.backends.redis.protocol import QueuingBackend
from distlocks.backends.redis.scripts import Attempt
from distlocks.backends.redis.server import driver_errors, settings_of
from distlocks.owner import Owner

logger = logging.getLogger(__name__)


def async_client(client: Any, **where: Any) -> Any:
    """An asyncio client to the server of the sync ``client`` (or, ``where`` a host and port, to another node of
    its cluster), with its address, credentials, timeouts and pool size.

    When all its connections are busy, a call waits for one (at most its
    SOCKET_TIMEOUT) instead of failing: many tasks on one loop share them.
    """
    import redis.asyncio

    pool = client.connection_pool
    settings = {**settings_of(pool), **where}
    connection_class = getattr(redis.asyncio.connection, pool.connection_class.__name__)
    return redis.asyncio.Redis(
        connection_pool=redis.asyncio.BlockingConnectionPool(
            connection_class=connection_class,
            max_connections=pool.max_connections,
            timeout=settings.get("socket_timeout"),
            **settings,
        )
    )


class AsyncWaiter(Waiter):
    """A task waiting for a lock: woken on the loop by the hand-over (or a resubscription)."""

    def __init__(self, channel: str, waiter_id: str) -> None:
        super().__init__(channel, waiter_id)
        self.woken = asyncio.Event()

    def awaken(self) -> None:
        self.woken.set()


class LoopReleases:
    """One event loop's client of one Redis, and its pub/sub connection read by one task that passes each hand-over on.

    Like the threads' ``Releases``, but read by the loop. The client also runs
    the loop's scripts (``redis.aio``). Both live as long as the loop: the
    reader task starts with them, subscribes once a task waits, and closes
    them when cancelled (``asyncio.run`` cancels it at the end).
    """

    def __init__(self, client: Any, listener: Any = None) -> None:
        self.client = client  # asyncio, for the scripts
        self.listener = listener or client  # the pub/sub connection's (closed with the reader)
        self.pubsub = self.listener.pubsub()
        process = secrets.token_hex(8)
        self.channel = f"distlocks:waiters:{process}"
        self.waiter_ids = (f"{process}.{n}" for n in itertools.count(1))  # unique across processes
        self.waiters: dict[str, Any] = {}
        self.subscribed = asyncio.Event()
        self.wanted = asyncio.Event()  # a task waits: subscribe
        self.reader = asyncio.get_running_loop().create_task(self._read(), name="distlocks-releases")
        self.broken = False
        self.silence = Silence(self.listener)

    async def enlist(self, lock_hash: str, waiter: AsyncWaiter | None = None) -> AsyncWaiter:
        """A waiter for the lock whose hash is ``lock_hash`` (any lock: the loop's channel tells them all)."""
        self.wanted.set()
        waiter = waiter or AsyncWaiter(self.channel, next(self.waiter_ids))
        waiter.home = self
        self.waiters[waiter.id] = waiter
        return waiter

    def ready(self, waiter: AsyncWaiter) -> bool:
        return self.subscribed.is_set()

    def current(self, waiter: AsyncWaiter) -> bool:
        return True

    def discharge(self, waiter: AsyncWaiter) -> None:
        self.waiters.pop(waiter.id, None)

    def pubsubs(self) -> list[Any]:
        return [self.pubsub]

    async def _read(self) -> None:
        try:
            await self.wanted.wait()
            while True:
                await self._step()
        finally:
            with contextlib.suppress(Exception):
                await self._close()

    async def _close(self) -> None:
        await self.pubsub.aclose()
        await self.listener.aclose()

    async def _step(self) -> None:
        """Read one message (at most a second), and pass it on."""
        from redis.exceptions import RedisError

        try:
            await self._listen()
            if self.silence.dead():
                await self._reconnect()
            elif self.waiters and self.silence.to_ping():  # no traffic while no task waits
                await self.pubsub.ping()
            message = await self.pubsub.get_message(timeout=self.silence.read_for(1.0))
        except RedisError as exc:  # redis-py reconnects and resubscribes at the next read
            if not self.broken:  # once per outage, not at every read
                logger.warning("Redis release channel lost, reconnecting: %s", exc)
            self.broken = True
            await self._lost()
            await asyncio.sleep(0.5)
            return
        self.broken = False
        if message is not None:
            self.silence.heard()
            await self._pass_on(message)

    async def _listen(self) -> None:
        """Subscribe the loop's channel (again, after a reconnect)."""
        if not self.pubsub.subscribed:
            await self.pubsub.subscribe(self.channel)

    async def _reconnect(self) -> None:
        """Drop a connection presumed dead: the read below reconnects and resubscribes."""
        await self.pubsub.connection.disconnect()

    async def _lost(self) -> None:
        """The connection broke: redis-py reconnects and resubscribes at the next read."""

    def handle(self, message: dict[str, Any]) -> tuple[str, str] | None:
        return pass_on(message, self.waiters, self.subscribed)

    async def _pass_on(self, message: dict[str, Any]) -> None:
        gone = self.handle(message)
        if gone is not None:
            with contextlib.suppress(*driver_errors()):
                await give_back(self.client, gone)


# Per event loop, per cache alias and server: a ``LoopReleases``, or a cluster's ``aioshards.LoopShardReleases``.
_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], Any]] = weakref.WeakKeyDictionary()


def _forget_loops_after_fork() -> None:
    """Drop the parent's pub/sub sockets in a forked child, which subscribes anew.

    Left open, they would make Redis count the parent's channels as listened to
    after the parent died, and hand locks to its dead waiters. The child runs
    no loop to close them on: each socket's copy here is replaced by /dev/null,
    which closes it for the child alone and leaves its number valid for the
    transport that closes it when collected.
    """
    for servers in list(_loops.values()):
        for releases in servers.values():
            for pubsub in releases.pubsubs():
                writer = getattr(pubsub.connection, "_writer", None)  # redis-py keeps no other handle
                sock = None if writer is None else writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        devnull = os.open(os.devnull, os.O_RDWR)
                        os.dup2(devnull, sock.fileno())
                        os.close(devnull)
    _loops.clear()


os.register_at_fork(after_in_child=_forget_loops_after_fork)


def loop_releases(server: tuple[str, str], make: Callable[[], Any]) -> Any:
    """The running loop's hand-overs from ``server`` (cache alias, address), made on first use by ``make()``."""
    servers = _loops.setdefault(asyncio.get_running_loop(), {})
    releases = servers.get(server)
    if releases is None or releases.reader.done():
        releases = servers[server] = make()
    return releases


async def _until(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


class RedisTurn(AsyncTurn):
    """A task's wait for one lock (or, with ``mode``, a read-write lock's side) on Redis, as ``RedisBackend.wait`` does a thread's."""

    def __init__(self, backend: QueuingBackend, key: str, mode: str = "") -> None:
        self.backend = backend
        self.key = key
        self.mode = mode
        self.slot = keys_of_read_write_lock(key)[0] if mode else key  # where an attempt leaves its hint
        self.lock_hash = self.slot if mode else lock_hash(key)
        self.releases: Any = None  # the loop's LoopReleases, or a cluster's LoopShardReleases
        self.waiter: AsyncWaiter | None = None
        self.hint = 1.0  # how long the last attempt said to wait at most

    def try_acquire(self, backend: BaseLockBackend, key: str, owner: Owner, ttl: float) -> int | None:
        # The pool thread's RedisBackend, or a read-write lock's side on it (RedisSide).
        redis = cast(QueuingBackend, getattr(backend, "backend", backend))
        return self.attempted(redis, redis.run(self.attempt(redis, key, owner, ttl)))

    def attempt(self, redis: QueuingBackend, key: str, owner: Owner, ttl: float) -> Attempt:
        """The steps of one attempt as this waiter, to run in a thread or on the loop."""
        if self.mode:
            return redis.rw_attempt(self.key, owner, ttl, self.mode, self.waiter)
        return redis.attempt(key, owner, ttl, self.waiter)

    def attempted(self, redis: QueuingBackend, token: int | None) -> int | None:
        """Keep how long the attempt that gave ``token`` said to wait at most."""
        self.hint = redis.wait_hint(self.slot)
        return token

    async def wait(self, attempt: int, remaining: float | None) -> None:
        """The first wait subscribes the loop's channel, so the next attempt queues; later ones wait for the turn.

        On a cluster a waiter whose lock's slot moved subscribes anew first (see ``shards``).
        """
        waiter = self.waiter
        try:
            if waiter is None or not self.releases.current(waiter):
                self.releases = releases = loop_releases(self.backend.server, self.backend.new_loop_releases)
                self.waiter = waiter = await releases.enlist(self.lock_hash, waiter)
                subscribing = True
            else:
                subscribing = not self.releases.ready(waiter)
        except driver_errors() as exc:
            raise self.backend.unavailable(exc) from exc
        if subscribing:  # the next attempt queues it: a release must find it listening
            deadline = asyncio.get_running_loop().time() + (1.0 if remaining is None else min(remaining, 1.0))
            while not self.releases.ready(waiter) and (left := deadline - asyncio.get_running_loop().time()) > 0:
                await _until(waiter.woken, left)
                waiter.woken.clear()
        else:
            await _until(waiter.woken, self.hint if remaining is None else min(self.hint, remaining))
            waiter.woken.clear()
        waiter.retry = False

    def end(self, acquired: bool) -> Callable[[BaseLockBackend], None] | None:
        waiter = self.waiter
        if waiter is None or self.releases is None:
            return None
        self.releases.discharge(waiter)
        if acquired or not waiter.entry:
            return None
        key, mode = self.key, self.mode

        def leave(backend: BaseLockBackend) -> None:
            cast(QueuingBackend, backend).leave_queue(key, waiter, mode)

        return leave
