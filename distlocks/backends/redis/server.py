"""What the Redis backend asks of a server: errors, timeouts, eviction, address."""

from __future__ import annotations

import urllib.parse
from typing import Any


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
    from redis.exceptions import RedisError

    return (RedisError,)


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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
