"""``LockedTask``: Celery task executions that never overlap, across workers.

This package is the only part of distlocks that imports Celery (``pip install 'distlocks[celery]'``);
``beat`` has the schedulers of one beat at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery import Task
from celery.exceptions import Retry
from celery.result import AsyncResult
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.arguments import check_positive_number, check_wait
from distlocks.exceptions import LockError, LockNotAcquired
from distlocks.handler import DEFAULT_ALIAS
from distlocks.lock import DistributedLock
from distlocks.names import check_name_fields
from distlocks.owner import acting_as, task_id_of, task_owner

logger = logging.getLogger(__name__)

BUSY_CHOICES = ("wait", "skip", "retry")
#: The message header that carries a kept lock's fencing token to the task's retry.
TOKEN_HEADER = "distlocks_token"


class _Default:
    def __repr__(self) -> str:
        return "<forever with lock_busy='wait', else 0>"


_DEFAULT: Any = _Default()


class LockedTask(Task):
    """A task base whose executions with the same lock name never overlap.

    ``lock_name`` is a format string over the task's bound arguments (defaults
    included): ``"report:{year}"``; or a callable taking the task's arguments
    and returning the name. The lock (on the ``lock_using`` alias, with a lease
    of ``lock_ttl`` seconds) is renewed while the task runs and released when
    it ends: on success, on failure, on a soft time limit and on
    ``revoke(terminate=True)``. A worker process that dies (SIGKILL, hard time
    limit) renews nothing any more, so the lock frees itself after ``lock_ttl``.
    The holder's owner reads ``host:pid:thread task <task id>``.

    When another execution holds the lock, ``lock_busy`` decides:

    - ``"wait"`` (default): wait up to ``lock_wait`` seconds (default: forever),
      then fail with ``LockNotAcquired``;
    - ``"skip"``: try for ``lock_wait`` seconds (default 0: once), then do not
      run, and return ``skipped_result()`` (``{"skipped": True, ...}``), which the
      result backend records as the task's result;
    - ``"retry"``: try for ``lock_wait`` seconds (default 0), then
      ``self.retry(countdown=lock_retry_countdown)`` (``max_retries`` applies).

    ``lock_across_retries = True`` keeps the lock while the task waits for its
    own ``self.retry()``: its retry, in any worker process, takes it back.
    ``lock_dedupe = True`` makes ``apply_async`` of a duplicate (same lock name)
    return the queued or running one's ``AsyncResult`` instead of queuing it again.
    """

    lock_name: str | Callable[..., str] | None = None
    lock_using: str = DEFAULT_ALIAS
    lock_ttl: float | None = None  # None: the alias's TTL
    lock_wait: float | None = _DEFAULT
    lock_busy: str = "wait"
    lock_retry_countdown: float = 5.0
    #: Keep the lock across this task's own ``self.retry()``: the lease is
    #: stretched over the countdown, and the retry (any worker) takes it back.
    lock_across_retries: bool = False
    #: ``apply_async`` of a duplicate while one is queued or running returns
    #: that one's AsyncResult instead of queuing it again.
    lock_dedupe: bool = False
    #: How long a queued task's dedupe marker lives at most; once the task
    #: runs it is renewed with ``lock_ttl`` and released when the task ends.
    lock_dedupe_ttl: float = 3600.0

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        if inspect.getattr_static(cls, "run") is Task.run:
            return  # a base class of tasks, not a task
        cls._check_lock_options()

    @classmethod
    def _check_lock_options(cls) -> None:
        """Raise ImproperlyConfigured naming the task and the option that is wrong."""

        def refuse(message: str) -> ImproperlyConfigured:
            return ImproperlyConfigured(f"LockedTask {cls.name!r}: {message}")

        name = cls._lock_name_option()
        if name is None or name == "":
            raise refuse("lock_name is required: a format string over the task's arguments, or a callable")
        if isinstance(name, str):
            try:
                check_name_fields(name, cls._run_parameters(), "lock_name", "the task")
            except ValueError as exc:
                raise refuse(str(exc)) from exc
        elif not callable(name):
            raise refuse(f"lock_name must be a str or a callable, not {type(name).__name__}")
        if not isinstance(cls.lock_using, str) or not cls.lock_using:
            raise refuse(f"lock_using must be the str alias of a DISTLOCKS entry, not {cls.lock_using!r}")
        if cls.lock_busy not in BUSY_CHOICES:
            raise refuse(f"lock_busy must be one of {', '.join(map(repr, BUSY_CHOICES))}, not {cls.lock_busy!r}")
        for option in ("lock_ttl", "lock_retry_countdown", "lock_dedupe_ttl"):
            value = getattr(cls, option)
            if value is not None or option != "lock_ttl":
                try:
                    check_positive_number(value, option)
                except ValueError as exc:
                    raise refuse(str(exc)) from exc
        if cls.lock_wait is not _DEFAULT:
            try:
                check_wait(cls.lock_wait)
            except ValueError as exc:
                raise refuse(f"lock_{exc}") from exc
        for option in ("lock_across_retries", "lock_dedupe"):
            if not isinstance(getattr(cls, option), bool):
                raise refuse(f"{option} must be True or False, not {getattr(cls, option)!r}")

    @classmethod
    def _lock_name_option(cls) -> Any:
        # Read without binding: a function given as lock_name is not a method.
        name = inspect.getattr_static(cls, "lock_name")
        return name.__func__ if isinstance(name, staticmethod | classmethod) else name

    @classmethod
    def _run_parameters(cls) -> dict[str, inspect.Parameter]:
        run = inspect.getattr_static(cls, "run")
        if isinstance(run, staticmethod):  # @app.task without bind=True
            return dict(inspect.signature(run.__func__).parameters)
        parameters = list(inspect.signature(run).parameters.items())
        return dict(parameters[1:])  # without self

    # -- the lock -----------------------------------------------------------------

    def lock_name_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Return the lock name of a call with ``args`` and ``kwargs``; ValueError if it cannot be formed."""
        try:
            bound = inspect.signature(self.run).bind(*args, **kwargs)
        except TypeError as exc:
            raise ValueError(f"{self.name}: cannot bind the arguments to form lock_name: {exc}") from exc
        bound.apply_defaults()
        name = self._lock_name_option()
        if callable(name):
            return str(name(*bound.args, **bound.kwargs))
        namespace = dict(bound.arguments)
        for parameter in bound.signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                namespace.update(namespace.pop(parameter.name, {}))
        try:
            return str(name).format(**namespace)
        except (KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"{self.name}: lock_name {name!r} cannot be formed from this call: {exc!r}") from exc

    def _lock_wait(self) -> float | None:
        if self.lock_wait is not _DEFAULT:
            return self.lock_wait
        return None if self.lock_busy == "wait" else 0

    def skipped_result(self, lock: DistributedLock) -> dict[str, Any]:
        """Return what a skipped execution returns (and the result backend records); override to change it."""
        return {"skipped": True, "reason": "lock busy", "lock": lock.name, "using": lock.alias}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self.request.id
        if task_id is None or self.request.called_directly:  # a plain function call, not a task
            return self.run(*args, **kwargs)
        name = self.lock_name_for(args, kwargs)
        lock = DistributedLock(name, using=self.lock_using, ttl=self.lock_ttl, wait=self._lock_wait())
        shared = self.lock_across_retries or self.lock_dedupe
        if shared:
            _refuse_session_backend(lock)
        with acting_as(task_owner(task_id, shared=shared)):
            marker = self._dedupe_marker(name) if self.lock_dedupe else None
            queued = marker.holder() if marker is not None and not marker.hold_count else None
            if marker is not None and queued is not None and queued.token is not None:
                marker.resume(queued.token)  # renewed while the task runs; gone after its ttl if the worker dies
            try:
                result = self._run_locked(lock, args, kwargs)
            except Retry as retry:
                if marker is not None:
                    _keep(marker, _seconds_until(retry.when) + self.lock_dedupe_ttl)  # still queued
                raise
            except BaseException:
                self._release_marker(marker)
                raise
            self._release_marker(marker)
            return result

    def _run_locked(self, lock: DistributedLock, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        token = self._kept_token()
        claim = None
        resumed = False
        if token is not None and not lock.hold_count:
            claim = self._claim_resume(lock)
            resumed = claim is not None and lock.resume(token)
        try:
            if not resumed and not lock.acquire():
                return self._busy(lock)
            failed = True
            try:
                result = self.run(*args, **kwargs)
                failed = False
                return result
            except Retry as retry:
                if self.lock_across_retries:
                    # The lease must outlast the countdown: nobody renews it meanwhile.
                    _keep(lock, _seconds_until(retry.when) + lock.ttl)
                failed = False
                raise
            finally:
                if lock.hold_count:
                    self._release(lock, failed)
        finally:
            if claim is not None and claim.hold_count:
                with contextlib.suppress(LockError):
                    claim.release()

    def _claim_resume(self, lock: DistributedLock) -> DistributedLock | None:
        """Return the claim on resuming ``lock``'s kept lease, or None if another copy of this retry has it.

        A retry message delivered twice (``acks_late`` and a visibility timeout
        shorter than the countdown) runs twice with the same owner, so both
        copies could renew the kept lease. The claim is an ordinary lock that
        the owner cannot re-enter by trying again: one copy resumes, the other
        waits for the lock like any other execution.
        """
        claim_name = f"resumed:{lock.name}"
        if len(claim_name) > 64:  # a name near the backend's limit must still leave room
            claim_name = f"resumed:{hashlib.sha256(lock.name.encode()).hexdigest()}"
        claim = DistributedLock(claim_name, using=lock.alias, ttl=lock.ttl)
        if claim.acquire(wait=0):
            return claim
        logger.warning("Task %s: another copy of this retry holds %r: not resuming it", self.request.id, lock.name)
        return None

    def _release(self, lock: DistributedLock, failed: bool) -> None:
        try:
            lock.release()
        except LockError:
            if not failed:
                raise  # LockLost: another execution may have overlapped this one
            logger.warning("Lock %r on %r was lost while task %s failed", lock.name, lock.alias, self.request.id)

    def _busy(self, lock: DistributedLock) -> Any:
        if self.lock_busy == "retry":
            raise self.retry(countdown=self.lock_retry_countdown)
        if self.lock_busy == "skip":
            logger.info("Task %s skipped: lock %r on %r is busy", self.request.id, lock.name, lock.alias)
            return self.skipped_result(lock)
        raise LockNotAcquired(
            f"Lock {lock.name!r} on {lock.alias!r} not acquired within {lock.wait}s", name=lock.name, alias=lock.alias
        )

    def retry(self, *args: Any, **kwargs: Any) -> Retry:
        """Retry as Celery does; with ``lock_across_retries`` the lock's fencing token goes along."""
        if self.lock_across_retries and self.request.id and not self.request.called_directly:
            name = self.lock_name_for(tuple(self.request.args or ()), dict(self.request.kwargs or {}))
            lock = DistributedLock(name, using=self.lock_using, ttl=self.lock_ttl)
            if lock.hold_count:
                kwargs["headers"] = {**(kwargs.get("headers") or {}), TOKEN_HEADER: lock.token}
        return super().retry(*args, **kwargs)

    def _kept_token(self) -> int | None:
        if not self.lock_across_retries or not self.request.retries:
            return None
        token = getattr(self.request, TOKEN_HEADER, None)
        if token is None:
            token = (self.request.headers or {}).get(TOKEN_HEADER)
        return int(token) if token is not None else None

    # -- dedupe at enqueue --------------------------------------------------------

    def _dedupe_marker(self, name: str) -> DistributedLock:
        return DistributedLock(f"dedupe:{name}", using=self.lock_using, ttl=self.lock_ttl)

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any) -> Any:
        """Send the task; with ``lock_dedupe``, return the queued duplicate's AsyncResult instead, if any."""
        if not self.lock_dedupe or options.get("retries"):  # a retry is the same task, not a duplicate
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        from celery.utils import uuid

        marker = self._dedupe_marker(self.lock_name_for(tuple(args or ()), dict(kwargs or {})))
        _refuse_session_backend(marker)
        task_id = task_id or uuid()
        delay = options.get("countdown") or 0
        if isinstance(options.get("eta"), datetime):
            delay = _seconds_until(options["eta"])
        with acting_as(task_owner(task_id, shared=True)):
            for _ in range(5):
                if marker.take_detached(lease=self.lock_dedupe_ttl + max(0.0, delay)) is not None:
                    try:
                        return super().apply_async(args, kwargs, task_id=task_id, **options)
                    except BaseException:
                        marker.release_detached()
                        raise
                queued = marker.holder()
                queued_id = task_id_of(queued.owner) if queued else None
                if queued_id:
                    logger.debug("Task %s not queued: %s is queued or running for %r", task_id, queued_id, marker.name)
                    return AsyncResult(queued_id, app=self.app, task_name=self.name)
                # Released between the two looks: try again.
        raise LockNotAcquired(
            f"{self.name}: dedupe marker {marker.name!r} keeps changing hands", name=marker.name, alias=marker.alias
        )

    def _release_marker(self, marker: DistributedLock | None) -> None:
        """Release this task's dedupe marker, checked by owner: another task's marker stays."""
        if marker is None:
            return
        try:
            if marker.hold_count:
                marker.release()
            else:  # it could not be renewed (its lease ran out): release it if it is still ours
                marker.release_detached()
        except LockError as exc:
            logger.warning("Dedupe marker %r of task %s was lost: %s", marker.name, self.request.id, exc)


def _refuse_session_backend(lock: DistributedLock) -> None:
    if lock.session_bound:
        raise ImproperlyConfigured(
            f"lock_across_retries and lock_dedupe need a lease backend (database, Redis, Redlock): "
            f"a lock on {lock.alias!r} lives with the session of the process that took it"
        )


def _seconds_until(when: Any) -> float:
    """Seconds until a Retry's ``when`` (a countdown, or an eta)."""
    if isinstance(when, datetime):
        aware = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
        return max(0.0, (aware - datetime.now(timezone.utc)).total_seconds())
    if isinstance(when, int | float):
        return max(0.0, float(when))
    return 0.0


def _keep(lock: DistributedLock, seconds: float) -> None:
    """Stop holding ``lock`` in this thread, leaving its lease on the server for ``seconds``."""
    if not lock.hold_count:
        return
    try:
        lock.detach(lease=max(seconds, lock.ttl))
    except LockError:
        logger.warning("Lock %r on %r was lost before the task's retry", lock.name, lock.alias)
