"""An async waiter on ZooKeeper: one queued node for the whole acquire, as a waiting thread has, woken by a watch."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from distlocks.backends.base import AsyncTurn, BaseLockBackend
from distlocks.owner import Owner


class _Queue(Protocol):
    """What the turn uses of ``ZooKeeperBackend`` (a thread's instance)."""

    _queued: dict[str, tuple[str, int]]

    def _request(self, operation: str, *args: Any, limit: float | None = None, **kwargs: Any) -> Any: ...

    def blocker(self, key: str) -> str | None: ...

    def leave_by(self, node: str, ends: float | None) -> None: ...


class ZooKeeperTurn(AsyncTurn):
    """A task's wait for a lock, or for a read-write lock's side, on ZooKeeper.

    A waiting thread's node stays queued from its first attempt to the end
    of its acquire, in its backend instance's ``_queued``. A task's attempts
    run in whichever pool thread is free, each with that thread's instance
    (``ZooKeeperBackend`` or its ``ZooKeeperSide``), so the node travels with
    the turn: put in the instance's ``_queued`` for the attempt and taken
    back after it. It keeps the task's place: a writer task that waits
    blocks the readers that come after it, and waiters are served in the
    order they queued, tasks and threads alike. After a failed attempt but
    the first (an acquire with ``wait=0`` sets no watch; the first wait is
    the core's backoff, a few ms) the pool thread watches the node that
    keeps ours waiting, as ``wait`` does, and the watch wakes the loop; it
    looks again every second at least (a lost session). ``end`` deletes the
    node of a task that gave up or was cancelled, within CONNECT_TIMEOUT of
    the end of its wait (else in the background).
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.queued: tuple[str, int] | None = None  # our node and its token, between attempts
        self.loop = asyncio.get_running_loop()
        self.changed = asyncio.Event()
        self.tried = False
        self.watching = False  # whether the last failed attempt set a watch
        self.ends: float | None = time.monotonic()  # when the acquire's wait ends (None: never)

    def try_acquire(self, backend: BaseLockBackend, key: str, owner: Owner, ttl: float) -> int | None:
        zk = cast(_Queue, getattr(backend, "backend", backend))  # a side's, or the backend itself
        if self.queued is not None:
            zk._queued[key] = self.queued
        try:
            token = backend.try_acquire(key, owner, ttl)
            self.watching = token is None and self.tried
            self.tried = True
            if self.watching:
                blocker = cast(_Queue, backend).blocker(key)
                if blocker is None or zk._request("exists", blocker, watch=self._wake) is None:
                    self._wake()
            return token
        finally:
            # The node is the turn's until its acquire ends (the core's end_wait finds none to delete).
            self.queued = zk._queued.pop(key, None)

    def _wake(self, event: object = None) -> None:
        """Wake the waiting task (called in any thread: kazoo's, when the watched node changes)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: no task waits any more
            self.loop.call_soon_threadsafe(self.changed.set)

    async def wait(self, attempt: int, remaining: float | None) -> None:
        self.ends = None if remaining is None else time.monotonic() + remaining
        if not self.watching:
            await super().wait(attempt, remaining)
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.changed.wait(), 1.0 if remaining is None else min(remaining, 1.0))
        self.changed.clear()

    def end(self, acquired: bool) -> Callable[[BaseLockBackend], None] | None:
        queued, self.queued = self.queued, None
        if acquired or queued is None:
            return None
        node, ends = queued[0], self.ends

        def leave(backend: BaseLockBackend) -> None:
            cast(_Queue, backend).leave_by(node, ends)

        return leave
