"""What the native database backends (MySQL ``GET_LOCK``, PostgreSQL advisory locks) share.

The server's own lock gives mutual exclusion and a first-come, first-served
queue: a waiter blocks inside the server and is woken the moment the lock is
free, with no polling. What the server's lock lacks, a row of
``distlocks_native_lease`` adds, written in the same statement that takes the
lock: the fencing token (the row's auto-increment id, new at every
acquisition), the lease (its expiry, on the server's clock) and who holds it
from which server session.

Each hold has a connection of its own (from a per-thread pool, opened with the
table backend's ``open_like`` and tracked for forks), so that the lock survives
the caller's transactions and connection closes, and ending one hold's session
ends no other hold. A waiter that finds the lease run out while the recorded
session still holds the server's lock ends that session (``KILL CONNECTION``,
``pg_terminate_backend``) and takes the lock: a hung holder loses it after
``ttl``, and its watchdog's next renewal (or its release) finds the lease gone.

The lock is free only once its lease is too: a session can end under a holder
that learns of it at its next renewal (``KILL``, ``wait_timeout``,
``idle_session_timeout``, a proxy). An acquisition writes its lease only over
one that has ended, in the statement that takes the server's lock, else frees
that again and waits; a release ends its lease as it frees the server's lock,
and a hold let go of otherwise ends it at once. So a holder that dies (SIGKILL)
keeps the lock until its lease runs out: the server cannot tell the two apart.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlocks.backends.base import BaseLockBackend, LockInfo
from distlocks.backends.db.config import (
    CONNECTION_OPTIONS,
    LOCATION_INSTEAD,
    connection_options,
    database_address,
    database_of,
    missing_database,
    missing_table,
    unavailable,
    unmigrated,
    unmigrated_warning,
    wrong_database,
)
from distlocks.backends.db.connections import close_if_dropped, is_busy, open_like, track, tracked
from distlocks.backends.db.native_sql import TABLE, Lease, NativeStatements, TimedOut, utc
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

T = TypeVar("T")

# How long a waiter that ended an expired holder's session waits for the server to free its lock.
TAKEOVER_WAIT = 2.0
# How long at most a waiter sleeps at once while the lease of a session that ended lives on (it may end sooner).
ORPHAN_POLL = 0.5


class Deadlocked(BackendUnavailable):
    """The server chose this statement as a deadlock's victim; its connection is closed (so its locks are free).

    An acquire attempt then counts as not acquired; any other statement fails as the server being unavailable.
    """


@dataclass
class _Hold:
    connection: BaseDatabaseWrapper
    token: int
    #: The instance whose idle connections it came from, and goes back to
    #: (from whatever thread releases it), so that no thread hoards them.
    home: NativeLockBackend
    count: int = 1


# Every hold of this process by (alias, key, owner secret), whichever thread's
# backend instance took it: an asyncio task's hold is released from another
# pool thread, and the watchdog's thread frees the hold of a thread that ended
# by closing its connection.
_holding: dict[tuple[str, str, str], _Hold] = {}
_holding_lock = threading.Lock()
# The tokens of holds whose session a re-entry found ended: their leases end when the hold is let go of
# (``drop``), not at once, since the holding thread is told only once the re-entry has returned.
_unended: dict[tuple[str, str, str], int] = {}


def _cursor(connection: BaseDatabaseWrapper) -> Any:
    """The cursor of ``connection``'s session (connecting if it has none).

    Kept on the connection, with the session it belongs to, for as long as that
    session lasts: a new cursor per statement cost the client half as much
    again as a bare statement.
    """
    kept = getattr(connection, "distlocks_cursor", None)
    if kept is not None and connection.connection is not None and kept[0] is connection.connection:
        return kept[1]
    cursor = connection.cursor()
    connection.distlocks_cursor = (connection.connection, cursor)  # type: ignore[attr-defined]
    return cursor


def _forget_after_fork() -> None:
    global _holding_lock
    _holding.clear()  # the parent's sessions: connections.py has cut the child off them
    _unended.clear()
    _holding_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


class NativeLockBackend(NativeStatements, BaseLockBackend):
    """A lock backend on a database server's own named locks; subclasses give the SQL."""

    max_key_length = 255
    session_bound = True  # the server's lock belongs to a session: no detach/resume in another process
    option_names = CONNECTION_OPTIONS
    location_instead = LOCATION_INSTEAD
    needs_app = True  # the lease rows (distlocks_native_lease)
    vendor = ""

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database, self.connect_timeout, self.timeout = connection_options(alias, self.options)
        self._idle: list[BaseDatabaseWrapper] = []
        self._won: dict[str, BaseDatabaseWrapper] = {}  # taken inside wait(), recorded by the next try_acquire
        self._lease_left: dict[str, float | None] = {}
        self._orphaned: set[str] = set()  # keys whose last look found a live lease of a session that ended

    def make_key(self, name: str) -> str:
        if "\x00" in name:
            raise ValueError("name must not contain a NUL character ('\\x00'): the lease table cannot store it")
        return super().make_key(name)

    # -- connections -------------------------------------------------------------

    def _base(self) -> BaseDatabaseWrapper:
        base = database_of(self.alias, self.database)
        wrong = wrong_database(self, base.vendor)
        if wrong is not None:
            raise ImproperlyConfigured(wrong)
        return base

    def _connection(self) -> BaseDatabaseWrapper:
        """An idle connection of this thread's, or a new one (tracked: closed with its thread, cut off in forks)."""
        while self._idle:
            connection = self._idle.pop()
            if tracked(connection):  # else the parent's, in a forked child
                close_if_dropped(connection)
                return connection
        connection = open_like(self._base(), f"distlocks:{self.alias}", self.connect_timeout, self.timeout)
        track(connection)
        return connection

    def _put(self, connection: BaseDatabaseWrapper) -> None:
        self._idle.append(connection)

    def _unavailable(self, exc: Exception) -> BackendUnavailable:
        return unavailable(self.alias, self.database, exc)

    def _run(self, connection: BaseDatabaseWrapper, statement: Callable[[Any], T], waits: bool = False) -> T:
        """Run ``statement(cursor)``; any error closes the connection and raises BackendUnavailable,
        except that the wait of a statement that ``waits`` for the server's lock running out raises TimedOut."""
        try:
            return statement(_cursor(connection))
        except DatabaseError as exc:
            if waits and self.timed_out(exc):
                raise TimedOut from exc
            with contextlib.suppress(Exception):
                connection.close()
            if missing_table(exc):
                raise unmigrated(self.alias, self.database) from exc
            if is_busy(exc):
                # A half-done statement may hold the server's lock (GET_LOCK is not
                # transactional): the closed session has freed it.
                raise Deadlocked(str(self._unavailable(exc)), alias=self.alias) from exc
            raise self._unavailable(exc) from exc
        except BaseException:
            # Interrupted (a signal handler raised: Celery's soft time limit, an
            # alarm): the statement may have taken the server's lock for a session
            # nothing tracks any more. Ending the session frees it.
            with contextlib.suppress(Exception):
                connection.close()
            raise

    def _on_any(self, statement: Callable[[Any], T]) -> T:
        """Run ``statement`` on an idle connection of this thread's."""
        connection = self._connection()
        try:
            return self._run(connection, statement)
        finally:
            self._put(connection)

    # -- the lock primitives -------------------------------------------------------

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        won = self._won.pop(key, None)  # wait() took the server's lock: only the lease is left to write
        connection = won or self._connection()
        try:
            if won is not None:
                token: int | None = self._write(won, key, owner, ttl)
            else:
                token = self._attempt(connection, key, owner, ttl)
        except BackendUnavailable as exc:
            self._put(connection)  # closed: it connects again when next used
            if won is None and not isinstance(exc, Deadlocked):
                raise
            return None  # not acquired (the core tries again): a deadlock's victim, or ended before its lease write
        except BaseException:
            self._put(connection)  # closed: it connects again when next used
            raise
        if token is None:
            self._put(connection)
            return None
        with _holding_lock:
            _holding[(self.alias, key, owner.secret)] = _Hold(connection, token, self)
        return token

    def _attempt(self, connection: BaseDatabaseWrapper, key: str, owner: Owner, ttl: float) -> int | None:
        token = self._run(connection, lambda c: self.sql_try(c, key, owner, ttl))
        if token is not None:
            return token
        lease, mine = self._look(connection, key)
        if mine:  # the server's lock was free, and the lease there had ended (its holder died)
            return self._write(connection, key, owner, ttl)
        if lease is not None and not lease.holding and lease.left > 0:
            return None  # the lease of a session that ended lives on: the lock is not free yet
        if lease is not None and lease.holding and not lease.released:
            holder: tuple[float, int] | None = (lease.left, lease.session)
        else:  # no lease names the holding session (a waiter handed the lock): see sql_unleased
            holder = self._run(connection, lambda c: self.sql_unleased(c, key))
        self._lease_left[key] = None if holder is None else holder[0]
        if holder is None or holder[0] > 0:
            return None
        # The lease ran out while its session still holds the server's lock (hung,
        # or not renewed): end that session, and take the lock once the server frees it.
        self._run(connection, lambda c: self.sql_end_session(c, key, holder[1]))
        if not self._block(connection, key, min(TAKEOVER_WAIT, self.timeout)):
            return None
        return self._write(connection, key, owner, ttl)

    def _write(self, connection: BaseDatabaseWrapper, key: str, owner: Owner, ttl: float) -> int | None:
        """Write the lease of the server lock this session took; None (the server's lock freed again) if a live
        lease is there: the server ended its holder's session, which may not know yet."""
        for _ in range(2):
            token = self._run(connection, lambda c: self.sql_write(c, key, owner, ttl))
            if token is not None or not self._look(connection, key)[1]:
                return token
        connection.close()  # a lease there that keeps coming back: free the server's lock with the session
        return None

    def _look(self, connection: BaseDatabaseWrapper, key: str) -> tuple[Lease | None, bool]:
        """``sql_lease``, after an attempt that did not get the lock; note a live lease whose session ended."""
        lease, mine = self._run(connection, lambda c: self.sql_lease(c, key))
        if lease is not None and not lease.holding and lease.left > 0:
            self._orphaned.add(key)
            self._lease_left[key] = lease.left
        else:
            self._orphaned.discard(key)
        return lease, mine

    def _end_lease(self, key: str, token: int) -> None:
        """End the lease ``token`` of a hold let go of without a release, if the server answers (else it runs out)."""
        with contextlib.suppress(BackendUnavailable):
            self._on_any(lambda c: self.sql_end_lease(c, key, token))

    def _block(self, connection: BaseDatabaseWrapper, key: str, seconds: float) -> bool:
        try:
            return self._run(connection, lambda c: self.sql_block(c, key, seconds), waits=True)
        except TimedOut:
            # Cancelled by a timeout as the server granted the lock, the wait leaves it held: it won.
            return self._run(connection, lambda c: self.sql_granted(c, key))

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Wait in the server's queue for the lock, until ``remaining`` runs out or the holder's lease would.

        Each wait lasts at most ``TIMEOUT`` seconds (a server that does not
        answer is noticed within it); then the core tries again, which ends the
        session of a holder whose lease ran out.
        """
        seconds = self.timeout if remaining is None else min(remaining, self.timeout)
        left = self._lease_left.get(key)
        if left is not None and left > 0:
            seconds = min(seconds, left + 0.01)
        if key in self._orphaned:
            # The server's lock is free, but not the lock: sleep until that lease ends (or look again sooner).
            time.sleep(min(seconds, ORPHAN_POLL))
            return
        connection = self._connection()
        try:
            won = self._block(connection, key, max(seconds, 0.001))
        except BaseException:
            self._put(connection)  # closed
            raise
        if won:
            self._won[key] = connection
        else:
            self._put(connection)

    def end_wait(self, key: str, acquired: bool) -> None:
        self._lease_left.pop(key, None)
        self._orphaned.discard(key)
        won = self._won.pop(key, None)
        if won is not None:  # taken by wait() but never recorded (the caller gave up): free it
            with contextlib.suppress(Exception):
                won.close()

    def _mine(self, key: str, owner: Owner, releasing: bool = False) -> _Hold | None:
        """``owner``'s hold of ``key`` in this process, if its session lasts (else it is let go of)."""
        hold = _holding.get((self.alias, key, owner.secret))
        if hold is None or not tracked(hold.connection):  # not held, or held by the parent of this fork
            return None
        close_if_dropped(hold.connection)
        if hold.connection.connection is None:  # the session ended: so did the server's lock
            self._let_go(key, owner, hold, last=releasing and hold.count <= 1)
            return None
        return hold

    def _let_go(self, key: str, owner: Owner, hold: _Hold, last: bool) -> None:
        """Forget ``hold``, whose session ended; end its lease at its ``last`` release, else when it is dropped.

        Not sooner: the holding thread is in its critical section until then, and is told it lost the lock
        only once this call returns.
        """
        self._forget(key, owner)
        hold.home._put(hold.connection)
        if last:
            self._end_lease(key, hold.token)
        else:
            _unended[(self.alias, key, owner.secret)] = hold.token

    def _forget(self, key: str, owner: Owner) -> None:
        with _holding_lock:
            _holding.pop((self.alias, key, owner.secret), None)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        hold = self._mine(key, owner)
        if hold is None:
            return False
        try:
            renewed = self._run(hold.connection, lambda c: self.sql_renew(c, key, owner.secret, ttl, 1, hold.token))
        except BackendUnavailable:
            self._let_go(key, owner, hold, last=False)  # its session is gone, and the server's lock with it
            return False
        if renewed:
            hold.count += 1
        return renewed

    def release(self, key: str, owner: Owner) -> bool:
        hold = self._mine(key, owner, releasing=True)
        if hold is None:
            return False
        last = hold.count <= 1
        try:
            if not last:
                hold.count -= 1
                return self._run(hold.connection, lambda c: self.sql_renew(c, key, owner.secret, None, -1, hold.token))
            live = self._run(hold.connection, lambda c: self.sql_unlock(c, key, hold.token))
        except BackendUnavailable:
            self._let_go(key, owner, hold, last)  # its session is closed (by _run), and the server's lock with it
            return False
        self._forget(key, owner)
        hold.home._put(hold.connection)
        return live

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._on_any(lambda c: self.sql_renew(c, key, owner.secret, ttl, 0, None))

    def extend_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return self._on_any(lambda c: self.sql_renew(c, key, owner.secret, ttl, 0, token))

    def session_ended(self, key: str, owner: Owner) -> bool:
        hold = _holding.get((self.alias, key, owner.secret))
        return hold is not None and hold.connection.connection is None  # closed by _run: the server's lock is gone

    def drop(self, key: str, owner: Owner) -> bool:
        """Free ``owner``'s hold of ``key`` by closing its session (from any thread of the process)."""
        with _holding_lock:
            hold = _holding.pop((self.alias, key, owner.secret), None)
            unended = _unended.pop((self.alias, key, owner.secret), None)
        if hold is None:
            if unended is not None:
                self._end_lease(key, unended)
            return False
        with contextlib.suppress(Exception):
            hold.connection.close()
        self._end_lease(key, hold.token)
        return True

    # -- inspection and maintenance ----------------------------------------------

    def _infos(self, key: str | None) -> list[LockInfo]:
        rows = self._on_any(lambda c: self.sql_held(c, key))
        return [
            LockInfo(
                alias=self.alias,
                key=row[0],
                owner=f"{row[1]}:{row[2]}:{row[3]}",
                hold_count=int(row[4]),
                token=int(row[5]),
                acquired_at=utc(row[6]),
                expires_at=utc(row[7]),
                waiters=None if row[8] is None else int(row[8]),
            )
            for row in rows
        ]

    def held(self) -> Iterator[LockInfo]:
        yield from self._infos(None)

    def holder(self, key: str) -> LockInfo | None:
        return next(iter(self._infos(key)), None)

    def force_release(self, key: str, token: int | None = None) -> bool:
        """End the holding session (and so its server lock), if it still holds ``token``'s acquisition."""
        return self._on_any(lambda c: self.sql_force_release(c, key, token))

    def clear_expired(self, dry_run: bool = False) -> int:
        """Delete leases whose session no longer holds the lock; end the sessions of expired leases."""
        return self._on_any(lambda c: self.sql_clear_expired(c, dry_run))

    @property
    def address(self) -> str:
        return database_address(self.database)

    def ping(self) -> list[checks.CheckMessage]:
        return self._on_any(self.sql_warnings) + unmigrated_warning(
            self.alias, self.database, TABLE, lambda sql: self._on_any(lambda cursor: cursor.execute(sql))
        )

    def check(self) -> list[checks.CheckMessage]:
        if self.database not in connections:
            return [missing_database(self.alias, self.database)]
        wrong = wrong_database(self, connections[self.database].vendor)
        hint = "Use the backend for that database, or distlocks.backends.db.DatabaseBackend (any database)."
        return [] if wrong is None else [checks.Error(f"{wrong}.", hint=hint, id="distlocks.E007")]
