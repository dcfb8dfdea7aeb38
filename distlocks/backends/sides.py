"""A read-write lock's side as a lock backend: what ``BaseLockBackend.read_write_side`` returns.

Each backend that has read-write locks subclasses ``ReadWriteSide`` next to
itself (``LocMemSide``, ``DatabaseSide``, ``RedisSide``, ``ZooKeeperSide``).
The core then takes a side as it takes a lock (``distlocks.rwlock``): the
same primitives, with the same meaning, on the side's key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from distlocks.backends.base import AsyncTurn, BaseLockBackend, LockInfo
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

READ, WRITE = "read", "write"


class ReadWriteSide(BaseLockBackend):
    """The ``mode`` side ("read" or "write") of ``backend``'s read-write locks, as a lock backend.

    Its keys are those of the core's holds of a side: the read-write lock's
    key and ``#read`` or ``#write`` (``lock_key`` gives the lock's back). Its
    primitives mean what ``BaseLockBackend`` says, for that side: a reader
    gets it unless a writer holds it (the owner itself: a downgrade) or waits
    for it; a writer unless anyone else holds it. The backend's ``held()``
    lists the holds of both sides (``LockInfo.key`` the read-write lock's,
    ``kind`` the mode); ``holder`` is one of this side's from there, and
    ``force_release(key, token)`` frees a holder of the read-write lock:
    with ``token``, that acquisition (of either side); without, the writer,
    else any one reader.

    A writer that fails an attempt between ``begin_wait`` and ``end_wait`` is
    recorded on the server as waiting (with a lease of the attempt's ttl),
    which blocks new readers. The default below keeps, per backend instance
    (one per thread), the secret of the writer so recorded (``waits``,
    ``waiting``) and deletes the record (``abandon``) when the acquire gives up.
    """

    def __init__(self, backend: BaseLockBackend, mode: str) -> None:  # noqa: D107 (the backend's set-up is done)
        self.backend = backend
        self.mode = mode
        self.alias = backend.alias
        self.session_bound = backend.session_bound
        self.ttl_is_lease = backend.ttl_is_lease
        self.suffix = f"#{mode}"
        self._waiting: dict[str, str] = {}  # key -> the secret of the writer recorded waiting ('' if none yet)

    def lock_key(self, key: str) -> str:
        """The read-write lock's key of the side's ``key``."""
        return key[: -len(self.suffix)]

    def begin_wait(self, key: str) -> None:
        self._waiting[key] = ""

    def end_wait(self, key: str, acquired: bool) -> None:
        secret = self._waiting.pop(key, "")
        if secret and not acquired:
            # Else new readers wait for it until its record's lease runs out.
            with contextlib.suppress(BackendUnavailable):
                self.abandon(key, secret)

    def waits(self, key: str) -> bool:
        """Whether an attempt on ``key`` that fails records a waiting writer."""
        return self.mode == WRITE and key in self._waiting

    def waiting(self, key: str, owner: Owner) -> None:
        """Note that ``owner`` is now recorded as a writer waiting for ``key`` (``end_wait`` forgets it)."""
        self._waiting[key] = owner.secret

    def keep_waiting(self, key: str) -> str:
        """An attempt of an acquire that goes on in another thread (an async one) ends: keep its record, if any.

        Return the secret of the writer the attempt recorded as waiting ('' if
        none), which ``end_wait`` then leaves on the server; the acquire
        ``abandon``s it when it gives up (see ``SideTurn``).
        """
        return self._waiting.pop(key, "")

    def abandon(self, key: str, secret: str) -> None:
        """Delete the record of the writer ``secret`` waiting for ``key``: new readers need not wait for it."""

    def async_turn(self, key: str) -> AsyncTurn:
        return SideTurn(key, self.mode)

    def holder(self, key: str) -> LockInfo | None:
        lock_key = self.lock_key(key)
        return next((info for info in self.backend.held() if info.key == lock_key and info.kind == self.mode), None)


class SideTurn(AsyncTurn):
    """An async acquire of a read-write lock's side: a writer that waits stays recorded as waiting.

    A waiting thread's record lasts from ``begin_wait`` to ``end_wait`` on its
    side instance; a task's attempts run in any pool thread, each on that
    thread's instance. So each attempt after the first wait records the writer
    (renewing the record's lease), keeps the record past the attempt
    (``keep_waiting``), and the end of an acquire that gave up deletes it.
    """

    def __init__(self, key: str, mode: str) -> None:
        self.key = key  # the side's
        self.mode = mode
        self.waiting = False
        self.secret = ""  # of the writer recorded as waiting, if it was

    def try_acquire(self, backend: BaseLockBackend, key: str, owner: Owner, ttl: float) -> int | None:
        if not self.waiting:
            return backend.try_acquire(key, owner, ttl)
        assert isinstance(backend, ReadWriteSide)
        backend.begin_wait(key)
        try:
            return backend.try_acquire(key, owner, ttl)
        finally:
            self.secret = backend.keep_waiting(key) or self.secret

    async def wait(self, attempt: int, remaining: float | None) -> None:
        self.waiting = True
        await super().wait(attempt, remaining)

    def end(self, acquired: bool) -> Callable[[BaseLockBackend], None] | None:
        key, mode, secret = self.key, self.mode, self.secret
        if acquired or not secret:
            return None  # a writer that got the lock is no longer recorded waiting

        def abandon(backend: BaseLockBackend) -> None:
            side = backend.read_write_side(mode)
            assert isinstance(side, ReadWriteSide)
            with contextlib.suppress(BackendUnavailable):  # else the record's lease runs out
                side.abandon(key, secret)

        return abandon
