"""PostgreSQL advisory locks as a lock backend: ``pg_advisory_lock`` on a 64-bit key derived from the name.

Guarantees: the server's advisory lock is the mutual exclusion, and waiters
queue for it inside the server, first come first served. The key is the first
8 bytes of the BLAKE2b hash of the name: two names share a key with a
probability of about n²/2⁶⁵ among n names (one in 3.7·10¹⁰ for a million
names); if they do, they exclude each other (never both held, never one hold
shared), nothing worse. The lease row (``distlocks_native_lease``, see
``distlocks.backends.db.native``) carries the fencing token and the lease.
Needs PostgreSQL 14 or newer (``pg_terminate_backend`` with a timeout), a
session of its own per hold (never PgBouncer in transaction or statement
pooling mode: the lock would stay with a server connection that other clients
then use), and the right to end the role's own sessions (any role has it).

The tokens come from the logged sequence ``distlocks_native_token``, one
``nextval`` per acquisition, committed with ``synchronous_commit`` as
configured: the sequence writes WAL once every 32 values and that commit waits
for the flush, so after a crash it restarts past every value it handed out
(unless the statement that wrote the record failed, and the server crashed
before its WAL writer flushed it, within a second: not tested). The other 31
commits write only their commit record (the lease table is ``UNLOGGED``) and
PostgreSQL does not wait for its flush: a commit that wrote no other WAL is
asynchronous already, and after a crash the lease table is empty anyway.
Neither shortcut keeps the tokens growing: a sequence ``CACHE`` gives each
session a block of its own (a token smaller than one already handed out in
another session), and ``synchronous_commit = off`` would lose the sequence's
last WAL record in a crash, handing the same values out again (the crash test
of ``tests/faults/test_native.py``, run once against a server so configured,
saw the tokens start again at 1), and would save no flush of the others.

Why the lease is still a row (issue 16, measured, not built): the server can
enforce the lease itself. The holding session sets ``idle_session_timeout``
to the ttl in the statement that takes the lock, and any statement on that
session renews it. Checked on PostgreSQL 15: a session left idle in autocommit
(a SIGSTOPped holder too) is ended when its timeout runs out, which frees its
advisory lock, and a waiter blocked in ``pg_advisory_lock`` gets it at once. A
session blocked in ``pg_advisory_lock`` is not idle, so waiters are never ended.
Inside a transaction only ``idle_in_transaction_session_timeout`` applies. It
does not reach the 1.5x target, and it would break the contract:

- Speed. Uncontended acquire + release in one process, six variants
  interleaved in blocks of 40 cycles, 60 blocks each, 3 runs on the 2-core test
  machine (load about 2), the 10th percentile of the block medians (the quiet
  times): the floor (``pg_advisory_lock`` / ``pg_advisory_unlock`` on a Django
  cursor) 56-59 µs; this backend 155-164 µs (2.8-2.9x); the lock, the token and
  ``set_config('idle_session_timeout')`` in one statement, with unlock and
  resetting the timeout in another, and no row, listing or renewal, 112-116
  µs (1.9-2.1x). Even the least any fenced acquisition can do
  (``pg_try_advisory_lock`` and ``nextval`` in one statement, then
  ``pg_advisory_unlock``) takes 96-97 µs (1.64-1.74x). Where that goes: the
  two statements alone on the backend's own connection 67 µs (1.14-1.20x),
  through ``NativeLockBackend.try_acquire``/``release`` 78-80 µs, through
  ``lock.acquire``/``release`` 96-97 µs. The rest of the gap is on the client,
  whatever the lease is made of.
- Contract. Other sessions see only ``pg_locks`` and ``pg_stat_activity``:
  the 64-bit key (the lock's name cannot be read back from its hash), the
  session, its state and when that last changed. The token, the hold count,
  ``acquired_at``, the ttl (the timeout is a session's own setting) and the
  owner's thread and task are not there, and the listing, the admin's
  force-release (which compares the token) and ``held()`` need them. Setting
  ``application_name`` to them at every acquisition added 23-57 µs a cycle on
  a bare psycopg connection (probably because the server reports each new
  value to the client), as much as the row's write. Publishing the token as a
  second, shared advisory lock made the acquisition about as slow as this
  backend's (177-192 against 197-224 µs, in the same noisy runs). So the row
  stays.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import psycopg
from django.core import checks
from django.db import connections
from psycopg.types.numeric import Int8

from distlocks.backends.db.native import NativeLockBackend
from distlocks.backends.db.native_sql import HELD_COLUMNS, TABLE, Lease
from distlocks.owner import Owner

_TIMED_OUT = {"55P03", "57014"}  # lock_timeout, statement_timeout
_NOW = "STATEMENT_TIMESTAMP()"
_LATER = f"{_NOW} + %s * INTERVAL '1 microsecond'"
# The granted advisory lock of session n.session on n.lock_key, as pg_locks shows it (alias l).
_HOLDS = (
    "l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.pid = n.session"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND l.classid::bigint = ((n.lock_key::bigint >> 32) & 4294967295)"
    " AND l.objid::bigint = (n.lock_key::bigint & 4294967295)"
)
_HELD_BY_SESSION = f"EXISTS (SELECT 1 FROM pg_locks l WHERE {_HOLDS})"
_COLUMNS = "id, lock_name, lock_key, session, owner_host, owner_pid, owner_thread, owner_secret, hold_count, acquired_at, expires_at"
_LIVE = f"n.expires_at > {_NOW}"
# Over a lease that has ended only (released, or run out), whatever its session: the lock is not free while
# it lives. ON CONFLICT locks the row, waiting for a release's update to commit, and reads its latest version.
_UPSERT = (
    " ON CONFLICT (lock_name) DO UPDATE SET id = EXCLUDED.id, lock_key = EXCLUDED.lock_key,"
    " session = EXCLUDED.session, owner_host = EXCLUDED.owner_host, owner_pid = EXCLUDED.owner_pid,"
    " owner_thread = EXCLUDED.owner_thread, owner_secret = EXCLUDED.owner_secret, hold_count = 1,"
    f" acquired_at = EXCLUDED.acquired_at, expires_at = EXCLUDED.expires_at WHERE NOT {_LIVE} RETURNING n.id"
)
_VALUES = f"nextval('distlocks_native_token'), %s, %s, pg_backend_pid(), %s, %s, %s, %s, 1, {_NOW}, {_LATER}"
_TRY = (
    f"WITH l AS (SELECT pg_try_advisory_lock(%s) AS ok) INSERT INTO {TABLE} AS n ({_COLUMNS})"
    f" SELECT {_VALUES} FROM l WHERE l.ok{_UPSERT}"
)
_WRITE = f"INSERT INTO {TABLE} AS n ({_COLUMNS}) VALUES ({_VALUES}){_UPSERT}"
_END = (
    f"UPDATE {TABLE} n SET expires_at = n.acquired_at, hold_count = 0 WHERE n.lock_name = %s AND n.id = %s AND {_LIVE}"
)
# The live lease is ended (its row locked until the statement commits), then the lock freed: a waiter that the
# server hands the lock to writes its lease after that commit (ON CONFLICT waits for the row). Matched only if
# live; else the lock is freed alone. The row stays, for the next holder to overwrite.
_UNLOCK = f"{_END} RETURNING pg_advisory_unlock(%s)"
_MINE = (
    "EXISTS (SELECT 1 FROM pg_locks m WHERE m.locktype = 'advisory' AND m.objsubid = 1 AND m.granted"
    " AND m.pid = pg_backend_pid() AND m.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND m.classid::bigint = ((%s::bigint >> 32) & 4294967295) AND m.objid::bigint = (%s::bigint & 4294967295))"
)
# The lease (if any); whether its session holds the lock; whether this session does (the first parameters: its
# key), and if so with a live lease there, the lock freed (left to right: after the lease is read).
_LEASE = (
    f"SELECT n.id, EXTRACT(EPOCH FROM n.expires_at - {_NOW}), n.session, {_HELD_BY_SESSION}, n.hold_count = 0,"
    f" {_MINE}, CASE WHEN {_MINE} AND {_LIVE} THEN pg_advisory_unlock(%s) END"
    f" FROM (SELECT 1) one LEFT JOIN {TABLE} n ON n.lock_name = %s"
)
_END_EXPIRED = (
    f"SELECT pg_terminate_backend(n.session::int, %s) FROM {TABLE} n"
    f" WHERE n.lock_name = %s AND n.session = %s AND n.expires_at <= {_NOW} AND n.hold_count > 0 AND {_HELD_BY_SESSION}"
)
# The session idle holding the advisory lock (alias l) with no lease naming it (the first parameter: the lock_key).
_UNLEASED = (
    "l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND a.pid = l.pid AND a.state = 'idle'"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND l.classid::bigint = ((%s::bigint >> 32) & 4294967295) AND l.objid::bigint = (%s::bigint & 4294967295)"
    f" AND NOT EXISTS (SELECT 1 FROM {TABLE} n WHERE n.lock_key = %s AND n.session = l.pid AND n.hold_count > 0)"
)
_RENEW = (
    f"UPDATE {TABLE} n SET {{expiry}}hold_count = n.hold_count + %s"
    f" WHERE n.lock_name = %s AND n.owner_secret = %s AND n.id = COALESCE(%s, n.id)"
    f" AND n.expires_at > {_NOW} AND {_HELD_BY_SESSION}"
)
# Held: by its session, or by a live lease whose session ended (it holds the lock until the lease ends).
_HELD = (
    f"SELECT {HELD_COLUMNS}, (SELECT COUNT(*) FROM pg_locks w WHERE w.locktype = 'advisory' AND NOT w.granted"
    " AND w.objsubid = 1 AND w.database = l.database AND w.classid = l.classid AND w.objid = l.objid)"
    f" FROM {TABLE} n LEFT JOIN pg_locks l ON {_HOLDS} WHERE (l.pid IS NOT NULL OR {_LIVE})"
)
_STALE = f"NOT {_LIVE}"


def _execute(cursor: Any, sql: str, params: list[Any]) -> Any:
    """Run one of the statements of every acquisition and release, prepared; its first row.

    psycopg binds the parameters on the server and prepares the statement at
    its first use in a session, so the server parses and plans it once per
    session, not at every lock (planning alone was 100 of their 165 µs of
    server time), and nothing is quoted into the text (measured here, pinned to
    one core: acquire + release 98 µs with the parameters quoted into
    ``EXECUTE`` of a ``PREPARE``d statement, 74 µs bound). Errors are turned
    into Django's as Django's cursor does (Django's cursor cost 4-5 µs more a
    statement).
    """
    connection = cursor.db
    kept = getattr(connection, "distlocks_bound", None)
    if kept is not None and kept[0] is connection.connection:
        bound = kept[1]
    else:  # the session's first statement: kept with the session it belongs to, as native._cursor keeps Django's
        raw = connection.connection
        raw.prepare_threshold = _ONLY_WHEN_ASKED  # Django's None would turn ``prepare=True`` off too
        bound = psycopg.Cursor(raw)
        connection.distlocks_bound = (raw, bound)
    # Every int as a bigint: psycopg sends the smallest type that fits, and each
    # new combination of types would be prepared anew.
    params = [Int8(param) if type(param) is int else param for param in params]
    with cursor.db.wrap_database_errors:
        bound.execute(sql, params, prepare=True)
        return bound.fetchone()


_ONLY_WHEN_ASKED = 2**62


@functools.lru_cache(maxsize=4096)
def advisory_key(key: str) -> int:
    """The signed 64-bit advisory lock key of ``key``: the same in every process and Python version.

    Cached: an acquisition and its release need it three times (1.8 µs each uncached, 0.2 cached).
    """
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big", signed=True)


class AdvisoryLockBackend(NativeLockBackend):
    """Locks as PostgreSQL session-level advisory locks, in the database named by ``OPTIONS['DATABASE']``."""

    vendor = "postgresql"

    def server_key(self, key: str) -> str:
        return str(advisory_key(key))

    def _ms(self) -> int:
        return round(self.timeout * 1000)

    def timed_out(self, exc: Exception) -> bool:
        return getattr(exc.__cause__, "sqlstate", None) in _TIMED_OUT

    def _values(self, key: str, owner: Owner, ttl: float) -> list[Any]:
        who = [owner.host[:255], owner.pid, owner.thread_label[:255], owner.secret]
        return [key, self.server_key(key), *who, round(ttl * 1_000_000)]

    def sql_try(self, cursor: Any, key: str, owner: Owner, ttl: float) -> int | None:
        row = _execute(cursor, _TRY, [advisory_key(key), *self._values(key, owner, ttl)])
        return None if row is None else int(row[0])

    def sql_block(self, cursor: Any, key: str, seconds: float) -> bool:
        """Wait with ``lock_timeout`` set to ``seconds`` (read when the wait begins), then set back to ``TIMEOUT``."""
        cursor.execute(
            "SELECT set_config('lock_timeout', %s, false), pg_advisory_lock(%s), set_config('lock_timeout', %s, false)",
            [f"{max(1, round(seconds * 1000))}ms", advisory_key(key), f"{self._ms()}ms"],
        )
        return True

    def sql_granted(self, cursor: Any, key: str) -> bool:
        # A wait cancelled by its lock_timeout (55P03) or statement_timeout (57014) after the releasing session
        # granted it the lock (the grant is made there, the cancel here) keeps the session-level lock.
        number = advisory_key(key)
        cursor.execute(f"SELECT set_config('lock_timeout', %s, false), {_MINE}", [f"{self._ms()}ms", number, number])
        return bool(cursor.fetchone()[1])

    def sql_write(self, cursor: Any, key: str, owner: Owner, ttl: float) -> int | None:
        row = _execute(cursor, _WRITE, self._values(key, owner, ttl))
        return None if row is None else int(row[0])

    def sql_unlock(self, cursor: Any, key: str, token: int) -> bool:
        if _execute(cursor, _UNLOCK, [key, token, advisory_key(key)]) is not None:
            return True
        cursor.execute("SELECT pg_advisory_unlock(%s)", [advisory_key(key)])  # the lease had ended: free the lock alone
        return False

    def sql_lease(self, cursor: Any, key: str) -> tuple[Lease | None, bool]:
        number = advisory_key(key)
        cursor.execute(_LEASE, [number, number, number, number, number, key])
        row = cursor.fetchone()
        lease = None if row[0] is None else Lease(float(row[1]), int(row[2]), bool(row[3]), bool(row[4]))
        return lease, bool(row[5]) and (lease is None or lease.left <= 0)

    def sql_end_lease(self, cursor: Any, key: str, token: int) -> None:
        cursor.execute(_END, [key, token])

    def sql_end_session(self, cursor: Any, key: str, session: int) -> None:
        cursor.execute(_END_EXPIRED, [self._ms(), key, session])
        if cursor.fetchone() is None:  # or it holds the lock idle on no lease (see sql_unleased)
            cursor.execute(
                f"SELECT pg_terminate_backend(a.pid, %s) FROM pg_locks l, pg_stat_activity a WHERE a.pid = %s AND {_UNLEASED}",
                [self._ms(), session, advisory_key(key), advisory_key(key), self.server_key(key)],
            )

    def sql_unleased(self, cursor: Any, key: str) -> tuple[float, int] | None:
        cursor.execute(
            f"SELECT %s - EXTRACT(EPOCH FROM {_NOW} - a.state_change), a.pid"
            f" FROM pg_locks l, pg_stat_activity a WHERE {_UNLEASED}",
            [self.timeout, advisory_key(key), advisory_key(key), self.server_key(key)],
        )
        row = cursor.fetchone()
        return None if row is None else (float(row[0]), int(row[1]))

    def sql_renew(self, cursor: Any, key: str, secret: str, ttl: float | None, more: int, token: int | None) -> bool:
        expiry = "" if ttl is None else f"expires_at = {_LATER}, "
        params = ([] if ttl is None else [round(ttl * 1_000_000)]) + [more, key, secret, token]
        cursor.execute(_RENEW.format(expiry=expiry), params)
        return bool(cursor.rowcount == 1)

    def sql_held(self, cursor: Any, key: str | None) -> list[Any]:
        cursor.execute(_HELD + (" AND n.lock_name = %s" if key else ""), [key] if key else [])
        return list(cursor.fetchall())

    def sql_force_release(self, cursor: Any, key: str, token: int | None) -> bool:
        # Compare (name, token, session still holding) and end the session in one statement.
        mine = "" if token is None else " AND n.id = %s"
        cursor.execute(
            f"WITH d AS (DELETE FROM {TABLE} n WHERE n.lock_name = %s{mine} AND ({_HELD_BY_SESSION} OR {_LIVE})"
            f" RETURNING n.session, {_HELD_BY_SESSION} AS holding)"
            " SELECT COUNT(*), COUNT(pg_terminate_backend(session::int, %s)) FILTER (WHERE holding) FROM d",
            [key, *([] if token is None else [token]), self._ms()],
        )
        return bool(cursor.fetchone()[0])

    def sql_clear_expired(self, cursor: Any, dry_run: bool) -> int:
        if dry_run:
            cursor.execute(f"SELECT COUNT(*) FROM {TABLE} n WHERE {_STALE}")
            return int(cursor.fetchone()[0])
        cursor.execute(
            f"WITH d AS (DELETE FROM {TABLE} n WHERE {_STALE}"
            f" RETURNING n.session, n.hold_count > 0 AND {_HELD_BY_SESSION} AS hung)"
            " SELECT COUNT(*), COUNT(pg_terminate_backend(session::int, %s)) FILTER (WHERE hung) FROM d",
            [self._ms()],
        )
        return int(cursor.fetchone()[0])

    def sql_warnings(self, cursor: Any) -> list[checks.CheckMessage]:
        """Tell a transaction-pooling PgBouncer and old servers.

        Behind such a pooler, successive statements of one client connection
        may run in different server sessions, and two client connections open at
        once run theirs in the same one (the pooler hands the server connection
        one client let go of to the next); directly, or in session pooling,
        neither happens.
        """
        sessions = set()
        for _ in range(3):
            cursor.execute("SELECT pg_backend_pid(), inet_server_port(), current_setting('server_version_num')::int")
            pid, port, version = cursor.fetchone()
            sessions.add(pid)
        found: list[checks.CheckMessage] = []
        if len(sessions) > 1 or sessions & self._sessions_of_another_connection():
            found.append(
                checks.Error(
                    f"DISTLOCKS[{self.alias!r}]: two client connections shared a server session, or one "
                    "connection's statements ran in several: "
                    "a pooler (PgBouncer in transaction or statement pooling mode) is in between, "
                    "and advisory locks would stay with server sessions that other clients use.",
                    hint="Point OPTIONS['DATABASE'] at a direct connection (or PgBouncer in session mode), "
                    "or use distlocks.backends.db.DatabaseBackend, which is safe behind PgBouncer.",
                    id="distlocks.E008",
                )
            )
        configured = int(connections.settings[self.database].get("PORT") or 5432)
        if port is not None and port != configured:
            found.append(
                checks.Warning(
                    f"DISTLOCKS[{self.alias!r}]: the server listens on port {port} but is reached on {configured}: "
                    "through a proxy or pooler. PgBouncer in transaction or statement pooling mode breaks advisory locks.",
                    hint="Use a direct connection or session pooling for this backend.",
                    id="distlocks.W012",
                )
            )
        if version < 140000:
            found.append(
                checks.Error(
                    f"DISTLOCKS[{self.alias!r}] needs PostgreSQL 14 or newer (pg_terminate_backend with a timeout).",
                    id="distlocks.E009",
                )
            )
        return found

    def _sessions_of_another_connection(self) -> set[int]:
        """The server sessions that a second client connection, open meanwhile, runs three statements in."""
        other = self._connection()
        try:

            def sessions(cursor: Any) -> set[int]:
                found = set()
                for _ in range(3):
                    cursor.execute("SELECT pg_backend_pid()")
                    found.add(cursor.fetchone()[0])
                return found

            return self._run(other, sessions)
        finally:
            self._put(other)
