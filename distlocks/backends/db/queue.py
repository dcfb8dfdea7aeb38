"""The table backend's waiter queue: a place per waiter, polled or woken, so that waiters are served in turn.

Waiting is a thing of its own beside the lock statements: a ``LockWaiter``
row per waiting thread (or task), leased and renewed while it waits, plain
SELECTs that look at the lock and the waiters ahead, and on PostgreSQL a
LISTEN for the releases. ``DatabaseBackend`` builds its primitives on this
class; its INSERT of a lock only checks the place a waiter was given here.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlocks.backends.base import AsyncTurn, BaseLockBackend, deadline_after
from distlocks.backends.db.connections import OwnConnectionBackend, execute, open_like
from distlocks.backends.db.notify import batches, can_listen, channel, known_own_session, notified, own_session
from distlocks.backends.db.statements import sql_for
from distlocks.backends.db.wake import Alarm, alarm, database_id, wait_for, wake
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

# Waiters poll from 1 ms, doubling up to 4 ms between reads for each waiter
# ahead, and 20 ms at most. The first two in the queue, the next to take the
# lock and the one after it, poll every 1 ms for their first 50 ms there, then
# back off likewise.
POLL_FIRST = 0.001
_HEAD_POLL_MAX = 0.004
_HEAD_FAST = 0.05
POLL_MAX = 0.02
# On PostgreSQL a release wakes the waiters (NOTIFY), on SQLite a datagram (wake.py);
# they still look every 50 ms for what sends none: a lease that ran out, a waiter ahead stopped.
_LISTEN_POLL = 0.05
#: Seconds a waiter's place in the queue lasts unless renewed: how long a
#: waiter that crashed holds up the ones behind it, at most.
WAITER_LEASE = 2.0


@dataclass
class Place:
    """This thread's place in a lock's queue: the waiter row's id, and when its lease was last renewed (monotonic)."""

    id: int
    renewed: float
    #: The lease of this waiter's last attempt: a hold shorter than a place's lease does not keep its place.
    ttl: float = 0.0


@dataclass
class _Attempt:
    """What an async waiter's attempt gives: the token (None: not acquired), and its place if still queued."""

    token: int | None
    place: Place | None


class _TableTurn(AsyncTurn):
    """A task's wait for a lock in the table: a place in the lock's queue, as a waiting thread takes.

    Its attempts run in whichever pool thread is free, so the place travels
    with the turn; the wait between attempts is the core's backoff on the loop.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.place: Place | None = None
        self.tried = False

    def try_acquire(self, backend: BaseLockBackend, key: str, owner: Owner, ttl: float) -> int | None:
        assert isinstance(backend, QueuedBackend)
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
            assert isinstance(backend, QueuedBackend)
            backend.leave_queue(key, place)

        return leave


def sleep(delay: float, deadline: float | None) -> bool:
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


class QueuedBackend(OwnConnectionBackend):
    """A backend whose waiters queue in the ``LockWaiter`` table (``try_acquire`` honours ``_places``)."""

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self._places: dict[str, Place] = {}  # this thread's (backend instances are per thread)
        self._listening: dict[str, Any] = {}  # key: the psycopg connection that LISTENs for its releases
        self._kept: dict[str, int] = {}  # key: the place of a lock this thread took, left at its release (MySQL)
        self._alarms: dict[str, Alarm] = {}  # key: the socket this thread sleeps on while queued (SQLite)

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Wait in the lock's queue until it looks free and no live waiter is ahead, at most ``remaining`` seconds.

        The first call queues this thread (a row with a growing id); then it
        polls with a plain SELECT, which takes no row or gap locks (MVCC on
        InnoDB and PostgreSQL, WAL readers on SQLite), so waiters never get in
        the holder's way. The first two in the queue poll most often, as they
        take the lock next; the place is renewed every third of its lease. On
        PostgreSQL a waiter waits between looks for a release's notification
        that names its place (see ``notify``), on SQLite for its datagram (``wake``).
        """
        if self._using() != self._connection_alias:
            self._poll(key, remaining)  # SQLite inside the caller's transaction: nobody else can write anyway
            return
        deadline = deadline_after(remaining)
        place = self._places.get(key) or self._enqueue(key, listen=True)
        delay = POLL_FIRST
        near_since: float | None = None
        slept_unwoken = False
        while True:
            if time.monotonic() - place.renewed > WAITER_LEASE / 3:
                place = self._stay_queued(key, place)
            listening = self._listen(key)  # before the look, so that no release after it goes unheard
            sleeper = self._alarm(key, place)  # likewise

            look = functools.partial(self._look, key, place.id)
            try:
                live, ahead = self._run(look)
            except BackendUnavailable:
                # A session the server ended during the look (KILL, a restart): the look only reads,
                # so it is asked again once, on the new connection _run opens; a second failure is the answer.
                live, ahead = self._run(look)
            if not live and not ahead:
                if sleeper is not None and slept_unwoken:
                    sleeper.unheard()
                return
            if listening is not None:
                if self._hear(listening, place.id, deadline):
                    return
                continue
            if sleeper is not None:
                if wait_for(sleeper, _LISTEN_POLL, deadline):
                    return
                slept_unwoken = True
                continue
            if ahead > 1:
                near_since = None
                delay = min(delay * 2, _HEAD_POLL_MAX * ahead, POLL_MAX)
            else:
                # The next to take the lock, or the one after it: the first takes the lock within
                # a look of a release, so the second must be looking by then, not in a long sleep.
                near_since = near_since or time.monotonic()
                delay = min(delay * 2, POLL_MAX) if time.monotonic() - near_since > _HEAD_FAST else POLL_FIRST
            if not sleep(delay, deadline):
                return

    def _alarm(self, key: str, place: Place) -> Alarm | None:
        """On SQLite (Linux), the socket on which a release wakes ``place`` (bound again if the place changed)."""
        sleeper = self._alarms.get(key)
        if sleeper is not None and sleeper.place != place.id:
            self._alarms.pop(key).close()
            sleeper = None
        if sleeper is None:
            sleeper = alarm(database_id(connections[self._connection_alias]), key, place.id)
            if sleeper is not None:
                self._alarms[key] = sleeper
        return sleeper

    def _wake_first(self, connection: BaseDatabaseWrapper, key: str) -> None:
        """On SQLite, wake the first live waiter for ``key`` (after the caller's commit, inside its transaction).

        Called once the lock is free, or a waiter left: the next one need not wait for its fallback look.
        """
        if database_id(connection) is None:
            return
        with connection.cursor() as cursor:
            cursor.execute(sql_for(connection).first, [key])
            self._wake(connection, key, cursor.fetchone()[0])

    @staticmethod
    def _wake(connection: BaseDatabaseWrapper, key: str, place: int | None) -> None:
        """Wake the waiter of ``place`` (None: nobody is queued) once the caller's transaction commits, if any."""
        database = None if place is None else database_id(connection)
        if place is not None and database is not None:
            connection.on_commit(lambda: wake(database, key, place))

    def _keeps_place(self) -> bool:
        return sql_for(connections[self._connection_alias]).release_leaving is not None

    @staticmethod
    def _hear(listening: Any, place: int, deadline: float | None) -> bool:
        """Wait for a release that names ``place`` the first in the queue, or the time for the next look.

        True: try at once (named, or the deadline passed: the core's loop ends
        it); False: look. A release names the first live waiter only, so the
        others sleep on through it instead of all looking (no herd).
        """
        look_at = time.monotonic() + _LISTEN_POLL
        while True:
            pause = look_at - time.monotonic()
            if deadline is not None and deadline - time.monotonic() < pause:
                pause = deadline - time.monotonic()
                if pause <= 0:
                    return True
            if pause <= 0:
                return False
            payloads = notified(listening, pause)
            if payloads is None or "" in payloads:  # a failed connection, or a release that named nobody
                return False
            if str(place) in payloads:
                return True

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

    def _enqueue(self, key: str, listen: bool = False) -> Place:
        """Queue for ``key``; with ``listen`` (a waiting thread's), LISTEN in the same round trip where wait() will."""

        def enqueue(connection: BaseDatabaseWrapper) -> int:
            sql = sql_for(connection)
            listen_too = (
                listen
                and can_listen(connection)
                and batches(connection)
                and known_own_session(self.database)
                and self._listening.get(key) is not connection.connection
            )
            with connection.cursor() as cursor:
                if listen_too:
                    cursor.execute(f'LISTEN "{channel(key)}"; {sql.enqueue}', [key, sql.lease(WAITER_LEASE)])
                    self._listening[key] = connection.connection
                    cursor.nextset()
                else:
                    cursor.execute(sql.enqueue, [key, sql.lease(WAITER_LEASE)])
                return int(cursor.fetchone()[0] if sql.returning else cursor.lastrowid)

        place = self._places[key] = Place(self._run(enqueue), time.monotonic())
        return place

    def _stay_queued(self, key: str, place: Place) -> Place:
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
        """Leave the queue; if the server cannot be told, the place's lease runs out by itself.

        Where one statement can delete the lock and the place (MySQL), a waiter
        that took the lock keeps its place until it releases the lock: while the
        lock is held, nobody behind could take it anyway, and the handoff has one
        round trip fewer. A place kept longer than its lease holds up nobody;
        a hold whose lease is shorter than the place's does not keep it, or a
        waiter would wait for the place after the hold's lease ran out.
        """
        place = self._places.pop(key, None)
        listening = self._listening.pop(key, None)
        sleeper = self._alarms.pop(key, None)
        if sleeper is not None:
            sleeper.close()
        if acquired and place is not None and place.ttl >= WAITER_LEASE and self._keeps_place():
            self._kept[key], place = place.id, None

        def leave(connection: BaseDatabaseWrapper) -> None:
            if place is not None:
                execute(connection, sql_for(connection).dequeue, [place.id])
                if sleeper is not None and not acquired:  # it may have been woken: pass it on
                    self._wake_first(connection, key)
            if listening is not None and listening is connection.connection:
                execute(connection, f'UNLISTEN "{channel(key)}"', [])

        if place is not None or listening is not None:
            with contextlib.suppress(BackendUnavailable):
                self._run(leave)

    def async_turn(self, key: str) -> AsyncTurn:
        return _TableTurn(key)

    def try_acquire_in_turn(self, key: str, owner: Owner, ttl: float, place: Place | None) -> _Attempt:
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

    def leave_queue(self, key: str, place: Place) -> None:
        """Delete ``place`` from the lock's queue (an async waiter's, at its end)."""
        self._places[key] = place
        self.end_wait(key, False)

    def _poll(self, key: str, remaining: float | None) -> None:
        """Poll with a plain SELECT until the lock looks free, for at most ``remaining`` seconds."""
        deadline = deadline_after(remaining)
        delay = POLL_FIRST
        while True:
            if not sleep(delay, deadline):
                return

            def is_live(connection: BaseDatabaseWrapper) -> bool:
                with connection.cursor() as cursor:
                    cursor.execute(sql_for(connection).is_live, [key])
                    return cursor.fetchone() is not None

            if not self._run(is_live):
                return
            delay = min(delay * 2, POLL_MAX)
