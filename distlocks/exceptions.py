"""The distlocks exception hierarchy."""

from __future__ import annotations

from django.core.exceptions import SynchronousOnlyOperation


class LockError(Exception):
    """Base class of every lock failure; carries the lock's name and alias."""

    def __init__(self, message: str, *, name: str | None = None, alias: str | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.alias = alias


class LockNotAcquired(LockError):
    """The lock was not acquired within `wait` seconds."""


class LockNotOwned(LockError):
    """A release or renewal by a caller that does not hold the lock."""


class LockLost(LockError):
    """The lease expired, was taken over or was force-released while held."""


class LeadershipLost(LockLost):
    """A leader's term is over: its lease was lost, or is no longer proven by its own clock (``distlocks.election``)."""


class BackendUnavailable(LockError):
    """The lock server cannot be reached; the driver's error is chained."""


class StaleToken(LockLost):
    """A fenced write carried a smaller token than the row's: a newer holder wrote it, nothing was written.

    ``model``, ``pk``, ``token`` (the writer's) and ``current`` (the row's) say
    which write was refused; ``name`` and ``alias`` are the lock's when known.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str | None = None,
        alias: str | None = None,
        model: str | None = None,
        pk: object = None,
        token: int | None = None,
        current: int | None = None,
    ) -> None:
        super().__init__(message, name=name, alias=alias)
        self.model = model
        self.pk = pk
        self.token = token
        self.current = current


class SyncLockInAsyncContext(SynchronousOnlyOperation):
    """A sync lock was asked for inside a running event loop, whose every task it would block: use the async API.

    A subclass of Django's ``SynchronousOnlyOperation`` (what Django raises for
    a query there), so code that catches that catches this too. It is no
    LockError: it is a bug in the caller, not a lock that was not to be had.
    """

    def __init__(self, message: str, *, name: str | None = None, alias: str | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.alias = alias
