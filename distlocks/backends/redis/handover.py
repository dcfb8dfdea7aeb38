"""The hand-over of a released lock to its first waiter, told on its process's pub/sub channel."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from distlocks.backends.redis.keys import RW_SUFFIX, lock_keys
from distlocks.backends.redis.scripts import registered
from distlocks.backends.redis.server import driver_errors
from distlocks.owner import Owner

logger = logging.getLogger(__name__)

# A release channel silent this long while waiters read it is pinged...
PING_AFTER = 1.0
# ... and presumed dead (black-holed: no error, no data) if the pong takes longer than the connection's
# socket timeout, or this without one.
ANSWER_WITHIN = 5.0


class Waiter:
    """A thread waiting for a lock, woken by the release that hands it the lock, with its token."""

    def __init__(self, channel: str, waiter_id: str) -> None:
        self.channel = channel  # what its queue entry names (on a cluster ':w:<process>', see ``shards``)
        self.id = waiter_id
        self.home: Any = None  # the releases that read its channel (its lock's primary's, on a cluster)
        self.subscription = channel  # the channel that tells it
        self.moved = False  # on a cluster: its subscription was dropped (a slot moved, a reconnect)
        self.entry = ""  # its entry in the lock's queue, once it has one
        self.wake = threading.Event()
        self.token = 0
        self.queued = False  # an attempt put its entry in the lock's queue
        self.queued_at = 0.0  # when the first such attempt was sent (monotonic): no hand-over came before
        self.retry = False  # the channel was (re)subscribed: releases may have been missed

    def awaken(self) -> None:
        self.wake.set()

    def queue_entry(self, owner: Owner, lease_ms: int, mode: str = "") -> str:
        """Where to tell it, who it is, and the lease to hand it the lock with (a read-write lock's: which side)."""
        self.entry = f"{mode}{'|' if mode else ''}{self.channel}|{self.id}|{owner.secret}|{lease_ms}|{owner}"
        return self.entry


class Silence:
    """How long a release channel has been silent: when to ping it, and when it is presumed dead.

    A connection that a NAT or firewall dropped without a reset raises
    nothing and reads nothing: the hand-overs published to it are lost, and
    each waiter of the process would learn of its lock only when the lease it
    was told ran out. A reconnect resubscribes, which makes every waiter try
    again (and take what was handed to it).
    """

    def __init__(self, client: Any) -> None:
        self.answer_within = client.connection_pool.connection_kwargs.get("socket_timeout") or ANSWER_WITHIN
        self.heard_at = time.monotonic()
        self.pinged_at: float | None = None
        self.gone = False  # presumed dead since it was last heard (warned once)

    def heard(self) -> None:
        self.heard_at = time.monotonic()
        self.pinged_at = None
        self.gone = False

    def to_ping(self) -> bool:
        """Whether to ping now (silent for PING_AFTER, and not pinged since)."""
        now = time.monotonic()
        if self.pinged_at is None and now - self.heard_at >= PING_AFTER:
            self.pinged_at = now
            return True
        return False

    def dead(self) -> bool:
        """Whether the last ping went unanswered for too long (then it starts counting again)."""
        if self.pinged_at is None or time.monotonic() - self.pinged_at <= self.answer_within:
            return False
        if not self.gone:  # once per outage, not at every reconnect
            logger.warning("Redis release channel silent %.1fs after a PING: reconnecting", self.answer_within)
        self.gone = True
        self.heard_at, self.pinged_at = time.monotonic(), None
        return True

    def read_for(self, timeout: float) -> float:
        """How long to read at most (``timeout``, or less) before looking at the silence again."""
        due = self.heard_at + PING_AFTER if self.pinged_at is None else self.pinged_at + self.answer_within
        return max(0.01, min(timeout, due - time.monotonic()))


def connected_to(pubsub: Any) -> tuple[str, int] | None:
    """The server of ``pubsub``'s connection, if it has one now."""
    connection = pubsub.connection
    return None if connection is None or not connection.host else (str(connection.host), int(connection.port))


def about_to_ping(silence: Silence) -> bool:
    """Whether ``silence``'s channel is due for a ping (the one that ``Silence.to_ping`` will say)."""
    return silence.pinged_at is None and time.monotonic() - silence.heard_at >= PING_AFTER


class Releases:
    """One pub/sub connection per process and Redis, shared by every waiter.

    The process listens on a channel of its own; a release tells the first
    waiter in the lock's queue through its process's channel. There is no
    reader thread between Redis and a waiter: one of the waiting threads reads
    the connection and passes each message to the waiter it is for, so a process
    with one waiter wakes straight from the socket, with no thread switch. When
    the reading waiter leaves it wakes the others, one of which reads next.
    """

    def __init__(self, client: Any, listener: Any = None) -> None:
        self.client = client  # the scripts' (a lock handed to a waiter that left is given back by them)
        self.listener = listener or client  # the pub/sub connection's
        self.pubsub = self.listener.pubsub()
        process = secrets.token_hex(8)
        self.channel = f"distlocks:waiters:{process}"
        self.waiter_ids = (f"{process}.{n}" for n in itertools.count(1))  # unique across processes
        self.lock = threading.Lock()  # guards the waiters
        self.reading = threading.Lock()  # held by the one thread that reads the connection
        self.waiters: dict[str, Waiter] = {}
        self.subscribing = False
        self.subscribed = threading.Event()
        self.broken = False
        self.silence = Silence(self.listener)
        self.forgotten = False  # in a forked child: the parent's

    def enlist(self, lock_hash: str, waiter: Waiter | None = None) -> Waiter:
        """A waiter for the lock whose hash is ``lock_hash`` (any lock: the process's channel tells them all)."""
        with self.lock:
            waiter = waiter or Waiter(self.channel, next(self.waiter_ids))
            waiter.home = self
            if not self.subscribing:
                self.pubsub.subscribe(self.channel)
                self.subscribing = True
            self.waiters[waiter.id] = waiter
        return waiter

    def enlisted(self, lock_hash: str) -> Waiter | None:
        """A waiter for ``lock_hash`` that may queue at once, if one can be had without a request (else None)."""
        return self.enlist(lock_hash) if self.subscribed.is_set() else None

    def ready(self, waiter: Waiter) -> bool:
        """Whether a release can tell ``waiter`` now: it may queue."""
        return self.subscribed.is_set()

    def current(self, waiter: Waiter) -> bool:
        """Whether ``waiter`` still listens where its lock's releases tell (always, here: see ``shards``)."""
        return True

    def discharge(self, waiter: Waiter) -> None:
        with self.lock:
            self.waiters.pop(waiter.id, None)

    def forget(self) -> None:
        """In a forked child: close the parent's socket (see ``_forget_releases_after_fork``)."""
        self.forgotten = True
        if self.pubsub.connection is not None:
            with contextlib.suppress(Exception):
                self.pubsub.connection.disconnect()

    def wait_until(self, done: Callable[[], bool], waiter: Waiter, timeout: float) -> None:
        """Return once ``done()`` or after ``timeout`` seconds, reading the connection when nobody else does."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.reading.acquire(blocking=False):
                try:
                    while not done() and (left := deadline - time.monotonic()) > 0:
                        self._read(left)
                finally:
                    self.reading.release()
                    with self.lock:  # one of the others reads next
                        for other in self.waiters.values():
                            other.wake.set()
            else:
                waiter.wake.wait(left)
                waiter.wake.clear()

    def _read(self, timeout: float) -> None:
        """Read one message, waiting at most ``timeout`` seconds, and pass it to the waiter it is for."""
        try:
            if self.silence.dead():
                self.reconnect()
            elif self.silence.to_ping():
                self.pubsub.ping()
            # Subscribed already: enlist() subscribes.
            message = self.pubsub.get_message(timeout=self.silence.read_for(timeout))
        except Exception as exc:  # the connection broke: redis-py reconnects and resubscribes
            if not self.broken:  # once per outage, not at every read
                logger.warning("Redis release channel lost, reconnecting: %s", exc)
            self.broken = True
            self.lost()
            time.sleep(min(timeout, 0.5))
            return
        self.broken = False
        if message is None:
            return
        self.silence.heard()
        with self.lock:
            gone = self.handle(message)
        if gone is not None:
            with contextlib.suppress(*driver_errors()):
                give_back(self.client, gone)

    def reconnect(self) -> None:
        """Drop a connection presumed dead: the next read reconnects and resubscribes."""
        self.pubsub.connection.disconnect()

    def lost(self) -> None:
        """The connection broke (a read raised): redis-py reconnects and resubscribes at the next read."""

    def handle(self, message: dict[str, Any]) -> tuple[str, str] | None:
        """Pass ``message`` on (under ``self.lock``): see ``pass_on``."""
        return pass_on(message, self.waiters, self.subscribed)


def pass_on(message: dict[str, Any], waiters: Mapping[str, Waiter], subscribed: Any) -> tuple[str, str] | None:
    """Wake the waiter a pub/sub ``message`` hands a lock to; on a (re)subscription, every waiter.

    A resubscription follows a reconnect (a Redis restart forgets the queues):
    every waiter tries again. Return (lock hash, waiter id) of a lock handed to
    a waiter that left without leaving the queue (Redis was unreachable then):
    the caller gives it back, or nobody holds it for a lease.
    """
    if message["type"] == "subscribe":
        subscribed.set()
        for waiter in waiters.values():
            waiter.retry = True
            waiter.awaken()
        return None
    if message["type"] != "message":
        return None
    token, waiter_id, lock_hash = message["data"].decode().split(" ", 2)
    handed_to = waiters.get(waiter_id)
    if handed_to is None:
        return lock_hash, waiter_id
    handed_to.token = int(token)
    handed_to.awaken()
    return None


def give_back(client: Any, gone: tuple[str, str]) -> Any:
    """Give back what a release handed to a waiter that left (``pass_on``'s answer): a lock, or a read-write lock's side.

    With an asyncio ``client``, return the awaitable.
    """
    lock_hash, waiter_id = gone
    abandon = "rw_abandon" if lock_hash.endswith(RW_SUFFIX) else "abandon"
    return registered(client)[abandon](keys=lock_keys(lock_hash), args=[waiter_id, ""])


# One per cache alias and server (tests point an alias at new servers), in this process: a ``Releases``, or a
# cluster's ``shards.ShardReleases``.
_releases: dict[tuple[str, str], Any] = {}
_releases_lock = threading.Lock()


def _forget_releases_after_fork() -> None:
    """Close the parent's pub/sub sockets in a forked child.

    Left open, they would make Redis count the parent's channels as listened to
    after the parent died, and hand locks to its dead waiters. redis-py closes
    a connection of another process without shutting it down for the parent.
    """
    global _releases_lock
    _releases_lock = threading.Lock()
    for releases in _releases.values():
        releases.forget()
    _releases.clear()


os.register_at_fork(after_in_child=_forget_releases_after_fork)


def releases_for(server: tuple[str, str], make: Callable[[], Any]) -> Any:
    """This process's hand-overs from ``server`` (cache alias, address), made on first use by ``make()``."""
    with _releases_lock:
        releases = _releases.get(server)
        if releases is None:
            releases = _releases[server] = make()
    return releases
