"""Read-write lock: many readers or one writer, across processes.

``read_write_lock("doc:7")`` is stored as ``rw:doc:7`` on its backend. Its two
sides, ``read()`` and ``write()``, are ``DistributedLock``s built on the
backend's read-write primitives (``rw_acquire`` and friends) instead of its
mutex ones, so that each side gets what the lock gives: a lease renewed by the
watchdog (on ZooKeeper, the session), ``LockLost``, a fencing token per
acquisition, re-entry per thread, ``BackendUnavailable`` in bounded time.

A writer that waits is recorded on the server and blocks new readers, so a
stream of readers never starves it (the writer preference of Java's
``ReentrantReadWriteLock`` in its fair mode, and of Curator's and kazoo's
recipes). The thread that holds the write side may take the read side too (a
downgrade: release the write side then, and it goes on reading); a thread that
holds the read side and asks for the write side gets ValueError at once: two
such readers would wait for each other for ever.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from distlocks.backends.base import AsyncTurn, BaseLockBackend, LockInfo, check_name_and_alias
from distlocks.exceptions import BackendUnavailable
from distlocks.handler import DEFAULT_ALIAS, locks
from distlocks.holds import holds
from distlocks.lock import DistributedLock
from distlocks.owner import Owner

#: The prefix of a read-write lock's name on its backend (as ``sem:`` is the semaphore's).
PREFIX = "rw:"
READ, WRITE = "read", "write"


class _Side(BaseLockBackend):
    """A backend's read-write primitives for one side, under the names the core calls.

    The core keeps a thread's holds by key: each side's key is the lock's key
    and a suffix (``#read``, ``#write``), which this strips before asking the backend.
    """

    def __init__(self, backend: BaseLockBackend, mode: str) -> None:  # noqa: D107 (no BaseLockBackend set-up)
        self.backend = backend
        self.mode = mode
        self.alias = backend.alias
        self.suffix = f"#{mode}"
        self.session_bound = backend.session_bound

    def _key(self, key: str) -> str:
        return key[: -len(self.suffix)]

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        return self.backend.rw_acquire(self._key(key), owner, ttl, self.mode)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return self.backend.rw_reenter(self._key(key), owner, ttl, self.mode)

    def release(self, key: str, owner: Owner) -> bool:
        return self.backend.rw_release(self._key(key), owner, self.mode)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self.backend.rw_extend(self._key(key), owner, ttl, self.mode)

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        self.backend.rw_wait(self._key(key), self.mode, attempt, remaining)

    def begin_wait(self, key: str) -> None:
        self.backend.rw_begin_wait(self._key(key), self.mode)

    def end_wait(self, key: str, acquired: bool) -> None:
        self.backend.rw_end_wait(self._key(key), self.mode, acquired)

    def drop(self, key: str, owner: Owner) -> bool:
        return self.backend.rw_drop(self._key(key), owner, self.mode)

    def holder(self, key: str) -> LockInfo | None:
        return self.backend.rw_holder(self._key(key), self.mode)

    def async_turn(self, key: str) -> AsyncTurn:
        return self.backend.rw_async_turn(self._key(key), self.mode) or SideTurn(self._key(key), self.mode)


class SideTurn(AsyncTurn):
    """An async acquire of a read-write lock's side: a writer that waits stays recorded as waiting.

    A waiting thread's record lasts from ``begin_wait`` to ``end_wait`` on its
    backend instance; a task's attempts run in any pool thread, each on that
    thread's instance. So each attempt after the first wait records the writer
    (renewing the record's lease), keeps the record past the attempt
    (``rw_keep_waiting``), and the end of an acquire that gave up deletes it.
    """

    def __init__(self, key: str, mode: str) -> None:
        self.key = key  # the read-write lock's, without the side's suffix
        self.mode = mode
        self.waiting = False
        self.secret = ""  # of the writer recorded as waiting, if it was

    def try_acquire(self, backend: BaseLockBackend, key: str, owner: Owner, ttl: float) -> int | None:
        if not self.waiting:
            return backend.try_acquire(key, owner, ttl)
        assert isinstance(backend, _Side)
        backend.begin_wait(key)
        try:
            return backend.try_acquire(key, owner, ttl)
        finally:
            self.secret = backend.backend.rw_keep_waiting(self.key, self.mode) or self.secret

    async def wait(self, attempt: int, remaining: float | None) -> None:
        self.waiting = True
        await super().wait(attempt, remaining)

    def end(self, acquired: bool) -> Callable[[BaseLockBackend], None] | None:
        key, secret = self.key, self.secret
        if acquired or not secret:
            return None  # a writer that got the lock is no longer recorded waiting

        def abandon(backend: BaseLockBackend) -> None:
            with contextlib.suppress(BackendUnavailable):  # else the record's lease runs out
                backend.rw_abandon(key, secret)

        return abandon


def side(backend: BaseLockBackend, mode: str) -> BaseLockBackend:
    """``backend``'s primitives for the ``mode`` side, made once per backend instance (one per thread)."""
    sides: dict[str, _Side] | None = getattr(backend, "_distlocks_rw_sides", None)
    if sides is None:
        sides = backend._distlocks_rw_sides = {}  # type: ignore[attr-defined]
    found = sides.get(mode)
    if found is None:
        found = sides[mode] = _Side(backend, mode)
    return found


class ReadLock(DistributedLock):
    """The read side of a read-write lock: shared with every other reader."""

    noun = "Read lock"
    mode = READ
    read_key = ""  # the key of the read side's holds (set by ReadWriteLock)

    @classmethod
    def primitives(cls, backend: BaseLockBackend) -> BaseLockBackend:
        return side(backend, cls.mode)


class WriteLock(ReadLock):
    """The write side of a read-write lock: no reader and no other writer while it is held."""

    noun = "Write lock"
    mode = WRITE

    def _acquire(
        self, wait: float | None, called: float, tell_not_acquired: bool = True, turn: AsyncTurn | None = None
    ) -> bool:
        """Acquire the write side (see ``DistributedLock.acquire``); ValueError if this thread (task) is reading."""
        if (self.alias, self.read_key) in holds() and (self.alias, self.key) not in holds():
            raise ValueError(
                self._message("is asked for by a thread that holds its read side: release the read lock first")
            )
        return super()._acquire(wait, called, tell_not_acquired, turn)


class ReadWriteLock:
    """A lock that many readers or one writer hold at once, across processes (see the module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        using: str = DEFAULT_ALIAS,
        ttl: float | None = None,
        wait: float | None = None,
        renew: bool = True,
    ) -> None:
        check_name_and_alias(name, using)
        backend = locks[using]
        if not backend.rw_supported:
            raise NotImplementedError(
                f"the {using!r} backend ({type(backend).__name__}) has no read-write locks: "
                "use the Redis, ZooKeeper, database table or LocMem backend"
            )
        self.name = name
        self.alias = using
        sides: dict[str, Any] = {"using": using, "ttl": ttl, "wait": wait, "renew": renew}
        self._read = ReadLock(PREFIX + name, **sides)
        self._write = WriteLock(PREFIX + name, **sides)
        self.key = self._read.key
        for lock in (self._read, self._write):
            lock.read_key = self.key + "#read"
            lock.key = self.key + f"#{lock.mode}"
        self.ttl = self._read.ttl
        self.wait = self._read.wait

    def __repr__(self) -> str:
        return f"<ReadWriteLock {self.name!r} using={self.alias!r} ttl={self.ttl} wait={self.wait}>"

    def read(self) -> ReadLock:
        """The read side: a lock that every reader holds at once, and no writer."""
        return self._read

    def write(self) -> WriteLock:
        """The write side: a lock that one writer holds, and no reader."""
        return self._write


def read_write_lock(
    name: str,
    *,
    using: str = DEFAULT_ALIAS,
    ttl: float | None = None,
    wait: float | None = None,
    renew: bool = True,
) -> ReadWriteLock:
    """Return a read-write lock on ``name`` from the ``using`` backend (see ReadWriteLock)."""
    return ReadWriteLock(name, using=using, ttl=ttl, wait=wait, renew=renew)
