"""The Lua scripts of the Redis read-write locks: every change is one script, atomic on the server.

Every script gets the keys of one read-write lock: KEYS[1] its hash, KEYS[2]
its fencing counter, KEYS[3] its waiting writers (a sorted set of owner
secrets by arrival, ms). The hash holds the writer (fields ``w`` its secret,
``wc`` its hold count, ``wt`` its token, ``wi`` its info, ``we`` when its
lease ends, ms by the server's clock), each reader (``r:<secret>``: "<lease
end> <count> <token> <info>") and each waiting writer's record (``q:<secret>``:
when it ends). Every hold is a lease of its own: an entry whose end has
passed counts for nothing and is deleted by the next script that meets it.
The hash itself outlives its longest lease, so Redis deletes what the last
holder's crash leaves. Tokens are taken as the lock's are (never below the
server's clock in microseconds, see ``scripts.TAKE``).
"""

from __future__ import annotations

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
  if w then redis.call('HDEL', KEYS[1], 'w', 'wc', 'wt', 'wi', 'we') end
  return nil
end
local function waiting()
  local live = {}
  for _, secret in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
    local ends = tonumber(redis.call('HGET', KEYS[1], 'q:' .. secret))
    if ends and ends > now then
      table.insert(live, secret)
    else
      redis.call('ZREM', KEYS[3], secret)
      redis.call('HDEL', KEYS[1], 'q:' .. secret)
    end
  end
  return live
end
local function readers()
  local fields = redis.call('HGETALL', KEYS[1])
  local live = 0
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'r:' then
      if tonumber(string.match(fields[i + 1], '^(%d+)')) > now then
        live = live + 1
      else
        redis.call('HDEL', KEYS[1], fields[i])
      end
    end
  end
  return live
end
"""

# ARGV[1] the owner's secret, ARGV[2] the lease in ms, ARGV[3] the mode, ARGV[4] the info,
# ARGV[5] (any value) to record a writer that does not get it as waiting
# return the new token, or 0 if not acquired
RW_ACQUIRE = (
    COMMON
    + """
local secret, lease = ARGV[1], tonumber(ARGV[2])
local w = writer()
if ARGV[3] == 'read' then
  if w and w ~= secret then return 0 end
  if not w and redis.call('EXISTS', KEYS[3]) == 1 and #waiting() > 0 then return 0 end
  local token = new_token()
  redis.call('HSET', KEYS[1], 'r:' .. secret, string.format('%d 1 %s %s', now + lease, token, ARGV[4]))
  keep(KEYS[1], lease)
  return tonumber(token)
end
local free = not w and readers() == 0
if free and redis.call('EXISTS', KEYS[3]) == 1 then
  local queued = waiting()
  free = #queued == 0 or queued[1] == secret
end
if not free then
  if ARGV[5] then
    redis.call('ZADD', KEYS[3], 'NX', now, secret)
    redis.call('HSET', KEYS[1], 'q:' .. secret, string.format('%d', now + lease))
    keep(KEYS[1], lease)
    keep(KEYS[3], lease)
  end
  return 0
end
if ARGV[5] then
  redis.call('ZREM', KEYS[3], secret)
  redis.call('HDEL', KEYS[1], 'q:' .. secret)
end
local token = new_token()
redis.call('HSET', KEYS[1], 'w', secret, 'wc', 1, 'wt', token, 'wi', ARGV[4], 'we', string.format('%d', now + lease))
keep(KEYS[1], lease)
return tonumber(token)
"""
)

# ARGV[1] the owner's secret, ARGV[2] the lease in ms, ARGV[3] the mode, ARGV[4] 1 to count one more hold
# return 1 if renewed, 0 if the owner does not hold that side
RW_RENEW = (
    COMMON
    + """
local secret, lease, more = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
if ARGV[3] == 'write' then
  if writer() ~= secret then return 0 end
  redis.call('HSET', KEYS[1], 'we', string.format('%d', now + lease))
  if more > 0 then redis.call('HINCRBY', KEYS[1], 'wc', more) end
else
  local field = 'r:' .. secret
  local entry = redis.call('HGET', KEYS[1], field)
  if not entry then return 0 end
  local ends, count, rest = string.match(entry, '^(%d+) (%d+) (.*)$')
  if tonumber(ends) <= now then
    redis.call('HDEL', KEYS[1], field)
    return 0
  end
  redis.call('HSET', KEYS[1], field, string.format('%d %d %s', now + lease, tonumber(count) + more, rest))
end
keep(KEYS[1], lease)
return 1
"""
)

# ARGV[1] the owner's secret, ARGV[2] the mode
# return the holds left (0: released), -1 if the owner does not hold that side
RW_RELEASE = (
    COMMON
    + """
local secret = ARGV[1]
if ARGV[2] == 'write' then
  if writer() ~= secret then return -1 end
  local count = redis.call('HINCRBY', KEYS[1], 'wc', -1)
  if count <= 0 then redis.call('HDEL', KEYS[1], 'w', 'wc', 'wt', 'wi', 'we') end
  return math.max(count, 0)
end
local field = 'r:' .. secret
local entry = redis.call('HGET', KEYS[1], field)
if not entry then return -1 end
local ends, count, rest = string.match(entry, '^(%d+) (%d+) (.*)$')
if tonumber(ends) <= now then
  redis.call('HDEL', KEYS[1], field)
  return -1
end
count = tonumber(count) - 1
if count > 0 then
  redis.call('HSET', KEYS[1], field, string.format('%s %d %s', ends, count, rest))
else
  redis.call('HDEL', KEYS[1], field)
end
return count
"""
)

# ARGV[1] a waiting writer's secret: it gives up waiting
RW_ABANDON = """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[1], 'q:' .. ARGV[1])
return 1
"""

# ARGV[1] the token of the hold to free ('': the writer, else any reader)
# return 1 if a hold was freed
RW_FORCE_RELEASE = (
    COMMON
    + """
local w = writer()
local wanted = ARGV[1]
if w and (wanted == '' or redis.call('HGET', KEYS[1], 'wt') == wanted) then
  redis.call('HDEL', KEYS[1], 'w', 'wc', 'wt', 'wi', 'we')
  return 1
end
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if string.sub(fields[i], 1, 2) == 'r:' then
    local ends, token = string.match(fields[i + 1], '^(%d+) %d+ (%d+)')
    if tonumber(ends) > now and (wanted == '' or token == wanted) then
      redis.call('HDEL', KEYS[1], fields[i])
      return 1
    end
  end
end
return 0
"""
)

SCRIPTS = {
    "rw_acquire": RW_ACQUIRE,
    "rw_renew": RW_RENEW,
    "rw_release": RW_RELEASE,
    "rw_abandon": RW_ABANDON,
    "rw_force_release": RW_FORCE_RELEASE,
}
