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
statement. Waiters are served roughly in turn: each takes a place in the
lock's queue (a ``LockWaiter`` row, a lease of ``queue.WAITER_LEASE`` seconds renewed
while it waits), and the INSERT that takes a lock inserts only if no live waiter
queued earlier, so a crashed waiter holds up the queue for at most that lease.
Lock statements run on a connection of their own in autocommit mode:
a lock is visible to every process as soon as it is taken and survives the
rollback of the caller's transaction.

Faults: if the database is down, every operation raises ``BackendUnavailable``
after at most ``CONNECT_TIMEOUT`` seconds (default 5; more than 0, rounded up
to whole seconds for the driver). On MySQL/MariaDB and
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
during a statement raises ``BackendUnavailable`` (a lock the acquire may have
taken is voided once the server answers: ``voids``). A forked child never closes, nor talks on, its
parent's lock connections.
"""

from __future__ import annotations

from distlocks.backends.db.backend import DatabaseBackend
from distlocks.backends.db.config import DEFAULT_TIMEOUT
from distlocks.backends.db.connections import close_connections

__all__ = ["DEFAULT_TIMEOUT", "DatabaseBackend", "close_connections"]
