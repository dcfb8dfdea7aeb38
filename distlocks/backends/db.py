"""Database lock backend: a row per held lock in the ``Lock`` table.

Guarantees: a lock is a row under a unique name, inserted in one statement, so
exactly one inserter wins. Leases are measured on the database server's clock
(``NOW()``), never on the clients', so clock skew between hosts does not shorten
or stretch them. An expired row is deleted by a statement that re-checks the
expiry and only then can a new row be inserted, which gives the new holder a
larger fencing token (the auto-increment key). Lock statements run on a
connection of their own in autocommit mode: a lock is visible to every process
as soon as it is taken and survives the rollback of the caller's transaction.
If the database is down, every operation raises ``BackendUnavailable`` after
at most ``CONNECT_TIMEOUT`` seconds (default 5).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, IntegrityError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField, ExpressionWrapper, F, QuerySet
from django.db.models.functions import Now
from django.db.utils import InterfaceError
from django.utils.connection import ConnectionDoesNotExist

from distlocks.backends.base import BaseLockBackend, LockInfo
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

if TYPE_CHECKING:
    from distlocks.models import Lock

T = TypeVar("T")

# Errors that mean "someone else was busy with this row": the attempt counts as
# failed and is retried, never shown to the caller (MySQL deadlock 1213 and lock
# wait timeout 1205, PostgreSQL deadlock / serialization / lock not available,
# SQLite's busy database).
_MYSQL_BUSY = {1205, 1213}
_POSTGRES_BUSY = {"40001", "40P01", "55P03"}
_SQLITE_BUSY = ("database is locked", "database table is locked")
# How often a busy write statement is retried before the attempt counts as failed.
_BUSY_RETRIES = 5


# Every lock connection with the thread it serves: a thread that ended without
# closing its connection has it closed when the next one is opened.
_opened: list[tuple[threading.Thread, BaseDatabaseWrapper]] = []
_opened_lock = threading.Lock()


def _track(connection: BaseDatabaseWrapper) -> None:
    connection.inc_thread_sharing()  # so that another thread may close it
    with _opened_lock:
        for thread, stale in [entry for entry in _opened if not entry[0].is_alive()]:
            stale.close()
            _opened.remove((thread, stale))
        _opened.append((threading.current_thread(), connection))


def close_connections() -> None:
    """Close every lock connection of this process (each reopens when next used)."""
    with _opened_lock:
        for _, connection in _opened:
            connection.close()


def _in_memory(connection: BaseDatabaseWrapper) -> bool:
    return connection.vendor == "sqlite" and bool(connection.creation.is_in_memory_db(connection.settings_dict["NAME"]))  # type: ignore[attr-defined]


def _expires(ttl: float) -> ExpressionWrapper:
    return ExpressionWrapper(Now() + timedelta(seconds=ttl), output_field=DateTimeField())


class _Raise:
    pass


RAISE = _Raise()


def _is_busy(exc: Exception | None) -> bool:
    if exc is None:
        return False
    cause = exc.__cause__
    if cause is not None and getattr(cause, "sqlstate", None) in _POSTGRES_BUSY:
        return True
    if exc.args and exc.args[0] in _MYSQL_BUSY:
        return True
    return any(text in str(exc) for text in _SQLITE_BUSY)


class DatabaseBackend(BaseLockBackend):
    """Locks as rows of ``distlocks.Lock`` in the database named by ``OPTIONS['DATABASE']``."""

    max_key_length = 255

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database: str = self.options.get("DATABASE", DEFAULT_DB_ALIAS)
        self.connect_timeout = self.options.get("CONNECT_TIMEOUT", 5)
        self._connection_alias = f"distlocks:{alias}"
        self._pid = 0

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
        settings_dict = {**base.settings_dict, "ATOMIC_REQUESTS": False, "AUTOCOMMIT": True}
        options = dict(settings_dict.get("OPTIONS") or {})
        if base.vendor in ("mysql", "postgresql"):
            options.setdefault("connect_timeout", self.connect_timeout)
        settings_dict["OPTIONS"] = options
        return type(base)(settings_dict, alias=self._connection_alias)

    def _run(self, operation: Callable[[str], T], *, when_busy: T | _Raise = RAISE) -> T:
        """Run ``operation(using)``, mapping driver errors to lock semantics.

        A busy database (deadlock, lock wait) is retried a few times, then the
        answer is ``when_busy`` (for an attempt to acquire: not acquired) or
        BackendUnavailable; so is an unreachable database.
        """
        using = self._using()
        error: Exception | None = None
        for _ in range(_BUSY_RETRIES):
            try:
                return operation(using)
            except (OperationalError, InterfaceError) as exc:
                error = exc
                if _is_busy(exc):
                    continue
                if "no such table" in str(exc):
                    raise
                if using == self._connection_alias:
                    connections[using].close_if_unusable_or_obsolete()
                    self._pid = 0  # open a fresh connection next time
                break
        if _is_busy(error) and not isinstance(when_busy, _Raise):
            return when_busy
        raise BackendUnavailable(
            f"Database {self.database!r} for locks on {self.alias!r} is unavailable: {error}", alias=self.alias
        ) from error

    # -- the lock primitives ---------------------------------------------------

    def _locks(self, using: str) -> QuerySet[Lock]:
        from distlocks.models import Lock

        return Lock.objects.using(using)

    def _live(self, using: str, key: str, owner: Owner) -> QuerySet[Lock]:
        return self._locks(using).filter(lock_name=key, owner_secret=owner.secret, expires_at__gt=Now())

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        def attempt(using: str) -> int | None:
            for _ in range(2):
                try:
                    row = self._locks(using).create(
                        lock_name=key,
                        owner_host=owner.host[:255],
                        owner_pid=owner.pid,
                        owner_thread=owner.thread[:255],
                        owner_secret=owner.secret,
                        hold_count=1,
                        acquired_at=Now(),
                        expires_at=_expires(ttl),
                    )
                    return int(row.pk)
                except IntegrityError:
                    pass
                # Taken; if its lease ran out, delete it (re-checking the expiry in
                # the same statement) and try the insert once more.
                expired = self._locks(using).filter(lock_name=key, expires_at__lte=Now())
                if not expired._raw_delete(using):
                    return None
            return None

        return self._run(attempt, when_busy=None)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        def attempt(using: str) -> bool:
            updated = self._live(using, key, owner).update(hold_count=F("hold_count") + 1, expires_at=_expires(ttl))
            return updated == 1

        return self._run(attempt)

    def release(self, key: str, owner: Owner) -> bool:
        def attempt(using: str) -> bool:
            # QuerySet._raw_delete() is one DELETE statement; delete() would wrap
            # it in a transaction: three more round trips on MySQL.
            if self._live(using, key, owner).filter(hold_count__lte=1)._raw_delete(using):
                return True
            if self._live(using, key, owner).update(hold_count=F("hold_count") - 1):
                return True
            # The lease is gone; drop our expired row, if it is still there.
            self._locks(using).filter(lock_name=key, owner_secret=owner.secret)._raw_delete(using)
            return False

        return self._run(attempt)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        def attempt(using: str) -> bool:
            return self._live(using, key, owner).update(expires_at=_expires(ttl)) == 1

        return self._run(attempt)

    # -- inspection and maintenance --------------------------------------------

    def held(self) -> Iterator[LockInfo]:
        rows: list[Lock] = self._run(lambda using: list(self._locks(using).filter(expires_at__gt=Now())))
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

    def force_release(self, key: str) -> bool:
        return bool(self._run(lambda using: self._locks(using).filter(lock_name=key)._raw_delete(using)))

    def clear_expired(self, dry_run: bool = False) -> int:
        def attempt(using: str) -> int:
            expired = self._locks(using).filter(expires_at__lte=Now())
            return int(expired.count() if dry_run else expired._raw_delete(using))

        return self._run(attempt)

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
