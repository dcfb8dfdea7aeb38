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

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import BaseLockBackend, LockInfo
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner, current_owner

logger = logging.getLogger(__name__)

# KEYS[1] the lock hash, KEYS[2] its fencing counter, KEYS[3] the next owner, KEYS[4] the waiters' queue
# ARGV[1] the owner's secret, ARGV[2] the lease in ms, ARGV[3] the owner's description,
# ARGV[4] '1' if the owner waits: queue it (by arrival on the server's clock) when not acquired
# return {token, 0} when acquired, {0, ms to wait at most} when not
ACQUIRE = """
local now = redis.call('TIME')
local function refuse(wait_ms)
  if ARGV[4] == '1' then
    redis.call('ZADD', KEYS[4], 'NX', now[1] * 1000 + math.floor(now[2] / 1000), ARGV[1])
    redis.call('PEXPIRE', KEYS[4], 60000)
  end
  return {0, wait_ms}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return refuse(redis.call('PTTL', KEYS[1]))
end
local next_owner = redis.call('GET', KEYS[3])
if next_owner and next_owner ~= ARGV[1] then
  return refuse(redis.call('PTTL', KEYS[3]))
end
if next_owner then redis.call('DEL', KEYS[3]) end
if ARGV[4] == '1' then redis.call('ZREM', KEYS[4], ARGV[1]) end
local token = redis.call('INCR', KEYS[2])
if token == 1 then
  -- A new counter (first use, or a restart without persistence): start from
  -- the clock in microseconds, above every token it can have given before.
  token = redis.call('INCRBY', KEYS[2], now[1] .. string.format('%06d', now[2]))
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'count', 1, 'token', token, 'info', ARGV[3], 'acquired', now[1])
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

# KEYS[1] the lock hash, KEYS[2] its release channel, KEYS[3] the next owner, KEYS[4] the waiters' queue
# ARGV[1] the owner's secret, ARGV[2] how long a starving waiter has the lock to itself, in ms,
# ARGV[3] how long a waiter waits before it is starving, in ms
# return the holds left (0: released, and the first waiter's secret published), -1 if the owner does not hold it
RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return -1 end
local left = redis.call('HINCRBY', KEYS[1], 'count', -1)
if left > 0 then return left end
redis.call('DEL', KEYS[1])
local first = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
if first[1] then
  local now = redis.call('TIME')
  if now[1] * 1000 + math.floor(now[2] / 1000) - tonumber(first[2]) >= tonumber(ARGV[3]) then
    redis.call('ZREM', KEYS[4], first[1])
    redis.call('SET', KEYS[3], first[1], 'PX', ARGV[2])
  end
end
redis.call('PUBLISH', KEYS[2], first[1] or '')
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


# A waiter queued for STARVING_MS gets the next release to itself for up to
# HANDOFF_MS: before that, whoever asks first gets it (usually the releaser,
# which is cheaper than waking another process), after it nobody can barge.
STARVING_MS = 4
HANDOFF_MS = 50
# How long a channel stays subscribed after its last waiter left, in seconds.
IDLE_SUBSCRIPTION = 10.0


class _Waiter:
    """A thread waiting on a release channel, woken for a release handed to it or to take its turn reading."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.released = False


class _Releases:
    """One pub/sub connection per process and Redis, shared by every waiter.

    Waiters subscribe to a lock's release channel. There is no reader thread
    between Redis and a waiter: one of the waiting threads reads the connection
    and hands each release to the waiter it is for (or to all when it is for
    nobody), so a process with one waiter wakes straight from the socket, with
    no thread switch. When the reading waiter leaves it wakes the others, one of
    which reads next. A channel stays subscribed for a while after its last
    waiter left, so that a busy lock does not subscribe again and again; a
    daemon thread drains what arrives while nobody waits.
    """

    def __init__(self, client: Any) -> None:
        self.pubsub = client.pubsub()
        self.lock = threading.Lock()  # guards the dicts below
        self.reading = threading.Lock()  # held by the one thread that reads the connection
        self.waiters: dict[str, dict[str, _Waiter]] = {}
        self.ready: dict[str, threading.Event] = {}
        self.idle_since: dict[str, float] = {}
        self.drainer = threading.Thread(target=self._drain, name="distlocks-redis-releases", daemon=True)
        self.broken = False

    def subscribe(self, channel: str, secret: str) -> tuple[_Waiter, threading.Event]:
        """Return the waiter ``secret`` on ``channel`` and the event set once the channel is subscribed."""
        waiter = _Waiter()
        with self.lock:
            self.waiters.setdefault(channel, {})[secret] = waiter
            self.idle_since.pop(channel, None)
            if channel not in self.ready:
                try:
                    self.pubsub.subscribe(channel)
                except Exception:
                    self.waiters[channel].pop(secret, None)
                    raise
                self.ready[channel] = threading.Event()
            if not self.drainer.is_alive():
                self.drainer.start()
            return waiter, self.ready[channel]

    def unsubscribe(self, channel: str, secret: str) -> None:
        with self.lock:
            waiters = self.waiters.get(channel, {})
            waiters.pop(secret, None)
            if not waiters:
                self.waiters.pop(channel, None)
                self.idle_since[channel] = time.monotonic()

    def wait_until(self, done: Callable[[], bool], waiter: _Waiter, timeout: float) -> None:
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
                    self._wake_all()  # one of them reads next
            else:
                waiter.wake.wait(left)
                waiter.wake.clear()

    def _wake_all(self) -> None:
        with self.lock:
            for waiters in self.waiters.values():
                for waiter in waiters.values():
                    waiter.wake.set()

    def _read(self, timeout: float) -> None:
        """Read one message, waiting at most ``timeout`` seconds, and hand it to whom it concerns."""
        try:
            response = self.pubsub.parse_response(block=False, timeout=timeout)
            message = self.pubsub.handle_message(response) if response else None
        except Exception as exc:  # the connection broke: redis-py reconnects and resubscribes
            if not self.broken:  # once per outage, not at every read
                logger.warning("Redis release channel lost, reconnecting: %s", exc)
            self.broken = True
            time.sleep(min(timeout, 0.5))
            return
        self.broken = False
        if message is None:
            return
        channel, data = (v.decode() if isinstance(v, bytes) else v for v in (message["channel"], message["data"]))
        with self.lock:
            waiters = self.waiters.get(channel, {})
            if message["type"] == "subscribe" and channel in self.ready:
                self.ready[channel].set()
                for waiter in waiters.values():
                    waiter.wake.set()
            elif message["type"] == "message":
                chosen = waiters.get(data) if data else None
                for waiter in [chosen] if chosen else waiters.values():
                    waiter.released = True
                    waiter.wake.set()

    def _drain(self) -> None:
        """Every second, while nobody waits, read what arrived and unsubscribe channels idle too long."""
        while True:
            time.sleep(1.0)
            if not self.reading.acquire(blocking=False):
                continue
            try:
                with self.lock:
                    now = time.monotonic()
                    stale = [c for c, since in self.idle_since.items() if now - since > IDLE_SUBSCRIPTION]
                    for channel in stale:
                        del self.idle_since[channel]
                        del self.ready[channel]
                    waiting = bool(self.waiters)
                if stale:
                    with contextlib.suppress(Exception):  # a broken connection drops them anyway
                        self.pubsub.unsubscribe(*stale)
                while not waiting:
                    try:
                        if not self.pubsub.connection.can_read(timeout=0):
                            break
                    except Exception:  # not connected: nothing to drain
                        break
                    self._read(0)
                    with self.lock:
                        waiting = bool(self.waiters)
            finally:
                self.reading.release()
                self._wake_all()


_releases: dict[tuple[int, str], _Releases] = {}
_releases_lock = threading.Lock()


class RedisBackend(BaseLockBackend):
    """Locks as Lua-managed hashes in the Redis of a django-redis cache alias."""

    max_key_length = 1024
    cleanup_noun = "unused fencing counters"

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.cache: str = self.options.get("CACHE", "default")
        # This thread's waits (backend instances are per thread): the release
        # event per key, and how long the last failed attempt said to wait.
        self._waiting: dict[str, _Waiter] = {}
        self._wait_hint: dict[str, float] = {}

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

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        """Turn the driver's connection errors into BackendUnavailable."""
        from redis.exceptions import ConnectionError, TimeoutError

        try:
            yield
        except (ConnectionError, TimeoutError) as exc:
            raise BackendUnavailable(
                f"Redis of cache {self.cache!r} for locks on {self.alias!r} is unavailable: {exc}", alias=self.alias
            ) from exc

    def _call(self, script: str, keys: list[str], args: list[Any]) -> Any:
        with self._reaching():
            return self._scripts()[script](keys=keys, args=args)

    # Keys: the whole key is the hash tag, so all of one lock's keys share a slot.
    def _hash(self, key: str) -> str:
        return f"distlocks:{{{key}}}"

    def _fence(self, key: str) -> str:
        return f"distlocks:{{{key}}}:fence"

    def _channel(self, key: str) -> str:
        return f"distlocks:{{{key}}}:released"

    def _next(self, key: str) -> str:
        return f"distlocks:{{{key}}}:next"

    def _queue(self, key: str) -> str:
        return f"distlocks:{{{key}}}:queue"

    @staticmethod
    def _ms(ttl: float) -> int:
        return max(1, round(ttl * 1000))

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        keys = [self._hash(key), self._fence(key), self._next(key), self._queue(key)]
        queued = "1" if key in self._waiting else "0"
        token, wait_ms = self._call("acquire", keys, [owner.secret, self._ms(ttl), str(owner), queued])
        if token:
            return int(token)
        self._wait_hint[key] = int(wait_ms) / 1000 if int(wait_ms) >= 0 else 1.0
        return None

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self._call("reenter", [self._hash(key)], [owner.secret, self._ms(ttl)]))

    def release(self, key: str, owner: Owner) -> bool:
        keys = [self._hash(key), self._channel(key), self._next(key), self._queue(key)]
        return int(self._call("release", keys, [owner.secret, HANDOFF_MS, STARVING_MS])) >= 0

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
        """Sleep until the lock's release is published or its lease runs out, at most ``remaining``.

        The first call subscribes to the release channel and returns at once:
        only now can no release be missed, so the caller looks again, and that
        attempt queues the waiter if it fails. A release wakes the first waiter
        in the queue; once it has waited ``STARVING_MS`` the release is handed to
        it for up to ``HANDOFF_MS``, so that nobody barges in and no waiter starves.
        """
        releases = self._releases()
        waiter = self._waiting.get(key)
        if waiter is None:
            with self._reaching():
                waiter, subscribed = releases.subscribe(self._channel(key), current_owner().secret)
            self._waiting[key] = waiter
            releases.wait_until(subscribed.is_set, waiter, 1.0 if remaining is None else min(remaining, 1.0))
            return
        timeout = self._wait_hint.get(key, 1.0)
        releases.wait_until(lambda: waiter.released, waiter, timeout if remaining is None else min(timeout, remaining))
        waiter.released = False

    def end_wait(self, key: str, acquired: bool) -> None:
        self._wait_hint.pop(key, None)
        if self._waiting.pop(key, None) is None:
            return
        from redis.exceptions import RedisError

        secret = current_owner().secret
        self._releases().unsubscribe(self._channel(key), secret)
        if not acquired:  # acquiring took it off the queue already
            with contextlib.suppress(RedisError):
                self.client.zrem(self._queue(key), secret)

    # -- inspection and maintenance --------------------------------------------

    def held(self) -> Iterator[LockInfo]:
        with self._reaching():
            yield from self._held()

    def _held(self) -> Iterator[LockInfo]:
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
        with self._reaching():
            return self._clear_unused_counters(dry_run)

    def _clear_unused_counters(self, dry_run: bool) -> int:
        client = self.client
        stale = []
        for raw in client.scan_iter(match="distlocks:{*}:fence", count=500):
            fence = raw.decode() if isinstance(raw, bytes) else raw
            if not client.exists(fence[: -len(":fence")]):
                stale.append(fence)
        if stale and not dry_run:
            client.delete(*stale)
        return len(stale)

    @property
    def address(self) -> str:
        from django.conf import settings

        return str(settings.CACHES.get(self.cache, {}).get("LOCATION", self.cache))

    def ping(self) -> None:
        with self._reaching():
            self.client.ping()

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
