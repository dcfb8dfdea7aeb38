"""An event loop's hand-overs from a Sentinel group's master (``OPTIONS["SENTINELS"]``): ``redis.asyncio.sentinel``.

As ``sentinel.SentinelReleases`` for threads: the loop's pub/sub connection
follows the master the sentinels name (redis-py reconnects it there), and a
silent channel asks a sentinel, before its ping, whether it is still on the
master.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from distlocks.backends.redis.aiowait import LoopReleases
from distlocks.backends.redis.handover import about_to_ping, connected_to
from distlocks.backends.redis.server import driver_errors

logger = logging.getLogger(__name__)


class LoopSentinelReleases(LoopReleases):
    """An event loop's client of the master and its hand-overs (``LoopReleases``, and as ``SentinelReleases``)."""

    def __init__(self, service: str, client: Any) -> None:
        super().__init__(client)
        self.service = service  # the master's name, as the sentinels know it

    async def _step(self) -> None:
        if self.waiters and about_to_ping(self.silence) and (server := connected_to(self.pubsub)):
            try:
                master = await self.listener.connection_pool.sentinel_manager.discover_master(self.service)
            except driver_errors():
                master = server
            if (str(master[0]), int(master[1])) != server:
                logger.warning("Redis release channel on %s:%s, no longer the master: moving", *server)
                await self._reconnect()
        await super()._step()

    async def _reconnect(self) -> None:
        """As ``SentinelReleases.reconnect``: connect to the master of now, which subscribes again."""
        connection = self.pubsub.connection
        await connection.disconnect()
        with contextlib.suppress(*driver_errors()):
            await connection.connect()

    async def _close(self) -> None:
        """Close the client and its sentinels' clients (``Sentinel`` leaves those open)."""
        await super()._close()
        for sentinel in self.listener.connection_pool.sentinel_manager.sentinels:
            await sentinel.aclose()
