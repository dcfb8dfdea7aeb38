"""How PostgreSQL wakes the table backend's waiters: a release NOTIFYs the lock's channel, on which they LISTEN.

The waiters listen on their own lock connection, which is idle while they
wait; the notification only wakes them (a look or an attempt decides), so a
lost one costs a fallback poll, never the lock. LISTEN is session state: behind
a pooler in transaction mode (PgBouncer) it would stay with a server session
that other clients get next, so there waiters only poll.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper


def channel(key: str) -> str:
    """The channel of ``key``'s releases (a hash: a channel name has 63 bytes at most)."""
    return "distlocks_" + hashlib.blake2b(key.encode(), digest_size=12).hexdigest()


def can_listen(connection: BaseDatabaseWrapper) -> bool:
    """True on PostgreSQL with psycopg 3.2+, whose ``notifies()`` takes a timeout: else waiters only poll."""
    raw = connection.connection
    return connection.vendor == "postgresql" and raw is not None and _notifies_take_timeout(type(raw))


_takes_timeout: dict[Any, bool] = {}
_own_sessions: dict[str, bool] = {}  # settings alias of a database: True if its connections have sessions of their own


def own_session(connection: BaseDatabaseWrapper, database: str, open_other: Callable[[], BaseDatabaseWrapper]) -> bool:
    """True if ``connection`` keeps one server session to itself (no pooler in transaction mode in between).

    Asked once per process and database, as the check of the advisory locks
    does: directly, statements of one connection run in one session and two
    connections open at once have two; a transaction pooler hands one server
    session to the next client that asks.
    """
    if database not in _own_sessions:
        other = open_other()
        try:
            pids = [_session(connection), _session(other), _session(connection)]
        finally:
            other.close()
        _own_sessions[database] = pids[0] == pids[2] != pids[1]
    return _own_sessions[database]


def known_own_session(database: str) -> bool:
    """True if ``own_session`` has already found that ``database``'s connections have sessions of their own."""
    return _own_sessions.get(database, False)


def _session(connection: BaseDatabaseWrapper) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _notifies_take_timeout(connection_class: Any) -> bool:
    if connection_class not in _takes_timeout:
        _takes_timeout[connection_class] = "timeout" in inspect.signature(connection_class.notifies).parameters
    return _takes_timeout[connection_class]


def notified(raw: Any, timeout: float) -> set[str] | None:
    """Wait up to ``timeout`` seconds for notifications on psycopg connection ``raw``; return their payloads.

    Ones that came while the connection ran other statements count. None
    means the connection failed: the next look finds out, and reconnects.
    """
    import psycopg

    try:
        first = list(raw.notifies(timeout=timeout, stop_after=1))
        if not first:
            return set()
        # Any others already here come with it (a backlog of earlier releases): no wait for them.
        return {notify.payload for notify in [*first, *raw.notifies(timeout=0)]}
    except psycopg.Error:
        return None


def batches(connection: BaseDatabaseWrapper) -> bool:
    """True if ``connection`` binds parameters on the client (Django's default), so that one ``execute()``
    can carry a LISTEN or UNLISTEN with a statement: one round trip, not two."""
    return not (connection.settings_dict.get("OPTIONS") or {}).get("server_side_binding")
