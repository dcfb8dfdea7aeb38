"""The connections to a Sentinel group's master, and their retries: one at once, and a failover waited out.

A connection to a master that the sentinels have just demoted gets
``READONLY``; redis-py drops it and raises ``ConnectionError("The previous
master is now a slave")``, and the retry connects to the master the first
sentinel that answers names. Until the failover's new configuration reaches
every sentinel (their hello messages, every 2 s), that may be the demoted
master again. A call that meets it tries again, pausing ``PAUSE`` between
tries, for at most ``FAILOVER_WAIT`` seconds, then raises. A refused or
silent server is not waited for (one retry, as before): only a demoted
master is known to have a successor on the way. ``READONLY`` means the
script ran nothing, so sending it again cannot take a lock twice.

Each reconnection asks the sentinels (``MasterConnection``): redis-py 8
reconnects a connection dropped within a command, as a retry's is, to the
address it had (redis/redis-py issue 3874), which would be the demoted
master until the wait ran out.

Imported by ``sentinel`` once redis-py is known to be there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import sentinel as asyncio_sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, ReadOnlyError
from redis.retry import Retry
from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

#: How long a call that meets a demoted master goes on trying: a little more than two of the sentinels' hello
#: periods, and no longer than the master's default socket timeout, which already bounds a call.
FAILOVER_WAIT = 5.0
#: The pause between those tries (each asks the sentinels for the master again).
PAUSE = 0.1

T = TypeVar("T")


def demoted(error: BaseException) -> bool:
    """Whether ``error`` is redis-py's for a master that answered ``READONLY`` (it has become a replica)."""
    return isinstance(error, ConnectionError) and isinstance(error.__context__, ReadOnlyError)


def again(error: ConnectionError, first: float) -> bool:
    """Whether a call that raised ``error``, and first failed at ``first`` (monotonic), tries again after ``PAUSE``."""
    return demoted(error) and time.monotonic() + PAUSE <= first + FAILOVER_WAIT


class FailoverRetry(Retry):
    """redis-py's ``Retry`` with ``retries`` and no backoff, which waits out a failover (see the module)."""

    def __init__(self, retries: int) -> None:
        super().__init__(NoBackoff(), retries)

    def call_with_retry(self, do: Callable[[], T], fail: Any, *args: Any, **kwargs: Any) -> T:
        first = 0.0
        while True:
            try:
                return super().call_with_retry(do, fail, *args, **kwargs)
            except ConnectionError as error:
                first = first or time.monotonic()
                if not again(error, first):
                    raise
                time.sleep(PAUSE)


class AsyncFailoverRetry(AsyncRetry):
    """``FailoverRetry`` for ``redis.asyncio``'s connections."""

    def __init__(self, retries: int) -> None:
        super().__init__(NoBackoff(), retries)

    async def call_with_retry(self, do: Callable[[], Awaitable[T]], fail: Any, *args: Any, **kwargs: Any) -> T:
        first = 0.0
        while True:
            try:
                return await super().call_with_retry(do, fail, *args, **kwargs)
            except ConnectionError as error:
                first = first or time.monotonic()
                if not again(error, first):
                    raise
                await asyncio.sleep(PAUSE)


class MasterConnection(SentinelManagedConnection):
    """redis-py's connection to the master of a Sentinel group, which asks the sentinels whenever it reconnects."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            self.connect()  # redis-py's would reconnect to the address it had
        super().send_packed_command(command, check_health)


class MasterSSLConnection(MasterConnection, SentinelManagedSSLConnection):
    """``MasterConnection`` over TLS."""


class AsyncMasterConnection(asyncio_sentinel.SentinelManagedConnection):
    """``MasterConnection`` for ``redis.asyncio``."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()
        await super().send_packed_command(command, check_health)


class AsyncMasterSSLConnection(AsyncMasterConnection, asyncio_sentinel.SentinelManagedSSLConnection):
    """``AsyncMasterConnection`` over TLS."""


def connection_class(asyncio: bool, ssl: bool) -> type:
    """The class of the master's connections, for an event loop or threads, with TLS or without."""
    if asyncio:
        return AsyncMasterSSLConnection if ssl else AsyncMasterConnection
    return MasterSSLConnection if ssl else MasterConnection
