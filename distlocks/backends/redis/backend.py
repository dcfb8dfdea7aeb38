"""The Redis lock backend: locks as Lua-managed hashes in the Redis of a cache alias (django-redis or Django's own),
in a Redis Cluster (``OPTIONS["CLUSTER"]``), or on the master of a Sentinel group (``OPTIONS["SENTINELS"]``)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

from django.core import checks

from distlocks.backends.base import AsyncPrimitives, AsyncTurn, BaseLockBackend, Granted, LockInfo
from distlocks.backends.redis import caches, cluster, listing, replicas, sentinel, strays
from distlocks.backends.redis.handover import Releases, Waiter, releases_for
from distlocks.backends.redis.keys import (
    acquire_keys,
    keys_of_lock,
    keys_of_read_write_lock,
    lock_hash,
    rw_acquire_keys,
)
from distlocks.backends.redis.scripts import Attempt, HoldCalls, registered
from distlocks.backends.redis.server import (
    TIMEOUTS,
    driver_errors,
    eviction_policy,
    eviction_warnings,
    inspected,
    lease_ms,
    without_password,
)
from distlocks.backends.redis.side import RedisSide
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

logger = logging.getLogger(__name__)

# A thread that waited for a lock this many seconds ago or less queues at once (see begin_wait).
WAITED_LATELY = 1.0


def _info(owner: Owner) -> str:
    """What a lock's hash shows operators: when it was acquired (seconds) and by whom."""
    return f"{int(time.time())} {owner.description}"


class RedisBackend(BaseLockBackend):
    """Locks as Lua-managed hashes in the Redis of a cache alias: django-redis's, or Django's own RedisCache."""

    max_key_length = 1024
    cleanup_noun = "unused fencing counters"
    side_class = RedisSide
    option_names = ("CACHE", "CLUSTER", "CLUSTER_OPTIONS", "WAIT_REPLICAS", "WAIT_TIMEOUT", *sentinel.NAMES)
    location_instead = (
        "OPTIONS['CACHE'] names the Redis cache (an alias of CACHES, default 'default'; django-redis or Django's own) "
        "whose Redis holds the locks: set the Redis URL as that cache's LOCATION. For a Redis Cluster, list its "
        "seed nodes in OPTIONS['CLUSTER']; for Sentinel, the sentinels in OPTIONS['SENTINELS'] and the master's name "
        "in OPTIONS['SERVICE']."
    )

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # A Sentinel group or a Redis Cluster, with redis-py's options; none: the Redis of a cache.
        self.remote = sentinel.configured(alias, self.options) or cluster.configured(alias, self.options)
        self.cache: str = "" if self.remote else self.options.get("CACHE", "default")
        # An acquisition counts once this many replicas acknowledge it, within the timeout (see ``replicas``).
        is_cluster = isinstance(self.remote, cluster.Cluster)
        self.wait_replicas, self.wait_timeout = replicas.configured(alias, self.options, is_cluster)
        # Whether a hand-over is renewed before it counts (see ``_handed_over``).
        self.confirm_handovers = bool(self.wait_replicas) or isinstance(self.remote, sentinel.Group)
        # This thread's waits (instances are per thread): each key's waiter, and how long the last attempt said to wait.
        self._waiting: dict[str, Waiter] = {}
        self._wait_hint: dict[str, float] = {}
        self._client_scripts: dict[str, Any] | None = None
        self._process_releases: Releases | None = None
        self._waited_at = -math.inf
        self._async_primitives: AsyncPrimitives | None = None

    @property
    def client(self) -> Any:
        """The redis-py client of the cache alias (django-redis's, or the one Django's own RedisCache writes with),
        or this process's ``RedisCluster`` (BackendUnavailable if no seed node answers) or Sentinel's master client."""
        if not self.remote:
            return caches.client_of(self.alias, self.cache)
        with self._reaching():
            return self.remote.client()

    def unavailable(self, exc: Exception) -> BackendUnavailable:
        where = f"Redis {self.address}" if self.remote else f"Redis of cache {self.cache!r} ({self.address})"
        return BackendUnavailable(
            f"{where} for locks on {self.alias!r} is unavailable: {str(exc) or type(exc).__name__}",
            alias=self.alias,
        )

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        """Turn the driver's errors into BackendUnavailable (see ``driver_errors``)."""
        try:
            yield
        except driver_errors() as exc:
            raise self.unavailable(exc) from exc

    def call(self, script: str, keys: Sequence[str], args: list[Any], confirmed: bool = False) -> Any:
        """Run ``script``: the lock's hot path, so without a context manager and with the scripts kept.

        An attempt's call of a script that writes a hold is ``confirmed``: with
        WAIT_REPLICAS, its answer is an ``Acked`` (``replicas.call``).
        """
        scripts = self._client_scripts
        if scripts is None:
            client = self.client
            self._inspect(client)
            scripts = self._client_scripts = registered(client)
        try:
            if confirmed and self.wait_replicas and script in replicas.CONFIRMED:
                return replicas.call(scripts[script], keys, args, self.wait_replicas, self.wait_timeout)
            return scripts[script](keys=keys, args=args)
        except BaseException as exc:
            if strays.unanswered(exc, script, keys, args, lambda: self.client):  # an acquire is voided
                raise self.unavailable(exc) from exc
            raise

    def _hash(self, key: str) -> str:
        return lock_hash(key)

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        return self.run(self.attempt(key, owner, ttl, self._waiting.get(key)))

    def try_acquire_as(self, key: str, owner: Owner, ttl: float, waiter: Waiter | None) -> int | None:
        """One attempt, by ``waiter`` if it waits (a thread's, or an async task's: see ``aiowait``)."""
        return self.run(self.attempt(key, owner, ttl, waiter))

    def attempt(self, key: str, owner: Owner, ttl: float, waiter: Waiter | None) -> Attempt:
        """The steps of one attempt at the lock ``key`` (see ``_attempt``)."""
        keys = acquire_keys(key)
        calls = HoldCalls(
            key, ("extend", [keys[0]], [owner.secret, lease_ms(ttl)]), ("release", keys[:3], [owner.secret])
        )
        return self._attempt("acquire", keys, [strays.attempt_id()], key, owner, ttl, waiter, calls)

    def run(self, attempt: Attempt) -> int | None:
        """Run an attempt's script calls in the calling thread; a call that raised is thrown into it."""
        try:
            call = next(attempt)
            while True:
                try:
                    answer = self.call(*call, confirmed=True)
                except BaseException as exc:
                    call = attempt.throw(exc)
                else:
                    call = attempt.send(answer)
        except StopIteration as done:
            return done.value

    def _attempt(
        self,
        script: str,
        keys: Sequence[str],
        args: list[Any],
        slot: str,
        owner: Owner,
        ttl: float,
        waiter: Waiter | None,
        calls: HoldCalls,
        mode: str = "",
    ) -> Attempt:
        """One attempt of a lock's or a read-write lock's side (``mode``): ``script`` with ``args`` and the owner's.

        A ``waiter`` queues when it does not get it, and takes what a release
        handed it. A failed attempt leaves the most to wait in ``_wait_hint[slot]``.
        With WAIT_REPLICAS, a hold counts once confirmed (``replicas.confirm``).
        """
        if waiter is not None and waiter.token:
            return (yield from self._handed_over(waiter, ttl, calls, waiter.token))
        lease = lease_ms(ttl)
        args += [owner.secret, lease, _info(owner)]
        if waiter is not None:
            args.append(waiter.queue_entry(owner, lease, mode))
            if waiter.queued:
                args.append("queued")
        sent = time.monotonic()
        answer = yield script, keys, args
        token = int(replicas.value_of(answer))
        if token > 0:
            yield from replicas.confirm(self, answer, calls, token)
            # Taken now, or (a queued waiter) handed over by a release whose message it had not read.
            if waiter and waiter.queued:
                return (yield from self._handed_over(waiter, ttl, calls, token, confirmed=True))
            return token
        if waiter is not None and not waiter.queued:
            waiter.queued = True
            waiter.queued_at = sent
        self._wait_hint[slot] = -token / 1000
        return None

    def _handed_over(
        self, waiter: Waiter, ttl: float, calls: HoldCalls, token: int, confirmed: bool = False
    ) -> Attempt:
        """Take a lock a release handed to ``waiter``, its lease counted from no later than the hand-over.

        The server began the lease at the hand-over, which came after the
        waiter's first queuing attempt was sent (``queued_at``), however late
        the waiter reads it (a paused process, a busy event loop): counted from
        then, the lease never seems longer than the server keeps it. A waiter
        that queued less than a third of ``ttl`` ago has two thirds of it ahead
        so counted and takes the lock with no request (the common case). One
        that waited longer renews it first (``calls.renewal``), and its lease counts
        from this attempt, sent before the renewal: the lease may have run out
        and the lock gone to someone else (then it queues again). A hand-over not ``confirmed`` by a write of
        the waiter's own is renewed too with WAIT_REPLICAS (the releaser's connection wrote it), and on
        Sentinel: a demoted master that kept the channel gets the message by replication, uncounted.
        """
        waiter.token = 0
        if (confirmed or not self.confirm_handovers) and time.monotonic() - waiter.queued_at <= ttl / 3:
            return Granted(token, waiter.queued_at)
        script, keys, args = calls.renewal
        answer = yield script, keys, [*args, token]
        if replicas.value_of(answer):
            yield from replicas.confirm(self, answer, calls, token)
            return token
        logger.info("A lock handed over to a waiter was gone when it woke: queueing again")
        return None

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self.call("reenter", [self._hash(key)], [owner.secret, lease_ms(ttl)]))

    def reenter_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return bool(self.call("reenter", [self._hash(key)], [owner.secret, lease_ms(ttl), token]))

    def release(self, key: str, owner: Owner) -> bool:
        return int(self.call("release", keys_of_lock(key), [owner.secret])) >= 0

    def release_token(self, key: str, owner: Owner, token: int) -> bool:
        return int(self.call("release", keys_of_lock(key), [owner.secret, token])) >= 0

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self.call("extend", [self._hash(key)], [owner.secret, lease_ms(ttl)]))

    def extend_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return bool(self.call("extend", [self._hash(key)], [owner.secret, lease_ms(ttl), token]))

    def release_later(self, key: str, token: int) -> None:
        """Free the acquisition ``token`` of ``key`` once the server answers (see ``strays``), if it is still held."""
        strays.release_later(lambda: self.client, keys_of_lock(key), token)

    def _releases(self) -> Releases:
        releases = self._process_releases  # kept: looked up at every acquire that may wait
        if releases is None or releases.forgotten:
            releases = self._process_releases = releases_for(self.server, self._new_releases)
        return releases

    def _new_releases(self) -> Releases:
        return self.remote.releases(self.client) if self.remote else Releases(self.client)

    def new_loop_releases(self) -> Any:
        """The running event loop's hand-overs (and client) of this server: see ``aiowait``, ``aioshards``, ``aiosentinel``."""
        if self.remote:
            return self.remote.loop_releases(self.client)
        from distlocks.backends.redis.aiowait import LoopReleases, async_client

        return LoopReleases(async_client(self.client))

    def begin_wait(self, key: str, lock_hash: str = "") -> None:
        """Queue at the first attempt a thread that waited lately: it will likely wait again.

        Joining the queue at once saves a round trip when the lock is taken;
        when it is free, a plain attempt is cheaper, so others try first.
        ``lock_hash`` is the hash of the lock of ``key`` (a read-write lock's).
        """
        if time.monotonic() - self._waited_at < WAITED_LATELY:
            releases = self._releases()
            with self._reaching():
                waiter = releases.enlisted(lock_hash or self._hash(key))  # if it can be had without a request
            if waiter is not None:
                self._waiting[key] = waiter

    def wait(self, key: str, attempt: int, remaining: float | None, lock_hash: str = "") -> None:
        """Sleep until a release hands the lock to this waiter or the lease runs out, at most ``remaining``.

        Unless ``begin_wait()`` found the process's channel subscribed already,
        the first call subscribes it and returns: only then may the next
        attempt queue the waiter. A release hands the lock to the first waiter
        in the queue, first come first served, and the waiter takes it without
        asking Redis again (on a cluster, after asking the lock's primary: see
        ``shards``, which also moves a waiter whose lock's slot moved).
        """
        self._waited_at = time.monotonic()
        releases = self._releases()
        waiter = self._waiting.get(key)
        with self._reaching():
            if waiter is None or not releases.current(waiter):
                waiter = self._waiting[key] = releases.enlist(lock_hash or self._hash(key), waiter)
                subscribing = True
            else:
                subscribing = not releases.ready(waiter)
        if subscribing:  # the next attempt queues it: a release must find it listening
            subscribed = waiter
            releases.wait_until(
                lambda: releases.ready(subscribed), waiter, 1.0 if remaining is None else min(remaining, 1.0)
            )
            waiter.retry = False
            return
        timeout = self._wait_hint.get(key, 1.0)
        waiting = timeout if remaining is None else min(timeout, remaining)
        releases.wait_until(lambda: waiter.token > 0 or waiter.retry, waiter, waiting)
        waiter.retry = False

    def end_wait(self, key: str, acquired: bool) -> None:
        self.stop_waiting(key, acquired, "abandon", keys_of_lock(key))

    def waiter(self, slot: str) -> Waiter | None:
        """This thread's waiter in the queue of ``slot`` (a lock's key, a read-write lock's hash), if it queued."""
        return self._waiting.get(slot)

    def wait_hint(self, slot: str) -> float:
        """How long the last failed attempt at ``slot`` said to wait at most (forgotten once told)."""
        return self._wait_hint.pop(slot, 1.0)

    def stop_waiting(self, slot: str, acquired: bool, abandon: str, keys: Sequence[str]) -> None:
        """End this thread's wait at ``slot``; if it did not get the lock, leave the queue of ``keys`` (by the script ``abandon``)."""
        self._wait_hint.pop(slot, None)
        waiter = self._waiting.pop(slot, None)
        if waiter is None:
            return
        if not acquired:
            self._leave(abandon, keys, waiter)
        self._releases().discharge(waiter)

    def leave_queue(self, key: str, waiter: Waiter, mode: str = "") -> None:
        """Take ``waiter`` out of the queue of the lock (of the read-write lock, with ``mode``), passing on what a release handed it meanwhile."""
        if mode:
            self._leave("rw_abandon", keys_of_read_write_lock(key), waiter)
        else:
            self._leave("abandon", keys_of_lock(key), waiter)

    def _leave(self, abandon: str, keys: Sequence[str], waiter: Waiter) -> None:
        if waiter.entry:
            with contextlib.suppress(BackendUnavailable):
                self.call(abandon, keys, [waiter.id, waiter.entry])

    def async_turn(self, key: str) -> AsyncTurn:
        from distlocks.backends.redis.aiowait import RedisTurn

        return RedisTurn(self, key)

    def async_primitives(self) -> AsyncPrimitives:
        """The same scripts as coroutines on the event loop's ``redis.asyncio`` client (see ``redis.aio``)."""
        primitives = self._async_primitives
        if primitives is None:
            from distlocks.backends.redis.aio import AsyncRedis

            primitives = self._async_primitives = AsyncRedis(self)
        return primitives

    # -- read-write locks (their sides: RedisSide) ---------------------------------

    def rw_attempt(self, key: str, owner: Owner, ttl: float, mode: str, waiter: Waiter | None) -> Attempt:
        """One attempt at the ``mode`` side of the read-write lock ``key``, by ``waiter`` if it waits (see ``attempt``)."""
        keys = rw_acquire_keys(key)
        calls = HoldCalls(
            key,
            ("rw_renew", keys[:3], [owner.secret, lease_ms(ttl), mode, 0]),
            ("rw_release", keys[:3], [owner.secret, mode]),
        )
        args = [strays.attempt_id(), mode]
        return self._attempt("rw_acquire", keys, args, keys[0], owner, ttl, waiter, calls, mode)

    # -- inspection and maintenance --------------------------------------------

    def held(self) -> Iterator[LockInfo]:
        with self._reaching():
            yield from listing.held(self.client, self.alias)
            yield from listing.rw_held(self.client, self.alias)

    def holder(self, key: str) -> LockInfo | None:
        with self._reaching():
            return listing.lock_info(self.client, self.alias, lock_hash(key))

    def force_release(self, key: str, token: int | None = None) -> bool:
        return bool(self.call("force_release", keys_of_lock(key), ["" if token is None else token]))

    def take_at_least(self, key: str, owner: Owner, ttl: float, least: int) -> int | None:
        """Take a free lock once, with a token of at least ``least``; its token, or None (Redlock's nodes)."""
        token = int(
            self.call("acquire_at_least", keys_of_lock(key)[:2], [owner.secret, lease_ms(ttl), _info(owner), least])
        )
        return token or None

    def raise_token(self, key: str, owner: Owner, token: int) -> bool:
        """Make the hash show ``token`` and the counter give a larger one next; False if ``owner`` does not hold it.

        Redlock calls it on a majority that gave smaller tokens, so that any
        later majority, which shares a node with this one, gives a larger token.
        """
        return bool(self.call("raise_token", keys_of_lock(key)[:2], [owner.secret, token]))

    def clear_expired(self, dry_run: bool = False) -> int:
        """Delete fencing counters of locks (and read-write locks) not held (tokens still grow: they restart from the clock)."""
        with self._reaching():
            return listing.clear_unused_counters(self.client, dry_run)

    @property
    def server(self) -> tuple[str, str]:
        """The cache alias (or lock alias: options may differ) and address: one set of hand-overs each per process."""
        return self.cache or self.alias, self.address

    @property
    def address(self) -> str:
        """The cache's LOCATION, with any password masked, the cluster's seed nodes or the sentinels: for messages and logs."""
        from django.conf import settings

        if self.remote:
            return self.remote.address
        urls = caches.addresses(settings.CACHES.get(self.cache), self.cache)
        return ", ".join(without_password(url) for url in urls)

    def ping(self) -> list[checks.CheckMessage]:
        """Ask Redis for a PONG, and warn if its eviction policy can delete held locks."""
        with self._reaching():
            client = self.client
            client.ping()
            return self._eviction_warnings_of(eviction_policy(client))

    def _eviction_warnings_of(self, policy: str | None) -> list[checks.CheckMessage]:
        server = f"the Redis {self.address}" if self.remote else f"the Redis of cache {self.cache!r}"
        return eviction_warnings(self.alias, server, policy)

    def _inspect(self, client: Any) -> None:
        """Log a warning, once per process and server, if the server's eviction policy can delete held locks."""
        if self.server in inspected:
            return
        try:
            policy = eviction_policy(client)
        except driver_errors():
            return  # the call that follows says it; look again at the next first use
        self.inspected(policy)

    def inspected(self, policy: str | None) -> None:
        """Note the server's eviction policy, looked at on its first use by this process, and warn if it evicts."""
        inspected.add(self.server)
        for warning in self._eviction_warnings_of(policy):
            logger.warning("%s %s", warning.msg, warning.hint)

    def check(self) -> list[checks.CheckMessage]:
        if self.remote:  # a cluster's or a Sentinel group's: its options were checked when it was made (E002)
            return self.remote.check()
        return caches.check(self.alias, self.cache, TIMEOUTS)
