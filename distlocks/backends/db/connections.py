"""The database lock backend's connections of its own: opening, tracking, forks, dropped sessions, timeouts.

``OwnConnectionBackend`` is the table backend's base class: which connection
its statements run on, and what a driver's error means for a lock. The
waiter queue (``queue.py``) and the lock primitives (``backend.py``) build on it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DatabaseError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.db.utils import InterfaceError

from distlocks.backends.base import BaseLockBackend
from distlocks.backends.db.config import (
    CONNECTION_OPTIONS,
    LOCATION_INSTEAD,
    Unmigrated,
    connection_options,
    database_of,
    missing_table,
    unavailable,
    unmigrated,
)
from distlocks.exceptions import BackendUnavailable

T = TypeVar("T")

# Where a lock connection's settings carry its TIMEOUT, for ``_bound_lock_waits``.
_TIMEOUT_KEY = "DISTLOCKS_TIMEOUT"


# Every lock connection of this process with the thread it serves: a thread that
# ended without closing its connection has it closed when the next one is opened.
_opened: dict[BaseDatabaseWrapper, threading.Thread] = {}
_opened_lock = threading.Lock()


# Errors that mean "someone else was busy with this row": the attempt counts as
# failed and is retried, never shown to the caller (MySQL deadlock 1213,
# PostgreSQL deadlock / serialization failure, SQLite's busy database).
_MYSQL_BUSY = {1213}
_POSTGRES_BUSY = {"40001", "40P01"}
_SQLITE_BUSY = ("database is locked", "database table is locked")
# Errors that mean a statement waited ``TIMEOUT`` seconds for a lock or ran that
# long (MySQL lock wait timeout 1205, PostgreSQL lock_timeout 55P03 and
# statement_timeout 57014): not retried, the time is up.
_MYSQL_TIMED_OUT = {1205}
_POSTGRES_TIMED_OUT = {"55P03", "57014"}
# How often a busy write statement is retried before the attempt counts as failed.
_BUSY_RETRIES = 5


def is_busy(exc: Exception | None) -> bool:
    """True if ``exc`` means another session was busy with the same rows (a deadlock): try again."""
    if exc is None:
        return False
    if getattr(exc.__cause__, "sqlstate", None) in _POSTGRES_BUSY:
        return True
    if exc.args and exc.args[0] in _MYSQL_BUSY:
        return True
    return any(text in str(exc) for text in _SQLITE_BUSY)


def _timed_out(exc: Exception | None) -> bool:
    if exc is None:
        return False
    if getattr(exc.__cause__, "sqlstate", None) in _POSTGRES_TIMED_OUT:
        return True
    return bool(exc.args and exc.args[0] in _MYSQL_TIMED_OUT)


def track(connection: BaseDatabaseWrapper) -> None:
    connection.inc_thread_sharing()  # so that another thread may close it
    with _opened_lock:
        for stale, thread in list(_opened.items()):
            if not thread.is_alive():
                stale.close()
                del _opened[stale]
        _opened[connection] = threading.current_thread()


def tracked(connection: BaseDatabaseWrapper | None) -> bool:
    """True if ``connection`` is a lock connection of this process (after a fork, the parent's are not)."""
    return connection in _opened


def _forget_parents_connections() -> None:
    """In a forked child, let go of the lock connections, which are the parent's, without a word to the server.

    Closing one, or merely freeing it (mysqlclient says goodbye to the server
    then), would end the parent's session on the socket both share. So, in this
    process only, each socket is swapped for an unconnected one: whatever
    happens to these connections here reaches nobody.
    """
    global _opened, _opened_lock
    inherited, _opened, _opened_lock = _opened, {}, threading.Lock()
    for connection in inherited:
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
    """Close every lock connection of this process (each reopens when next used).

    A connection that another thread is closing at the same moment (the
    watchdog ending a hold of a thread that ended) makes the driver refuse the
    second close: that one is closed already, and the others still are.
    """
    with _opened_lock:
        for connection in _opened:
            with contextlib.suppress(DatabaseError):
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
    # A session of its own, ended by close(): a pool's close() hands the session,
    # and the server locks and LISTENs it holds, to the pool's next user.
    options.pop("pool", None)
    if base.vendor in ("mysql", "postgresql"):
        # Whole seconds: mysqlclient refuses a float (TypeError), libpq reads an integer.
        options.setdefault("connect_timeout", math.ceil(connect_timeout))
        settings_dict[_TIMEOUT_KEY] = timeout
    if base.vendor == "mysql":  # psycopg's: see _answers_bounded
        options.setdefault("read_timeout", client_timeout(timeout))
        options.setdefault("write_timeout", client_timeout(timeout))
    settings_dict["OPTIONS"] = options
    connection = type(base)(settings_dict, alias=alias)
    if base.vendor == "postgresql":
        connection.get_new_connection = _answers_bounded(connection.get_new_connection, timeout)  # type: ignore[method-assign,assignment]
    return connection


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


def _answers_bounded(get_new_connection: Callable[[Any], Any], timeout: float) -> Callable[[Any], Any]:
    """Bound psycopg's every wait for an answer on the new connection, from its first statement on.

    libpq has no read timeout, but psycopg's wait takes one. Set as the
    connection is made, before the statements Django runs on it then (the
    time zone) and ours above: a server that answers the login and then hangs
    would keep any of them waiting for good.
    """

    def connect(conn_params: Any) -> Any:
        raw = get_new_connection(conn_params)
        if _wait_takes_timeout(type(raw)):
            raw.wait = functools.partial(type(raw).wait, raw, timeout=client_timeout(timeout))
        return raw

    return connect


def _wait_takes_timeout(connection_class: Any) -> bool:
    """True if psycopg's ``Connection.wait()`` takes a deadline (3.2+; in 3.1 ``timeout`` was the poll interval)."""
    parameters = inspect.signature(connection_class.wait).parameters
    return "interval" in parameters and "timeout" in parameters


connection_created.connect(_bound_lock_waits, dispatch_uid="distlocks.backends.db.bound_lock_waits")


def execute(connection: BaseDatabaseWrapper, sql: str, params: list[Any]) -> int:
    """Run one statement; return the rows it changed."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


def session_of(connection: BaseDatabaseWrapper) -> int | None:
    """The server's id of ``connection``'s session, as the client knows it (None: not connected, or SQLite)."""
    raw = connection.connection
    if raw is None or connection.vendor not in ("mysql", "postgresql"):
        return None
    return int(raw.thread_id() if connection.vendor == "mysql" else raw.info.backend_pid)


def end_session(connection: BaseDatabaseWrapper, session: int, began: float, timeout: float) -> None:
    """End ``session``, used since ``began`` (monotonic), and wait ``timeout`` seconds at most until it is gone:
    by then what it ran has committed or rolled back, and nothing it was sent runs any more.

    Not a session the server gave the same id since (a PostgreSQL pid used
    again, any MySQL id after a restart): one that began after ``began``
    (give or take a second) is not it.
    """
    age = time.monotonic() - began - 1.0
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid, %s) FROM pg_stat_activity WHERE pid = %s"
                " AND backend_start <= STATEMENT_TIMESTAMP() - %s * INTERVAL '1 microsecond'",
                [max(1, round(timeout * 500)), session, round(age * 1_000_000)],
            )
            return
        cursor.execute("SHOW GLOBAL STATUS LIKE 'Uptime'")
        if float(cursor.fetchone()[1]) < age:  # restarted since: the session is gone, and its id may be another's
            return
        with contextlib.suppress(DatabaseError):  # gone already
            cursor.execute(f"KILL CONNECTION {int(session)}")
        deadline = time.monotonic() + timeout / 2
        while time.monotonic() < deadline:
            cursor.execute("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s", [session])
            if not cursor.fetchone()[0]:
                return
            time.sleep(0.01)


class _Raise:
    pass


RAISE = _Raise()


class OwnConnectionBackend(BaseLockBackend):
    """A backend whose lock statements run on a connection of its own (``_using``), through ``_run``."""

    option_names = CONNECTION_OPTIONS
    location_instead = LOCATION_INSTEAD

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database, self.connect_timeout, self.timeout = connection_options(alias, self.options)
        self._connection_alias = f"distlocks:{alias}"
        self._connection: BaseDatabaseWrapper | None = None

    def _using(self) -> str:
        """Return the alias to run this thread's lock statements on.

        Normally a connection of our own, opened on first use: it copies the
        database's settings but is not in ``DATABASES``, so Django neither wraps it
        in ``ATOMIC_REQUESTS`` nor closes it at the end of a request, and the
        caller's transactions never touch it. SQLite allows one writer at a time,
        so there a lock taken inside the caller's transaction joins it (a second
        connection would wait for the caller's own write lock); nobody else can
        write until it ends, and its rollback drops the lock.
        """
        base = database_of(self.alias, self.database)
        if base.vendor == "sqlite" and (base.in_atomic_block or in_memory(base)):
            return self.database
        connection = self._connection
        # First use, or this process is a fork of the one that opened it:
        if connection is None or not tracked(connection):
            connection = self._connection = open_like(base, self._connection_alias, self.connect_timeout, self.timeout)
            track(connection)
        # Registered at each use (0.5 us): Django's registry belongs to the asyncio context (asgiref's Local), and
        # one thread may lock in and out of an event loop (DJANGO_ALLOW_ASYNC_UNSAFE) with this one connection.
        connections[self._connection_alias] = connection
        return self._connection_alias

    def _run_taking(
        self,
        operation: Callable[[BaseDatabaseWrapper], T | None],
        undo: Callable[[BaseDatabaseWrapper], object],
        lost: Callable[[int], object],
        began: float,
    ) -> T | None:
        """``_run(operation, when_busy=None)`` for a statement that may take a lock, begun at ``began`` (monotonic);
        ``undo`` deletes what it took.

        Interrupted by anything but the driver (a signal handler raised:
        Celery's soft time limit, an alarm), the statement may have taken the
        lock, or still be about to, for an owner who is told it did not: its
        session is ended (and waited for), then ``undo`` runs on a new one.
        One whose connection failed (``BackendUnavailable``) may run once the
        server goes on: ``lost(session)`` has it voided then; so is an
        interrupted one whose session could not be ended, or ``undo`` run (a
        frozen server), and the interruption goes on as soon as that failed.
        """
        using = self._using()
        sessions: list[int | None] = []

        def recorded(connection: BaseDatabaseWrapper) -> T | None:
            connection.ensure_connection()
            sessions.append(session_of(connection))
            return operation(connection)

        try:
            return self._run(recorded, when_busy=None)
        except BackendUnavailable:
            if sessions and sessions[-1] is not None:
                lost(sessions[-1])
            raise
        except (DatabaseError, Unmigrated):  # the server answered: the statement ran, or will not
            raise
        except BaseException:
            # Nothing recorded: interrupted before the statement was sent, it took nothing. A session of None
            # is SQLite's: nothing to end, nor to void by, and the statement is over; undo still runs.
            session = sessions[-1] if sessions else None
            undone = False
            try:
                with contextlib.suppress(Exception):
                    if using == self._connection_alias:
                        with contextlib.suppress(Exception):
                            connections[using].close()
                    if session is not None:
                        self._run(lambda other: end_session(other, session, began, self.timeout))
                    if sessions:
                        self._run(undo)
                    undone = True
            finally:
                if not undone and session is not None:
                    with contextlib.suppress(Exception):
                        lost(session)
            raise

    def _run(self, operation: Callable[[BaseDatabaseWrapper], T], *, when_busy: T | _Raise = RAISE) -> T:
        """Run ``operation(connection)``, mapping driver errors to lock semantics.

        A busy database (deadlock) is retried a few times; then, or when a
        statement ran out of ``TIMEOUT``, the answer is ``when_busy`` (for an
        attempt to acquire: not acquired) or BackendUnavailable. Any other error
        closes our connection (the next call opens a new one) and raises
        BackendUnavailable.
        """
        using = self._using()
        connection = connections[using]
        if using == self._connection_alias:
            close_if_dropped(connection)
        error: Exception | None = None
        for _ in range(_BUSY_RETRIES):
            try:
                return operation(connection)
            except DatabaseError as exc:
                if missing_table(exc):
                    raise unmigrated(self.alias, self.database) from exc
                if not isinstance(exc, OperationalError | InterfaceError):
                    raise
                error = exc
                if is_busy(exc):
                    continue
                if using == self._connection_alias and not _timed_out(exc):
                    with contextlib.suppress(DatabaseError):
                        connection.close()
                break
        if (is_busy(error) or _timed_out(error)) and not isinstance(when_busy, _Raise):
            return when_busy
        raise unavailable(self.alias, self.database, error) from error
