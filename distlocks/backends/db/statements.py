"""The database lock backend's SQL statements, in each database's dialect."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.base.base import BaseDatabaseWrapper

from distlocks.backends.db.rw import ReadWriteStatements


class Statements:
    """The lock statements in one database's SQL, built once per vendor.

    Hand-written rather than ORM queries: compiling a query costs more than the
    round trip it makes, and these run on every acquire and release. Every time
    is the database server's (``now``), never a client's.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        from distlocks.models import Lock, LockWaiter

        vendor = connection.vendor
        table = connection.ops.quote_name(Lock._meta.db_table)
        queue = connection.ops.quote_name(LockWaiter._meta.db_table)
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
            self.lease = lambda ttl: f"{ttl:+.3f} seconds"
        else:
            raise ImproperlyConfigured(f"the database lock backend does not support {connection.display_name}")
        self.now = now
        returning = " RETURNING id" if vendor == "postgresql" else ""
        # The owner's live hold; the acquisition (its token, the row's id) too, unless None: a request that
        # reaches the server late (after its caller gave up on it) never touches the owner's next hold.
        mine = f"lock_name = %s AND owner_secret = %s AND id = COALESCE(%s, id) AND expires_at > {now}"
        self.returning = bool(returning)
        # Insert only if no live waiter queued before the one inserting (the
        # last parameter: its place, or the largest id for one not queued).
        ahead = f"{queue} WHERE lock_name = %s AND id < %s AND expires_at > {now}"
        dual = " FROM DUAL" if vendor == "mysql" else ""
        self.insert = (
            f"INSERT INTO {table} (lock_name, owner_host, owner_pid, owner_thread, owner_secret,"
            f" hold_count, acquired_at, expires_at) SELECT %s, %s, %s, %s, %s, 1, {now}, {later}{dual}"
            f" WHERE NOT EXISTS (SELECT 1 FROM {ahead}){returning}"
        )
        # On PostgreSQL a waiter that takes the lock leaves the queue in the same
        # statement (the last parameter: its place); elsewhere end_wait() does.
        self.insert_leaving = (
            f"WITH taken AS ({self.insert}), gone AS (DELETE FROM {queue} WHERE id = %s"
            " AND EXISTS (SELECT 1 FROM taken)) SELECT id FROM taken"
            if returning
            else None
        )
        # A waiter's look: is the lock live, and how many live waiters are ahead of it.
        self.look = f"SELECT (SELECT COUNT(*) FROM {table} WHERE lock_name = %s AND expires_at > {now}), (SELECT COUNT(*) FROM {ahead})"
        self.enqueue = f"INSERT INTO {queue} (lock_name, expires_at) VALUES (%s, {later}){returning}"
        # Only a live place keeps its rank: one that ran out (a waiter stopped past its lease) queues again at the end.
        self.stay_queued = f"UPDATE {queue} SET expires_at = {later} WHERE id = %s AND expires_at > {now}"
        self.dequeue = f"DELETE FROM {queue} WHERE id = %s"
        # The first live place, the one a release wakes (on SQLite: wake.py).
        self.first = f"SELECT MIN(id) FROM {queue} WHERE lock_name = %s AND expires_at > {now}"
        self.clear_queue = f"DELETE FROM {queue} WHERE expires_at <= {now}"
        self.delete_expired = f"DELETE FROM {table} WHERE lock_name = %s AND expires_at <= {now}"
        self.is_live = f"SELECT 1 FROM {table} WHERE lock_name = %s AND expires_at > {now}"
        self.reenter = f"UPDATE {table} SET hold_count = hold_count + 1, expires_at = {later} WHERE {mine}"
        self.extend = f"UPDATE {table} SET expires_at = {later} WHERE {mine}"
        self.release_last = f"DELETE FROM {table} WHERE {mine} AND hold_count <= 1"
        # PostgreSQL wakes the waiters (LISTENing on the lock's channel, the
        # last parameter) when the last hold is released while any is queued;
        # the payload is the place of the first, the one to try: the others wait on.
        self.notifies = vendor == "postgresql"
        if self.notifies:
            self.release_last = (
                f"WITH gone AS ({self.release_last} RETURNING lock_name) SELECT CASE WHEN head.id IS NOT NULL"
                " THEN pg_notify(%s, head.id::text) END"
                f" FROM gone, LATERAL (SELECT MIN(w.id) AS id FROM {queue} w WHERE w.lock_name = gone.lock_name"
                f" AND w.expires_at > {now}) head"
            )
        # On SQLite (Linux, 3.35+ for RETURNING) the last release also names the first live place (the
        # last parameter: the lock's name again), whose waiter it wakes on this host (see ``wake``).
        self.wakes = vendor == "sqlite" and sys.platform == "linux" and _sqlite_version(connection) >= (3, 35)
        if self.wakes:
            self.release_last += f" RETURNING ({self.first})"
        # On MySQL the last release also deletes the place its holder queued in, if it kept one (the first parameter).
        self.release_leaving = (
            f"DELETE held, kept FROM {table} held LEFT JOIN {queue} kept ON kept.id = %s"
            f" WHERE held.lock_name = %s AND held.owner_secret = %s AND held.id = COALESCE(%s, held.id)"
            f" AND held.expires_at > {now} AND held.hold_count <= 1"
            if vendor == "mysql"
            else None
        )
        self.release_one = f"UPDATE {table} SET hold_count = hold_count - 1 WHERE {mine}"
        owned = f"DELETE FROM {table} WHERE lock_name = %s AND owner_secret = %s"
        self.drop_mine = f"{owned} AND id = COALESCE(%s, id)"  # live or expired
        # The row an attempt of this thread of this process may have inserted since (the last parameter: a
        # negative lease) it began: not a hold of another with the same secret (a Celery task's copies).
        attempt = f"owner_host = %s AND owner_pid = %s AND owner_thread = %s AND acquired_at >= {later}"
        self.drop_attempt = f"{owned} AND {attempt}"
        self.force_release = f"DELETE FROM {table} WHERE lock_name = %s"
        # Compare and delete in one statement: the next holder's row has another id.
        self.force_release_token = f"DELETE FROM {table} WHERE lock_name = %s AND id = %s"
        self.rw = ReadWriteStatements(connection, now, later, attempt)


def _sqlite_version(connection: BaseDatabaseWrapper) -> tuple[int, ...]:
    return tuple(connection.Database.sqlite_version_info)  # type: ignore[attr-defined]


_statements: dict[str, Statements] = {}


def sql_for(connection: BaseDatabaseWrapper) -> Statements:
    statements = _statements.get(connection.vendor)
    if statements is None:
        statements = _statements[connection.vendor] = Statements(connection)
    return statements
