"""Who holds a lock: host, pid and thread (and the task it runs), plus a per-thread secret."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Owner:
    """The identity of the calling thread, as a backend records it.

    ``secret`` is random per thread and per process (regenerated after fork), so
    a reused pid in another container or a reused thread id is never mistaken for
    the owner, and nobody can release a lock without holding the secret.
    ``task`` is the id of the task the thread runs (see ``running_task``), shown
    to operators only: it takes no part in ownership.
    """

    host: str
    pid: int
    thread: str
    secret: str
    task: str | None = None

    @property
    def thread_label(self) -> str:
        """The thread, and the task it runs if any: ``MainThread/140 task 3f2a...``."""
        return f"{self.thread} task {self.task}" if self.task else self.thread

    @functools.cached_property
    def description(self) -> str:
        """``host:pid:thread``, as backends record it (kept: every acquire sends it)."""
        return f"{self.host}:{self.pid}:{self.thread_label}"

    def __str__(self) -> str:
        return self.description


class _Local(threading.local):
    """A thread's owner (made at its first lock) and the one it acts as (``acting_as``), read as attributes."""

    owner: Owner | None = None
    acting: Owner | None = None


_local = _Local()


def _forget_owners_after_fork() -> None:
    """A forked child is a new owner: its threads draw new secrets."""
    global _local
    _local = _Local()


os.register_at_fork(after_in_child=_forget_owners_after_fork)


def _thread_owner() -> Owner:
    owner = _local.owner
    if owner is None:
        thread = threading.current_thread()
        owner = Owner(
            host=socket.gethostname(),
            pid=os.getpid(),
            thread=f"{thread.name}/{thread.ident}",
            secret=secrets.token_hex(16),
        )
        _local.owner = owner
    return owner


def current_owner() -> Owner:
    """Return the calling thread's owner identity (the task's, inside ``acting_as``)."""
    local = _local
    owner = local.owner
    if owner is None:
        owner = _thread_owner()
    acting = local.acting
    if acting is not None and acting.pid == owner.pid:
        return acting
    return owner


def task_owner(task_id: str, *, shared: bool = False) -> Owner:
    """Return the calling thread's identity while it runs the task ``task_id``.

    It shows ``host:pid:thread task <id>`` as the owner. The secret stays the
    thread's own, unless ``shared``: then it is derived from the task id and
    ``SECRET_KEY``, so that the same task in another process (its retry, or the
    worker that runs a task enqueued here) is the same owner, while nobody who
    only knows the task id (the admin shows it) can release its lock.
    """
    from django.utils.crypto import salted_hmac

    base = _thread_owner()
    secret = (
        salted_hmac("distlocks.owner.task_owner", task_id, algorithm="sha256").hexdigest()[:32]
        if shared
        else base.secret
    )
    return dataclasses.replace(base, task=task_id, secret=secret)


def asyncio_task_owner(task_name: str) -> Owner:
    """A new identity for an asyncio task run by the calling thread (its event loop's).

    Its secret is its own, not the thread's: the tasks on one loop are owners
    apart, and the pool threads that run the task's calls act as it.
    """
    return dataclasses.replace(_thread_owner(), task=task_name, secret=secrets.token_hex(16))


@contextlib.contextmanager
def acting_as(owner: Owner) -> Iterator[Owner]:
    """Make ``owner`` the calling thread's identity (``current_owner()``) while the block runs."""
    previous = _local.acting
    _local.acting = owner
    try:
        yield owner
    finally:
        _local.acting = previous


def task_id_of(owner: str) -> str | None:
    """Return the task id in an owner description (``LockInfo.owner``), or None."""
    _, marker, task_id = owner.rpartition(" task ")
    return task_id.strip() or None if marker else None
