"""LockAPI: what every kind of lock offers on top of its ``acquire()`` and ``release()``.

``with``, the decorator, and the wording of the kind's errors are the same for
the lock, the read-write lock's sides, the semaphore and the multi-lock: they
live here once, apart from ``DistributedLock``'s acquire loop (``lock.py``).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import iscoroutinefunction

from distlocks.exceptions import LockError, LockNotAcquired, SyncLockInAsyncContext

P = ParamSpec("P")
R = TypeVar("R")


class _Default:
    def __repr__(self) -> str:
        return "<the lock's wait>"


_DEFAULT: Any = _Default()


L = TypeVar("L", bound="LockAPI")
E = TypeVar("E", bound=LockError | SyncLockInAsyncContext)


class LockAPI:
    """The context manager and decorator of every kind of lock, built on its ``acquire()`` and ``release()``.

    It also words the kind's errors: "<noun> 'name' on 'alias' <what>".
    """

    noun = "Lock"
    #: The kind's async form, which the error of a sync acquire inside an event loop names.
    async_form = "distlocks.alock(...)"
    name: str
    alias: str
    wait: float | None

    def acquire(self, wait: float | None = _DEFAULT) -> bool:
        raise NotImplementedError("subclasses of LockAPI must provide an acquire() method")

    def release(self) -> None:
        raise NotImplementedError("subclasses of LockAPI must provide a release() method")

    def _message(self, what: str) -> str:
        return f"{self.noun} {self.name!r} on {self.alias!r} {what}"

    def _error(self, kind: type[E], what: str) -> E:
        """A ``kind`` of LockError about this lock, saying ``what``."""
        return kind(self._message(what), name=self.name, alias=self.alias)

    def _not_acquired(self, wait: float | None) -> LockNotAcquired:
        return self._error(LockNotAcquired, f"not acquired within {wait}s")

    def _refuse_in_event_loop(self) -> None:
        """Raise SyncLockInAsyncContext if an asyncio event loop runs in the calling thread.

        A sync acquire there blocks every task of the loop while it waits (and
        on the database backends Django refuses its queries deep inside): say at
        once what to use instead. ``DJANGO_ALLOW_ASYNC_UNSAFE`` allows it, as it
        allows Django's own sync-only calls (``django.utils.asyncio.async_unsafe``).
        """
        # get_running_loop() raises when none runs, the common case: 250 ns a call against 35 ns.
        if asyncio._get_running_loop() is None:
            return
        if not os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE"):
            raise self._error(
                SyncLockInAsyncContext,
                "cannot be acquired by sync code inside a running event loop, which it would block: "
                f"in async code use {self.async_form} (`async with`, or `await acquire()`), "
                "or run the sync code in a thread (asgiref's sync_to_async)",
            )

    def __enter__(self: L) -> L:
        if not self.acquire():
            raise self._not_acquired(self.wait)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Use the lock as a decorator: hold it while ``func`` runs.

        Not on a coroutine function: its call only makes the coroutine, which
        would run after the release. TypeError at once, naming the async form.
        """
        if iscoroutinefunction(func):
            raise TypeError(
                self._message(
                    f"cannot decorate the coroutine function {func.__qualname__}: "
                    f"use `async with {self.async_form}` inside it"
                )
            )

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with self:
                return func(*args, **kwargs)

        return wrapper
