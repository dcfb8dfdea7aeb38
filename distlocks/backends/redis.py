"""Redis lock backend on a django-redis cache alias.

Guarantees: every state change is one Lua script, so it is atomic on the
server. A lock is a hash (owner secret, hold count, fencing token, owner
description) whose lease is the key's ``PEXPIRE``: when it runs out Redis
deletes the key and the lock is free. Releasing the last hold deletes the key
and publishes on the lock's release channel, which wakes waiters in every
process at once (Redisson's approach: no polling). All keys of one lock share a
hash tag, so they live in one slot of a Redis Cluster.

Fencing tokens come from a counter key that never expires. When the counter is
missing (first use, or a Redis restart without persistence) it starts from the
server's clock in microseconds, so tokens keep growing across restarts as long
as the server's clock does not go back. A restart without persistence forgets
held locks: their holders' next renewal fails (``LockLost``) and others can take
the lock at once. With ``appendonly yes`` nothing is forgotten.

Set ``SOCKET_CONNECT_TIMEOUT`` and ``SOCKET_TIMEOUT`` in the cache's
``OPTIONS``: they bound how long an unreachable server takes to raise
``BackendUnavailable``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import BaseLockBackend, LockInfo
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

logger = logging.getLogger(__name__)

# KEYS[1] the lock hash, KEYS[2] its fencing counter
# ARGV[1] the owner's secret, ARGV[2] the lease in ms, ARGV[3] the owner's description
# return {token, 0} when acquired, {0, remaining lease in ms} when held by someone
ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('PTTL', KEYS[1])}
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  local now = redis.call('TIME')
  redis.call('SET', KEYS[2], now[1] .. string.format('%06d', now[2]))
end
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'count', 1, 'token', token, 'info', ARGV[3],
           'acquired', redis.call('TIME')[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {token, 0}
"""

# KEYS[1] the lock hash / ARGV[1] the owner's secret, ARGV[2] the lease in ms
# return 1 if the owner holds it once more, 0 if it does not hold it
REENTER = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HINCRBY', KEYS[1], 'count', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS[1] the lock hash, KEYS[2] its release channel / ARGV[1] the owner's secret
# return the holds left (0: released and published), -1 if the owner does not hold it
RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return -1 end
local left = redis.call('HINCRBY', KEYS[1], 'count', -1)
if left > 0 then return left end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', KEYS[2], 'released')
return 0
"""

# KEYS[1] the lock hash / ARGV[1] the owner's secret, ARGV[2] the lease in ms
# return 1 if renewed, 0 if the owner does not hold it
EXTEND = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

# KEYS[1] the lock hash, KEYS[2] its release channel
# return 1 if it was held
FORCE_RELEASE = """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('PUBLISH', KEYS[2], 'released')
return 1
"""


class _Releases:
    """One pub/sub connection per process and Redis, shared by every waiter.

    Waiters subscribe to a lock's release channel; a daemon thread reads the
    connection and wakes the waiters of the channel a release arrives on.
    """

    def __init__(self, client: Any) -> None:
        self.pubsub = client.pubsub()
        self.lock = threading.Lock()
        self.waiters: dict[str, list[threading.Event]] = {}
        self.ready: dict[str, threading.Event] = {}
        self.thread = threading.Thread(target=self._run, name="distlocks-redis-releases", daemon=True)
        self.started = False

    def subscribe(self, channel: str) -> tuple[threading.Event, threading.Event]:
        """Return (released, subscribed) events for a new waiter on ``channel``."""
        released = threading.Event()
        with self.lock:
            waiters = self.waiters.setdefault(channel, [])
            waiters.append(released)
            if len(waiters) == 1:
                self.ready[channel] = threading.Event()
                self.pubsub.subscribe(channel)
            if not self.started:
                self.thread.start()
                self.started = True
            return released, self.ready[channel]

    def unsubscribe(self, channel: str, released: threading.Event) -> None:
        with self.lock:
            waiters = self.waiters.get(channel, [])
            waiters.remove(released)
            if not waiters:
                del self.waiters[channel]
                self.ready.pop(channel, None)
                self.pubsub.unsubscribe(channel)

    def _run(self) -> None:
        while True:
            try:
                message = self.pubsub.get_message(timeout=None)
            except Exception as exc:  # the connection broke: redis-py reconnects and resubscribes
                logger.warning("Redis release channel: %s", exc)
                time.sleep(0.5)
                continue
            if message is None:
                continue
            channel = message["channel"]
            if isinstance(channel, bytes):
                channel = channel.decode()
            with self.lock:
                if message["type"] == "subscribe" and channel in self.ready:
                    self.ready[channel].set()
                elif message["type"] == "message":
                    for released in self.waiters.get(channel, []):
                        released.set()


_releases: dict[tuple[int, str], _Releases] = {}
_releases_lock = threading.Lock()


class RedisBackend(BaseLockBackend):
    """Locks as Lua-managed hashes in the Redis of a django-redis cache alias."""

    max_key_length = 1024
    cleanup_noun = "unused fencing counters"

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.cache: str = self.options.get("CACHE", "default")

    @property
    def client(self) -> Any:
        """The redis-py client of the cache alias, on django-redis's connection pool."""
        try:
            from django_redis import get_redis_connection
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCKS[{self.alias!r}] needs django-redis: pip install 'distlocks[redis]'"
            ) from exc
        try:
            return get_redis_connection(self.cache)
        except NotImplementedError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCKS[{self.alias!r}]: cache {self.cache!r} is not a django-redis cache"
            ) from exc
        except Exception as exc:  # InvalidCacheBackendError and friends
            raise ImproperlyConfigured(f"DISTLOCKS[{self.alias!r}]: cache {self.cache!r}: {exc}") from exc

    def _scripts(self) -> dict[str, Any]:
        """The scripts, registered once per client: redis-py runs them by EVALSHA, loading on NOSCRIPT."""
        client = self.client
        scripts: dict[str, Any] | None = getattr(client, "_distlocks_scripts", None)
        if scripts is None:
            scripts = {
                name: client.register_script(source)
                for name, source in (
                    ("acquire", ACQUIRE),
                    ("reenter", REENTER),
                    ("release", RELEASE),
                    ("extend", EXTEND),
                    ("force_release", FORCE_RELEASE),
                )
            }
            client._distlocks_scripts = scripts
        return scripts

    def _call(self, script: str, keys: list[str], args: list[Any]) -> Any:
        from redis.exceptions import ConnectionError, TimeoutError

        try:
            return self._scripts()[script](keys=keys, args=args)
        except (ConnectionError, TimeoutError) as exc:
            raise BackendUnavailable(
                f"Redis of cache {self.cache!r} for locks on {self.alias!r} is unavailable: {exc}", alias=self.alias
            ) from exc

    # Keys: the whole key is the hash tag, so all of one lock's keys share a slot.
    def _hash(self, key: str) -> str:
        return f"distlocks:{{{key}}}"

    def _fence(self, key: str) -> str:
        return f"distlocks:{{{key}}}:fence"

    def _channel(self, key: str) -> str:
        return f"distlocks:{{{key}}}:released"

    @staticmethod
    def _ms(ttl: float) -> int:
        return max(1, round(ttl * 1000))

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        token, _ = self._call("acquire", [self._hash(key), self._fence(key)], [owner.secret, self._ms(ttl), str(owner)])
        return int(token) or None

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self._call("reenter", [self._hash(key)], [owner.secret, self._ms(ttl)]))

    def release(self, key: str, owner: Owner) -> bool:
        return int(self._call("release", [self._hash(key), self._channel(key)], [owner.secret])) >= 0

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self._call("extend", [self._hash(key)], [owner.secret, self._ms(ttl)]))

    def _releases(self) -> _Releases:
        index = (os.getpid(), self.cache)
        with _releases_lock:
            releases = _releases.get(index)
            if releases is None:
                releases = _releases[index] = _Releases(self.client)
            return releases

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Sleep until the lock's release is published or its lease runs out, at most ``remaining``."""
        from redis.exceptions import RedisError

        releases = self._releases()
        channel = self._channel(key)
        released, subscribed = releases.subscribe(channel)
        try:
            # Only once subscribed can no release be missed: then look again.
            subscribed.wait(1.0 if remaining is None else min(remaining, 1.0))
            try:
                lease_ms = int(self.client.pttl(self._hash(key)))
            except RedisError as exc:
                raise BackendUnavailable(f"Redis for locks on {self.alias!r} is unavailable: {exc}") from exc
            if lease_ms == -2:
                return  # free already
            # Wake at the latest when the lease runs out (a holder that died), or
            # once a second if the key has no expiry.
            timeout = lease_ms / 1000 if lease_ms >= 0 else 1.0
            if remaining is not None:
                timeout = min(timeout, remaining)
            released.wait(timeout)
        finally:
            releases.unsubscribe(channel, released)

    # -- inspection and maintenance --------------------------------------------

    def held(self) -> Iterator[LockInfo]:
        client = self.client
        prefix = "distlocks:{"
        for raw in client.scan_iter(match="distlocks:{*}", count=500):
            name = raw.decode() if isinstance(raw, bytes) else raw
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(name)
            pipe.pttl(name)
            fields, lease_ms = pipe.execute()
            if not fields or lease_ms < 0:
                continue
            fields = {k.decode(): v.decode() for k, v in fields.items()}
            now = datetime.now(UTC)
            yield LockInfo(
                alias=self.alias,
                name=name[len(prefix) : -1],
                owner=fields.get("info", ""),
                hold_count=int(fields.get("count", 0)),
                token=int(fields["token"]) if "token" in fields else None,
                acquired_at=datetime.fromtimestamp(int(fields["acquired"]), UTC) if "acquired" in fields else None,
                expires_at=now + timedelta(milliseconds=lease_ms),
            )

    def force_release(self, key: str) -> bool:
        return bool(self._call("force_release", [self._hash(key), self._channel(key)], []))

    def clear_expired(self, dry_run: bool = False) -> int:
        """Delete fencing counters of locks not held (tokens still grow: they restart from the clock)."""
        client = self.client
        stale = []
        for raw in client.scan_iter(match="distlocks:{*}:fence", count=500):
            fence = raw.decode() if isinstance(raw, bytes) else raw
            if not client.exists(fence[: -len(":fence")]):
                stale.append(fence)
        if stale and not dry_run:
            client.delete(*stale)
        return len(stale)

    def check(self) -> list[checks.CheckMessage]:
        from django.conf import settings

        if self.cache not in settings.CACHES:
            return [
                checks.Error(
                    f"DISTLOCKS[{self.alias!r}] uses cache {self.cache!r}, which is not in CACHES.",
                    hint="Set OPTIONS['CACHE'] to a django-redis cache alias.",
                    id="distlocks.E004",
                )
            ]
        try:
            import django_redis  # noqa: F401
        except ImportError:
            return [
                checks.Error(
                    f"DISTLOCKS[{self.alias!r}] needs django-redis.",
                    hint="pip install 'distlocks[redis]'",
                    id="distlocks.E005",
                )
            ]
        return []
