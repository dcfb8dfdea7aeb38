"""DistributedLock: the lock API on top of any backend."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Generator
from typing import Any, NoReturn, TypeVar

from distlocks.backends.arguments import check_name_and_alias, check_positive_number, check_wait
from distlocks.backends.base import (
    AsyncTurn,
    BaseLockBackend,
    LockInfo,
    deadline_after,
    lease_start,
    time_left,
)
from distlocks.exceptions import LockError, LockLost, LockNotOwned
from distlocks.handler import DEFAULT_ALIAS, locks
from distlocks.holds import Hold, holds
from distlocks.lockapi import _DEFAULT, LockAPI
from distlocks.owner import Owner, current_owner
from distlocks.signals import lock_acquire_failed, lock_acquired, lock_released
from distlocks.transactions import after_transactions
from distlocks.watchdog import watchdog

logger = logging.getLogger(__name__)

R = TypeVar("R")


#: A call a lock's step makes to the server: the backend, its method's name and the arguments.
Call = tuple[BaseLockBackend, str, tuple[Any, ...]]
#: A lock's step with its calls to the server yielded, so that the thread (``run_steps``) or the
#: event loop (``distlocks.aio``, on a backend's ``async_primitives``) makes them.
Steps = Generator[Call, Any, R]


_DONE: Any = object()


def run_steps(steps: Steps[None]) -> None:
    """Run ``steps`` in the calling thread: each call is made and its result (or error) sent back."""
    # Steps that make no call (a hold recorded) end without a StopIteration raised and caught: that costs
    # more than the rest of them (next() with a default drops what they return, so they return None).
    call = next(steps, _DONE)
    if call is _DONE:
        return
    while True:
        backend, method, args = call
        try:
            result = getattr(backend, method)(*args)
        except BaseException as exc:  # noqa: B036 - thrown into the step, where the call was
            try:
                call = steps.throw(exc)
            except StopIteration:
                return
            continue
        try:
            call = steps.send(result)
        except StopIteration:
            return


class DistributedLock(LockAPI):
    """A named lock shared by every process that uses the same backend.

    Ownership, hold count and token belong to the calling thread, not to the
    object, so one object may be shared by many threads (as a decorator it is).
    With ``until="commit"``, a release inside a database transaction keeps the
    lock until that transaction has committed or rolled back.
    """

    def __init__(
        self,
        name: str,
        *,
        using: str = DEFAULT_ALIAS,
        ttl: float | None = None,
        wait: float | None = None,
        renew: bool = True,
        until: str | None = None,
    ) -> None:
        check_name_and_alias(name, using)
        if not isinstance(renew, bool):
            raise ValueError(f"renew must be True or False, not {renew!r}")
        if until is not None and not (isinstance(until, str) and until == "commit"):
            raise ValueError(f"until must be None (release at once) or 'commit', not {until!r}")
        backend = locks[using]
        self.name = name
        self.alias = using
        self.key = backend.make_key(name)
        self.ttl = backend.default_ttl if ttl is None else check_positive_number(ttl, "ttl")
        self.wait = check_wait(wait)
        self.renew = renew
        self.until = until

    def __repr__(self) -> str:
        return f"<DistributedLock {self.name!r} using={self.alias!r} ttl={self.ttl} wait={self.wait}>"

    @classmethod
    def primitives(cls, backend: BaseLockBackend) -> BaseLockBackend:
        """What this kind of lock calls on ``backend`` (a read-write lock's side: its ``read_write_side``)."""
        return backend

    @property
    def _backend(self) -> BaseLockBackend:
        return self.primitives(locks[self.alias])  # one instance per thread

    def _hold(self) -> Hold | None:
        return holds().get((self.alias, self.key))

    @property
    def token(self) -> int:
        """The calling thread's fencing token; raise LockNotOwned if it does not hold the lock."""
        hold = self._hold()
        if hold is None:
            raise self._error(LockNotOwned, "is not held by this thread")
        return hold.token

    @property
    def hold_count(self) -> int:
        """How many times the calling thread holds the lock (0: not held)."""
        hold = self._hold()
        return hold.count if hold else 0

    @property
    def lost(self) -> bool:
        """True if the calling thread held the lock and its lease was lost."""
        hold = self._hold()
        return bool(hold and hold.lost)

    @property
    def session_bound(self) -> bool:
        """True if a hold lives with the holding process's session (ZooKeeper), not as a lease.

        Such a hold cannot outlive its process: ``detach()``/``resume()`` and
        ``take_detached()`` need a lease backend.
        """
        return self._backend.session_bound

    def holder(self) -> LockInfo | None:
        """Who holds the lock right now, whatever process or thread (None: free); one look at the server."""
        return self._backend.holder(self.key)

    def take_detached(self, lease: float) -> int | None:
        """Take the free lock once for the current owner, held by no thread; return its token, or None.

        The lease runs out after ``lease`` seconds unless the same owner
        ``resume()``s it (a Celery task's dedupe marker, taken when the task is
        queued, resumed when it runs) or frees it with ``release_detached()``.
        """
        if self.session_bound:
            raise ValueError(self._message("lives with its process's session: it cannot be taken detached"))
        return self._backend.try_acquire(self.key, current_owner(), check_positive_number(lease, "lease"))

    def extend_detached(self, lease: float) -> bool:
        """Renew, for ``lease`` seconds, the current owner's lease that no thread holds; False if it is not the owner's."""
        if self.session_bound:
            raise ValueError(self._message("lives with its process's session: it cannot be held detached"))
        return self._backend.extend(self.key, current_owner(), check_positive_number(lease, "lease"))

    def release_detached(self) -> bool:
        """Free the current owner's lease that no thread holds; False if it was not the owner's any more."""
        if self._hold() is not None:
            raise ValueError(self._message("is held by this thread: release() it"))
        return self._backend.release(self.key, current_owner())

    def record(self, value: str) -> str:
        """Store ``value`` on the server under the lock's name unless one is there; return the one stored.

        Only session-bound backends (ZooKeeper) keep such values: elsewhere
        NotImplementedError (a lease shared by one owner's copies does it there).
        """
        return self._backend.record(self.key, value)

    def acquire(self, wait: float | None = _DEFAULT) -> bool:
        """Acquire the lock, waiting at most ``wait`` seconds; return True if acquired.

        ``wait=0`` tries once and ``None`` waits forever; by default the lock's
        own ``wait`` applies. Re-acquiring a lock the thread holds counts one more
        hold. Raise LockLost if the thread's hold was lost, BackendUnavailable if
        the server cannot be reached.
        """
        self._refuse_in_event_loop()
        return self._acquire(self.wait if wait is _DEFAULT else check_wait(wait), time.monotonic())

    def _acquire(
        self, wait: float | None, called: float, tell_not_acquired: bool = True, turn: AsyncTurn | None = None
    ) -> bool:
        """``acquire()`` called at ``called`` (monotonic); an async caller that tries again has the failure told later."""
        self._may_acquire()
        backend = self.primitives(locks[self.alias])
        hold = holds().get((self.alias, self.key))
        if hold is not None:
            run_steps(self._reenter(hold))
            return True
        owner = current_owner()
        try:
            taken = self._take(backend, owner, wait, turn)
        except Exception as exc:
            self._failed(called, exc)
            raise
        if taken is None:
            if tell_not_acquired:
                logger.debug("Lock %r on %r not acquired within %ss", self.name, self.alias, wait)
                self._failed(called, None)
            return False
        run_steps(self._record(backend, owner, *taken, called))
        return True

    def _may_acquire(self) -> None:
        """Raise if the calling thread (task) may not ask for this lock at all (see ``WriteLock``)."""

    def _record(self, backend: BaseLockBackend, owner: Owner, token: int, started: float, called: float) -> Steps[None]:
        """Make the lock just taken (``token``, its lease begun at ``started`` at the latest) the caller's hold, watched."""
        hold = Hold(type(self), backend, self.alias, self.name, self.key, owner, token, self.ttl, started + self.ttl)
        mine = holds()
        try:
            mine[(self.alias, self.key)] = hold
            if self.renew or backend.session_bound:
                watchdog().watch(hold, renew=self.renew)
            if logger.isEnabledFor(logging.DEBUG):  # one call, where debug() makes two
                logger.debug("Acquired lock %r on %r, token %d", self.name, self.alias, token)
            if lock_acquired.receivers:  # sending costs microseconds even to nobody
                waited = hold.acquired - called
                lock_acquired.send_robust(
                    sender=type(self), name=self.name, alias=self.alias, token=token, waited=waited
                )
        except BaseException as exc:
            # Whatever broke here (a thread that cannot start, an interrupt),
            # the caller is told it did not get the lock: it must not stay held.
            mine.pop((self.alias, self.key), None)
            watchdog().unwatch(hold)
            with contextlib.suppress(Exception):
                yield backend, "release_token", (self.key, owner, token)
            if isinstance(exc, Exception):
                self._failed(called, exc)
            raise

    def _failed(self, called: float, error: Exception | None) -> None:
        """Tell ``lock_acquire_failed`` that the acquire called at ``called`` (monotonic) gave up or raised."""
        if lock_acquire_failed.receivers:
            waited = time.monotonic() - called
            lock_acquire_failed.send_robust(
                sender=type(self), name=self.name, alias=self.alias, waited=waited, error=error
            )

    def _take(
        self, backend: BaseLockBackend, owner: Owner, wait: float | None, turn: AsyncTurn | None = None
    ) -> tuple[int, float] | None:
        """Try until the lock is taken or ``wait`` runs out: (token, when its lease began at the latest), or None.

        An async lock tries once (``wait=0``) as its ``turn``, and waits on its loop.
        """
        deadline = deadline_after(wait)
        attempt = 0
        token = None
        if wait != 0:
            backend.begin_wait(self.key)
        try:
            while True:
                started = time.monotonic()
                if turn is None:
                    token = backend.try_acquire(self.key, owner, self.ttl)
                else:
                    token = turn.try_acquire(backend, self.key, owner, self.ttl)
                if token is not None:
                    return int(token), lease_start(token, started)
                remaining = time_left(deadline)
                if remaining == 0:
                    return None
                backend.wait(self.key, attempt, remaining)
                attempt += 1
        finally:
            backend.end_wait(self.key, acquired=token is not None)

    def _reenter(self, hold: Hold) -> Steps[None]:
        """Count one more hold, checking on the server that the lease is still ours."""
        if hold.lost:
            raise self._error(LockLost, "was lost while held")
        started = time.monotonic()
        ttl = max(self.ttl, hold.ttl)  # another lock object's shorter ttl must not cut the outer lease
        backend = hold.backend_here()
        try:
            still_held = yield backend, "reenter_token", (self.key, hold.owner, ttl, hold.token)
        except BaseException:  # a KeyboardInterrupt too: it ends the session of a session-bound backend's call
            hold.uncounted += 1  # the server may have counted it
            self._lost_with_session(hold, backend)
            raise
        if not still_held:
            self._lost(hold, "its lease was gone at re-entry")
        hold.count += 1
        hold.renewed(started, ttl)

    def release(self) -> None:
        """Release one hold of the lock.

        With ``until="commit"`` and a transaction open in this thread, the lock
        stays held (and renewed) until the transaction ends: it is released
        right after the commit, or at the rollback. Raise LockNotOwned if the
        calling thread does not hold it, LockLost if its lease expired, was
        taken over or was force-released meanwhile.
        """
        if self.until == "commit":
            hold = self._hold()
            if hold is not None and not hold.lost and after_transactions(self._release_after_transaction):
                return
        run_steps(self._release())

    def _release_after_transaction(self, committed: bool) -> None:
        """The deferred release: a failure has nobody left to raise to, so it is logged."""
        try:
            run_steps(self._release())
        except LockError as exc:
            # After a commit the writes may have gone in unprotected: say so. After
            # a rollback nothing was written (and SQLite's rollback drops the lock).
            level = logging.WARNING if committed else logging.DEBUG
            when = "its transaction committed" if committed else "its transaction rolled back"
            logger.log(level, "Lock %r on %r released after %s: %s", self.name, self.alias, when, exc)

    def _release(self) -> Steps[None]:
        """Release one hold of the caller's (``release()`` without the wait for a commit)."""
        mine = holds()
        hold = mine.get((self.alias, self.key))
        if hold is None:
            raise self._error(LockNotOwned, "is not held by this thread")
        backend = hold.backend_here()
        hold.count -= 1
        if hold.count > 0:
            yield from self._release_inner(hold, backend)
            return
        del mine[(self.alias, self.key)]
        watchdog().unwatch(hold)
        if hold.lost:
            with contextlib.suppress(Exception):  # our own leftovers (an expired row, a node), if any
                if backend.session_bound:
                    yield backend, "drop", (self.key, hold.owner)
                else:
                    yield backend, "release_token", (self.key, hold.owner, hold.token)
            raise self._error(LockLost, "was lost while held")
        # An error here leaves the lease unrenewed: it runs out unless the
        # backend frees it later (a session-bound one deletes its node as soon as it can).
        try:
            released = yield backend, "release_token", (self.key, hold.owner, hold.token)
        except BaseException:
            backend.release_later(self.key, hold.token)
            raise
        for _ in range(hold.uncounted if released else 0):
            # Inner holds whose release failed may still count on the server.
            if not (yield backend, "release_token", (self.key, hold.owner, hold.token)):
                break
        if not released:
            self._lost(hold, "its lease was gone at release")
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Released lock %r on %r", self.name, self.alias)
        if lock_released.receivers:
            held = time.monotonic() - hold.acquired
            lock_released.send_robust(sender=type(self), name=self.name, alias=self.alias, token=hold.token, held=held)

    def _release_inner(self, hold: Hold, backend: BaseLockBackend) -> Steps[None]:
        """Release a hold that is not the last: the outer one goes on, renewed."""
        if hold.lost:
            raise self._error(LockLost, "was lost while held")
        try:
            still_held = yield backend, "release_token", (self.key, hold.owner, hold.token)
        except BaseException:  # as in _reenter
            hold.uncounted += 1  # the server may still count it: the last release makes sure
            self._lost_with_session(hold, backend)
            raise
        if not still_held:
            self._lost(hold, "its lease was gone at release")

    def _lost_with_session(self, hold: Hold, backend: BaseLockBackend) -> None:
        """After a call about ``hold`` failed: if the failure ended its session (a session-bound backend's, whose
        call was interrupted), the lock is free now, and the holder is told now, not at the next renewal."""
        if backend.session_bound and backend.session_ended(self.key, hold.owner):
            watchdog().lose(hold, "its session was ended by a failed call", watched_only=False)

    def _lost(self, hold: Hold, why: str) -> NoReturn:
        """The holding thread found its hold lost: tell ``lock_lost`` (unless told already) and raise LockLost."""
        watchdog().lose(hold, why, watched_only=False)
        raise self._error(LockLost, "was lost while held")

    def detach(self, lease: float) -> int:
        """Stop holding the lock in this thread without releasing it; return its token.

        The lease stays on the server, unrenewed, for ``lease`` seconds, for the
        same owner to ``resume()`` (a Celery task's retry, in any process).
        Raise LockNotOwned if this thread does not hold it, LockLost if it was lost.
        """
        hold = holds().pop((self.alias, self.key), None)
        if hold is None:
            raise self._error(LockNotOwned, "is not held by this thread")
        watchdog().unwatch(hold)
        if hold.lost or not self._backend.extend_token(self.key, hold.owner, lease, hold.token):
            raise self._error(LockLost, "was lost while held")
        return hold.token

    def resume(self, token: int) -> bool:
        """Hold, once, the lease that the current owner left with ``detach()``; False if it is gone.

        Renewing the lease checks that it is still this owner's; from then on it
        is renewed and released like any hold, with ``token`` as its token.
        """
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"token must be the int that detach() returned, not {type(token).__name__}")
        if self._hold() is not None:
            raise ValueError(self._message("is already held by this thread: nothing to resume"))
        owner = current_owner()
        started = time.monotonic()
        if not self._backend.extend_token(self.key, owner, self.ttl, token):
            return False
        holder = self._backend.holder(self.key)
        if holder is None or holder.token != token:
            # The same owner took it anew since (a task's other copy): that hold is not this one to resume.
            return False
        hold = Hold(
            type(self), self._backend, self.alias, self.name, self.key, owner, token, self.ttl, started + self.ttl
        )
        holds()[(self.alias, self.key)] = hold
        if self.renew:
            watchdog().watch(hold)
        return True


def lock(
    name: str,
    *,
    using: str = DEFAULT_ALIAS,
    ttl: float | None = None,
    wait: float | None = None,
    renew: bool = True,
    until: str | None = None,
) -> DistributedLock:
    """Return a lock on ``name`` from the ``using`` backend (see DistributedLock)."""
    return DistributedLock(name, using=using, ttl=ttl, wait=wait, renew=renew, until=until)
