"""``alock()``: the lock for asyncio code, owned by the task, on the sync core.

On a backend with ``async_primitives`` (Redis, on ``redis.asyncio``) the
lock's steps run on the event loop, acting as the calling task (its owner
identity and its table of holds: see ``holds.acting_for``), and await the
primitives for their calls to the server. On the others each call runs in one
bounded pool of threads shared by the process, acting as the task. Either way
reentrancy, tokens, signals and the watchdog are the sync lock's own. Waiting happens on the event loop, holding
no thread, as the backend's ``async_turn`` says: on Redis the task queues like
a waiting thread and the loop reads its hand-over from pub/sub, so threads and
tasks are served in turn; on ZooKeeper its node stays queued between attempts
and a watch wakes the loop; elsewhere it sleeps with the core's backoff. A
cancelled waiter leaves nothing behind: no lock, no queue entry.
The process's watchdog renews a task's holds from its own threads: a loop that
stalls past the lease keeps its locks, and a hold that could not be renewed is
marked lost (``lost``; ``release()`` raises LockLost).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

from distlocks.backends.arguments import check_wait
from distlocks.backends.base import AsyncPrimitives, AsyncTurn, lease_start
from distlocks.exceptions import LockNotAcquired
from distlocks.handler import DEFAULT_ALIAS, locks
from distlocks.holds import Hold, acting_for
from distlocks.lock import _DEFAULT, DistributedLock, Steps
from distlocks.owner import Owner, acting_as, asyncio_task_owner

T = TypeVar("T")

#: The threads that run the async locks' calls to their servers, for the whole process.
POOL_SIZE = 8


class _Pool:
    """One bounded executor per process (a forked child starts a new one)."""

    def __init__(self) -> None:
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.pid = 0
        self.lock = threading.Lock()

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        with self.lock:
            if self.executor is None or self.pid != os.getpid():
                self.executor = concurrent.futures.ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="distlocks-aio")
                self.pid = os.getpid()
            return self.executor


_pool = _Pool()


class _TaskHolder:
    """A task as the watchdog sees a holder: alive until it is done (a weak reference: no cycle)."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = weakref.ref(task)
        self.name = task.get_name()

    def is_alive(self) -> bool:
        task = self._task()
        return task is not None and not task.done()


@dataclass
class _TaskState:
    """A task's identity and holds, as the pool threads act for it."""

    owner: Owner
    holder: _TaskHolder
    holds: dict[tuple[str, str], Hold] = field(default_factory=dict)

    @contextlib.contextmanager
    def acting(self) -> Iterator[None]:
        with acting_as(self.owner), acting_for(self.holder, self.holds):
            yield

    def run(self, func: Callable[..., T], *args: Any) -> T:
        with self.acting():
            return func(*args)


_tasks: weakref.WeakKeyDictionary[asyncio.Task[Any], _TaskState] = weakref.WeakKeyDictionary()


def _current() -> _TaskState:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop
        task = None
    if task is None:
        raise RuntimeError("an async lock is used from an asyncio task (it belongs to the task)")
    state = _tasks.get(task)
    if state is None:
        state = _tasks[task] = _TaskState(asyncio_task_owner(task.get_name()), _TaskHolder(task))
    return state


def in_pool(func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run ``func(*args)`` in the pool, acting as the calling task."""
    return _submit(_current(), func, *args)


A = TypeVar("A", bound="AsyncLockAPI")


class AsyncLockAPI:
    """``async with`` for every kind of async lock, built on its ``acquire()`` and ``release()``."""

    wait: float | None
    #: The sync lock of the kind, whose steps the pool runs as the task.
    sync: Any

    async def acquire(self, wait: float | None = _DEFAULT) -> bool:
        raise NotImplementedError("subclasses of AsyncLockAPI must provide an acquire() method")

    async def release(self) -> None:
        raise NotImplementedError("subclasses of AsyncLockAPI must provide a release() method")

    def _not_acquired(self, wait: float | None) -> LockNotAcquired:
        raise NotImplementedError("subclasses of AsyncLockAPI must provide a _not_acquired() method")

    async def __aenter__(self: A) -> A:
        if not await self.acquire():
            raise self._not_acquired(self.wait)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()


class TaskView(Generic[T]):
    """A read-only property of an async lock: its sync lock's of the same name, read as the calling task (no request)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type) -> TaskView[T]: ...

    @overload
    def __get__(self, obj: AsyncLockAPI, objtype: type | None = None) -> T: ...

    def __get__(self, obj: AsyncLockAPI | None, objtype: type | None = None) -> T | TaskView[T]:
        if obj is None:
            return self
        with _current().acting():
            return getattr(obj.sync, self.name)


class AsyncDistributedLock(AsyncLockAPI):
    """A named lock for asyncio code: the same lock as ``lock()`` with the same name and alias.

    Ownership, hold count and token belong to the calling task, so one object
    may be shared by many tasks. Use ``async with`` or ``await acquire()`` /
    ``await release()``; ``token``, ``hold_count`` and ``lost`` read the calling
    task's hold without a request.
    """

    lock: DistributedLock

    def __init__(
        self,
        name: str,
        *,
        using: str = DEFAULT_ALIAS,
        ttl: float | None = None,
        wait: float | None = None,
        renew: bool = True,
    ) -> None:
        self.lock = DistributedLock(name, using=using, ttl=ttl, wait=wait, renew=renew)
        self.wait = self.lock.wait

    @classmethod
    def of(cls, lock: DistributedLock) -> AsyncDistributedLock:
        """The async form of ``lock`` (a read-write lock's side, a semaphore's permit): the same lock, held by tasks."""
        made = cls.__new__(cls)
        made.lock = lock
        made.wait = lock.wait
        return made

    @property
    def name(self) -> str:
        return self.lock.name

    @property
    def alias(self) -> str:
        return self.lock.alias

    def __repr__(self) -> str:
        return f"<async {type(self.lock).__name__} {self.name!r} using={self.alias!r} ttl={self.lock.ttl} wait={self.wait}>"

    def _not_acquired(self, wait: float | None) -> LockNotAcquired:
        return self.lock._not_acquired(wait)

    @property
    def sync(self) -> DistributedLock:
        return self.lock

    token = TaskView[int]("The calling task's fencing token; raise LockNotOwned if it does not hold the lock.")
    hold_count = TaskView[int]("How many times the calling task holds the lock (0: not held).")
    lost = TaskView[bool]("True if the calling task held the lock and its lease was lost.")

    async def acquire(self, wait: float | None = _DEFAULT) -> bool:
        """Acquire the lock, waiting at most ``wait`` seconds on the event loop; return True if acquired.

        As ``DistributedLock.acquire``. Cancelling the waiting task leaves no
        trace: an attempt under way when it is cancelled is undone once it ends,
        and then the task leaves the lock's queue, if it joined one.
        """
        called = time.monotonic()
        wait = self.wait if wait is _DEFAULT else check_wait(wait)
        deadline = None if wait is None else called + wait
        state = _current()
        backend = self.lock.primitives(locks[self.alias])
        native = backend.async_primitives()
        turn = backend.async_turn(self.lock.key)
        attempt = 0
        tried: asyncio.Future[bool] | None = None
        try:
            while True:
                if native is None:
                    tried = _submit(state, self.lock._acquire, 0, called, False, turn)
                else:
                    tried = asyncio.ensure_future(self._attempt(state, native, called, turn))
                if await attempt_or_undo(tried, self.lock.release, self.lock._release if native else None):
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self.lock._failed(called, None)
                    return False
                await turn.wait(attempt, remaining)
                attempt += 1
        finally:
            if tried is None or tried.done():
                leaving = self._end(state, native, turn, tried)
                if leaving is not None:
                    await finish_or_undo(
                        leaving, _took(tried), self.lock.release, self.lock._release if native else None
                    )
            else:  # cancelled during an attempt: the wait ends with it, without holding up the task
                tried.add_done_callback(lambda _: self._end(state, native, turn, tried))

    async def _attempt(self, state: _TaskState, native: AsyncPrimitives, called: float, turn: AsyncTurn) -> bool:
        """One attempt on the loop, as ``DistributedLock._acquire(0)`` in a thread (failures told by the caller)."""
        lock = self.lock
        with state.acting():
            lock._may_acquire()
        hold = state.holds.get((lock.alias, lock.key))
        if hold is not None:
            await run_steps(state, lock._reenter(hold))
            return True
        started = time.monotonic()
        try:
            token = await native.try_acquire(lock.key, state.owner, lock.ttl, turn)
        except Exception as exc:
            lock._failed(called, exc)
            raise
        if token is None:
            return False
        started = lease_start(token, started)
        await run_steps(state, lock._record(locks[lock.alias], state.owner, int(token), started, called))
        return True

    def _end(
        self,
        state: _TaskState,
        native: AsyncPrimitives | None,
        turn: AsyncTurn,
        tried: asyncio.Future[bool] | None,
    ) -> asyncio.Future[None] | None:
        """Stop waiting once the last attempt has ended, leaving the queue on the server if need be (in the pool,
        or on the loop)."""
        acquired = _took(tried)
        if native is not None:
            return asyncio.ensure_future(native.end_wait(turn, acquired))
        leave = turn.end(acquired)
        return None if leave is None else _submit(state, lambda: leave(locks[self.alias]))

    async def release(self) -> None:
        """Release one hold, as ``DistributedLock.release``; it completes even if the task is cancelled meanwhile."""
        if self.lock.primitives(locks[self.alias]).async_primitives() is None:
            await finish(in_pool(self.lock.release))
        else:
            await finish(asyncio.ensure_future(run_steps(_current(), self.lock._release())))


def _submit(state: _TaskState, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run ``func(*args)`` in the pool, acting as the task of ``state``."""
    return asyncio.get_running_loop().run_in_executor(_pool.get(), state.run, func, *args)


async def attempt_or_undo(
    attempt: asyncio.Future[T], undo: Callable[[], object], undo_on_loop: Callable[[], Steps[None]] | None = None
) -> T:
    """Await an ``attempt`` (running in the pool, or on the loop); if the task is cancelled meanwhile and it ends
    taking the lock (it returns True), ``undo()`` that in the pool, or run the steps ``undo_on_loop()`` on the loop."""
    state = _current()
    try:
        return await asyncio.shield(attempt)
    except asyncio.CancelledError:
        attempt.add_done_callback(functools.partial(_undo, state, undo, undo_on_loop))
        raise


def _took(attempt: asyncio.Future[Any] | None) -> bool:
    """Whether ``attempt`` (done, or None: none made) ended taking the lock."""
    return attempt is not None and not attempt.cancelled() and attempt.exception() is None and attempt.result() is True


def _undo(
    state: _TaskState,
    undo: Callable[[], object],
    undo_on_loop: Callable[[], Steps[None]] | None,
    attempt: asyncio.Future[Any],
) -> None:
    if _took(attempt):
        _give_back(state, undo, undo_on_loop)


def _give_back(state: _TaskState, undo: Callable[[], object], undo_on_loop: Callable[[], Steps[None]] | None) -> None:
    """Undo a take the task of ``state`` was never told of: ``undo()`` in the pool, or ``undo_on_loop()`` on the loop."""
    if undo_on_loop is None:
        _pool.get().submit(state.run, undo)
    else:
        _retrieved(asyncio.ensure_future(run_steps(state, undo_on_loop())))


async def run_steps(state: _TaskState, steps: Steps[T]) -> T:
    """Run a lock's ``steps`` on the loop as the task of ``state``, awaiting the backend's async primitives for
    their calls (``lock.run_steps`` does it in a thread). Only the steps between two calls act as the task: the
    loop's thread runs other tasks meanwhile."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            with state.acting():
                backend, method, args = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value
        try:
            result, error = await getattr(backend.async_primitives(), method)(*args), None
        except BaseException as exc:  # noqa: B036 - thrown into the step, where the call was
            result, error = None, exc


def _retrieved(call: asyncio.Future[Any]) -> None:
    """Let ``call`` end unawaited: an error of its is not logged as never retrieved (the lease runs out)."""
    call.add_done_callback(lambda done: done.cancelled() or done.exception())


async def finish(call: asyncio.Future[T]) -> T:
    """Await ``call``, which runs on to its end even if the task is cancelled meanwhile."""
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        _retrieved(call)
        raise


async def finish_or_undo(
    call: asyncio.Future[Any],
    taken: bool,
    undo: Callable[[], object],
    undo_on_loop: Callable[[], Steps[None]] | None = None,
) -> None:
    """``finish(call)``, the end of an acquire that has ``taken`` the lock: if the task is cancelled meanwhile,
    its caller is told CancelledError, not that it holds the lock (it runs no ``async with`` body and never
    releases), so ``undo()`` the take once ``call`` has ended, as ``attempt_or_undo`` does."""
    state = _current()
    try:
        await finish(call)
    except asyncio.CancelledError:
        if taken:
            call.add_done_callback(lambda _: _give_back(state, undo, undo_on_loop))
        raise


def alock(
    name: str,
    *,
    using: str = DEFAULT_ALIAS,
    ttl: float | None = None,
    wait: float | None = None,
    renew: bool = True,
) -> AsyncDistributedLock:
    """Return an asyncio lock on ``name`` from the ``using`` backend (see AsyncDistributedLock)."""
    return AsyncDistributedLock(name, using=using, ttl=ttl, wait=wait, renew=renew)
