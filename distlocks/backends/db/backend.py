"""The database lock backend: a row per held lock in the ``Lock`` table.

The lock statements, the read-write table's and the listing live here; the
connection they run on is ``connections.py``'s, the waiter queue ``queue.py``'s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from django.core import checks
from django.db import IntegrityError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import QuerySet
from django.db.models.expressions import RawSQL

from distlocks.backends.base import LockInfo, deadline_after
from distlocks.backends.db import rw, voids
from distlocks.backends.db.config import database_address, missing_database, unmigrated_warning
from distlocks.backends.db.connections import execute, in_memory
from distlocks.backends.db.notify import batches, channel
from distlocks.backends.db.queue import POLL_FIRST, POLL_MAX, QueuedBackend, sleep
from distlocks.backends.db.statements import Statements, sql_for
from distlocks.backends.sides import ReadWriteSide
from distlocks.owner import Owner

if TYPE_CHECKING:
    from distlocks.models import Lock, ReadWriteHold

# The place of an attempt not queued: behind every waiter.
_NOT_QUEUED = 2**63 - 1
# Seconds by which the server's clock may have stepped back since an attempt began (its row is older by that).
_CLOCK_SLACK = 1.0


class DatabaseSide(ReadWriteSide):
    """A read-write lock's side as rows of ``ReadWriteHold`` (see ``ReadWriteSide`` and ``rw``)."""

    backend: DatabaseBackend

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        waits, lock = self.waits(key), self.lock_key(key)

        def attempt(connection: BaseDatabaseWrapper) -> int | None:
            sql = sql_for(connection)
            return rw.acquire(connection, sql.rw, sql.lease(ttl), lock, owner, self.mode, waits)

        # Voided by the lock's key, not the side's: the thread's next attempt at either side voids it first.
        drop = [lock, self.mode, owner.secret]
        token = self.backend._run_acquire(lock, owner, attempt, lambda sql: sql.rw.drop_attempt, drop)
        if token is None and waits:
            self.waiting(key, owner)
        return token

    def _renew(self, key: str, owner: Owner, ttl: float, statement: str, token: int | None) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            params = [sql.lease(ttl), self.lock_key(key), self.mode, owner.secret, token]
            return execute(connection, getattr(sql.rw, statement), params) == 1

        return self.backend._run(attempt)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._renew(key, owner, ttl, "reenter", None)

    def reenter_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return self._renew(key, owner, ttl, "reenter", token)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._renew(key, owner, ttl, "extend", None)

    def extend_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return self._renew(key, owner, ttl, "extend", token)

    def release(self, key: str, owner: Owner) -> bool:
        return self.release_token(key, owner, None)

    def release_token(self, key: str, owner: Owner, token: int | None) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection).rw
            params = [self.lock_key(key), self.mode, owner.secret, token]
            if execute(connection, sql.release_last, params) or execute(connection, sql.release_one, params):
                return True
            execute(connection, sql.drop_mine, params)  # our expired row, if it is still there
            return False

        return self.backend._run(attempt)

    def abandon(self, key: str, secret: str) -> None:
        params = [self.lock_key(key), "waiting", secret]
        self.backend._run(lambda connection: execute(connection, sql_for(connection).rw.drop, params))

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        sleep(min(POLL_FIRST * 2 ** min(attempt, 5), POLL_MAX), deadline_after(remaining))  # 2**1024 is no float

    def force_release(self, key: str, token: int | None = None) -> bool:
        lock = self.lock_key(key)

        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection).rw
            if token is None:
                with connection.cursor() as cursor:
                    cursor.execute(sql.holds, [lock])
                    first = cursor.fetchone()
                if first is None:
                    return False
                return execute(connection, sql.force_release, [lock, first[0]]) > 0
            return execute(connection, sql.force_release, [lock, token]) > 0

        return self.backend._run(attempt)


class DatabaseBackend(QueuedBackend):
    """Locks as rows of ``distlocks.Lock`` in the database named by ``OPTIONS['DATABASE']``."""

    max_key_length = 255
    side_class = DatabaseSide
    needs_app = True

    def make_key(self, name: str) -> str:
        """Return the key of ``name``; raise ValueError if a database cannot store it.

        PostgreSQL refuses NUL in text and the others would store it; refuse it
        on every database, so that a name works on all three or on none.
        """
        if "\x00" in name:
            raise ValueError("name must not contain a NUL character ('\\x00'): the database backend cannot store it")
        return super().make_key(name)

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
        if place is not None:
            place.ttl = ttl

        def attempt(connection: BaseDatabaseWrapper) -> int | None:
            sql = sql_for(connection)
            owned = [key, owner.host[:255], owner.pid, owner.thread_label[:255], owner.secret, sql.lease(ttl)]
            params = [*owned, key, queued_as]
            leaving = place is not None and sql.insert_leaving is not None
            statement = sql.insert_leaving if leaving else sql.insert
            # A listening waiter's attempt stops listening in the same round trip (it listens again if it lost).
            unlisten = leaving and self._listening.get(key) is connection.connection and batches(connection)
            if unlisten:
                statement = f'{statement}; UNLISTEN "{channel(key)}"'
            for _ in range(2):
                try:
                    with connection.cursor() as cursor:
                        cursor.execute(statement, [*params, queued_as] if leaving else params)
                        if unlisten:
                            self._listening.pop(key, None)
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

        return self._run_acquire(key, owner, attempt, lambda sql: sql.drop_attempt, [key, owner.secret])

    def _run_acquire(
        self,
        key: str,
        owner: Owner,
        attempt: Callable[[BaseDatabaseWrapper], int | None],
        drop: Callable[[Statements], str],
        where: list[Any],
    ) -> int | None:
        """Run ``owner``'s ``attempt`` at ``key`` (see ``_run_taking``): one whose answer was lost is voided once
        the server answers, and first of all by the owner's next attempt at ``key``; one interrupted, at once.

        Undoing it runs ``drop(statements)`` with ``where`` and the attempt's
        thread and process and start: it deletes the row this attempt may have
        inserted, and none that another attempt did, nor an older one.
        """
        began = time.monotonic()
        who = [owner.host[:255], owner.pid, owner.thread_label[:255]]

        def undo(connection: BaseDatabaseWrapper) -> None:
            sql = sql_for(connection)
            execute(connection, drop(sql), [*where, *who, sql.lease(began - time.monotonic() - _CLOCK_SLACK)])

        def lost(session: int) -> None:
            voids.void(self.database, key, owner.secret, session, began, (self.connect_timeout, self.timeout), undo)

        voids.settle(self.database, key, owner.secret, self._run)
        return self._run_taking(attempt, undo, lost, began)

    # The ``*_token`` forms name the acquisition (its row's id), the others any hold of the owner (a detached one).

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return self.reenter_token(key, owner, ttl, None)

    def reenter_token(self, key: str, owner: Owner, ttl: float, token: int | None) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            return execute(connection, sql.reenter, [sql.lease(ttl), key, owner.secret, token]) == 1

        return self._run(attempt)

    def release(self, key: str, owner: Owner) -> bool:
        return self.release_token(key, owner, None)

    def release_token(self, key: str, owner: Owner, token: int | None) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            mine = [key, owner.secret, token]
            kept = self._kept.get(key)
            if kept is not None and sql.release_leaving is not None:
                if execute(connection, sql.release_leaving, [kept, *mine]):
                    del self._kept[key]
                    return True
            elif self._release_last(connection, key, mine):
                return True
            if execute(connection, sql.release_one, mine):
                return True
            # The lease is gone; drop our expired row, if it is still there, and the place we kept.
            execute(connection, sql.drop_mine, mine)
            if self._kept.pop(key, None) is not None:
                execute(connection, sql.dequeue, [kept])
            return False

        return self._run(attempt)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self.extend_token(key, owner, ttl, None)

    def extend_token(self, key: str, owner: Owner, ttl: float, token: int | None) -> bool:
        def attempt(connection: BaseDatabaseWrapper) -> bool:
            sql = sql_for(connection)
            return execute(connection, sql.extend, [sql.lease(ttl), key, owner.secret, token]) == 1

        return self._run(attempt)

    def _release_last(self, connection: BaseDatabaseWrapper, key: str, mine: list[str | int | None]) -> bool:
        """Delete the lock's row if this is its last hold, and wake the first waiter: by NOTIFY (PostgreSQL), or
        by a datagram to the place that the statement names (SQLite); elsewhere waiters poll."""
        sql = sql_for(connection)
        if not sql.wakes:
            return bool(execute(connection, sql.release_last, [*mine, channel(key)] if sql.notifies else mine))
        with connection.cursor() as cursor:
            cursor.execute(sql.release_last, [*mine, key])
            row = cursor.fetchone()
        if row is None:
            return False
        self._wake(connection, key, row[0])
        return True

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
        return database_address(self.database)

    def ping(self) -> list[checks.CheckMessage]:
        from distlocks.models import Lock

        def ask(sql: str) -> None:
            def select(connection: BaseDatabaseWrapper) -> None:
                with connection.cursor() as cursor:
                    cursor.execute(sql)

            self._run(select)

        return unmigrated_warning(self.alias, self.database, Lock._meta.db_table, ask)

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
