"""The other lock kinds for asyncio code: ``asemaphore()``, ``amulti_lock()``, ``aread_write_lock()``.

Each wraps the sync kind (``Semaphore``, ``MultiLock``, ``ReadWriteLock``)
and runs its steps that never wait in the async locks' pool, acting as the
calling task (``aio.in_pool``), while every wait is an ``AsyncDistributedLock``'s
on one of its member locks: on the event loop, holding no thread, and leaving
nothing behind when the task is cancelled. Ownership belongs to the task.
"""

from __future__ import annotations

import contextlib

from distlocks.aio import (
    AsyncDistributedLock,
    AsyncLockAPI,
    TaskView,
    attempt_or_undo,
    finish,
    finish_or_undo,
    in_pool,
)
from distlocks.backends.arguments import check_wait
from distlocks.backends.base import deadline_after, time_left
from distlocks.exceptions import LockNotAcquired
from distlocks.handler import DEFAULT_ALIAS
from distlocks.lock import DistributedLock
from distlocks.lockapi import _DEFAULT
from distlocks.multi import MultiLock
from distlocks.rwlock import ReadWriteLock
from distlocks.semaphore import Semaphore


class AsyncSemaphore(AsyncLockAPI):
    """``Semaphore`` for asyncio code: at most ``permits`` holders (tasks or threads) of ``name`` at once.

    The same semaphore as ``semaphore()`` with the same name, permits and
    alias; a task holds at most one permit of it (again: one more hold).
    """

    def __init__(
        self,
        name: str,
        permits: int,
        *,
        using: str = DEFAULT_ALIAS,
        ttl: float | None = None,
        wait: float | None = None,
        renew: bool = True,
    ) -> None:
        self.sync = Semaphore(name, permits, using=using, ttl=ttl, wait=wait, renew=renew)
        self.name, self.permits, self.alias, self.wait = name, permits, using, self.sync.wait
        self.queue = AsyncDistributedLock.of(self.sync.queue)

    def __repr__(self) -> str:
        return f"<AsyncSemaphore {self.name!r} permits={self.permits} using={self.alias!r} wait={self.wait}>"

    def _not_acquired(self, wait: float | None) -> LockNotAcquired:
        return self.sync._not_acquired(wait)

    slot = TaskView[int]("Which permit the calling task holds; raise LockNotOwned if none.")
    token = TaskView[int]("The fencing token of the calling task's permit; raise LockNotOwned if it holds none.")
    hold_count = TaskView[int]("How many times the calling task holds its permit (0: none).")
    lost = TaskView[bool]("True if the calling task's permit was lost.")

    async def acquire(self, wait: float | None = _DEFAULT) -> bool:
        """Take a permit, waiting at most ``wait`` seconds on the loop; return True if one was taken.

        As ``Semaphore.acquire``: the first in the semaphore's queue waits on
        each permit in turn. A cancelled task leaves no permit and no place in the queue.
        """
        sem = self.sync
        wait = sem.wait if wait is _DEFAULT else check_wait(wait)
        deadline = deadline_after(wait)
        order = await attempt_or_undo(in_pool(sem._try_first, wait), sem.release)
        if isinstance(order, bool):
            return order
        if not await self.queue.acquire(wait=time_left(deadline)):
            return False
        taken = False
        try:
            attempt = 0
            while True:
                step = await attempt_or_undo(in_pool(sem._next_wait, order, attempt, deadline), sem.release)
                if isinstance(step, bool):
                    taken = step
                    return step
                taken = await AsyncDistributedLock.of(step[0]).acquire(wait=step[1])
                if taken:
                    return True
                attempt += 1
        finally:
            await finish_or_undo(in_pool(sem._leave_queue), taken, sem.release)

    async def release(self) -> None:
        """Release one hold of the calling task's permit (see ``Semaphore.release``)."""
        await finish(in_pool(self.sync.release))


class AsyncMultiLock(AsyncLockAPI):
    """``MultiLock`` for asyncio code: several locks held by the task all together or not at all."""

    def __init__(
        self,
        names: list[str] | tuple[str, ...],
        *,
        using: str = DEFAULT_ALIAS,
        ttl: float | None = None,
        wait: float | None = None,
        renew: bool = True,
    ) -> None:
        self.sync = MultiLock(names, using=using, ttl=ttl, wait=wait, renew=renew)
        self.names, self.alias, self.wait = self.sync.names, using, self.sync.wait
        self.members = [AsyncDistributedLock.of(lk) for lk in self.sync.locks]

    def __repr__(self) -> str:
        return f"<AsyncMultiLock {list(self.names)!r} using={self.alias!r} wait={self.wait}>"

    def _not_acquired(self, wait: float | None) -> LockNotAcquired:
        return self.sync._not_acquired(wait)

    tokens = TaskView[dict[str, int]](
        "Each member's fencing token, by name; LockNotOwned if the task does not hold the set."
    )
    token = TaskView[tuple[int, ...]]("The members' fencing tokens in ``names`` order (sorted).")
    hold_count = TaskView[int]("How many times the calling task holds the whole set (0: not held).")
    lost = TaskView[bool]("True if the calling task holds the set and any member's lease was lost.")

    async def acquire(self, wait: float | None = _DEFAULT) -> bool:
        """Take every member in sorted order within ``wait`` seconds in all, on the loop; return True if all were taken.

        Otherwise (and if the task is cancelled) those taken are released again.
        """
        wait = self.wait if wait is _DEFAULT else check_wait(wait)
        deadline = deadline_after(wait)
        taken: list[DistributedLock] = []
        try:
            for member in self.members:
                if not await member.acquire(wait=time_left(deadline)):
                    break
                taken.append(member.lock)
            else:
                return True
        except BaseException:
            with contextlib.suppress(Exception):
                await finish(in_pool(self.sync._release_all, taken))
            raise
        await finish(in_pool(self.sync._release_all, taken))
        return False

    async def release(self) -> None:
        """Release one hold of every member, the last taken first (see ``MultiLock.release``)."""
        await finish(in_pool(self.sync.release))


class AsyncReadWriteLock:
    """``ReadWriteLock`` for asyncio code: ``read()`` and ``write()`` are async locks held by tasks.

    The same lock as ``read_write_lock()`` with the same name and alias. A
    waiting writer task blocks new readers as a waiting thread does.
    """

    def __init__(
        self,
        name: str,
        *,
        using: str = DEFAULT_ALIAS,
        ttl: float | None = None,
        wait: float | None = None,
        renew: bool = True,
    ) -> None:
        self.rw = ReadWriteLock(name, using=using, ttl=ttl, wait=wait, renew=renew)
        self.name, self.alias, self.wait = name, using, self.rw.wait
        self._read = AsyncDistributedLock.of(self.rw.read())
        self._write = AsyncDistributedLock.of(self.rw.write())

    def __repr__(self) -> str:
        return f"<AsyncReadWriteLock {self.name!r} using={self.alias!r} wait={self.wait}>"

    def read(self) -> AsyncDistributedLock:
        """The read side: held by every reader at once, and no writer."""
        return self._read

    def write(self) -> AsyncDistributedLock:
        """The write side: held by one writer, and no reader (ValueError for a task that reads)."""
        return self._write


# The kinds' async forms are made as the sync ones are: ``asemaphore(name, permits, ...)`` and so on.
asemaphore = AsyncSemaphore
amulti_lock = AsyncMultiLock
aread_write_lock = AsyncReadWriteLock
