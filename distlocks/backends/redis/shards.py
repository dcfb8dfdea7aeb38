"""Hand-overs on a Redis Cluster: one sharded channel per waiting process and lock, in the lock's own slot.

``PUBLISH`` on a cluster reaches every node, but counts the listeners of the
node it runs on alone: a release that counted none would pass the lock on
while its waiter, told on another node, took it too. So on a cluster a
waiter's queue entry names ``:w:<process>``, and the release script tells it
with ``SPUBLISH`` on ``<lock's hash>:w:<process>`` (``rwscripts.TELL``): a
channel in the lock's slot, whose listeners are those of the slot's primary,
where this process subscribes (``SSUBSCRIBE``) before the waiter queues. One
connection per process and primary is read by one of the threads waiting for a
lock there (as ``handover.Releases`` is).

A message is never trusted on a cluster: it wakes its waiter, whose next
attempt asks the lock's primary whether the lock was handed to it (the acquire
script's "granted" answer) before taking it. A failover or a slot that moved
may make a release count a listener that will not read (its waiter wakes when
the lease it was told ends) or miss one (the waiter is skipped, and queues
again): neither gives the lock to two holders. A subscription lost with its
connection, or dropped by the server when the slot moved (``sunsubscribe``),
is handled like a reconnect: its waiters try again, and subscribe anew on the
node redis-py's map of slots (refreshed by ``MOVED``, ``ASK`` or the failover)
names before they queue again.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from typing import Any

from distlocks.backends.redis.handover import Releases, Waiter
from distlocks.backends.redis.server import node_client

# A channel no waiter of this process has used for this long is unsubscribed (at the next subscription or leave).
IDLE_AFTER = 1.0


def shard_channel(lock_hash: str, process: str) -> str:
    """The sharded channel of ``process``'s waiters for the lock whose hash is ``lock_hash`` (in the lock's slot)."""
    return f"{lock_hash}:w:{process}"


def entry_channel(process: str) -> str:
    """What a queue entry names for a channel on a cluster: the script puts the lock's hash before it."""
    return f":w:{process}"


class ShardChannels:
    """One process's sharded channels on one primary, and which of its waiters each tells: the bookkeeping (no I/O)
    that the threads' ``NodeReleases`` and an event loop's (``aioshards``) share."""

    waiters: dict[str, Any]
    pubsub: Any

    def keep_channels(self, node_name: str, process: str) -> None:
        self.node_name = node_name
        self.process = process
        self.counts: dict[str, int] = {}  # the waiters of each channel subscribed (or being subscribed)
        self.confirmed: set[str] = set()  # the channels the server said it subscribed
        self.idle: dict[str, float] = {}  # the channels without waiters, since when (monotonic)

    def to_subscribe(self, lock_hash: str) -> str | None:
        """The channel of ``lock_hash`` if it is to be subscribed now (it is counted from now on), else None."""
        channel = shard_channel(lock_hash, self.process)
        if channel in self.counts:
            return None
        self.counts[channel] = 0
        return channel

    def join(self, lock_hash: str, waiter: Waiter) -> Waiter:
        """Count ``waiter`` on the channel of ``lock_hash`` (subscribed, or being subscribed)."""
        channel = shard_channel(lock_hash, self.process)
        self.counts[channel] = self.counts.get(channel, 0) + 1
        self.idle.pop(channel, None)
        waiter.home, waiter.subscription, waiter.moved = self, channel, False
        self.waiters[waiter.id] = waiter
        return waiter

    def subscribed_to(self, lock_hash: str) -> bool:
        return shard_channel(lock_hash, self.process) in self.confirmed

    def ready(self, waiter: Waiter) -> bool:
        return waiter.subscription in self.confirmed and not waiter.moved

    def leave(self, waiter: Waiter) -> None:
        """Take ``waiter`` off its channel; a channel left without waiters stays subscribed for ``IDLE_AFTER``."""
        if self.waiters.pop(waiter.id, None) is None:
            return
        channel = waiter.subscription
        if channel in self.counts:
            self.counts[channel] -= 1
            if not self.counts[channel]:
                self.idle[channel] = time.monotonic()

    def to_unsubscribe(self) -> list[str]:
        """The channels idle for ``IDLE_AFTER``, to unsubscribe now (forgotten from now on)."""
        now = time.monotonic()
        stale = [channel for channel, since in self.idle.items() if now - since >= IDLE_AFTER]
        for channel in stale:
            del self.idle[channel], self.counts[channel]
            self.confirmed.discard(channel)
        return stale

    def drop_all(self) -> None:
        """Forget every channel (the connection is gone): each waiter subscribes anew, where its lock's slot is now.

        redis-py would resubscribe every channel at once on this node, which the
        server refuses when they lie in several slots (CROSSSLOT): the waiters
        subscribe again one by one, each on its lock's primary of now.
        """
        self.counts.clear()
        self.confirmed.clear()
        self.idle.clear()
        for waiter in self.waiters.values():
            _moved(waiter)
        self.waiters.clear()

    def handle(self, message: dict[str, Any]) -> tuple[str, str] | None:
        """Pass a message on: wake the waiter it names (whose next attempt confirms the hand-over), or note a
        (un)subscription. Return (lock hash, waiter id) of a hand-over to a waiter this process no longer has:
        the caller gives it back.
        """
        kind, channel = message["type"], message["channel"]
        channel = channel.decode() if isinstance(channel, bytes) else channel
        if kind == "ssubscribe":
            if channel in self.counts:
                self.confirmed.add(channel)
            for waiter in self.waiters.values():
                if waiter.subscription == channel:
                    waiter.retry = True  # subscribed anew: a release may have skipped it meanwhile
                    waiter.awaken()
        elif kind == "sunsubscribe" and channel in self.confirmed:  # the server's: its slot left this node
            self.confirmed.discard(channel)
            self.counts.pop(channel, None)
            self.idle.pop(channel, None)
            self.pubsub.shard_channels.pop(message["channel"], None)  # not to be resubscribed here
            for waiter in [w for w in self.waiters.values() if w.subscription == channel]:
                _moved(waiter)
                del self.waiters[waiter.id]
        elif kind == "smessage":
            token, waiter_id, lock_hash = message["data"].decode().split(" ", 2)
            told = self.waiters.get(waiter_id)
            if told is None:
                return lock_hash, waiter_id
            told.retry = True  # not trusted: its next attempt confirms the hand-over with the lock's primary
            told.awaken()
        return None


def _moved(waiter: Waiter) -> None:
    waiter.moved = waiter.retry = True
    waiter.awaken()


class NodeReleases(ShardChannels, Releases):
    """This process's sharded channels on one primary, on a connection of their own, read by one of the threads
    that wait there (see the module's docstring)."""

    def __init__(self, client: Any, node: Any, process: str, waiter_ids: Any) -> None:
        super().__init__(client, node_client(client, node))
        self.keep_channels(node.name, process)
        self.waiter_ids = waiter_ids

    def enlist(self, lock_hash: str, waiter: Waiter | None = None) -> Waiter:
        """A waiter for the lock ``lock_hash`` (or ``waiter`` again, subscribed here anew), subscribing its channel."""
        with self.lock:
            self._unsubscribe_idle()
            channel = self.to_subscribe(lock_hash)
            if channel is not None:
                try:
                    self.pubsub.ssubscribe(channel)
                except BaseException:
                    del self.counts[channel]
                    raise
            return self.join(lock_hash, waiter or Waiter(entry_channel(self.process), next(self.waiter_ids)))

    def enlisted(self, lock_hash: str) -> Waiter | None:
        with self.lock:
            if not self.subscribed_to(lock_hash):
                return None
        return self.enlist(lock_hash)

    def discharge(self, waiter: Waiter) -> None:
        with self.lock:
            self.leave(waiter)
            self._unsubscribe_idle()

    def _unsubscribe_idle(self) -> None:
        for channel in self.to_unsubscribe():
            with contextlib.suppress(Exception):  # its connection broke: the read says so
                self.pubsub.sunsubscribe(channel)

    def reconnect(self) -> None:
        self.lost()

    def lost(self) -> None:
        """The connection broke or went silent: every subscription is gone (see ``drop_all``)."""
        with self.lock:
            old, self.pubsub = self.pubsub, self.listener.pubsub()
            with contextlib.suppress(Exception):
                old.reset()  # closes its connection
            self.drop_all()


class ShardReleases:
    """This process's hand-overs on a Redis Cluster: a ``NodeReleases`` per primary that has its waiters' locks.

    The same calls as ``handover.Releases``, each on the waiter's primary.
    """

    def __init__(self, client: Any) -> None:
        self.client = client  # redis-py's RedisCluster: the scripts, and the map of slots
        self.process = secrets.token_hex(8)
        # Unique across processes; a map, not a generator: threads enlisting on two primaries draw at once.
        self.waiter_ids = map(f"{self.process}.{{}}".format, itertools.count(1))
        self.nodes: dict[str, NodeReleases] = {}
        self.lock = threading.Lock()
        self.forgotten = False  # in a forked child: the parent's

    def _home(self, lock_hash: str) -> NodeReleases:
        """The releases of the primary that serves ``lock_hash`` now, as redis-py's map of slots has it."""
        node = self.client.get_node_from_key(lock_hash)
        with self.lock:
            home = self.nodes.get(node.name)
            if home is None:
                home = self.nodes[node.name] = NodeReleases(self.client, node, self.process, self.waiter_ids)
        return home

    def enlist(self, lock_hash: str, waiter: Waiter | None = None) -> Waiter:
        if waiter is not None and waiter.home is not None:
            waiter.home.discharge(waiter)
        return self._home(lock_hash).enlist(lock_hash, waiter)

    def enlisted(self, lock_hash: str) -> Waiter | None:
        return self._home(lock_hash).enlisted(lock_hash)

    def ready(self, waiter: Waiter) -> bool:
        return bool(waiter.home.ready(waiter))

    def current(self, waiter: Waiter) -> bool:
        """Whether ``waiter`` listens on its lock's primary of now (else it subscribes anew before it queues)."""
        if waiter.moved or waiter.home.broken:
            return False
        lock_hash = waiter.subscription[: -len(shard_channel("", self.process))]
        return bool(self.client.get_node_from_key(lock_hash).name == waiter.home.node_name)

    def discharge(self, waiter: Waiter) -> None:
        if waiter.home is not None:
            waiter.home.discharge(waiter)

    def wait_until(self, done: Any, waiter: Waiter, timeout: float) -> None:
        waiter.home.wait_until(done, waiter, timeout)

    def forget(self) -> None:
        self.forgotten = True
        for home in self.nodes.values():
            home.forget()
