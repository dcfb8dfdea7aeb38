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
lease). Any name works: braces in it are escaped so that the hash tag is
always well formed.

Fencing tokens come from a counter key that never expires, and are never
below the server's clock in microseconds. So every token is larger than every
earlier one of that lock as long as the server's clock does not go back: also
when the counter is missing (first use, a restart without persistence) or
comes back stale (a restart from an RDB snapshot; a failover to a replica
that lagged, as long as the replica's clock is not behind its old master's).
A restart without persistence forgets held locks: their holders' next renewal
fails (``LockLost``) and others can take the lock at once. With ``appendonly
yes`` nothing is forgotten. ``force_release`` with a token compares and
deletes in one script: it never frees a later holder's lock.

Locks need ``maxmemory-policy noeviction``, ideally on a Redis of their own:
under any evicting policy a full Redis may delete a held lock's hash, and
another process takes the lock while its holder goes on. ``manage.py check``
(through ``ping()``) and the first use of each server in a process warn about
such a policy when the server tells it (``CONFIG GET``; a server that refuses
CONFIG is not checked).

Set ``SOCKET_CONNECT_TIMEOUT`` and ``SOCKET_TIMEOUT`` in the cache's
``OPTIONS`` (``manage.py check`` warns when they are missing): they bound how
long an unreachable or hung server takes to raise ``BackendUnavailable``.
Messages show the cache's LOCATION with its password masked.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import re
import secrets
import threading
import time
import urllib.parse
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
# returns: its only TIME call is the fencing token's (in TAKE), and it creates
# no Lua function but ``take``, each of which would cost more than the rest of
# it. The hash's 'info', shown to operators only, is
# "<when acquired, in seconds> <owner description>": by the acquiring client's
# clock, or the server's for a hand-over (one argument, one field: cheaper).

# Give the lock to an owner: a new fencing token, one hold, the lease. The
# token is never below the server's clock in microseconds, so that a counter
# that comes back stale (a restart from an RDB snapshot, a failover to a
# replica that lagged) or not at all gives no token twice. Every later token is
# larger as long as the server's clock does not go back; when it does (or two
# takes fall in one microsecond), the counter counts on from the last token.
TAKE = """
local function take(secret, lease, info, least)
  local clock = redis.call('TIME')
  local token = clock[1] .. string.format('%06d', clock[2])
  if least and tonumber(least) > tonumber(token) then token = least end
  local last = redis.call('GETSET', KEYS[2], token)  -- SET ... GET needs Redis 6.2
  if last and tonumber(last) >= tonumber(token) then
    redis.call('SET', KEYS[2], last)
    token = redis.call('INCR', KEYS[2])
  end
  redis.call('HSET', KEYS[1], 'owner', secret, 'count', 1, 'token', token, 'info', info)
  redis.call('PEXPIRE', KEYS[1], lease)
  return tonumber(token)
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

# ARGV[1] the fencing token it must still have ('': whatever it has)
# return 1 if it was held and is now free
FORCE_RELEASE = (
    PASS_ON
    + """
if ARGV[1] ~= '' and tonumber(redis.call('HGET', KEYS[1], 'token')) ~= tonumber(ARGV[1]) then return 0 end
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
pass_on()
return 1
"""
)

# Redlock's acquire on one node: ARGV[1] the owner's secret, ARGV[2] the lease in ms, ARGV[3] the
# info, ARGV[4] the least token to give (the client's proposal, so that the nodes of a majority
# agree on one token and need no second round to raise the others)
# return the token when acquired, 0 if the lock is held
ACQUIRE_AT_LEAST = (
    TAKE
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
return take(ARGV[1], ARGV[2], ARGV[3], ARGV[4])
"""
)

# KEYS[1] the lock hash, KEYS[2] its fencing counter / ARGV[1] the owner's secret, ARGV[2] a token
# Redlock gave out: the hash shows it and the counter will give a larger one next.
# return 1 if the owner holds the lock here, 0 if not
RAISE_TOKEN = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[2])
if (tonumber(redis.call('GET', KEYS[2])) or 0) < tonumber(ARGV[2]) then redis.call('SET', KEYS[2], ARGV[2]) end
return 1
"""


SCRIPTS = {
    "acquire": ACQUIRE,
    "reenter": REENTER,
    "release": RELEASE,
    "abandon": ABANDON,
    "extend": EXTEND,
    "force_release": FORCE_RELEASE,
    "raise_token": RAISE_TOKEN,
    "acquire_at_least": ACQUIRE_AT_LEAST,
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


#: The cache OPTIONS that bound how long a Redis that does not answer makes a call wait.
TIMEOUTS = ("SOCKET_CONNECT_TIMEOUT", "SOCKET_TIMEOUT")


def _sets_timeout(cache: dict[str, Any], name: str) -> bool:
    """Whether a django-redis cache's settings set the timeout ``name`` (in OPTIONS, or its pool's kwargs)."""
    options = cache.get("OPTIONS") or {}
    return bool(options.get(name) or (options.get("CONNECTION_POOL_KWARGS") or {}).get(name.lower()))


def _without_password(url: str) -> str:
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


# The servers whose eviction policy this process has looked at (at their first use).
_inspected: set[tuple[str, str]] = set()


def _eviction_policy(client: Any) -> str | None:
    """The server's ``maxmemory-policy``, or None when it does not say (CONFIG disabled, renamed or denied)."""
    from redis.exceptions import ResponseError

    try:
        reply = client.config_get("maxmemory-policy")
    except ResponseError:
        return None
    policy = {_text(name): _text(value) for name, value in reply.items()}.get("maxmemory-policy")
    return policy or None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _info(owner: Owner) -> str:
    """What a lock's hash shows operators: when it was acquired (seconds) and by whom."""
    return f"{int(time.time())} {owner.description}"


# A key's braces and backslashes, escaped in its hash tag: a '}' would end the tag early.
_ESCAPES = {"\\": "\\\\", "{": "\\(", "}": "\\)"}
_UNESCAPES = {escaped[1]: char for char, escaped in _ESCAPES.items()}


@functools.lru_cache(maxsize=4096)  # built at every acquire and release
def _lock_hash(key: str) -> str:
    """The name of a lock's hash: the key is its hash tag, so that all the lock's keys share a cluster slot.

    Braces are escaped so that the tag always ends where the key does and is
    never empty; keys without braces or backslashes stay as they are.
    """
    if "{" in key or "}" in key or "\\" in key:
        key = "".join(_ESCAPES.get(char, char) for char in key)
    return f"distlocks:{{{key}}}"


def _key_of(lock_hash: str) -> str:
    """The key of a lock from its hash's name (the reverse of ``_lock_hash``)."""
    tagged = lock_hash[len("distlocks:{") : -1]
    return re.sub(r"\\(.)", lambda escaped: _UNESCAPES.get(escaped[1], escaped[1]), tagged)


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
        self.queued_at = 0.0  # when the first such attempt was sent (monotonic): no hand-over came before
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
            client = self.client
            self._inspect(client)
            scripts = self._client_scripts = _scripts(client)
        try:
            return scripts[script](keys=keys, args=args)
        except _connection_errors() as exc:
            raise self._unavailable(exc) from exc

    def _hash(self, key: str) -> str:
        return _lock_hash(key)

    def _keys(self, key: str) -> tuple[str, str, str]:
        return _lock_keys(_lock_hash(key))

    @staticmethod
    def _ms(ttl: float) -> int:
        return max(1, round(ttl * 1000))

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        waiter = self._waiting.get(key)
        if waiter is not None and waiter.token:
            return self._handed_over(key, owner, ttl, waiter, waiter.token)
        lease = self._ms(ttl)
        args = [owner.secret, lease, _info(owner)]
        if waiter is not None:
            args.append(waiter.queue_entry(owner, lease))
            if waiter.queued:
                args.append("queued")
        sent = time.monotonic()
        token = int(self._call("acquire", self._keys(key), args))
        if token > 0:
            # Taken now, or (a queued waiter) handed over by a release whose message it had not read.
            return self._handed_over(key, owner, ttl, waiter, token) if waiter and waiter.queued else token
        if waiter is not None and not waiter.queued:
            waiter.queued = True
            waiter.queued_at = sent
        self._wait_hint[key] = -token / 1000
        return None

    def _handed_over(self, key: str, owner: Owner, ttl: float, waiter: _Waiter, token: int) -> int | None:
        """Take a lock a release handed to ``waiter``, if its lease is surely still ours.

        The lease began at the hand-over, which came after the waiter queued: a
        waiter that queued less than a third of ``ttl`` ago has two thirds of the
        lease ahead at least. One that waited longer, or whose process was paused
        meanwhile, renews it first: the lease may have run out and the lock gone
        to someone else. Then it queues again.
        """
        waiter.token = 0
        if time.monotonic() - waiter.queued_at <= ttl / 3 or self.extend(key, owner, ttl):
            return token
        logger.info("A lock handed over to a waiter was gone when it woke: queueing again")
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
                name=_key_of(name),
                owner=owner,
                hold_count=int(fields.get("count", 0)),
                token=int(fields["token"]) if "token" in fields else None,
                acquired_at=datetime.fromtimestamp(int(acquired), UTC) if acquired.isdigit() else None,
                expires_at=now + timedelta(milliseconds=lease_ms),
            )

    def force_release(self, key: str, token: int | None = None) -> bool:
        return bool(self._call("force_release", self._keys(key), ["" if token is None else token]))

    def take_at_least(self, key: str, owner: Owner, ttl: float, least: int) -> int | None:
        """Take a free lock once, with a token of at least ``least``; its token, or None (Redlock's nodes)."""
        token = int(
            self._call("acquire_at_least", self._keys(key)[:2], [owner.secret, self._ms(ttl), _info(owner), least])
        )
        return token or None

    def raise_token(self, key: str, owner: Owner, token: int) -> bool:
        """Make the hash show ``token`` and the counter give a larger one next; False if ``owner`` does not hold it.

        Redlock calls it on a majority that gave smaller tokens, so that any
        later majority, which shares a node with this one, gives a larger token.
        """
        return bool(self._call("raise_token", self._keys(key)[:2], [owner.secret, token]))

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
        """The cache's LOCATION, with any password masked: it goes into messages and logs."""
        from django.conf import settings

        location = settings.CACHES.get(self.cache, {}).get("LOCATION", self.cache)
        urls = location if isinstance(location, list | tuple) else [location]
        return ", ".join(_without_password(str(url)) for url in urls)

    def ping(self) -> list[checks.CheckMessage]:
        """Ask Redis for a PONG, and warn if its eviction policy can delete held locks."""
        with self._reaching():
            client = self.client
            client.ping()
            return self._eviction_warnings(_eviction_policy(client))

    def _eviction_warnings(self, policy: str | None) -> list[checks.CheckMessage]:
        if policy in (None, "noeviction"):
            return []
        return [
            checks.Warning(
                f"DISTLOCKS[{self.alias!r}]: the Redis of cache {self.cache!r} evicts keys "
                f"(maxmemory-policy {policy}): when it runs short of memory it may delete a held "
                "lock, and another process takes it while the holder goes on.",
                hint="Set maxmemory-policy noeviction on that server, ideally a Redis of its own for "
                "locks (with noeviction, a full Redis refuses writes instead of forgetting).",
                id="distlocks.W011",
            )
        ]

    def _inspect(self, client: Any) -> None:
        """Log a warning, once per process and server, if the server's eviction policy can delete held locks."""
        server = (self.cache, self.address)
        if server in _inspected:
            return
        try:
            policy = _eviction_policy(client)
        except _connection_errors():
            return  # the call that follows says it; look again at the next first use
        _inspected.add(server)
        for warning in self._eviction_warnings(policy):
            logger.warning("%s %s", warning.msg, warning.hint)

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
        missing = [name for name in TIMEOUTS if not _sets_timeout(settings.CACHES[self.cache], name)]
        if missing:
            return [
                checks.Warning(
                    f"DISTLOCKS[{self.alias!r}] uses cache {self.cache!r}, whose OPTIONS set no "
                    f"{' and no '.join(missing)}: a Redis that hangs stalls lock calls and lease renewals "
                    "for redis-py's default (forever before redis-py 8).",
                    hint="Set OPTIONS['SOCKET_CONNECT_TIMEOUT'] and OPTIONS['SOCKET_TIMEOUT'] (seconds, "
                    "e.g. 2 and 5): they bound how long a Redis that does not answer makes a lock call wait.",
                    id="distlocks.W010",
                )
            ]
        return []
