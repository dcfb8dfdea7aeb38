"""An event loop's hand-overs on a Redis Cluster: the sharded channels of ``shards``, read by the loop.

The loop's scripts go through ``redis.asyncio.cluster.RedisCluster``; its
waiters' channels, one per lock, are subscribed on the lock's primary, on a
connection per primary read by a task of its own (as ``aiowait.LoopReleases``
reads the loop's channel). A hand-over is confirmed by the waiter's next
attempt, and a subscription lost is subscribed anew where the lock's slot is,
as the threads' are (``shards``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from typing import Any

from distlocks.backends.redis.aiowait import AsyncWaiter, LoopReleases, async_client
from distlocks.backends.redis.shards import ShardChannels, entry_channel


class LoopNodeReleases(ShardChannels, LoopReleases):
    """The loop's sharded channels on one primary, and the task that reads them."""

    def __init__(self, client: Any, listener: Any, node_name: str, process: str, waiter_ids: Any) -> None:
        self.keep_channels(node_name, process)
        super().__init__(client, listener)
        self.waiter_ids = waiter_ids

    async def enlist(self, lock_hash: str, waiter: AsyncWaiter | None = None) -> AsyncWaiter:
        for idle in self.to_unsubscribe():
            with contextlib.suppress(Exception):  # its connection broke: the read says so
                await self.pubsub.sunsubscribe(idle)
        channel = self.to_subscribe(lock_hash)
        if channel is not None:
            try:
                await self.pubsub.ssubscribe(channel)
            except BaseException:
                self.counts.pop(channel, None)
                raise
            self.wanted.set()
        waiter = waiter or AsyncWaiter(entry_channel(self.process), next(self.waiter_ids))
        self.join(lock_hash, waiter)
        return waiter

    def discharge(self, waiter: AsyncWaiter) -> None:
        self.leave(waiter)

    async def _listen(self) -> None:
        """Wait until a channel is subscribed: the waiters subscribe theirs (``enlist``)."""
        while not self.pubsub.subscribed:
            self.wanted.clear()
            await self.wanted.wait()

    async def _reconnect(self) -> None:
        await self._lost()

    async def _lost(self) -> None:
        """Every subscription is gone with the connection: its waiters subscribe anew (see ``drop_all``)."""
        old, self.pubsub = self.pubsub, self.listener.pubsub()
        self.drop_all()
        with contextlib.suppress(Exception):
            await old.aclose()


class LoopShardReleases:
    """An event loop's hand-overs on a Redis Cluster: a ``LoopNodeReleases`` per primary of its waiters' locks.

    Its ``client`` runs the loop's scripts; a task keeps it, and closes it when
    cancelled (``asyncio.run`` cancels it at the end).
    """

    def __init__(self, client: Any, sync_client: Any) -> None:
        self.client = client  # redis.asyncio.cluster.RedisCluster
        self.sync_client = sync_client  # the process's RedisCluster: the nodes' connection settings
        self.process = secrets.token_hex(8)
        self.waiter_ids = (f"{self.process}.{n}" for n in itertools.count(1))  # unique across processes
        self.nodes: dict[str, LoopNodeReleases] = {}
        self.reader = asyncio.get_running_loop().create_task(self._keep(), name="distlocks-cluster")

    async def _keep(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            with contextlib.suppress(Exception):
                await self.client.aclose()

    async def _home(self, lock_hash: str) -> LoopNodeReleases:
        await self.client.initialize()  # at once if it ran a script already
        node = self.client.get_node_from_key(lock_hash)
        home = self.nodes.get(node.name)
        if home is None or home.reader.done():
            some_node = self.sync_client.get_redis_connection(self.sync_client.get_default_node())
            listener = async_client(some_node, host=node.host, port=node.port)
            home = self.nodes[node.name] = LoopNodeReleases(
                self.client, listener, node.name, self.process, self.waiter_ids
            )
        return home

    async def enlist(self, lock_hash: str, waiter: AsyncWaiter | None = None) -> AsyncWaiter:
        if waiter is not None and waiter.home is not None:
            waiter.home.discharge(waiter)
        return await (await self._home(lock_hash)).enlist(lock_hash, waiter)

    def ready(self, waiter: AsyncWaiter) -> bool:
        return bool(waiter.home.ready(waiter))

    def current(self, waiter: AsyncWaiter) -> bool:
        """Whether ``waiter`` listens on its lock's primary of now (see ``shards.ShardReleases.current``)."""
        if waiter.moved or waiter.home.broken:
            return False
        lock_hash = waiter.subscription[: -len(entry_channel(self.process))]
        return bool(self.client.get_node_from_key(lock_hash).name == waiter.home.node_name)

    def discharge(self, waiter: AsyncWaiter) -> None:
        if waiter.home is not None:
            waiter.home.discharge(waiter)

    def pubsubs(self) -> list[Any]:
        return [home.pubsub for home in self.nodes.values()]
