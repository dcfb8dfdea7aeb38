"""The database lock backend: a row per held lock in the ``Lock`` table."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from django.core import checks
from django.db import DatabaseError, IntegrityError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import QuerySet
from django.db.models.expressions import RawSQL
from django.db.utils import InterfaceError

from distlocks.backends.base import AsyncTurn, BaseLockBackend, LockInfo
from distlocks.backends.db import rw
from distlocks.backends.db.connections import (
    close_if_dropped,
    connection_options,
    database_of,
    execute,
    in_memory,
    is_busy,
    missing_database,
    open_like,
    track,
    tracked,
)
from distlocks.backends.db.notify import can_listen, channel, notified, own_session
from distlocks.backends.db.statements import sql_for
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

if TYPE_CHECKING:
    from distlocks.models import Lock, ReadWriteHold

T = TypeVar("T")

_MYSQL_TIMED_OUT = {1205}
_POSTGRES_TIMED_OUT = {"55P03", "57014"}
# Waiters poll from 1 ms, doubling up to 4 ms between reads, 4 ms more for each
# waiter ahead, and 20 ms at most. The first in the queue, which takes the lock
# next, polls every 1 ms for its first 50 ms there, then backs off likewise.
_POLL_FIRST = 0.001
_HEAD_POLL_MAX = 0.004
_HEAD_FAST = 0.05
_POLL_MAX = 0.02
# On PostgreSQL a release wakes the waiters (NOTIFY); they still look every 50 ms
# for what sends no notification: a lease that ran out, a waiter ahead leaving.
_LISTEN_POLL = 0.05
#: Seconds a waiter's place in the queue lasts unless renewed: how long a
#: waiter that crashed holds up the ones behind it, at most.
WAITER_LEASE = 2.0
# The place of an attempt not queued: behind every waiter.
_NOT_QUEUED = 2**63 - 1
# How often a busy write statement is retried before the attempt counts as failed.
_BUSY_RETRIES = 5
# OPTIONS['TIMEOUT'] by default: seconds a lock statement may wait or run.


class _Raise:
    pass


@dataclass
class _Place:
    """This thread's place in a lock's queue: the waiter row's id, and when its lease was last renewed (monotonic)."""

    id: int
    renewed: float


RAISE = _Raise()


@dataclass
class _Attempt:
    """What an async waiter's attempt gives: the token (None: not acquired), and its place if still queued."""

    token: int | None
    place: _Place | None


class _TableTurn(AsyncTurn):
    """A task's wait for a lock in the table: a place in the lock's queue, as a waiting thread takes.

    Its attempts run in whichever pool thread is free, so the place travels
    with the turn; the wait between attempts is the core's backoff on the loop.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.place: _Place | None = None
        self.tried = False

    def try_acquire(self, backend: BaseLockBackend, key: str, owner: Owner, ttl: float) -> int | None:
        assert isinstance(backend, DatabaseBackend)
        if not self.tried:  # the first attempt, as a thread's, is not queued: most find the lock free
            self.tried = True
            return backend.try_acquire(key, owner, ttl)
        attempt = backend.try_acquire_in_turn(key, owner, ttl, self.place)
        self.place = attempt.place
        return attempt.token

    def end(self, acquired: bool) -> Callable[[BaseLockBackend], None] | None:
        place, key, self.place = self.place, self.key, None
        if place is None:
            return None

        def leave(backend: BaseLockBackend) -> None:
            assert isinstance(backend, DatabaseBackend)
            backend.leave_queue(key, place)

        return leave


def _sleep(delay: float, deadline: float | None) -> bool:
    """Sleep for ``delay`` seconds with jitter (so that waiters do not poll in lockstep), not past ``deadline``.

    Return False, without sleeping, if the deadline (monotonic) has passed.
    """
    pause = delay * random.uniform(0.5, 1.0)
    if deadline is not None:
        pause = min(pause, deadline - time.monotonic())
        if pause <= 0:
            return False
    time.sleep(pause)
    return True


def _timed_out(exc: Exception | None) -> bool:
    if exc is None:
        return False
    if getattr(exc.__cause__, "sqlstate", None) in _POSTGRES_TIMED_OUT:
        return True
    return bool(exc.args and exc.args[0] in _MYSQL_TIMED_OUT)


class DatabaseBackend(BaseLockBackend):
    """Locks as rows of ``distlocks.Lock`` in the database named by ``OPTIONS['DATABASE']``."""

    max_key_length = 255

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database, self.connect_timeout, self.timeout = connection_options(alias, self.options)
        self._connection_alias = f"distlocks:{alias}"
        self._connection: BaseDatabaseWrapper | None = None
        self._places: dict[str, _Place] = {}  # this thread's (backend instances are per thread)
        self._listening: dict[str, Any] = {}  # key: the psycopg connection that LISTENs for its releases

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
        base = database_of(self.alias, self.database)
        if base.vendor == "sqlite" and (base.in_atomic_block or in_memory(base)):
            return self.database
        if not tracked(self._connection):  # first use, or this process is a fork of the one that opened it
            self._connection = open_like(base, self._connection_alias, self.connect_timeout, self.timeout)
            track(self._connection)
            connections[self._connection_alias] = self._connection
        return self._connection_alias

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
            except (OperationalError, InterfaceError) as exc:
                error = exc
                if is_busy(exc):
                    continue
                if "no such table" in str(exc):
                    raise
                if using == self._connection_alias and not _timed_out(exc):
                    with contextlib.suppress(DatabaseError):
                        connection.close()
                break
        if (is_busy(error) or _timed_out(error)) and not isinstance(when_busy, _Raise):
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
        now = RawSQL(sql_for(connection).now, ())
        locks = self._locks(connection.alias)
        return locks.filter(expires_at__gt=now) if live else locks.filter(expires_at__lte=now)

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        place = self._places.get(key)
        queued_as = _NOT_QUEUED if place is None else place.id

        def attempt(connection: BaseDatabaseWrapper) -> int | None:
            sql = sql_for(connection)
            owned = [key, owner.host[:255], owner.pid, owner.thread_label[:255], owner.secret, sql.lease(ttl)]
            params = [*owned, key, queued_as]
            leaving = place is not None and sql.insert_leaving is not None
            statement = sql.insert_leaving if leaving else sql.insert
            for _ in range(2):
                try:
                    with connection.cursor() as cursor:
                        cursor.execute(statement, [*params, queued_as] if leaving else params)
                        if sql.returning:
                            row = cursor.fetchone()
                            if row is not None and leaving:
                                self._places.pop(key, None)  # left the queue: end_wait() has nothing to delete
                            return None if row is None else int(row[0])
                        return int(cursor.lastrowid) if cursor.rowcount == 1 else None
                except IntegrityError:
                    pass
                # Taken. If its lease ran out, delete it (the statement re-checks
                # the expiry, so a live lock is never deleted) and insert again.
                if not execute(connection, sql.delete_expired, [key]):
                    return None
            return None

        return self._run(attempt, when_busy=None)

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Wait in the lock's queue until it looks free and no live waiter is ahead, at most ``remaining`` seconds.

        The first call queues this thread (a row with a growing id); then it
        polls with a plain SELECT, which takes no row or gap locks (MVCC on
        InnoDB and PostgreSQL, WAL readers on SQLite), so waiters never get in
        the holder's way. The first in the queue polls most often, as it is the
        one to take the lock next; the place is renewed every third of its lease.
        On PostgreSQL it waits for the release's notification between looks
        instead (see ``notify``).
        """
        if self._using() != self._connection_alias:
            self._poll(key, remaining)  # SQLite inside the caller's transaction: nobody else can write anyway
            return
        deadline = None if remaining is None else time.monotonic() + remaining
        place = self._places.get(key) or self._enqueue(key)
        delay = _POLL_FIRST
        head_since: float | None = None
        while True:
            if time.monotonic() - place.renewed > WAITER_LEASE / 3:
                place = self._stay_queued(key, place)
            listening = self._listen(key)  # before the look, so that no release after it goes unheard

            look = functools.partial(self._look, key, place.id)
            try:
                live, ahead = self._run(look)
            except BackendUnavailable:
                # A session the server ended during the look (KILL, a restart): the look only reads,
                # so it is asked again once, on the new connection _run opens; a second failure is the answer.
                live, ahead = self._run(look)
            if not live and not ahead:
                return
            if listening is not None:
                pause = _LISTEN_POLL if deadline is None else min(_LISTEN_POLL, deadline - time.monotonic())
                if pause <= 0:
                    return
                if notified(listening, pause) and not ahead:
                    return  # released: the first in the queue tries at once
                continue
            if ahead:
                head_since = None
                delay = min(delay * 2, _HEAD_POLL_MAX * (ahead + 1), _POLL_MAX)
            else:
                head_since = head_since or time.monotonic()
                delay = min(delay * 2, _POLL_MAX) if time.monotonic() - head_since > _HEAD_FAST else _POLL_FIRST
            if not _sleep(delay, deadline):
                return

    @staticmethod
    def _look(key: str, place: int, connection: BaseDatabaseWrapper) -> tuple[int, int]:
        """Whether the lock is live (0 or 1), and how many live waiters are ahead of ``place``."""
        with connection.cursor() as cursor:
            cursor.execute(sql_for(connection).look, [key, key, place])
            live, ahead = cursor.fetchone()
            return int(live), int(ahead)

    def _listen(self, key: str) -> Any | None:
        """On PostgreSQL, LISTEN for the releases of ``key`` on our connection (again if it was replaced).

        Return the psycopg connection that listens, or None to poll: where
        waiters only poll, or this time, if the connection failed (the look
        that follows opens another, or tells that the server is unavailable).
        """
        connection = connections[self._connection_alias]
        if not can_listen(connection):
            return None
        if self._listening.get(key) is connection.connection:
            return connection.connection
        base = connections[self.database]
        probe = functools.partial(
            open_like, base, f"{self._connection_alias}:probe", self.connect_timeout, self.timeout
        )
        try:
            if not self._run(lambda connection: own_session(connection, self.database, probe)):
                return None
            self._run(lambda connection: execute(connection, f'LISTEN "{channel(key)}"', []))
        except BackendUnavailable:
            return None
        listening = self._listening[key] = connections[self._connection_alias].connection
        return listening

    def _enqueue(self, key: str) -> _Place:
        def enqueue(connection: BaseDatabaseWrapper) -> int:
            sql = sql_for(connection)
            with connection.cursor() as cursor:
                cursor.execute(sql.enqueue, [key, sql.lease(WAITER_LEASE)])
                return int(cursor.fetchone()[0] if sql.returning else cursor.lastrowid)

        place = self._places[key] = _Place(self._run(enqueue), time.monotonic())
        return place

    def _stay_queued(self, key: str, place: _Place) -> _Place:
        """Renew the lease of ``place``; queue again at the end if it ran out (a stopped waiter) or a cleanup deleted it."""

        def renew(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            return execute(connection, sql.stay_queued, [sql.lease(WAITER_LEASE), place.id]) == 1

        renewed = time.monotonic()
        if not self._run(renew):
            return self._enqueue(key)
        place.renewed = renewed
        return place

    def end_wait(self, key: str, acquired: bool) -> None:
        """Leave the queue; if the server cannot be told, the place's lease runs out by itself."""
        place = self._places.pop(key, None)
        listening = self._listening.pop(key, None)

        def leave(connection: BaseDatabaseWrapper) -> None:
            if place is not None:
                execute(connection, sql_for(connection).dequeue, [place.id])
            if listening is not None and listening is connection.connection:
                execute(connection, f'UNLISTEN "{channel(key)}"', [])

        if place is not None or listening is not None:
            with contextlib.suppress(BackendUnavailable):
                self._run(leave)

    def async_turn(self, key: str) -> AsyncTurn:
        return _TableTurn(key)

    def try_acquire_in_turn(self, key: str, owner: Owner, ttl: float, place: _Place | None) -> _Attempt:
        """An attempt of an async waiter whose ``place`` (None: not queued yet) travels with it between pool threads.

        It queues as a waiting thread does at its first wait, so that threads
        queued later do not pass it (nor it them); its place is renewed as theirs are.
        """
        if place is None:
            place = self._enqueue(key)
        else:
            self._places[key] = place
            if time.monotonic() - place.renewed > WAITER_LEASE / 3:
                place = self._stay_queued(key, place)
        try:
            token = self.try_acquire(key, owner, ttl)
        finally:
            place = self._places.pop(key, None)  # None: the attempt left the queue
        return _Attempt(token, place)

    def leave_queue(self, key: str, place: _Place) -> None:
        """Delete ``place`` from the lock's queue (an async waiter's, at its end)."""
        self._places[key] = place
        self.end_wait(key, False)

    def _poll(self, key: str, remaining: float | None) -> None:
        """Poll with a plain SELECT until the lock looks free, for at most ``remaining`` seconds."""
        deadline = None if remaining is None else time.monotonic() + remaining
        delay = _POLL_FIRST
        while True:
            if not _sleep(delay, deadline):
                return

            def is_live(connection: BaseDatabaseWrapper) -> bool:
                with connection.cursor() as cursor:
                    cursor.execute(sql_for(connection).is_live, [key])
                    return cursor.fetchone() is not None

            if not self._run(is_live):
                return
            delay = min(delay * 2, _POLL_MAX)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            return execute(connection, sql.reenter, [sql.lease(ttl), key, owner.secret]) == 1

        return self._run(attempt)

    def release(self, key: str, owner: Owner) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            mine = [key, owner.secret]
            if execute(connection, sql.release_last, [*mine, channel(key)] if sql.notifies else mine):
                return True
            if execute(connection, sql.release_one, [key, owner.secret]):
                return True
            # The lease is gone; drop our expired row, if it is still there.
            execute(connection, sql.drop_mine, [key, owner.secret])
            return False

        return self._run(attempt)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            return execute(connection, sql.extend, [sql.lease(ttl), key, owner.secret]) == 1

        return self._run(attempt)

    # -- read-write locks (see rw) ------------------------------------------------

    rw_supported = True

    def rw_acquire(self, key: str, owner: Owner, ttl: float, mode: str) -> int | None:
        waits = self.rw_waits(key, mode)

        def attempt(connection: BaseDatabaseWrapper) -> int | None:
            return rw.acquire(
                connection, sql_for(connection).rw, sql_for(connection).lease(ttl), key, owner, mode, waits
            )

        token = self._run(attempt, when_busy=None)
        if token is None and waits:
            self.rw_waiting(key, owner)
        return token

    def _rw_renew(self, key: str, owner: Owner, ttl: float, mode: str, statement: str) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            return execute(connection, getattr(sql.rw, statement), [sql.lease(ttl), key, mode, owner.secret]) == 1

        return self._run(attempt)

    def rw_reenter(self, key: str, owner: Owner, ttl: float, mode: str) -> bool:
        return self._rw_renew(key, owner, ttl, mode, "reenter")

    def rw_extend(self, key: str, owner: Owner, ttl: float, mode: str) -> bool:
        return self._rw_renew(key, owner, ttl, mode, "extend")

    def rw_release(self, key: str, owner: Owner, mode: str) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection).rw
            params = [key, mode, owner.secret]
            if execute(connection, sql.release_last, params) or execute(connection, sql.release_one, params):
                return True
            execute(connection, sql.drop, params)  # our expired row, if it is still there
            return False

        return self._run(attempt)

    def rw_abandon(self, key: str, secret: str) -> None:
        self._run(lambda connection: execute(connection, sql_for(connection).rw.drop, [key, "waiting", secret]))

    def rw_wait(self, key: str, mode: str, attempt: int, remaining: float | None) -> None:
        delay = min(_POLL_FIRST * 2**attempt, _POLL_MAX) * random.uniform(0.5, 1.0)
        time.sleep(delay if remaining is None else min(delay, remaining))

    def rw_force_release(self, key: str, token: int | None = None) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection).rw
            if token is None:
                with connection.cursor() as cursor:
                    cursor.execute(sql.holds, [key])
                    first = cursor.fetchone()
                if first is None:
                    return False
                return execute(connection, sql.force_release, [key, first[0]]) > 0
            return execute(connection, sql.force_release, [key, token]) > 0

        return self._run(attempt)

    def _rw_held(self, connection: BaseDatabaseWrapper) -> list[LockInfo]:
        from distlocks.models import ReadWriteHold

        now = RawSQL(sql_for(connection).now, ())
        rows = list(
            ReadWriteHold.objects.using(connection.alias)
            .filter(expires_at__gt=now, mode__in=["read", "write", "waiting"])
            .order_by("lock_name", "-mode", "id")
        )
        waiting: dict[str, int] = {}
        for row in rows:
            if row.mode == "waiting":
                waiting[row.lock_name] = waiting.get(row.lock_name, 0) + 1
        return [
            dataclasses.replace(self._info(row), waiters=waiting.get(row.lock_name, 0), kind=row.mode)
            for row in rows
            if row.mode != "waiting"
        ]

    # -- inspection and maintenance --------------------------------------------

    def held(self) -> Iterator[LockInfo]:
        rows: list[Lock] = self._run(lambda connection: list(self._live(connection, True)))
        read_write = self._run(self._rw_held)
        return iter([*map(self._info, rows), *read_write])

    def holder(self, key: str) -> LockInfo | None:
        rows: list[Lock] = self._run(lambda connection: list(self._live(connection, True).filter(lock_name=key)))
        return self._info(rows[0]) if rows else None

    def _info(self, row: Lock | ReadWriteHold) -> LockInfo:
        return LockInfo(
            alias=self.alias,
            key=row.lock_name,
            owner=row.owner,
            hold_count=row.hold_count,
            token=row.pk,
            acquired_at=row.acquired_at,
            expires_at=row.expires_at,
        )

    def force_release(self, key: str, token: int | None = None) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            if token is None:
                return execute(connection, sql.force_release, [key]) > 0
            return execute(connection, sql.force_release_token, [key, token]) > 0

        return self._run(attempt)

    def clear_expired(self, dry_run: bool = False) -> int:
        """Delete the expired locks and read-write holds (gate rows stay: they are no state), and the places of
        waiters that crashed (not counted); return how many locks and holds."""

        def attempt(connection: BaseDatabaseWrapper) -> int:
            from distlocks.models import ReadWriteHold

            now = RawSQL(sql_for(connection).now, ())
            expired = self._live(connection, False)
            holds = ReadWriteHold.objects.using(connection.alias).filter(expires_at__lte=now).exclude(mode="gate")
            if dry_run:
                return expired.count() + holds.count()
            execute(connection, sql_for(connection).clear_queue, [])
            return int(expired.delete()[0] + holds.delete()[0])

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
            return [missing_database(self.alias, self.database)]
        base = connections[self.database]
        if in_memory(base):
            return [
                checks.Warning(
                    f"DISTLOCKS[{self.alias!r}] keeps locks in an in-memory SQLite database: "
                    "they are seen by this process only, and join its transactions.",
                    hint="Use a file database (or MariaDB/PostgreSQL) to lock across processes.",
                    id="distlocks.W002",
                )
            ]
        return []
