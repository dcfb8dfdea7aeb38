"""What the admin page and the management commands ask of the backends: the one place they reach them."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import BaseLockBackend, LockInfo
from distlocks.exceptions import LockError
from distlocks.handler import locks
from distlocks.owner import task_id_of

#: The kinds of lock, as the admin and ``distlocks_list`` show them ("read" and "write": a read-write lock's sides).
KINDS = ("lock", "semaphore", "multi", "read", "write", "leader")
READ_WRITE = ("read", "write")
# A semaphore's locks: its permits and its queue (see distlocks.semaphore).
_SEMAPHORE = re.compile(r"(^|:)sem:.*#(\d+|queue)$")
# An election's lock (see distlocks.election).
_LEADER = re.compile(r"(^|:)leader:")
# A semaphore's record of its permits count: kept on a lease backend as a lease, but held by nobody.
_PERMITS_RECORD = re.compile(r"(^|:)sem:.*#permits$")


def kind_of(info: LockInfo) -> str:
    """What kind of lock ``info`` is part of: the backend says for a read-write lock, the name or owner else."""
    if info.kind != "lock":
        return info.kind
    task = task_id_of(info.owner) or ""
    if task.startswith("permits=") or _SEMAPHORE.search(info.key):
        return "semaphore"
    if task.startswith("multi="):
        return "multi"
    if _LEADER.search(info.key):
        return "leader"
    return "lock"


@dataclass
class HeldLocks:
    """The locks held right now, and the aliases that could not tell."""

    locks: list[LockInfo] = field(default_factory=list)
    #: alias -> why its locks are missing (server down, backend cannot list).
    errors: dict[str, str] = field(default_factory=dict)


def held_locks(using: Iterable[str] | None = None) -> HeldLocks:
    """Collect the held locks of the given aliases (default: every configured one).

    One backend that is down, misconfigured (ImproperlyConfigured) or cannot
    list its locks does not hide the others: its reason goes into ``errors``.
    An alias that is not configured raises ImproperlyConfigured.

    A semaphore's permits record (``sem:<name>#permits``) is left out: on a
    lease backend it is a lease that outlives every holder by design (for
    ``MARKER_LEASE``), so listed it showed a permit held, by a process long
    gone, after the permits themselves had run out.
    """
    result = HeldLocks()
    for alias in using if using is not None else list(locks):
        try:
            result.locks.extend(
                dataclasses.replace(info, kind=kind_of(info))
                for info in locks[alias].held()
                if not _PERMITS_RECORD.search(info.key)
            )
        except NotImplementedError:
            result.errors[alias] = "this backend cannot list its locks"
        except LockError as exc:
            result.errors[alias] = str(exc)
        except ImproperlyConfigured as exc:
            if alias not in locks.settings:
                raise
            result.errors[alias] = str(exc)
    result.locks.sort(key=lambda info: (info.alias, info.key))
    return result


def force_release(alias: str, key: str, token: int | None = None, kind: str = "lock") -> bool:
    """Free the lock stored as ``key`` (a ``LockInfo.key``) whoever holds it; False if it was not held.

    With ``token``, only that acquisition of it: the server compares and frees
    in one step, so a lock that changed hands since it was shown stays held.
    A read-write lock's holder (``kind`` "read" or "write") is freed alone:
    with ``token``, that one; without, the writer or else any one reader.
    """
    backend = _backend(alias, kind)
    return backend.force_release(_key(key, kind)) if token is None else backend.force_release(_key(key, kind), token)


def holder(alias: str, key: str, kind: str = "lock") -> LockInfo | None:
    """The lock stored as ``key`` if it is held right now (one look at the server), else None.

    For a read-write lock's side (``kind`` "read" or "write"): one of its holders.
    """
    return _backend(alias, kind).holder(_key(key, kind))


def prefixed_key(alias: str, name: str) -> str | None:
    """The key a lock named ``name`` has on ``alias`` when that alias sets a KEY_PREFIX and ``name`` lacks it, else None."""
    backend = locks[alias]
    if not backend.key_prefix or name.startswith(f"{backend.key_prefix}:"):
        return None
    try:
        return backend.make_key(name)
    except ValueError:  # too long to be a name on this backend
        return None


def _backend(alias: str, kind: str) -> BaseLockBackend:
    """What holds a lock of ``kind``: the backend, or for a read-write lock's side its ``read_write_side``."""
    return locks[alias].read_write_side(kind) if kind in READ_WRITE else locks[alias]


def _key(key: str, kind: str) -> str:
    """The key of the lock stored as ``key`` on ``_backend``: a read-write lock's side's ends in ``#read``/``#write``."""
    return f"{key}#{kind}" if kind in READ_WRITE else key


def clear_expired(alias: str, dry_run: bool = False) -> tuple[int, str]:
    """Delete what locks no longer held left on ``alias``'s server: (how many, what they are).

    Raise NotImplementedError if the backend keeps no such state.
    """
    backend = locks[alias]
    return backend.clear_expired(dry_run=dry_run), backend.cleanup_noun
