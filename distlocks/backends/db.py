"""Database lock backend: a row per held lock in the ``Lock`` table.

Guarantees: a lock is a row under a unique name, inserted in one statement, so
exactly one inserter wins. Names compare byte for byte on every database (on
MySQL/MariaDB through a binary NO PAD collation): case, accents and trailing
spaces make other locks; a name with a NUL is refused (ValueError). Leases are
measured on the database server's clock, in UTC (on MySQL/MariaDB
``UTC_TIMESTAMP``, whatever the session's time zone, so a DST change neither
ends nor stretches them), never on the clients', so clock skew between hosts
does not shorten or stretch them. An expired row is deleted by a statement that
re-checks the expiry and only then can a new row be inserted, which gives the
new holder a larger fencing token (the auto-increment key); a force-release
given a token deletes the row only if it is still that acquisition, in the same
statement. Lock statements run on a connection of their own in autocommit mode:
a lock is visible to every process as soon as it is taken and survives the
rollback of the caller's transaction.

Faults: if the database is down, every operation raises ``BackendUnavailable``
after at most ``CONNECT_TIMEOUT`` seconds (default 5). On MySQL/MariaDB and
PostgreSQL, a lock statement waits at most ``OPTIONS['TIMEOUT']`` seconds
(default 5) for another session's lock (on PostgreSQL it also runs at most that
long); an attempt to acquire that runs out of it has not acquired, any other
operation raises ``BackendUnavailable``. A server that does not answer at all
(hung, or behind a link that swallows the packets) gets ``TIMEOUT`` + 1 s,
rounded up to whole seconds (on PostgreSQL: with psycopg 3.2 or newer), then the
connection is closed and ``BackendUnavailable`` raised. (SQLite waits for as long as its own ``timeout``
option says.) A session the server ended while the connection was idle
(``KILL``, ``pg_terminate_backend``; ``wait_timeout`` or a restart close it the
same way) is reopened before the next statement, which succeeds; one that dies
during a statement raises ``BackendUnavailable`` (a lock the statement may have
taken expires after its ``ttl``). A forked child never closes, nor talks on, its
parent's lock connections.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, DatabaseError, IntegrityError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.db.models import QuerySet
from django.db.models.expressions import RawSQL
from django.db.utils import InterfaceError
from django.utils.connection import ConnectionDoesNotExist

from distlocks.backends.base import BaseLockBackend, LockInfo, check_positive_number
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

if TYPE_CHECKING:
    from distlocks.models import Lock

T = TypeVar("T")

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
# Waiters poll from 1 ms, doubling up to 20 ms between reads.
_POLL_FIRST = 0.001
_POLL_MAX = 0.02
# How often a busy write statement is retried before the attempt counts as failed.
_BUSY_RETRIES = 5
# OPTIONS['TIMEOUT'] by default: seconds a lock statement may wait or run.
DEFAULT_TIMEOUT = 5.0
# Where a lock connection's settings carry its TIMEOUT, for ``_bound_lock_waits``.
_TIMEOUT_KEY = "DISTLOCKS_TIMEOUT"


# Every lock connection of this process with the thread it serves: a thread that
# ended without closing its connection has it closed when the next one is opened.
_opened: list[tuple[threading.Thread, BaseDatabaseWrapper]] = []
_opened_lock = threading.Lock()


def _track(connection: BaseDatabaseWrapper) -> None:
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


def _close_if_dropped(connection: BaseDatabaseWrapper) -> None:
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


def _in_memory(connection: BaseDatabaseWrapper) -> bool:
    return connection.vendor == "sqlite" and bool(connection.creation.is_in_memory_db(connection.settings_dict["NAME"]))  # type: ignore[attr-defined]


class _Statements:
    """The lock statements in one database's SQL, built once per vendor.

    Hand-written rather than ORM queries: compiling a query costs more than the
    round trip it makes, and these run on every acquire and release. Every time
    is the database server's (``now``), never a client's.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        from distlocks.models import Lock

        vendor = connection.vendor
        table = connection.ops.quote_name(Lock._meta.db_table)
        if vendor == "mysql":
            # UTC whatever the session's time zone, so a DST change on the server
            # neither ends nor stretches a lease; Django reads DATETIME as UTC.
            now, later = "UTC_TIMESTAMP(6)", "UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND"
            self.lease: Callable[[float], Any] = lambda ttl: round(ttl * 1_000_000)
        elif vendor == "postgresql":
            now, later = "STATEMENT_TIMESTAMP()", "STATEMENT_TIMESTAMP() + %s * INTERVAL '1 microsecond'"
            self.lease = lambda ttl: round(ttl * 1_000_000)
        elif vendor == "sqlite":
            # The text format Django stores datetimes in on SQLite.
            now = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"
            later = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %s)"
            self.lease = lambda ttl: f"+{ttl:.3f} seconds"
        else:
            raise ImproperlyConfigured(f"the database lock backend does not support {connection.display_name}")
        self.now = now
        returning = " RETURNING id" if vendor == "postgresql" else ""
        mine = f"lock_name = %s AND owner_secret = %s AND expires_at > {now}"
        self.returning = bool(returning)
        self.insert = (
            f"INSERT INTO {table} (lock_name, owner_host, owner_pid, owner_thread, owner_secret,"
            f" hold_count, acquired_at, expires_at) VALUES (%s, %s, %s, %s, %s, 1, {now}, {later}){returning}"
        )
        self.delete_expired = f"DELETE FROM {table} WHERE lock_name = %s AND expires_at <= {now}"
        self.is_live = f"SELECT 1 FROM {table} WHERE lock_name = %s AND expires_at > {now}"
        self.reenter = f"UPDATE {table} SET hold_count = hold_count + 1, expires_at = {later} WHERE {mine}"
        self.extend = f"UPDATE {table} SET expires_at = {later} WHERE {mine}"
        self.release_last = f"DELETE FROM {table} WHERE {mine} AND hold_count <= 1"
        self.release_one = f"UPDATE {table} SET hold_count = hold_count - 1 WHERE {mine}"
        self.drop_mine = f"DELETE FROM {table} WHERE lock_name = %s AND owner_secret = %s"
        self.force_release = f"DELETE FROM {table} WHERE lock_name = %s"
        # Compare and delete in one statement: the next holder's row has another id.
        self.force_release_token = f"DELETE FROM {table} WHERE lock_name = %s AND id = %s"


_statements: dict[str, _Statements] = {}


def _sql(connection: BaseDatabaseWrapper) -> _Statements:
    statements = _statements.get(connection.vendor)
    if statements is None:
        statements = _statements[connection.vendor] = _Statements(connection)
    return statements


def _execute(connection: BaseDatabaseWrapper, sql: str, params: list[Any]) -> int:
    """Run one statement; return the rows it changed."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


class _Raise:
    pass


RAISE = _Raise()


def _is_busy(exc: Exception | None) -> bool:
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


def _client_timeout(timeout: float) -> int:
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
        raw.wait = functools.partial(type(raw).wait, raw, timeout=_client_timeout(timeout))


def _wait_takes_timeout(connection_class: Any) -> bool:
    """True if psycopg's ``Connection.wait()`` takes a deadline (3.2+; in 3.1 ``timeout`` was the poll interval)."""
    parameters = inspect.signature(connection_class.wait).parameters
    return "interval" in parameters and "timeout" in parameters


connection_created.connect(_bound_lock_waits, dispatch_uid="distlocks.backends.db.bound_lock_waits")


class DatabaseBackend(BaseLockBackend):
    """Locks as rows of ``distlocks.Lock`` in the database named by ``OPTIONS['DATABASE']``."""

    max_key_length = 255

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database: str = self.options.get("DATABASE", DEFAULT_DB_ALIAS)
        self.connect_timeout = self.options.get("CONNECT_TIMEOUT", 5)
        try:
            self.timeout = check_positive_number(self.options.get("TIMEOUT", DEFAULT_TIMEOUT), "OPTIONS['TIMEOUT']")
        except ValueError as exc:
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]: {exc}") from exc
        self._connection_alias = f"distlocks:{alias}"
        self._pid = 0

    def make_key(self, name: str) -> str:
        """Return the key of ``name``; raise ValueError if a database cannot store it.

        PostgreSQL refuses NUL in text and the others would store it; refuse it
        on every database, so that a name works on all three or on none.
        """
        if "\x00" in name:
            raise ValueError("name must not contain a NUL character ('\\x00'): the database backend cannot store it")
        return super().make_key(name)

    # -- the connection of our own ---------------------------------------------

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
        try:
            base = connections[self.database]
        except ConnectionDoesNotExist as exc:
            raise ImproperlyConfigured(
                f"DISTLOCKS[{self.alias!r}]['OPTIONS']['DATABASE'] names {self.database!r}, which is not in DATABASES"
            ) from exc
        if base.vendor == "sqlite" and (base.in_atomic_block or _in_memory(base)):
            return self.database
        if self._pid != os.getpid():
            connection = self._open_like(base)
            _track(connection)
            connections[self._connection_alias] = connection
            self._pid = os.getpid()
        return self._connection_alias

    def _open_like(self, base: BaseDatabaseWrapper) -> BaseDatabaseWrapper:
        # TIME_ZONE None: read the rows' datetimes as the UTC they are stored in.
        settings_dict = {**base.settings_dict, "ATOMIC_REQUESTS": False, "AUTOCOMMIT": True, "TIME_ZONE": None}
        options = dict(settings_dict.get("OPTIONS") or {})
        if base.vendor in ("mysql", "postgresql"):
            options.setdefault("connect_timeout", self.connect_timeout)
            settings_dict[_TIMEOUT_KEY] = self.timeout
        if base.vendor == "mysql":  # psycopg's: see _bound_lock_waits
            options.setdefault("read_timeout", _client_timeout(self.timeout))
            options.setdefault("write_timeout", _client_timeout(self.timeout))
        settings_dict["OPTIONS"] = options
        return type(base)(settings_dict, alias=self._connection_alias)

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
            _close_if_dropped(connection)
        error: Exception | None = None
        for _ in range(_BUSY_RETRIES):
            try:
                return operation(connection)
            except (OperationalError, InterfaceError) as exc:
                error = exc
                if _is_busy(exc):
                    continue
                if "no such table" in str(exc):
                    raise
                if using == self._connection_alias and not _timed_out(exc):
                    with contextlib.suppress(DatabaseError):
                        connection.close()
                break
        if (_is_busy(error) or _timed_out(error)) and not isinstance(when_busy, _Raise):
            return when_busy
        raise BackendUnavailable(
            f"Database {self.database!r} for locks on {self.alias!r} is unavailable: {error}", alias=self.alias
        ) from error

    # -- the lock primitives ---------------------------------------------------

    def _locks(self, using: str) -> QuerySet[Lock]:
        from distlocks.models import Lock

        return Lock.objects.using(using)

    def _live(self, connection: BaseDatabaseWrapper, live: bool) -> QuerySet[Lock]:
        """The rows whose lease has not run out (``live``) or has, by the lock statements' clock."""
        now = RawSQL(_sql(connection).now, ())
        locks = self._locks(connection.alias)
        return locks.filter(expires_at__gt=now) if live else locks.filter(expires_at__lte=now)

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        def attempt(connection: BaseDatabaseWrapper) -> int | None:
            sql = _sql(connection)
            params = [key, owner.host[:255], owner.pid, owner.thread_label[:255], owner.secret, sql.lease(ttl)]
            for _ in range(2):
                try:
                    with connection.cursor() as cursor:
                        cursor.execute(sql.insert, params)
                        return int(cursor.fetchone()[0] if sql.returning else cursor.lastrowid)
                except IntegrityError:
                    pass
                # Taken. If its lease ran out, delete it (the statement re-checks
                # the expiry, so a live lock is never deleted) and insert again.
                if not _execute(connection, sql.delete_expired, [key]):
                    return None
            return None

        return self._run(attempt, when_busy=None)

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Poll with a plain SELECT until the lock looks free, for at most ``remaining`` seconds.

        A read takes no row or gap locks (MVCC on InnoDB and PostgreSQL, WAL
        readers on SQLite), so waiters never get in the holder's way; only when
        the lock looks free do they try the INSERT again.
        """
        deadline = None if remaining is None else time.monotonic() + remaining
        delay = _POLL_FIRST
        while True:
            pause = delay * random.uniform(0.5, 1.0)
            if deadline is not None:
                pause = min(pause, deadline - time.monotonic())
                if pause <= 0:
                    return
            time.sleep(pause)

            def is_live(connection: BaseDatabaseWrapper) -> bool:
                with connection.cursor() as cursor:
                    cursor.execute(_sql(connection).is_live, [key])
                    return cursor.fetchone() is not None

            if not self._run(is_live):
                return
            delay = min(delay * 2, _POLL_MAX)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = _sql(connection)
            return _execute(connection, sql.reenter, [sql.lease(ttl), key, owner.secret]) == 1

        return self._run(attempt)

    def release(self, key: str, owner: Owner) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = _sql(connection)
            if _execute(connection, sql.release_last, [key, owner.secret]):
                return True
            if _execute(connection, sql.release_one, [key, owner.secret]):
                return True
            # The lease is gone; drop our expired row, if it is still there.
            _execute(connection, sql.drop_mine, [key, owner.secret])
            return False

        return self._run(attempt)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = _sql(connection)
            return _execute(connection, sql.extend, [sql.lease(ttl), key, owner.secret]) == 1

        return self._run(attempt)

    # -- inspection and maintenance --------------------------------------------

    def held(self) -> Iterator[LockInfo]:
        rows: list[Lock] = self._run(lambda connection: list(self._live(connection, True)))
        for row in rows:
            yield LockInfo(
                alias=self.alias,
                name=row.lock_name,
                owner=row.owner,
                hold_count=row.hold_count,
                token=row.pk,
                acquired_at=row.acquired_at,
                expires_at=row.expires_at,
            )

    def force_release(self, key: str, token: int | None = None) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = _sql(connection)
            if token is None:
                return _execute(connection, sql.force_release, [key]) > 0
            return _execute(connection, sql.force_release_token, [key, token]) > 0

        return self._run(attempt)

    def clear_expired(self, dry_run: bool = False) -> int:
        def attempt(connection: BaseDatabaseWrapper) -> int:
            expired = self._live(connection, False)
            return expired.count() if dry_run else expired.delete()[0]

        return self._run(attempt)

    @property
    def address(self) -> str:
        database = connections.settings[self.database] if self.database in connections else {}
        where = ":".join(str(part) for part in (database.get("HOST"), database.get("PORT")) if part)
        return f"database {self.database!r} ({where + ' ' if where else ''}{database.get('NAME', '')})"

    def ping(self) -> None:
        def select_one(connection: BaseDatabaseWrapper) -> None:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")

        self._run(select_one)

    def check(self) -> list[checks.CheckMessage]:
        if self.database not in connections:
            return [
                checks.Error(
                    f"DISTLOCKS[{self.alias!r}] uses database {self.database!r}, which is not in DATABASES.",
                    hint=f"Set OPTIONS['DATABASE'] to one of: {', '.join(connections)}.",
                    id="distlocks.E003",
                )
            ]
        base = connections[self.database]
        if _in_memory(base):
            return [
                checks.Warning(
                    f"DISTLOCKS[{self.alias!r}] keeps locks in an in-memory SQLite database: "
                    "they are seen by this process only, and join its transactions.",
                    hint="Use a file database (or MariaDB/PostgreSQL) to lock across processes.",
                    id="distlocks.W002",
                )
            ]
        return []
