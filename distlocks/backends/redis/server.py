"""What the Redis backend asks of a server: errors, timeouts, eviction, address."""

from __future__ import annotations

import urllib.parse
from typing import Any

from django.core import checks


def connection_errors() -> tuple[type[Exception], ...]:
    """The driver's errors for a server it cannot reach (imported late: redis is an optional dependency).

    Called in ``except`` clauses, which evaluate it only when an exception is raised.
    """
    from redis.exceptions import ConnectionError, TimeoutError

    return ConnectionError, TimeoutError


def driver_errors() -> tuple[type[Exception], ...]:
    """Every error of the driver, which a lock call raises as BackendUnavailable (the driver's error chained).

    A server it cannot reach (``connection_errors()``), and one that answered
    with an error: a wrong password or DB index (``AuthenticationError``,
    ``ResponseError: DB index is out of range``), a script it refused (OOM,
    READONLY), or something else than Redis at the address (``InvalidResponse``).
    """
    from redis.exceptions import RedisClusterException, RedisError

    return RedisError, RedisClusterException  # the latter: no node of a cluster answers, no node serves a slot


#: The cache OPTIONS that bound how long a Redis that does not answer makes a call wait.
TIMEOUTS = ("SOCKET_CONNECT_TIMEOUT", "SOCKET_TIMEOUT")


def without_password(url: str) -> str:
    """``url`` with its password (``redis://user:password@host``, ``?password=``) replaced by ***."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{host}"
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "password" for name, _ in query):
        masked = [(name, "***" if name == "password" else value) for name, value in query]
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=urllib.parse.urlencode(masked, safe="*")))
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)) if netloc != parts.netloc else url


def lease_ms(ttl: float) -> int:
    """A lease of ``ttl`` seconds as the scripts take it: whole milliseconds, at least one."""
    return max(1, round(ttl * 1000))


# The servers whose eviction policy this process has looked at (at their first use).
inspected: set[tuple[str, str]] = set()


def eviction_policy(client: Any) -> str | None:
    """The server's ``maxmemory-policy``, or None when it does not say (CONFIG disabled, renamed or denied)."""
    from redis.exceptions import ResponseError

    try:
        return policy_of(client.config_get("maxmemory-policy"))
    except ResponseError:
        return None


def policy_of(reply: dict[Any, Any]) -> str | None:
    """The ``maxmemory-policy`` in a reply to CONFIG GET (from a sync or an asyncio client)."""
    policy = {_text(name): _text(value) for name, value in reply.items()}.get("maxmemory-policy")
    return policy or None


def eviction_warnings(alias: str, server: str, policy: str | None) -> list[checks.CheckMessage]:
    """W011 if ``policy``, the eviction policy of ``server`` (as messages name it), can delete held locks."""
    if policy in (None, "noeviction"):
        return []
    return [
        checks.Warning(
            f"DISTLOCKS[{alias!r}]: {server} evicts keys "
            f"(maxmemory-policy {policy}): when it runs short of memory it may delete a held "
            "lock, and another process takes it while the holder goes on.",
            hint="Set maxmemory-policy noeviction on that server, ideally a Redis of its own for "
            "locks (with noeviction, a full Redis refuses writes instead of forgetting).",
            id="distlocks.W011",
        )
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# A client's connection settings that a client of another node (of its cluster), or an asyncio client, takes
# as they are (besides ssl_*).
SHARED_SETTINGS = (
    "host",
    "port",
    "path",
    "db",
    "username",
    "password",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_keepalive_options",
    "client_name",
)


def settings_of(pool: Any) -> dict[str, Any]:
    """The settings of a redis-py connection ``pool`` that a new client takes (``SHARED_SETTINGS`` and ssl_*)."""
    return {k: v for k, v in pool.connection_kwargs.items() if k in SHARED_SETTINGS or k.startswith("ssl_")}


def node_client(cluster: Any, node: Any) -> Any:
    """A client of its own to one node of a redis-py ``RedisCluster`` (for its pub/sub connection).

    With the cluster's credentials, SSL and timeouts, but none of its hooks,
    and no retries: a node that died fails the read at once, and its waiters
    find the lock's new primary.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pool = cluster.get_redis_connection(node).connection_pool
    return redis.Redis(
        connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class, retry=Retry(NoBackoff(), 0), **settings_of(pool)
        )
    )
