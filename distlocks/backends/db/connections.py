"""The database lock backend's connections of its own: opening, tracking, forks, dropped sessions, timeouts."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import select
import socket
import threading
from typing import Any

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

# Where a lock connection's settings carry its TIMEOUT, for ``_bound_lock_waits``.
_TIMEOUT_KEY = "DISTLOCKS_TIMEOUT"


# Every lock connection of this process with the thread it serves: a thread that
# ended without closing its connection has it closed when the next one is opened.
_opened: list[tuple[threading.Thread, BaseDatabaseWrapper]] = []
_opened_lock = threading.Lock()


def track(connection: BaseDatabaseWrapper) -> None:
    connection.inc_thread_sharing()  # so that another thread may close it
    with _opened_lock:
        for thread, stale in [entry for entry in _opened if not entry[0].is_alive()]:
            stale.close()
            _opened.remove((thread, stale))
        _opened.append((threading.current_thread(), connection))


def _forget_parents_connections() -> None:
    """In a forked child, let go of the lock connections, which are the parent's, without a word to the server.

    Closing one, or merely freeing it (mysqlclient says goodbye to the server
    then), would end the parent's session on the socket both share. So, in this
    process only, each socket is swapped for an unconnected one: whatever
    happens to these connections here reaches nobody.
    """
    global _opened, _opened_lock
    inherited, _opened, _opened_lock = _opened, [], threading.Lock()
    for _, connection in inherited:
        raw = connection.connection
        if raw is None:
            continue
        try:
            fd = raw.fileno()
        except Exception:  # SQLite, or closed underneath: no socket
            continue
        with socket.socket(socket.AF_UNIX) as unconnected:
            os.dup2(unconnected.fileno(), fd)


os.register_at_fork(after_in_child=_forget_parents_connections)


def close_connections() -> None:
    """Close every lock connection of this process (each reopens when next used)."""
    with _opened_lock:
        for _, connection in _opened:
            connection.close()


def close_if_dropped(connection: BaseDatabaseWrapper) -> None:
    """Close ``connection`` if the server ended its session while it was idle; the next statement reconnects.

    An idle connection has nothing to read: a readable socket means the server
    closed it (``wait_timeout``, ``KILL``, a restart, a proxy) or sent something
    unasked, which a ping tells apart. So no statement is sent on a dead session,
    and none is ever in doubt for that reason. While the connection is healthy
    this costs one ``poll()`` and no round trip.
    """
    fileno = getattr(connection.connection, "fileno", None)  # None: closed, or SQLite (no socket)
    if fileno is None:
        return
    try:
        poller = select.poll()
        poller.register(fileno(), select.POLLIN)
        if not poller.poll(0):
            return
    except Exception:  # a driver connection closed underneath has no socket
        pass
    if not connection.is_usable():
        with contextlib.suppress(DatabaseError):
            connection.close()


def in_memory(connection: BaseDatabaseWrapper) -> bool:
    return connection.vendor == "sqlite" and bool(connection.creation.is_in_memory_db(connection.settings_dict["NAME"]))  # type: ignore[attr-defined]


def open_like(base: BaseDatabaseWrapper, alias: str, connect_timeout: float, timeout: float) -> BaseDatabaseWrapper:
    """Return a new connection named ``alias`` with ``base``'s settings, in autocommit, bounded by the timeouts."""
    # TIME_ZONE None: read the rows' datetimes as the UTC they are stored in.
    settings_dict = {**base.settings_dict, "ATOMIC_REQUESTS": False, "AUTOCOMMIT": True, "TIME_ZONE": None}
    options = dict(settings_dict.get("OPTIONS") or {})
    if base.vendor in ("mysql", "postgresql"):
        options.setdefault("connect_timeout", connect_timeout)
        settings_dict[_TIMEOUT_KEY] = timeout
    if base.vendor == "mysql":  # psycopg's: see _bound_lock_waits
        options.setdefault("read_timeout", client_timeout(timeout))
        options.setdefault("write_timeout", client_timeout(timeout))
    settings_dict["OPTIONS"] = options
    return type(base)(settings_dict, alias=alias)


def client_timeout(timeout: float) -> int:
    """Seconds after which the client gives up on a silent server: the server's own timeouts would have answered."""
    return math.ceil(timeout) + 1


def _bound_lock_waits(sender: object, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """Once a lock connection is open, bound its lock waits and statements by ``TIMEOUT`` on the server.

    Done here rather than in the connection's options: neither startup options
    (PgBouncer refuses them) nor a second ``init_command`` (MySQL) can be relied on.
    """
    timeout = connection.settings_dict.get(_TIMEOUT_KEY)
    if timeout is None:
        return
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            seconds = math.ceil(timeout)  # whole seconds only
            cursor.execute("SET SESSION lock_wait_timeout = %s, innodb_lock_wait_timeout = %s", [seconds, seconds])
        elif connection.vendor == "postgresql":
            ms = f"{math.ceil(timeout * 1000)}ms"
            cursor.execute(
                "SELECT set_config('lock_timeout', %s, false), set_config('statement_timeout', %s, false)", [ms, ms]
            )
    raw = connection.connection
    if connection.vendor == "postgresql" and _wait_takes_timeout(type(raw)):
        # libpq has no read timeout, but psycopg's wait for an answer takes one.
        raw.wait = functools.partial(type(raw).wait, raw, timeout=client_timeout(timeout))


def _wait_takes_timeout(connection_class: Any) -> bool:
    """True if psycopg's ``Connection.wait()`` takes a deadline (3.2+; in 3.1 ``timeout`` was the poll interval)."""
    parameters = inspect.signature(connection_class.wait).parameters
    return "interval" in parameters and "timeout" in parameters


connection_created.connect(_bound_lock_waits, dispatch_uid="distlocks.backends.db.bound_lock_waits")
