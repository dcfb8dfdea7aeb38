"""The Lua scripts of the Redis backend: every change to a lock is one script, atomic on the server.

Every script but Redlock's two gets the keys of one lock: KEYS[1] its hash,
KEYS[2] its fencing counter, KEYS[3] its waiters' queue: a sorted set of
"channel|waiter id|owner secret|lease ms|owner description" by arrival (ms).
Each script's common case runs first and returns: its only TIME call is the
fencing token's (in TAKE), and it creates no Lua function but ``take``, each of
which would cost more than the rest of it. So the two shared functions, TAKE
and PASS_ON, are prepended to the scripts that call them, and RELEASE defines
``pass_on`` only past its common case. The hash's 'info', shown to operators
only, is "<when acquired, in seconds> <owner description>": by the acquiring
client's clock, or the server's for a hand-over (one argument, one field:
cheaper).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, NamedTuple

from distlocks.backends.redis.rwscripts import SCRIPTS as RW_SCRIPTS
from distlocks.backends.redis.rwscripts import TELL

#: A script to run: its name, keys and arguments.
ScriptCall = tuple[str, Sequence[str], list[Any]]
#: An attempt with its script calls yielded: run in a thread (``RedisBackend.run``) or on the loop (``redis.aio``).
#: A call that raised is thrown into it.
Attempt = Generator[ScriptCall, Any, int | None]


class HoldCalls(NamedTuple):
    """What an attempt at ``key`` calls on a hold it got: its renewal and its release, each with the token appended."""

    key: str
    renewal: ScriptCall
    release: ScriptCall


# Give the lock to an owner: a new fencing token, one hold, the lease. The
# token is never below the server's clock in microseconds, so that a counter
# that comes back stale (a restart from an RDB snapshot, a failover to a
# replica that lagged) or not at all gives no token twice. Every later token is
# larger as long as the server's clock does not go back; when it does (or two
# takes fall in one microsecond), the counter counts on from the last token.
TAKE = """
local function take(secret, lease, info, least, attempt)
  local clock = redis.call('TIME')
  local token = clock[1] .. string.format('%06d', clock[2])
  if least and tonumber(least) > tonumber(token) then token = least end
  local last = redis.call('GETSET', KEYS[2], token)  -- SET ... GET needs Redis 6.2
  if last and tonumber(last) >= tonumber(token) then
    redis.call('SET', KEYS[2], last)
    token = redis.call('INCR', KEYS[2])
  end
  if attempt then
    redis.call('HSET', KEYS[1], 'owner', secret, 'count', 1, 'token', token, 'info', info, 'attempt', attempt)
  else
    redis.call('HSET', KEYS[1], 'owner', secret, 'count', 1, 'token', token, 'info', info)
  end
  redis.call('PEXPIRE', KEYS[1], lease)
  return tonumber(token)
end
"""

# The lock is free: hand it to the first waiter in the queue, marking the hash
# 'granted' with the waiter's id and telling its process "token waiter-id
# lock-key" (``rwscripts.TELL``). A waiter whose process no longer listens (it
# died) is dropped, and the lock goes to the next one.
PASS_ON = (
    TAKE
    + TELL
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
    if tell(channel, string.format('%d', token), id) > 0 then return end
    redis.call('DEL', KEYS[1])
  end
end
-- Free the lock if it is ``ours`` to give back, and pass it on; a lock found free is passed on too.
-- return 1 if it freed the lock
local function give_back(ours)
  if ours then
    redis.call('DEL', KEYS[1])
    pass_on()
    return 1
  end
  if redis.call('EXISTS', KEYS[1]) == 0 then pass_on() end
  return 0
end
"""
)

# KEYS[1] the lock hash, KEYS[2] its fencing counter, KEYS[3] its waiters' queue, KEYS[4] the attempts voided
# ARGV[1] the attempt's id (unique), ARGV[2] the owner's secret, ARGV[3] the lease in ms, ARGV[4] the info;
# if it waits: ARGV[5] its queue entry, where it queues when not acquired, and ARGV[6] (any value) if an
# earlier attempt queued it
# return the token when acquired; when not, minus the ms to wait at most (one integer: cheaper to read)
# The hash of a lock it gives (taken, or handed over to it) shows the attempt's id: an attempt whose answer
# was lost is voided by VOID, which gives back what it took, or makes it do nothing if it has not run yet.
ACQUIRE = (
    TAKE
    + """
if redis.call('ZSCORE', KEYS[4], ARGV[1]) then return -1 end
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[6] then redis.call('ZREM', KEYS[3], ARGV[5]) end
  return take(ARGV[2], ARGV[3], ARGV[4], nil, ARGV[1])
end
local lease_left = redis.call('PTTL', KEYS[1])
if lease_left < 1 then lease_left = lease_left < 0 and 1000 or 1 end  -- no lease (set by hand): look again in 1 s
local attempt, granted, token = unpack(redis.call('HMGET', KEYS[1], 'attempt', 'granted', 'token'))
-- This attempt ran already (the client's driver sent it again when its answer was lost): what it took is its.
-- Written again: a WAIT after it on this connection then waits for the replicas to have the lock too (a server
-- counts the writes of each connection, and the first run was on another).
if attempt == ARGV[1] then
  redis.call('HSET', KEYS[1], 'attempt', ARGV[1])
  return tonumber(token)
end
if not ARGV[5] then return -lease_left end
if granted == string.match(ARGV[5], '^[^|]*|([^|]*)|') then
  -- Handed to this waiter by a release whose message it has not read yet.
  redis.call('HDEL', KEYS[1], 'granted')
  redis.call('HSET', KEYS[1], 'attempt', ARGV[1])
  return tonumber(token)
end
local clock = redis.call('TIME')
redis.call('ZADD', KEYS[3], 'NX', clock[1] * 1000 + math.floor(clock[2] / 1000), ARGV[5])
-- The queue outlives the lease this waiter will sleep through at most.
local keep = math.max(lease_left, tonumber(ARGV[3])) + 60000
if redis.call('PTTL', KEYS[3]) < keep then redis.call('PEXPIRE', KEYS[3], keep) end
return -lease_left
"""
)

# KEYS[1] the lock hash / ARGV[1] the owner's secret, ARGV[2] the lease in ms; ARGV[3] (if given) the token
# of the acquisition to re-enter: one that reaches the server late never counts a hold of the owner's later one
# return 1 if the owner holds it once more, 0 if it does not hold it
REENTER = """
local owner, token = unpack(redis.call('HMGET', KEYS[1], 'owner', 'token'))
if owner ~= ARGV[1] or (ARGV[3] and tonumber(token) ~= tonumber(ARGV[3])) then return 0 end
redis.call('HINCRBY', KEYS[1], 'count', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS[1] the lock hash, KEYS[2] its fencing counter, KEYS[3] its waiters' queue
# ARGV[1] the owner's secret; ARGV[2] (if given) the token of the acquisition to release: a release that
# reaches the server late (after its caller gave up on it) never frees the owner's later acquisition
# return the holds left (0: released and passed on), -1 if the owner does not hold it
RELEASE = (
    """
local owner, count, token = unpack(redis.call('HMGET', KEYS[1], 'owner', 'count', 'token'))
if owner ~= ARGV[1] or (ARGV[2] and tonumber(token) ~= tonumber(ARGV[2])) then return -1 end
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

# KEYS[1] the lock hash, KEYS[2] its fencing counter, KEYS[3] its waiters' queue
# A waiter gives up, or its process got a hand-over for a waiter it no longer has:
# ARGV[1] the waiter's id, ARGV[2] its queue entry ('' if none).
# It leaves the queue; a lock handed to it and not taken, or a free lock, is passed on.
# return 1 if it gave back a lock handed to it
ABANDON = (
    PASS_ON
    + """
if ARGV[2] ~= '' then redis.call('ZREM', KEYS[3], ARGV[2]) end
return give_back(redis.call('HGET', KEYS[1], 'granted') == ARGV[1])
"""
)

# KEYS as ACQUIRE's. An acquire whose answer was lost (a timeout, a broken connection, an interrupt) may
# run later, or have run: ARGV[1] its id, ARGV[2] the owner's secret, ARGV[3] how long (ms) to remember
# the id: if it runs meanwhile it does nothing; ARGV[4] its queue entry ('' if none), which leaves the queue.
# A lock it took, or that was handed over to its waiter, is released and passed on, unless the hash shows
# another attempt or owner (held before, or taken anew since) or more than one hold (re-entered).
# return 1 if it released a lock
VOID = (
    PASS_ON
    + """
local clock = redis.call('TIME')
local now = clock[1] * 1000 + math.floor(clock[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[1])
if redis.call('PTTL', KEYS[4]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[4], ARGV[3]) end
if ARGV[4] ~= '' then redis.call('ZREM', KEYS[3], ARGV[4]) end
local owner, attempt, count, granted = unpack(redis.call('HMGET', KEYS[1], 'owner', 'attempt', 'count', 'granted'))
local waiter = string.match(ARGV[4], '^[^|]*|([^|]*)|')
return give_back((owner == ARGV[2] and attempt == ARGV[1] and count == '1') or (waiter ~= nil and granted == waiter))
"""
)

# KEYS[1] the lock hash / ARGV[1] the owner's secret, ARGV[2] the lease in ms; ARGV[3] (if given) the
# token of the acquisition to renew: a renewal that reaches the server late never cuts the owner's later one
# return 1 if renewed, 0 if the owner does not hold it
EXTEND = """
local owner, token = unpack(redis.call('HMGET', KEYS[1], 'owner', 'token'))
if owner ~= ARGV[1] or (ARGV[3] and tonumber(token) ~= tonumber(ARGV[3])) then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

# KEYS[1] the lock hash, KEYS[2] its fencing counter, KEYS[3] its waiters' queue
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

# KEYS[1] the lock hash, KEYS[2] its fencing counter
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
    "void": VOID,
    "extend": EXTEND,
    "force_release": FORCE_RELEASE,
    "raise_token": RAISE_TOKEN,
    "acquire_at_least": ACQUIRE_AT_LEAST,
    **RW_SCRIPTS,  # the read-write locks'
}


def registered(client: Any, sources: dict[str, str] = SCRIPTS, attribute: str = "_distlocks_scripts") -> dict[str, Any]:
    """The scripts, registered once per client: redis-py runs them by EVALSHA, loading them on NOSCRIPT."""
    scripts: dict[str, Any] | None = getattr(client, attribute, None)
    if scripts is None:
        scripts = {name: client.register_script(source) for name, source in sources.items()}
        setattr(client, attribute, scripts)
    return scripts
