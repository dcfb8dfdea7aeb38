"""The SQL a native database backend gives per server (``mysql.py``, ``postgresql.py``), and the lease it reads.

``NativeLockBackend`` (``native.py``) builds the lock on these statements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from django.core import checks

from distlocks.owner import Owner

TABLE = "distlocks_native_lease"
# The columns ``held()`` reads, in this order.
HELD_COLUMNS = "n.lock_name, n.owner_host, n.owner_pid, n.owner_thread, n.hold_count, n.id, n.acquired_at, n.expires_at"


class TimedOut(Exception):
    """A statement waited as long as it was allowed to for the server's lock."""


@dataclass
class Lease:
    """A lock's lease row as an attempt that did not get the lock found it."""

    left: float  # seconds until it runs out (<= 0: ended)
    session: int
    holding: bool  # its session holds the server's lock
    released: bool  # ended by a release: a session holding the lock on it is taking it anew, not hung


class NativeStatements:
    """The statements of one server; each runs on the cursor given, in autocommit."""

    def server_key(self, key: str) -> str:
        """What the server locks for ``key``, as stored in the ``lock_key`` column."""
        raise NotImplementedError

    def sql_try(self, cursor: Any, key: str, owner: Owner, ttl: float) -> int | None:
        """Take the server's lock if free and write the lease, in one statement; the token or None."""
        raise NotImplementedError

    def sql_block(self, cursor: Any, key: str, seconds: float) -> bool:
        """Wait inside the server at most ``seconds`` for its lock; True if taken (no lease written), False or
        TimedOut if not (see ``sql_granted``)."""
        raise NotImplementedError

    def sql_granted(self, cursor: Any, key: str) -> bool:
        """After ``sql_block`` raised TimedOut, set the session back as it was; whether it holds the server's
        lock all the same (granted as the timeout cancelled the wait)."""
        raise NotImplementedError

    def sql_write(self, cursor: Any, key: str, owner: Owner, ttl: float) -> int | None:
        """Write the lease of a server lock this session holds, unless a live lease is there; the token, or None."""
        raise NotImplementedError

    def sql_unlock(self, cursor: Any, key: str, token: int) -> bool:
        """End the lease ``token`` and then free the server's lock; True if that lease was still live."""
        raise NotImplementedError

    def sql_lease(self, cursor: Any, key: str) -> tuple[Lease | None, bool]:
        """``key``'s lease (None: none), and whether this session holds the server's lock with none live there
        (an attempt that took it found a lease that had ended); if it holds it with a live one, it frees it."""
        raise NotImplementedError

    def sql_end_lease(self, cursor: Any, key: str, token: int) -> None:
        """End the lease ``token`` (its session has ended, or is about to): the lock is free once the server's is."""
        raise NotImplementedError

    def sql_end_session(self, cursor: Any, key: str, session: int) -> None:
        """End ``session`` if it holds ``key``'s server lock on an expired lease (not a released one), or idle on none
        (its locks are freed)."""
        raise NotImplementedError

    def sql_unleased(self, cursor: Any, key: str) -> tuple[float, int] | None:
        """The session idle holding ``key``'s server lock with no lease naming it but a released one (a waiter the
        server handed the lock to, which has yet to write its lease), and the seconds left of its ``TIMEOUT`` to
        write it; else None."""
        raise NotImplementedError

    def sql_renew(self, cursor: Any, key: str, secret: str, ttl: float | None, more: int, token: int | None) -> bool:
        """Renew (``ttl``; None: leave it) the live lease of ``secret`` whose session holds the lock, counting ``more``
        holds; only the acquisition ``token`` (None: any), so that a late renewal never touches the owner's next."""
        raise NotImplementedError

    def sql_held(self, cursor: Any, key: str | None) -> list[Sequence[Any]]:
        """Rows of ``HELD_COLUMNS`` plus waiters, of the leases whose session holds the server lock."""
        raise NotImplementedError

    def sql_force_release(self, cursor: Any, key: str, token: int | None) -> bool:
        raise NotImplementedError

    def sql_clear_expired(self, cursor: Any, dry_run: bool) -> int:
        raise NotImplementedError

    def sql_warnings(self, cursor: Any) -> list[checks.CheckMessage]:
        """What the server says that breaks these locks (a pooler, a cluster), for ``manage.py check``."""
        return []

    def timed_out(self, exc: Exception) -> bool:
        """Whether ``exc`` means a wait for the server's lock ran out of its time."""
        return False


def utc(value: datetime) -> datetime:
    """A DATETIME read back naive (MySQL) is UTC: the leases are written in UTC."""
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
