"""Read-write lock: many readers or one writer, across processes.

``read_write_lock("doc:7")`` is stored as ``rw:doc:7`` on its backend. Its two
sides, ``read()`` and ``write()``, are ``DistributedLock``s on the backend's
``read_write_side("read")`` and ``read_write_side("write")`` (lock backends of
their own: see ``distlocks.backends.sides``) instead of the backend, so that
each side gets what the lock gives: a lease renewed by the watchdog (on
ZooKeeper, the session), ``LockLost``, a fencing token per acquisition,
re-entry per thread, ``BackendUnavailable`` in bounded time.

A writer that waits is recorded on the server and blocks new readers, so a
stream of readers never starves it (the writer preference of Java's
``ReentrantReadWriteLock`` in its fair mode, and of Curator's and kazoo's
recipes). The thread that holds the write side may take the read side too (a
downgrade: release the write side then, and it goes on reading); a thread that
holds the read side and asks for the write side gets ValueError at once: two
such readers would wait for each other for ever.
"""

from __future__ import annotations

from typing import Any

from distlocks.backends.arguments import check_name_and_alias
from distlocks.backends.base import BaseLockBackend
from distlocks.backends.sides import READ, WRITE
from distlocks.handler import DEFAULT_ALIAS, locks
from distlocks.holds import holds
from distlocks.lock import DistributedLock

#: The prefix of a read-write lock's name on its backend (as ``sem:`` is the semaphore's).
PREFIX = "rw:"


class ReadLock(DistributedLock):
    """The read side of a read-write lock: shared with every other reader."""

    noun = "Read lock"
    async_form = "distlocks.aread_write_lock(...).read()"
    mode = READ
    read_key = ""  # the key of the read side's holds (set by ReadWriteLock)

    @classmethod
    def primitives(cls, backend: BaseLockBackend) -> BaseLockBackend:
        return backend.read_write_side(cls.mode)


class WriteLock(ReadLock):
    """The write side of a read-write lock: no reader and no other writer while it is held."""

    noun = "Write lock"
    async_form = "distlocks.aread_write_lock(...).write()"
    mode = WRITE

    def _may_acquire(self) -> None:
        """ValueError if this thread (task) is reading: two such readers would wait for each other for ever."""
        if (self.alias, self.read_key) in holds() and (self.alias, self.key) not in holds():
            raise ValueError(
                self._message("is asked for by a thread that holds its read side: release the read lock first")
            )


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
        try:
            backend.read_write_side(READ)
        except NotImplementedError as exc:
            raise NotImplementedError(
                f"the {using!r} backend ({type(backend).__name__}) has no read-write locks: "
                "use the Redis, ZooKeeper, database table or LocMem backend"
            ) from exc
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
