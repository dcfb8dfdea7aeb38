"""The Lua scripts of the Redis read-write locks: every change is one script, atomic on the server.

Every script gets the keys of one read-write lock, named as a lock's (see
``keys.lock_keys``): KEYS[1] its hash, KEYS[2] its fencing counter, KEYS[3]
its waiters' queue, a sorted set by arrival (ms) of entries
"mode|channel|waiter id|owner secret|lease ms|owner description". The hash
holds the writer (fields ``w`` its secret, ``wc`` its hold count, ``wt`` its
token, ``wi`` its info, ``we`` when its lease ends, ms by the server's clock),
each reader (``r:<secret>``: "<lease end> <count> <token> <info>"), when each
queued waiter's entry ends (``q:<waiter id>``), and, for a hold handed to a
waiter that has not taken it yet, the waiter's id (``g`` and the hold's field:
``gw``, ``gr:<secret>``), and, for a hold an acquire took, the id of that attempt (``a`` and the
hold's field: ``aw``, ``ar:<secret>``; see ``strays``). Every hold and every queue entry is a lease of its
own: one whose end has passed counts for nothing and is deleted by the next
script that meets it. The hash outlives its longest lease, so Redis deletes
what the last holder's crash leaves. Tokens are taken as the lock's are (never
below the server's clock in microseconds, see ``scripts.TAKE``).

The hand-over is the lock's (``scripts.PASS_ON``): a script that may free the
lock serves the queue from its head, gives the side to the waiters that may
have it (a writer alone, or the run of readers up to the next writer) and
tells each on its process's channel (``TELL``), "token waiter-id hash",
which ``handover.pass_on`` reads. As in the lock's scripts, the common case runs
first and returns before the queue's functions are made.
"""

from __future__ import annotations

# Tell a waiter's process "token waiter-id hash" on the channel of its queue entry: the process's own
# (PUBLISH), or on a Redis Cluster, where an entry's channel is ':w:<process>', the sharded channel of
# this lock and that process, '<KEYS[1]>:w:<process>': in the lock's slot, so that SPUBLISH reaches the
# subscribers of the lock's own primary (and counts them), wherever the process connected first.
# return how many listened
TELL = """
local function tell(channel, token, id)
  if string.byte(channel, 1) == 58 then
    return redis.call('SPUBLISH', KEYS[1] .. channel, token .. ' ' .. id .. ' ' .. KEYS[1])
  end
  return redis.call('PUBLISH', channel, token .. ' ' .. id .. ' ' .. KEYS[1])
end
"""

COMMON = """
local clock = redis.call('TIME')
local now = clock[1] * 1000 + math.floor(clock[2] / 1000)
local function new_token()
  local token = clock[1] .. string.format('%06d', clock[2])
  local last = redis.call('GETSET', KEYS[2], token)
  if last and tonumber(last) >= tonumber(token) then
    redis.call('SET', KEYS[2], last)
    token = string.format('%d', redis.call('INCR', KEYS[2]))
  end
  return token
end
local function keep(key, lease)
  if redis.call('PTTL', key) < lease then redis.call('PEXPIRE', key, lease) end
end
local function writer()
  local w, ends = unpack(redis.call('HMGET', KEYS[1], 'w', 'we'))
  if w and tonumber(ends) > now then return w end
  if w then redis.call('HDEL', KEYS[1], 'w', 'wc', 'wt', 'wi', 'we', 'gw', 'aw') end
  return nil
end
local function readers()
  local fields = redis.call('HGETALL', KEYS[1])
  local live = 0
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'r:' then
      if tonumber(string.match(fields[i + 1], '^(%d+)')) > now then
        live = live + 1
      else
        redis.call('HDEL', KEYS[1], fields[i], 'g' .. fields[i], 'a' .. fields[i])
      end
    end
  end
  return live
end
"""

# Give the ``mode`` side to ``secret`` for ``lease`` ms; return its token (a string). The hold shows
# ``attempt``, the id of the acquire that took it, unless the owner held that side already (a read
# hold of its own, live): a void of the attempt must leave that hold.
HOLD = """
local function hold(mode, secret, lease, info, attempt)
  local token = new_token()
  local ends = string.format('%d', now + lease)
  local field = mode == 'read' and 'r:' .. secret or 'w'
  local had = mode == 'read' and tonumber(string.match(redis.call('HGET', KEYS[1], field) or '0', '^(%d+)')) > now
  if attempt and not had then
    redis.call('HSET', KEYS[1], 'a' .. field, attempt)
  else
    redis.call('HDEL', KEYS[1], 'a' .. field)
  end
  if mode == 'read' then
    redis.call('HSET', KEYS[1], field, ends .. ' 1 ' .. token .. ' ' .. info)
  else
    redis.call('HSET', KEYS[1], 'w', secret, 'wc', 1, 'wt', token, 'wi', info, 'we', ends)
  end
  keep(KEYS[1], lease)
  return token
end
"""

# The queue: serve it from its head (``pass_on``), drop a hold (``drop``: its field, 'w' or 'r:<secret>').
QUEUE = (
    HOLD
    + TELL
    + """
local function drop(field)
  if field == 'w' then
    redis.call('HDEL', KEYS[1], 'w', 'wc', 'wt', 'wi', 'we', 'gw', 'aw')
  else
    redis.call('HDEL', KEYS[1], field, 'g' .. field, 'a' .. field)
  end
end
-- Give the side to the waiters at the head that may have it now: a writer alone, or the run of
-- readers up to the next writer. An entry whose lease ran out (its waiter stopped asking: it died)
-- is dropped, and so is a waiter whose process no longer listens (the side goes to the next).
local function pass_on()
  while true do
    local first = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not first then return end
    local mode, channel, id, secret, lease, info = string.match(first, '^(%a+)|([^|]*)|([^|]*)|([^|]*)|(%d+)|(.*)$')
    local ends = tonumber(redis.call('HGET', KEYS[1], 'q:' .. id))
    local live = ends and ends > now
    if live and (writer() or (mode == 'write' and readers() > 0)) then return end
    redis.call('ZREM', KEYS[3], first)
    redis.call('HDEL', KEYS[1], 'q:' .. id)
    if live then
      local token = hold(mode, secret, tonumber(lease), clock[1] .. ' ' .. info)
      local field = mode == 'write' and 'w' or 'r:' .. secret
      redis.call('HSET', KEYS[1], 'g' .. field, id)
      if tell(channel, token, id) == 0 then
        drop(field)
      elseif mode == 'write' then
        return
      end
    end
  end
end
"""
)

# KEYS[4] the attempts voided / ARGV[1] the attempt's id (unique), ARGV[2] the mode, ARGV[3] the owner's
# secret, ARGV[4] the lease in ms, ARGV[5] the info; if it waits: ARGV[6] its queue entry, where it queues
# when not acquired, and ARGV[7] (any value) if an earlier attempt queued it
# return the token when acquired; when not, minus the ms to wait at most
# A hold it takes (or is handed over) shows the attempt's id: an attempt whose answer was lost is voided
# by RW_VOID, which gives back what it took, or makes it do nothing if it has not run yet.
RW_ACQUIRE = (
    COMMON
    + HOLD
    + """
if redis.call('ZSCORE', KEYS[4], ARGV[1]) then return -1 end
local attempt, mode, secret, lease = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
-- Sent again (a retrying connection) after its answer was lost: say what its first run took.
local mine = mode == 'write' and 'w' or 'r:' .. secret
-- Written again, as the lock's ACQUIRE does: a WAIT after it then waits for the replicas to have the hold.
if redis.call('HGET', KEYS[1], 'a' .. mine) == attempt then
  local token
  if mode == 'write' and tonumber(redis.call('HGET', KEYS[1], 'we')) > now then
    token = redis.call('HGET', KEYS[1], 'wt')
  else
    local ends, read = string.match(redis.call('HGET', KEYS[1], mine) or '', '^(%d+) %d+ (%d+)')
    if ends and tonumber(ends) > now then token = read end
  end
  if token then
    redis.call('HSET', KEYS[1], 'a' .. mine, attempt)
    return tonumber(token)
  end
end
local queue = redis.call('EXISTS', KEYS[3]) == 1
local w = writer()
if mode == 'read' then
  -- The write holder reads at once (a downgrade); others when nobody writes or waits.
  if w == secret or not (w or queue) then return tonumber(hold(mode, secret, lease, ARGV[5], attempt)) end
elseif not (w or queue) and readers() == 0 then
  return tonumber(hold(mode, secret, lease, ARGV[5], attempt))
end
"""
    + QUEUE
    + """
-- Its head may be free: a holder's lease ran out, a waiter ahead died.
if queue then pass_on() end
local field = mode == 'write' and 'w' or 'r:' .. secret
local id = ARGV[6] and string.match(ARGV[6], '^%a+|[^|]*|([^|]*)|')
if ARGV[7] and redis.call('HGET', KEYS[1], 'g' .. field) == id then
  -- Handed to this waiter, now or by a release whose message it has not read yet.
  redis.call('HDEL', KEYS[1], 'g' .. field)
  redis.call('HSET', KEYS[1], 'a' .. field, attempt)
  if mode == 'write' then return tonumber(redis.call('HGET', KEYS[1], 'wt')) end
  return tonumber(string.match(redis.call('HGET', KEYS[1], field), '^%d+ %d+ (%d+)'))
end
if redis.call('EXISTS', KEYS[3]) == 0 and not writer() and (mode == 'read' or readers() == 0) then
  return tonumber(hold(mode, secret, lease, ARGV[5], attempt))
end
if id then
  redis.call('ZADD', KEYS[3], 'NX', now, ARGV[6])
  redis.call('HSET', KEYS[1], 'q:' .. id, string.format('%d', now + lease))
  keep(KEYS[1], lease)
  keep(KEYS[3], lease)
end
-- Wait until a hold or an entry ahead may run out, and ask again before this one's does.
local wait = math.floor(lease / 3)
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local name, ends = fields[i], nil
  local kind = string.sub(name, 1, 2)
  if name == 'we' or (kind == 'q:' and name ~= 'q:' .. tostring(id)) then
    ends = tonumber(fields[i + 1])
  elseif kind == 'r:' then
    ends = tonumber(string.match(fields[i + 1], '^(%d+)'))
  end
  if ends and ends - now + 1 < wait then wait = ends - now + 1 end
end
return -math.max(wait, 1)
"""
)

# ARGV[1] the owner's secret, ARGV[2] the lease in ms, ARGV[3] the mode, ARGV[4] 1 to count one more hold;
# ARGV[5] (if given) the token of the acquisition to renew: a renewal that reaches the server late (after its
# caller gave up on it) never touches the owner's later acquisition of the side (a reader's token is the
# first word of its entry past the count)
# return 1 if renewed, 0 if the owner does not hold that side (that acquisition of it)
RW_RENEW = (
    COMMON
    + """
local secret, lease, more = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
if ARGV[3] == 'write' then
  if writer() ~= secret then return 0 end
  if ARGV[5] and tonumber(redis.call('HGET', KEYS[1], 'wt')) ~= tonumber(ARGV[5]) then return 0 end
  redis.call('HSET', KEYS[1], 'we', string.format('%d', now + lease))
  if more > 0 then redis.call('HINCRBY', KEYS[1], 'wc', more) end
else
  local field = 'r:' .. secret
  local entry = redis.call('HGET', KEYS[1], field)
  if not entry then return 0 end
  local ends, count, rest = string.match(entry, '^(%d+) (%d+) (.*)$')
  if tonumber(ends) <= now then
    redis.call('HDEL', KEYS[1], field, 'g' .. field, 'a' .. field)
    return 0
  end
  if ARGV[5] and tonumber(string.match(rest, '^(%d+)')) ~= tonumber(ARGV[5]) then return 0 end
  redis.call('HSET', KEYS[1], field, string.format('%d %d %s', now + lease, tonumber(count) + more, rest))
end
keep(KEYS[1], lease)
return 1
"""
)

# ARGV[1] the owner's secret, ARGV[2] the mode; ARGV[3] (if given) the token of the acquisition to release,
# as RW_RENEW's
# return the holds left (0: released, and the queue served), -1 if the owner does not hold that side (that
# acquisition of it)
RW_RELEASE = (
    COMMON
    + """
local secret = ARGV[1]
if ARGV[2] == 'write' then
  if writer() ~= secret then return -1 end
  if ARGV[3] and tonumber(redis.call('HGET', KEYS[1], 'wt')) ~= tonumber(ARGV[3]) then return -1 end
  local count = redis.call('HINCRBY', KEYS[1], 'wc', -1)
  if count > 0 then return count end
  redis.call('HDEL', KEYS[1], 'w', 'wc', 'wt', 'wi', 'we', 'gw', 'aw')
else
  local field = 'r:' .. secret
  local entry = redis.call('HGET', KEYS[1], field)
  if not entry then return -1 end
  local ends, count, rest = string.match(entry, '^(%d+) (%d+) (.*)$')
  if tonumber(ends) <= now then
    redis.call('HDEL', KEYS[1], field, 'g' .. field, 'a' .. field)
    return -1
  end
  if ARGV[3] and tonumber(string.match(rest, '^(%d+)')) ~= tonumber(ARGV[3]) then return -1 end
  count = tonumber(count) - 1
  if count > 0 then
    redis.call('HSET', KEYS[1], field, string.format('%s %d %s', ends, count, rest))
    return count
  end
  redis.call('HDEL', KEYS[1], field, 'g' .. field, 'a' .. field)
end
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
"""
    + QUEUE
    + """
pass_on()
return 0
"""
)

# A waiter gives up, or its process got a hand-over for a waiter it no longer has:
# ARGV[1] the waiter's id, ARGV[2] its queue entry ('' if none).
# It leaves the queue; a hold handed to it and not taken is given back, and the queue served.
# return 1 if it gave back a hold handed to it
RW_ABANDON = (
    COMMON
    + QUEUE
    + """
local id = ARGV[1]
if ARGV[2] ~= '' then redis.call('ZREM', KEYS[3], ARGV[2]) end
redis.call('HDEL', KEYS[1], 'q:' .. id)
local given = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if string.sub(fields[i], 1, 1) == 'g' and fields[i + 1] == id then
    drop(string.sub(fields[i], 2))
    given = 1
  end
end
pass_on()
return given
"""
)

# ARGV[1] the token of the hold to free ('': the writer, else any reader)
# return 1 if a hold was freed (and the queue served)
RW_FORCE_RELEASE = (
    COMMON
    + QUEUE
    + """
local wanted = ARGV[1]
local freed = nil
if writer() and (wanted == '' or redis.call('HGET', KEYS[1], 'wt') == wanted) then
  freed = 'w'
else
  local fields = redis.call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do
    if not freed and string.sub(fields[i], 1, 2) == 'r:' then
      local ends, token = string.match(fields[i + 1], '^(%d+) %d+ (%d+)')
      if tonumber(ends) > now and (wanted == '' or token == wanted) then freed = fields[i] end
    end
  end
end
if not freed then return 0 end
drop(freed)
pass_on()
return 1
"""
)

# KEYS as RW_ACQUIRE's. An acquire whose answer was lost (a timeout, a broken connection, an interrupt)
# may run later, or have run: ARGV[1] its id, ARGV[2] the mode, ARGV[3] the owner's secret, ARGV[4] how
# long (ms) to remember the id: if it runs meanwhile it does nothing; ARGV[5] its queue entry ('' if
# none), which leaves the queue (a writer's blocks new readers). A hold of that side handed over to its
# waiter and not taken, or that the attempt took, is given back and the queue served, unless the hold
# shows another attempt (the owner held that side before, or took it anew since) or more than one hold
# (re-entered). Other holds, the owner's other side's included, are left as they are.
# return 1 if it gave back a hold
RW_VOID = (
    COMMON
    + QUEUE
    + """
local attempt, mode, secret, remember = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
redis.call('ZADD', KEYS[4], now + remember, attempt)
keep(KEYS[4], remember)
local id = string.match(ARGV[5], '^%a+|[^|]*|([^|]*)|')
if id then
  redis.call('ZREM', KEYS[3], ARGV[5])
  redis.call('HDEL', KEYS[1], 'q:' .. id)
end
local field = mode == 'write' and 'w' or 'r:' .. secret
local given = 0
if id and redis.call('HGET', KEYS[1], 'g' .. field) == id then
  given = 1
elseif redis.call('HGET', KEYS[1], 'a' .. field) == attempt then
  if mode == 'write' then
    if writer() == secret and redis.call('HGET', KEYS[1], 'wc') == '1' then given = 1 end
  else
    local ends, count = string.match(redis.call('HGET', KEYS[1], field) or '', '^(%d+) (%d+) ')
    if ends and tonumber(ends) > now and count == '1' then given = 1 end
  end
end
if given == 1 then drop(field) end
pass_on()
return given
"""
)

SCRIPTS = {
    "rw_acquire": RW_ACQUIRE,
    "rw_renew": RW_RENEW,
    "rw_release": RW_RELEASE,
    "rw_abandon": RW_ABANDON,
    "rw_force_release": RW_FORCE_RELEASE,
    "rw_void": RW_VOID,
}
