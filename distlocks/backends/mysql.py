"""MySQL/MariaDB named locks as a lock backend: ``GET_LOCK`` / ``RELEASE_LOCK``.

Guarantees: the server's named lock is the mutual exclusion, and waiters
queue for it inside the server, first come first served. Named locks are
server-wide, so the server's name is the database's name and the key, used
as they are when they are short lowercase ASCII (readable in
``IS_USED_LOCK``), else replaced by ``#`` and 60 hex digits of their BLAKE2b
hash: the 64-character limit never cuts a name, and case, accents and
trailing spaces make other locks, as on the table backend. The lease row
(``distlocks_native_lease``, see ``distlocks.backends.db.native``) carries the
fencing token and the lease. Galera: ``GET_LOCK`` is local to one node, so
two clients on two nodes can both hold a lock (a system check warns).
Ending a hung holder's session takes ``KILL CONNECTION``: a user may end its
own sessions; with several users, grant ``CONNECTION_ADMIN`` (MySQL) or
``CONNECTION ADMIN`` (MariaDB).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from functools import cached_property, lru_cache
from typing import Any

from django.core import checks
from django.db import DatabaseError, connections

from distlocks.backends.db.native import NativeLockBackend
from distlocks.backends.db.native_sql import HELD_COLUMNS, TABLE, Lease
from distlocks.owner import Owner

_PLAIN = re.compile(r"[a-z0-9_.:-]{1,64}")
_NOW = "UTC_TIMESTAMP(6)"
_LATER = f"{_NOW} + INTERVAL %s MICROSECOND"
_COLUMNS = "lock_name, lock_key, session, owner_host, owner_pid, owner_thread, owner_secret, hold_count, acquired_at, expires_at"
_VALUES = f"%s, %s, CONNECTION_ID(), %s, %s, %s, %s, 1, {_NOW}, {_LATER}"
_HOLDING = "IS_USED_LOCK(n.lock_key) <=> n.session"
_LIVE = f"n.expires_at > {_NOW}"
# InnoDB (MySQL): the lock and its lease in one statement, the row written only if GET_LOCK took the lock, and
# over no live lease of the lock (the first parameter: its name), whatever its session: the lock is not free
# while it lives. A release ends its lease (below), and the next holder replaces the row.
_NO_LEASE = f"NOT EXISTS (SELECT 1 FROM {TABLE} n WHERE n.lock_name = %s AND {_LIVE})"
_TRY = f"REPLACE INTO {TABLE} ({_COLUMNS}) SELECT {_VALUES} FROM DUAL WHERE {_NO_LEASE} AND GET_LOCK(%s, 0) = 1"
_WRITE = f"REPLACE INTO {TABLE} ({_COLUMNS}) SELECT {_VALUES} FROM DUAL WHERE {_NO_LEASE}"
# The live lease is ended, then the lock freed (assignments run left to right), in one statement. Matched only if live.
_UNLOCK = (
    f"UPDATE {TABLE} n SET n.expires_at = n.acquired_at, n.hold_count = 0 * IFNULL(RELEASE_LOCK(%s), 0)"
    f" WHERE n.id = %s AND {_LIVE}"
)
_END_LEASE = f"UPDATE {TABLE} n SET n.expires_at = n.acquired_at, n.hold_count = 0 WHERE n.lock_name = %s AND n.id = %s"
# MariaDB (migration 0004): the leases in a MEMORY table, the token from a sequence, returned as the statement's
# insert id. A release deletes its lease, so the lock is free when no row is there: an insert that finds one (a
# live lease; or one that ran out, which sql_write deletes) is ignored. A statement locks the whole table, so no
# other sees the lock taken or freed without its row written or deleted. (Reading the table in the statement
# that writes it, as InnoDB's do, would cost a temporary table: 30 us a lock.)
_SEQUENCED_COLUMNS = f"id, {_COLUMNS}"
_SEQUENCED_VALUES = f"LAST_INSERT_ID(NEXTVAL(distlocks_native_token)), {_VALUES}"
_TRY_MEMORY = (
    f"INSERT IGNORE INTO {TABLE} ({_SEQUENCED_COLUMNS}) SELECT {_SEQUENCED_VALUES} FROM DUAL WHERE GET_LOCK(%s, 0) = 1"
)
_WRITE_MEMORY = f"INSERT IGNORE INTO {TABLE} ({_SEQUENCED_COLUMNS}) VALUES ({_SEQUENCED_VALUES})"
# Matched (and the lock freed) only if live, in whichever order the conditions are read.
_UNLOCK_MEMORY = f"DELETE n FROM {TABLE} n WHERE n.id = %s AND {_LIVE} AND RELEASE_LOCK(%s) IS NOT NULL"
_END_LEASE_MEMORY = f"DELETE n FROM {TABLE} n WHERE n.lock_name = %s AND n.id = %s"
_TABLE_FULL = 1114  # the MEMORY table reached its size limit
# The lease (if any); whether its session holds the lock; whether this session does (the first parameters: its
# name), and if so with a live lease there, the lock freed (left to right: after the lease is read).
_LEASE = (
    f"SELECT n.id, TIMESTAMPDIFF(MICROSECOND, {_NOW}, n.expires_at), n.session, {_HOLDING}, n.hold_count = 0,"
    f" IS_USED_LOCK(%s) <=> CONNECTION_ID(), IF(IS_USED_LOCK(%s) <=> CONNECTION_ID() AND {_LIVE}, RELEASE_LOCK(%s), NULL)"
    f" FROM (SELECT 1) one LEFT JOIN {TABLE} n ON n.lock_name = %s"
)
_RENEW = (
    f"UPDATE {TABLE} n SET {{expiry}}n.hold_count = n.hold_count + %s"
    f" WHERE n.lock_name = %s AND n.owner_secret = %s AND n.id = COALESCE(%s, n.id)"
    f" AND n.expires_at > {_NOW} AND {_HOLDING}"
)
# The session idle holding the lock (the first parameter: its server name) with no lease naming it.
_UNLEASED = (
    "FROM information_schema.PROCESSLIST p WHERE p.ID = IS_USED_LOCK(%s) AND p.COMMAND = 'Sleep'"
    f" AND NOT EXISTS (SELECT 1 FROM {TABLE} n WHERE n.lock_key = %s AND n.session = p.ID AND n.hold_count > 0)"
)
_UNKNOWN_THREAD = 1094  # KILL of a session that ended meanwhile


@lru_cache(maxsize=4096)
def server_name(database: str, key: str) -> str:
    """The ``GET_LOCK`` name of ``key`` in ``database``: at most 64 characters, distinct for distinct keys.

    Cached: an acquisition and its release need it three times.
    """
    name = f"{database}:{key}"
    if _PLAIN.fullmatch(name) and not name.startswith("#"):
        return name
    return "#" + hashlib.blake2b(name.encode(), digest_size=30).hexdigest()


class MySQLLockBackend(NativeLockBackend):
    """Locks as MySQL/MariaDB named locks, in the database named by ``OPTIONS['DATABASE']``."""

    vendor = "mysql"

    def server_key(self, key: str) -> str:
        return server_name(str(connections.settings[self.database]["NAME"]), key)

    def _values(self, key: str, owner: Owner, ttl: float) -> list[Any]:
        who = [owner.host[:255], owner.pid, owner.thread_label[:255], owner.secret]
        return [key, self.server_key(key), *who, round(ttl * 1_000_000)]

    @cached_property
    def in_memory(self) -> bool:
        """Whether the leases live in a MEMORY table with tokens from a sequence (MariaDB), else InnoDB."""
        return bool(self._base().mysql_is_mariadb)  # type: ignore[attr-defined]

    def _write_lease(self, cursor: Any, statement: str, params: list[Any], took_lock: bool) -> None:
        """Write a lease row; a MEMORY table that is full is emptied of the rows of locks no longer held first."""
        try:
            cursor.execute(statement, params)
        except DatabaseError as exc:
            if not (self.in_memory and exc.args and exc.args[0] == _TABLE_FULL):
                raise
            if took_lock:  # the failed statement may have taken the server's lock: free it before trying again
                cursor.execute("SELECT RELEASE_ALL_LOCKS()")
            cursor.execute(f"DELETE n FROM {TABLE} n WHERE NOT ({_LIVE}) AND NOT ({_HOLDING})")
            cursor.execute(statement, params)

    def sql_try(self, cursor: Any, key: str, owner: Owner, ttl: float) -> int | None:
        if self.in_memory:
            self._write_lease(cursor, _TRY_MEMORY, [*self._values(key, owner, ttl), self.server_key(key)], True)
        else:
            self._write_lease(cursor, _TRY, [*self._values(key, owner, ttl), key, self.server_key(key)], True)
        return int(cursor.lastrowid) if cursor.rowcount > 0 else None

    def sql_block(self, cursor: Any, key: str, seconds: float) -> bool:
        cursor.execute("SELECT GET_LOCK(%s, %s)", [self.server_key(key), round(seconds, 3)])
        return bool(cursor.fetchone()[0] == 1)

    def sql_write(self, cursor: Any, key: str, owner: Owner, ttl: float) -> int | None:
        if not self.in_memory:
            self._write_lease(cursor, _WRITE, [*self._values(key, owner, ttl), key], took_lock=False)
            return int(cursor.lastrowid) if cursor.rowcount > 0 else None
        self._write_lease(cursor, _WRITE_MEMORY, self._values(key, owner, ttl), took_lock=False)
        if cursor.rowcount == 0:  # a lease is there: one that ended (its holder died) is deleted, a live one stays
            cursor.execute(f"DELETE n FROM {TABLE} n WHERE n.lock_name = %s AND NOT ({_LIVE})", [key])
            if cursor.rowcount == 0:
                return None
            self._write_lease(cursor, _WRITE_MEMORY, self._values(key, owner, ttl), took_lock=False)
        return int(cursor.lastrowid) if cursor.rowcount > 0 else None

    def sql_unlock(self, cursor: Any, key: str, token: int) -> bool:
        if self.in_memory:
            cursor.execute(_UNLOCK_MEMORY, [token, self.server_key(key)])
        else:
            cursor.execute(_UNLOCK, [self.server_key(key), token])
        if cursor.rowcount == 1:
            return True
        cursor.execute("SELECT RELEASE_LOCK(%s)", [self.server_key(key)])  # the lease had ended: free the lock alone
        return False

    def sql_lease(self, cursor: Any, key: str) -> tuple[Lease | None, bool]:
        name = self.server_key(key)
        cursor.execute(_LEASE, [name, name, name, key])
        row = cursor.fetchone()
        lease = None if row[0] is None else Lease(row[1] / 1e6, int(row[2]), bool(row[3]), bool(row[4]))
        return lease, bool(row[5]) and (lease is None or lease.left <= 0)

    def sql_end_lease(self, cursor: Any, key: str, token: int) -> None:
        cursor.execute(_END_LEASE_MEMORY if self.in_memory else _END_LEASE, [key, token])

    def _kill(self, cursor: Any, session: int) -> None:
        try:
            cursor.execute(f"KILL CONNECTION {int(session)}")
        except DatabaseError as exc:
            if not (exc.args and exc.args[0] == _UNKNOWN_THREAD):
                raise

    @contextlib.contextmanager
    def _still(self, cursor: Any) -> Iterator[None]:
        """Keep the leases as read (the MEMORY table locked, which has no row locks; InnoDB: the rows read
        ``FOR UPDATE``) until the block ends: a session ended for what they say cannot have moved on meanwhile
        (released, and taken a lock again), since its statements on them wait."""
        cursor.execute(f"LOCK TABLES {TABLE} AS n WRITE, {TABLE} WRITE" if self.in_memory else "START TRANSACTION")
        try:
            yield
        finally:
            with contextlib.suppress(DatabaseError):
                cursor.execute("UNLOCK TABLES" if self.in_memory else "COMMIT")

    def sql_end_session(self, cursor: Any, key: str, session: int) -> None:
        with self._still(cursor):
            cursor.execute(
                f"SELECT n.session FROM {TABLE} n WHERE n.lock_name = %s AND n.session = %s"
                f" AND n.expires_at <= {_NOW} AND n.hold_count > 0 AND {_HOLDING} FOR UPDATE",
                [key, session],
            )
            found = cursor.fetchone()
            if found is None:  # or it holds the lock idle on no lease (see sql_unleased)
                name = self.server_key(key)
                cursor.execute(f"SELECT p.ID {_UNLEASED} AND p.ID = %s", [name, name, session])
                found = cursor.fetchone()
            if found is not None:
                self._kill(cursor, session)

    def sql_unleased(self, cursor: Any, key: str) -> tuple[float, int] | None:
        name = self.server_key(key)
        cursor.execute(f"SELECT %s - p.TIME, p.ID {_UNLEASED}", [self.timeout, name, name])
        row = cursor.fetchone()
        return None if row is None else (float(row[0]), int(row[1]))

    def sql_renew(self, cursor: Any, key: str, secret: str, ttl: float | None, more: int, token: int | None) -> bool:
        expiry = "" if ttl is None else f"n.expires_at = {_LATER}, "
        params = ([] if ttl is None else [round(ttl * 1_000_000)]) + [more, key, secret, token]
        cursor.execute(_RENEW.format(expiry=expiry), params)
        return bool(cursor.rowcount == 1)

    def sql_held(self, cursor: Any, key: str | None) -> list[Any]:
        where = " AND n.lock_name = %s" if key else ""
        cursor.execute(
            f"SELECT {HELD_COLUMNS}, NULL FROM {TABLE} n WHERE ({_HOLDING} OR {_LIVE}){where}", [key] if key else []
        )
        return list(cursor.fetchall())

    def sql_force_release(self, cursor: Any, key: str, token: int | None) -> bool:
        """Compare, then end the holding session, with the leases kept still: a stale token never ends a new hold."""
        mine = "" if token is None else " AND n.id = %s"
        with self._still(cursor):
            cursor.execute(
                f"SELECT n.id, n.session, {_HOLDING} FROM {TABLE} n"
                f" WHERE n.lock_name = %s{mine} AND ({_HOLDING} OR {_LIVE}) FOR UPDATE",
                [key, *([] if token is None else [token])],
            )
            row = cursor.fetchone()
            if row is not None:
                if row[2]:
                    self._kill(cursor, row[1])
                cursor.execute(f"DELETE FROM {TABLE} WHERE id = %s", [row[0]])
        return row is not None

    def sql_clear_expired(self, cursor: Any, dry_run: bool) -> int:
        cursor.execute(f"SELECT n.id, n.session, n.hold_count > 0 AND {_HOLDING} FROM {TABLE} n WHERE NOT ({_LIVE})")
        rows = cursor.fetchall()
        if dry_run or not rows:
            return len(rows)
        for _, session, holding in rows:
            if holding:  # an expired lease whose session still holds the lock: hung
                self._kill(cursor, session)
        cursor.execute(f"DELETE FROM {TABLE} WHERE id IN ({', '.join(['%s'] * len(rows))})", [r[0] for r in rows])
        return len(rows)

    def sql_warnings(self, cursor: Any) -> list[checks.CheckMessage]:
        cursor.execute("SHOW VARIABLES LIKE 'wsrep_on'")
        row = cursor.fetchone()
        if row is None or str(row[1]).upper() != "ON":
            return []
        return [
            checks.Warning(
                f"DISTLOCKS[{self.alias!r}]: the server is a Galera cluster node, and GET_LOCK is local to one node: "
                "clients connected to two nodes can hold the same lock at once.",
                hint="Send every client to one node (a proxy with a single writer), "
                "or use distlocks.backends.db.DatabaseBackend.",
                id="distlocks.W013",
            )
        ]
