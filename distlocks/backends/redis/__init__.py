"""Redis lock backend on a Redis cache alias (django-redis's or Django's own: ``caches``), a Cluster or Sentinel.

Guarantees: every state change is one Lua script, so it is atomic on the
server. A lock is a hash (owner secret, hold count, fencing token, owner
description) whose lease is the key's ``PEXPIRE``: when it runs out Redis
deletes the key and the lock is free. A waiter that failed to acquire joins
the lock's queue; releasing the last hold hands the lock straight to the first
waiter (first come, first served) and tells it so on its process's pub/sub
channel, so it takes the lock without asking again and nobody polls. A waiter
whose process died is skipped: nobody listens on its channel any more. All
keys of one lock share a hash tag, so they live in one slot of a Redis Cluster
(``OPTIONS["CLUSTER"]``, see ``cluster``), where a waiter is told on a sharded
channel in its lock's slot and asks the lock's primary before it trusts a
hand-over (``shards``). On a Sentinel group (``OPTIONS["SENTINELS"]``, see
``sentinel``) the locks are on the master the sentinels name, and a waiter
renews a hand-over before it trusts it. Any name works: braces in it are
escaped so that the hash tag is always well formed.

Fencing tokens come from a counter key that never expires, and are never
below the server's clock in microseconds. So every token is larger than every
earlier one of that lock as long as the server's clock does not go back: also
when the counter is missing (first use, a restart without persistence) or
comes back stale (a restart from an RDB snapshot; a failover to a replica
that lagged, as long as the replica's clock is not behind its old master's).
A restart without persistence forgets held locks: their holders' next renewal
fails (``LockLost``) and others can take the lock at once. With ``appendonly
yes`` nothing is forgotten. A failover to a replica that lagged may forget one
too; with ``WAIT_REPLICAS`` an acquisition counts only once that many replicas
acknowledged it (``replicas``), which makes that less likely, not impossible. ``force_release`` with a token compares and
deletes in one script: it never frees a later holder's lock.

Locks need ``maxmemory-policy noeviction``, ideally on a Redis of their own:
under any evicting policy a full Redis may delete a held lock's hash, and
another process takes the lock while its holder goes on. ``manage.py check``
(through ``ping()``) and the first use of each server in a process warn about
such a policy when the server tells it (``CONFIG GET``; a server that refuses
CONFIG is not checked).

Set ``SOCKET_CONNECT_TIMEOUT`` and ``SOCKET_TIMEOUT`` in the cache's
``OPTIONS`` (``manage.py check`` warns when they are missing): they bound how
long an unreachable or hung server takes to raise ``BackendUnavailable``.
Messages show the cache's LOCATION with its password masked.
"""

from __future__ import annotations

from distlocks.backends.redis.backend import RedisBackend

__all__ = ["RedisBackend"]
