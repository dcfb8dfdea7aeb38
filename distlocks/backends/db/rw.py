"""The database backend's read-write locks: rows of ``ReadWriteHold``, changed one lock at a time.

Every change that decides who may hold a lock runs in one transaction that
first updates the lock's "gate" row: the row lock (the database lock on
SQLite) makes the changes to one lock run one after another, while other
locks go on. Renewals and releases touch only the holder's own row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.db import IntegrityError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from distlocks.backends.db.connections import execute
from distlocks.owner import Owner


class ReadWriteStatements:
    """The read-write lock statements in one database's SQL (``now`` and ``later`` as the lock's)."""

    def __init__(self, connection: BaseDatabaseWrapper, now: str, later: str, attempt: str) -> None:
        """``attempt``: the condition on the rows that an attempt may have inserted (``Statements.drop_attempt``)."""
        from distlocks.models import ReadWriteHold

        table = connection.ops.quote_name(ReadWriteHold._meta.db_table)
        returning = " RETURNING id" if connection.vendor == "postgresql" else ""
        # As the lock's (``Statements``): the acquisition's row id too, unless None.
        mine = f"lock_name = %s AND mode = %s AND owner_secret = %s AND id = COALESCE(%s, id) AND expires_at > {now}"
        columns = (
            "lock_name, mode, owner_host, owner_pid, owner_thread, owner_secret, hold_count, acquired_at, expires_at"
        )
        self.lock_gate = f"UPDATE {table} SET expires_at = {now} WHERE lock_name = %s AND mode = 'gate'"
        self.add_gate = f"INSERT INTO {table} ({columns}) VALUES (%s, 'gate', '', 0, '', '', 0, {now}, {now})"
        # The expired rows, and the asker's own row of the side it asks for: the thread holds none, so that
        # is what a release whose answer was lost left behind (taken anew, it neither collides nor blocks).
        self.prune = (
            f"DELETE FROM {table} WHERE lock_name = %s AND mode <> 'gate'"
            f" AND (expires_at <= {now} OR (mode = %s AND owner_secret = %s))"
        )
        self.rows = f"SELECT mode, owner_secret FROM {table} WHERE lock_name = %s AND mode <> 'gate' ORDER BY id"
        self.insert = f"INSERT INTO {table} ({columns}) VALUES (%s, %s, %s, %s, %s, %s, 1, {now}, {later}){returning}"
        self.wait_more = (
            f"UPDATE {table} SET expires_at = {later} WHERE lock_name = %s AND mode = %s AND owner_secret = %s"
        )
        self.drop = f"DELETE FROM {table} WHERE lock_name = %s AND mode = %s AND owner_secret = %s"
        self.drop_mine = f"{self.drop} AND id = COALESCE(%s, id)"  # a hold, live or expired
        # The hold, or the waiting writer's record, that an attempt at a side (the second parameter) may have
        # inserted. A reader's inserts no record, and its thread's next attempt at the lock (a writer's, that
        # may) voids the reader's first: what this deletes for a reader is its hold only.
        self.drop_attempt = (
            f"DELETE FROM {table} WHERE lock_name = %s AND mode IN (%s, 'waiting') AND owner_secret = %s AND {attempt}"
        )
        self.reenter = f"UPDATE {table} SET hold_count = hold_count + 1, expires_at = {later} WHERE {mine}"
        self.extend = f"UPDATE {table} SET expires_at = {later} WHERE {mine}"
        self.release_last = f"DELETE FROM {table} WHERE {mine} AND hold_count <= 1"
        self.release_one = f"UPDATE {table} SET hold_count = hold_count - 1 WHERE {mine}"
        holds = f"lock_name = %s AND mode IN ('read', 'write') AND expires_at > {now}"
        # The writer first, then the readers in the order they came.
        self.holds = f"SELECT id FROM {table} WHERE {holds} ORDER BY mode DESC, id"
        self.force_release = f"DELETE FROM {table} WHERE lock_name = %s AND mode IN ('read', 'write') AND id = %s"
        self.returning = bool(returning)


def may_take(rows: list[tuple[str, str]], secret: str, mode: str) -> bool:
    """Whether ``secret`` may take the ``mode`` side, given the lock's live rows (mode, secret) by arrival."""
    writer = next((holder for kind, holder in rows if kind == "write"), None)
    waiting = [holder for kind, holder in rows if kind == "waiting"]
    if mode == "read":
        return writer == secret or (writer is None and not waiting)
    readers = any(kind == "read" for kind, _ in rows)
    return writer is None and not readers and (not waiting or waiting[0] == secret)


def acquire(
    connection: BaseDatabaseWrapper,
    sql: ReadWriteStatements,
    lease: Any,
    key: str,
    owner: Owner,
    mode: str,
    waits: bool,
) -> int | None:
    """One attempt at the ``mode`` side (see ``backends.sides.ReadWriteSide``); a writer that ``waits`` is recorded."""
    for _ in range(2):
        with _transaction(connection):
            if execute(connection, sql.lock_gate, [key]):
                execute(connection, sql.prune, [key, mode, owner.secret])
                with connection.cursor() as cursor:
                    cursor.execute(sql.rows, [key])
                    rows = [(str(kind), str(secret)) for kind, secret in cursor.fetchall()]
                if not may_take(rows, owner.secret, mode):
                    if waits and not execute(connection, sql.wait_more, [lease, key, "waiting", owner.secret]):
                        _insert(connection, sql, lease, key, owner, "waiting")
                    return None
                if mode == "write":
                    execute(connection, sql.drop, [key, "waiting", owner.secret])
                return _insert(connection, sql, lease, key, owner, mode)
        try:
            with _transaction(connection):
                execute(connection, sql.add_gate, [key])
        except IntegrityError:
            pass  # added by another process meanwhile
    return None


@contextlib.contextmanager
def _transaction(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """One transaction on ``connection``: on a server, the lock connection's (in autocommit) own BEGIN and COMMIT.

    Django's ``atomic()`` would, once its COMMIT failed or was interrupted,
    turn autocommit back on: on a new connection (up to ``CONNECT_TIMEOUT``
    more against a frozen server), or not at all on psycopg's, still busy
    with the COMMIT, and raise that refusal instead of the interruption. The
    COMMIT may have taken the side all the same: the caller (``_run_taking``)
    must see what went wrong as it was. On SQLite there is no answer to lose,
    and inside the caller's transaction ``atomic()`` makes a savepoint.
    """
    if connection.vendor == "sqlite":
        with transaction.atomic(using=connection.alias):
            yield
        return
    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception), connection.cursor() as cursor:
            cursor.execute("ROLLBACK")  # the session's end rolls back a connection that failed
        raise
    with connection.cursor() as cursor:
        cursor.execute("COMMIT")


def _insert(
    connection: BaseDatabaseWrapper, sql: ReadWriteStatements, lease: Any, key: str, owner: Owner, mode: str
) -> int:
    params = [key, mode, owner.host[:255], owner.pid, owner.thread_label[:255], owner.secret, lease]
    with connection.cursor() as cursor:
        cursor.execute(sql.insert, params)
        return int(cursor.fetchone()[0] if sql.returning else cursor.lastrowid)
