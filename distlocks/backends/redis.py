"""Redis lock backend on a django-redis cache alias.

Guarantees: every state change is one Lua script, so it is atomic on the
server. A lock is a hash (owner secret, hold count, fencing token, owner
description) whose lease is the key's ``PEXPIRE``: when it runs out Redis
deletes the key and the lock is free. A waiter that failed to acquire joins
the lock's queue; releasing the last hold hands the lock straight to the first
waiter (first come, first served) and tells it so on its process's pub/sub
channel, so it takes the lock without asking again and nobody polls. A waiter
whose process died is skipped: nobody listens on its channel any more. All
keys of one lock share a hash tag, so they live in one slot of a Redis Cluster
(untested there: ``PUBLISH`` in a cluster counts only the listeners of the node
it runs on, so a waiter listening elsewhere would be skipped and wait for the
lease).

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
import functools
import itertools
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import BaseLockBackend, LockInfo
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

logger = logging.getLogger(__name__)

# A thread that waited for a lock this many seconds ago or less queues at once (see begin_wait).
WAITED_LATELY = 1.0

# KEYS[1] is the lock hash, KEYS[2] its fencing counter, KEYS[3] its waiters'
# queue: a sorted set of "channel|waiter id|owner secret|lease ms|owner
# description" by arrival (ms). Each script's common case runs first and
# returns: it makes no TIME call and creates no Lua function, which would cost
# more than the rest of it. The hash's 'info', shown to operators only, is
# "<when acquired, in seconds> <owner description>": by the acquiring client's
# clock, or the server's for a hand-over (one argument, one field: cheaper).

# Give the lock to an owner: a new fencing token, one hold, the lease.
TAKE = """
local function take(secret, lease, info)
  local token = redis.call('INCR', KEYS[2])
  if token == 1 then
    -- A new counter (first use, or a restart without persistence): start from
    -- the clock in microseconds, above every token it can have given before.
    local clock = redis.call('TIME')
    token = redis.call('INCRBY', KEYS[2], clock[1] .. string.format('%06d', clock[2]))
  end
  redis.call('HSET', KEYS[1], 'owner', secret, 'count', 1, 'token', token, 'info', info)
  redis.call('PEXPIRE', KEYS[1], lease)
  return token
end
"""

# The lock is free: hand it to the first waiter in the queue, marking the hash
# 'granted' with the waiter's id and telling its process "token waiter-id
# lock-key". A waiter whose process no longer listens (it died) is dropped, and
# the lock goes to the next one.
PASS_ON = (
    TAKE
    + """
local function pass_on()
  local now = redis.call('TIME')[1]
  while true do
    local first = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not first then return end
    redis.call('ZREM', KEYS[3], first)
    local channel, id, secret, lease, info = string.match(first, '^([^|]*)|([^|]*)|([^|]*)|(%d+)|(.*)$')
    local token = take(secret, lease, now .. ' ' .. info)
    redis.call('HSET', KEYS[1], 'granted', id)
    if redis.call('PUBLISH', channel, string.format('%d %s %s', token, id, KEYS[1])) > 0 then return end
    redis.call('DEL', KEYS[1])
  end
end
"""
)

# ARGV[1] the owner's secret, ARGV[2] the lease in ms, ARGV[3] the info; if it waits:
# ARGV[4] its queue entry, where it queues when not acquired, and ARGV[5] (any value)
# if an earlier attempt queued it
# return the token when acquired; when not, minus the ms to wait at most (one integer: cheaper to read)
ACQUIRE = (
    TAKE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[5] then redis.call('ZREM', KEYS[3], ARGV[4]) end
  return take(ARGV[1], ARGV[2], ARGV[3])
end
local lease_left = redis.call('PTTL', KEYS[1])
if lease_left < 1 then lease_left = lease_left < 0 and 1000 or 1 end  -- no lease (set by hand): look again in 1 s
if not ARGV[4] then return -lease_left end
local granted, token = unpack(redis.call('HMGET', KEYS[1], 'granted', 'token'))
if granted == string.match(ARGV[4], '^[^|]*|([^|]*)|') then
  -- Handed to this waiter by a release whose message it has not read yet.
  redis.call('HDEL', KEYS[1], 'granted')
  return tonumber(token)
end
local clock = redis.call('TIME')
redis.call('ZADD', KEYS[3], 'NX', clock[1] * 1000 + math.floor(clock[2] / 1000), ARGV[4])
-- The queue outlives the lease this waiter will sleep through at most.
local keep = math.max(lease_left, tonumber(ARGV[2])) + 60000
if redis.call('PTTL', KEYS[3]) < keep then redis.call('PEXPIRE', KEYS[3], keep) end
return -lease_left
"""
)

# KEYS[1] the lock hash / ARGV[1] the owner's secret, ARGV[2] the lease in ms
# return 1 if the owner holds it once more, 0 if it does not hold it
REENTER = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HINCRBY', KEYS[1], 'count', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# ARGV[1] the owner's secret
# return the holds left (0: released and passed on), -1 if the owner does not hold it
RELEASE = (
    """
local owner, count = unpack(redis.call('HMGET', KEYS[1], 'owner', 'count'))
if owner ~= ARGV[1] then return -1 end
if tonumber(count) > 1 then return redis.call('HINCRBY', KEYS[1], 'count', -1) end
redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
"""
    + PASS_ON
    + """
pass_on()
return 0
"""
)

# A waiter gives up, or its process got a hand-over for a waiter it no longer has:
# ARGV[1] the waiter's id, ARGV[2] its queue entry ('' if none).
# It leaves the queue; a lock handed to it and not taken, or a free lock, is passed on.
# return 1 if it gave back a lock handed to it
ABANDON = (
    PASS_ON
    + """
if ARGV[2] ~= '' then redis.call('ZREM', KEYS[3], ARGV[2]) end
if redis.call('HGET', KEYS[1], 'granted') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  pass_on()
  return 1
end
if redis.call('EXISTS', KEYS[1]) == 0 then pass_on() end
return 0
"""
)

# KEYS[1] the lock hash / ARGV[1] the owner's secret, ARGV[2] the lease in ms
# return 1 if renewed, 0 if the owner does not hold it
EXTEND = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

# return 1 if it was held
FORCE_RELEASE = (
    PASS_ON
    + """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
pass_on()
return 1
"""
)


SCRIPTS = {
    "acquire": ACQUIRE,
    "reenter": REENTER,
    "release": RELEASE,
    "abandon": ABANDON,
    "extend": EXTEND,
    "force_release": FORCE_RELEASE,
}


def _scripts(client: Any) -> dict[str, Any]:
    """The scripts, registered once per client: redis-py runs them by EVALSHA, loading them on NOSCRIPT."""
    scripts: dict[str, Any] | None = getattr(client, "_distlocks_scripts", None)
    if scripts is None:
        scripts = client._distlocks_scripts = {n: client.register_script(source) for n, source in SCRIPTS.items()}
    return scripts


def _connection_errors() -> tuple[type[Exception], ...]:
    """The driver's errors for a server it cannot reach (imported late: redis is an optional dependency).

    Called in ``except`` clauses, which evaluate it only when an exception is raised.
    """
    from redis.exceptions import ConnectionError, TimeoutError

    return ConnectionError, TimeoutError


def _info(owner: Owner) -> str:
    """What a lock's hash shows operators: when it was acquired (seconds) and by whom."""
    return f"{int(time.time())} {owner.description}"


@functools.lru_cache(maxsize=4096)  # built at every acquire and release
def _lock_keys(lock_hash: str) -> tuple[str, str, str]:
    """A lock's hash, fencing counter and waiters' queue, from the hash's name."""
    return lock_hash, f"{lock_hash}:fence", f"{lock_hash}:queue"


class _Waiter:
    """A thread waiting for a lock, woken by the release that hands it the lock, with its token."""

    def __init__(self, channel: str, waiter_id: str) -> None:
        self.channel = channel
        self.id = waiter_id
        self.entry = ""  # its entry in the lock's queue, once it has one
        self.wake = threading.Event()
        self.token = 0
        self.queued = False  # an attempt put its entry in the lock's queue
        self.retry = False  # the channel was (re)subscribed: releases may have been missed

    def queue_entry(self, owner: Owner, lease_ms: int) -> str:
        """Where to tell it, who it is, and the lease to hand it the lock with."""
        self.entry = f"{self.channel}|{self.id}|{owner.secret}|{lease_ms}|{owner}"
        return self.entry


class _Releases:
    """One pub/sub connection per process and Redis, shared by every waiter.

    The process listens on a channel of its own; a release tells the first
    waiter in the lock's queue through its process's channel. There is no
    reader thread between Redis and a waiter: one of the waiting threads reads
    the connection and passes each message to the waiter it is for, so a process
    with one waiter wakes straight from the socket, with no thread switch. When
    the reading waiter leaves it wakes the others, one of which reads next.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pubsub = client.pubsub()
        process = secrets.token_hex(8)
        self.channel = f"distlocks:waiters:{process}"
        self.waiter_ids = (f"{process}.{n}" for n in itertools.count(1))  # unique across processes
        self.lock = threading.Lock()  # guards the waiters
        self.reading = threading.Lock()  # held by the one thread that reads the connection
        self.waiters: dict[str, _Waiter] = {}
        self.subscribing = False
        self.subscribed = threading.Event()
        self.broken = False
        self.forgotten = False  # in a forked child: the parent's

    def enlist(self) -> _Waiter:
        with self.lock:
            waiter = _Waiter(self.channel, next(self.waiter_ids))
            if not self.subscribing:
                self.pubsub.subscribe(self.channel)
                self.subscribing = True
            self.waiters[waiter.id] = waiter
        return waiter

    def discharge(self, waiter: _Waiter) -> None:
        with self.lock:
            self.waiters.pop(waiter.id, None)

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
                    with self.lock:  # one of the others reads next
                        for other in self.waiters.values():
                            other.wake.set()
            else:
                waiter.wake.wait(left)
                waiter.wake.clear()

    def _read(self, timeout: float) -> None:
        """Read one message, waiting at most ``timeout`` seconds, and pass it to the waiter it is for."""
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
        if message["type"] == "subscribe":
            # The first subscription, or a resubscription after a reconnect
            # (a Redis restart forgets the queues): every waiter tries again.
            with self.lock:
                self.subscribed.set()
                for waiter in self.waiters.values():
                    waiter.retry = True
                    waiter.wake.set()
            return
        if message["type"] != "message":
            return
        token, waiter_id, lock_hash = message["data"].decode().split(" ", 2)
        with self.lock:
            handed_to = self.waiters.get(waiter_id)
            if handed_to is not None:
                handed_to.token = int(token)
                handed_to.wake.set()
                return
        # Handed to a waiter that left without leaving the queue (Redis was
        # unreachable then): give it back, or nobody holds it for a lease.
        from redis.exceptions import RedisError

        with contextlib.suppress(RedisError):
            _scripts(self.client)["abandon"](keys=_lock_keys(lock_hash), args=[waiter_id, ""])


# One per cache alias and server (tests point an alias at new servers), in this process.
_releases: dict[tuple[str, str], _Releases] = {}
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
        releases.forgotten = True
        if releases.pubsub.connection is not None:
            with contextlib.suppress(Exception):
                releases.pubsub.connection.disconnect()
    _releases.clear()


os.register_at_fork(after_in_child=_forget_releases_after_fork)


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
        self._client_scripts: dict[str, Any] | None = None
        self._process_releases: _Releases | None = None
        self._waited_at = -math.inf

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

    def _unavailable(self, exc: Exception) -> BackendUnavailable:
        return BackendUnavailable(
            f"Redis of cache {self.cache!r} for locks on {self.alias!r} is unavailable: {exc}", alias=self.alias
        )

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        """Turn the driver's connection errors into BackendUnavailable."""
        try:
            yield
        except _connection_errors() as exc:
            raise self._unavailable(exc) from exc

    def _call(self, script: str, keys: Sequence[str], args: list[Any]) -> Any:
        """Run ``script``: the lock's hot path, so without a context manager and with the scripts kept."""
        scripts = self._client_scripts
        if scripts is None:
            scripts = self._client_scripts = _scripts(self.client)
        try:
            return scripts[script](keys=keys, args=args)
        except _connection_errors() as exc:
            raise self._unavailable(exc) from exc

    # Keys: the whole key is the hash tag, so all of one lock's keys share a slot.
    def _hash(self, key: str) -> str:
        return f"distlocks:{{{key}}}"

    def _keys(self, key: str) -> tuple[str, str, str]:
        return _lock_keys(self._hash(key))

    @staticmethod
    def _ms(ttl: float) -> int:
        return max(1, round(ttl * 1000))

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        waiter = self._waiting.get(key)
        if waiter is not None and waiter.token:
            return waiter.token  # a release handed it over
        lease = self._ms(ttl)
        args = [owner.secret, lease, _info(owner)]
        if waiter is not None:
            args.append(waiter.queue_entry(owner, lease))
            if waiter.queued:
                args.append("queued")
        token = int(self._call("acquire", self._keys(key), args))
        if token > 0:
            return token
        if waiter is not None:
            waiter.queued = True
        self._wait_hint[key] = -token / 1000
        return None

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self._call("reenter", [self._hash(key)], [owner.secret, self._ms(ttl)]))

    def release(self, key: str, owner: Owner) -> bool:
        return int(self._call("release", self._keys(key), [owner.secret])) >= 0

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self._call("extend", [self._hash(key)], [owner.secret, self._ms(ttl)]))

    def _releases(self) -> _Releases:
        releases = self._process_releases  # kept: looked up at every acquire that may wait
        if releases is None or releases.forgotten:
            index = (self.cache, self.address)
            with _releases_lock:
                releases = _releases.get(index)
                if releases is None:
                    releases = _releases[index] = _Releases(self.client)
            self._process_releases = releases
        return releases

    def begin_wait(self, key: str) -> None:
        """Queue at the first attempt a thread that waited lately: it will likely wait again.

        Joining the queue at once saves a round trip when the lock is taken;
        when it is free, a plain attempt is cheaper, so others try first.
        """
        if time.monotonic() - self._waited_at < WAITED_LATELY:
            releases = self._releases()
            if releases.subscribed.is_set():  # no request made here
                self._waiting[key] = releases.enlist()

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Sleep until a release hands the lock to this waiter or the lease runs out, at most ``remaining``.

        Unless ``begin_wait()`` found the process's channel subscribed already,
        the first call subscribes it and returns: only then may the next
        attempt queue the waiter. A release hands the lock to the first waiter
        in the queue, first come first served, and the waiter takes it without
        asking Redis again.
        """
        self._waited_at = time.monotonic()
        releases = self._releases()
        waiter = self._waiting.get(key)
        if waiter is None:
            with self._reaching():
                waiter = self._waiting[key] = releases.enlist()
            releases.wait_until(releases.subscribed.is_set, waiter, 1.0 if remaining is None else min(remaining, 1.0))
            waiter.retry = False
            return
        timeout = self._wait_hint.get(key, 1.0)
        waiting = timeout if remaining is None else min(timeout, remaining)
        releases.wait_until(lambda: waiter.token > 0 or waiter.retry, waiter, waiting)
        waiter.retry = False

    def end_wait(self, key: str, acquired: bool) -> None:
        self._wait_hint.pop(key, None)
        waiter = self._waiting.pop(key, None)
        if waiter is None:
            return
        if not acquired and waiter.entry:
            # Leave the queue, passing on the lock if a release handed it over meanwhile.
            with contextlib.suppress(BackendUnavailable):
                self._call("abandon", self._keys(key), [waiter.id, waiter.entry])
        self._releases().discharge(waiter)

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
            acquired, _, owner = fields.get("info", "").partition(" ")
            now = datetime.now(UTC)
            yield LockInfo(
                alias=self.alias,
                name=name[len(prefix) : -1],
                owner=owner,
                hold_count=int(fields.get("count", 0)),
                token=int(fields["token"]) if "token" in fields else None,
                acquired_at=datetime.fromtimestamp(int(acquired), UTC) if acquired.isdigit() else None,
                expires_at=now + timedelta(milliseconds=lease_ms),
            )

    def force_release(self, key: str) -> bool:
        return bool(self._call("force_release", self._keys(key), []))

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
