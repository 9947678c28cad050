-- idemflow: one batch of one pipeline, atomically (see src/store/redis/batch.rs for the argument layout).
--
-- 1. The stored positions of the batch's partitions are checked against the owner epoch and the position this
--    worker last stored: nothing is written when a partition was claimed by another worker ("fenced") or when
--    Redis lost writes this worker had seen ("lost").
-- 2. Records in order. A record to apply claims its dedup key with SET NX PX (insert-then-check); only a new key
--    runs the record's commands, each with redis.pcall so that a failing command (WRONGTYPE, a number that is not
--    one) ends that record only. Redis has no rollback: commands of the record that ran before the failure stay,
--    the dead letter says how many. A key that existed is a duplicate: its value is returned for classification
--    and its duplicate count raised (KEEPTTL: the retention clock is the applied record's).
-- 3. Dead letters are appended to a stream, once per Kafka position.
-- 4. The new positions are stored last, so a script that stops half-way (an error raised by Redis itself) leaves
--    them where they were and the retried batch finds its finished records' keys.
local P = ARGV[1]
local ttl = ARGV[2]
local stream = ARGV[3]
local seq = ARGV[4]
local pipeline = ARGV[5]
local i = 6
local t = redis.call('TIME')
local now = tostring(t[1] * 1000 + math.floor(t[2] / 1000))

local offsets = P .. 'offsets'
local np = tonumber(ARGV[i]); i = i + 1
local parts = {}
local marks = {}
local bad = {}
for p = 1, np do
  local field, nxt, epoch, expected = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  i = i + 4
  local cur = redis.call('HGET', offsets, field)
  local ce, cn = -1, '-'
  if cur then
    local e, n = string.match(cur, '^(%d+) (%S+)$')
    ce, cn = tonumber(e), n
  end
  local pe = tonumber(epoch)
  if ce > pe then
    bad[#bad + 1] = {'fenced', field}
  elseif ce < pe or (cn ~= expected and cn ~= nxt) then
    -- Our claim, or a position we stored, is not there: Redis lost writes. (cn == nxt: this very batch was
    -- applied by an attempt whose answer was lost.)
    bad[#bad + 1] = {'lost', field, cn}
  end
  marks[p] = cn
  parts[p] = {field, epoch .. ' ' .. nxt}
end
if #bad > 0 then
  return {'refused', bad}
end

local nr = tonumber(ARGV[i]); i = i + 1
for r = 1, nr do
  redis.call('XDEL', stream, ARGV[i])
  i = i + 1
end

-- The commands: per command its arguments, false where a record's value goes (filled in place for each record).
local nc = tonumber(ARGV[i]); i = i + 1
local cmds = {}
local holes = {}
for c = 1, nc do
  local na = tonumber(ARGV[i]); i = i + 1
  local cmd, h = {}, {}
  for a = 1, na do
    local flag, arg = string.sub(ARGV[i], 1, 1), string.sub(ARGV[i], 2)
    if flag == '=' then
      cmd[a] = arg
    else
      cmd[a] = false
      h[#h + 1] = a
    end
    i = i + 1
  end
  cmds[c], holes[c] = cmd, h
end

local function dead_letter(topic, part, off, dlpos, reason, err, done, blob)
  local k = nil
  if dlpos ~= '' then
    k = P .. 'dl:' .. dlpos
    local id = redis.call('GET', k)
    if id then
      return {0, id}
    end
  end
  local nl = string.find(blob, '\n', 1, true)
  local id = redis.call('INCR', seq) .. '-0'
  redis.call('XADD', stream, id, 'pipeline', pipeline, 'topic', topic, 'partition', part, 'offset', off,
    'reason', reason, 'error', err, 'commands_done', done, 'created_at', now,
    'meta', string.sub(blob, 1, nl - 1), 'payload', string.sub(blob, nl + 1))
  if k then
    redis.call('SET', k, id, 'PX', ttl)
  end
  return {1, id}
end

local n = tonumber(ARGV[i]); i = i + 1
local out = {}
for r = 1, n do
  -- kind: A (apply), R<done> (apply a replayed dead letter, whose first <done> commands took effect), D (dead letter),
  -- DR (a replayed dead letter that fails again before its commands).
  local kind, dlpos, blob = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if kind == 'D' or kind == 'DR' then
    local topic, part, off, reason, err = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
    i = i + 5
    if kind == 'DR' and dlpos ~= '' then
      -- A replayed dead letter failing again: its position is dead-lettered anew, with the new error.
      redis.call('DEL', P .. 'dl:' .. dlpos)
    end
    local d = dead_letter(topic, part, off, dlpos, reason, err, '0', blob)
    out[r] = {3, d[1], d[2]}
  else
    local dk, value = P .. 'k:' .. ARGV[i], ARGV[i + 1]
    i = i + 2
    for c = 1, nc do
      local cmd = cmds[c]
      for _, a in ipairs(holes[c]) do
        cmd[a] = ARGV[i]
        i = i + 1
      end
    end
    local skip = 0
    if kind ~= 'A' then
      skip = tonumber(string.sub(kind, 2))
      -- A dead letter replayed: its key may hold the mark of its partial failure, and its position is no longer
      -- dead-lettered.
      if dlpos ~= '' then
        redis.call('DEL', P .. 'dl:' .. dlpos)
      end
      local old = redis.call('GET', dk)
      if old and string.sub(old, 1, 2) == 'D|' then
        redis.call('DEL', dk)
      end
    end
    if redis.call('SET', dk, 'A|' .. now .. '|0||' .. value, 'NX', 'PX', ttl) then
      local failed = nil
      for c = skip + 1, nc do
        local res = redis.pcall(unpack(cmds[c]))
        if type(res) == 'table' and res.err then
          failed = {c, res.err}
          break
        end
      end
      if failed then
        local done = failed[1] - 1
        local err = 'command ' .. failed[1] .. ' of ' .. nc .. ' (' .. cmds[failed[1]][1] .. ') failed: ' .. failed[2]
        if done == 0 then
          redis.call('DEL', dk)
          err = err .. '; none of the record\'s commands took effect'
        else
          -- Some commands took effect: the key stays, marked, so no later copy runs them again; a replay of the
          -- dead letter runs the rest.
          redis.call('SET', dk, 'D|' .. now .. '|0||' .. value, 'KEEPTTL')
          err = err .. '; the record\'s first ' .. done .. ' command(s) took effect and were not undone (a replay runs the rest)'
        end
        local part, off, topic = string.match(value, '^(-?%d+)|(%d+)|%x*|(.*)$')
        local d = dead_letter(topic, part, off, dlpos, 'side_effect_rejected', err, tostring(done), blob)
        out[r] = {2, d[1], d[2], done, err}
      else
        out[r] = 0
      end
    else
      local old = redis.call('GET', dk)
      local state, at, dups, rest = string.match(old, '^(%a)|(%d+)|(%d+)|%d*|(.*)$')
      if state then
        redis.call('SET', dk, state .. '|' .. at .. '|' .. (tonumber(dups) + 1) .. '|' .. now .. '|' .. rest, 'KEEPTTL')
      end
      out[r] = {1, old}
    end
  end
end

for p = 1, np do
  redis.call('HSET', offsets, parts[p][1], parts[p][2])
end
return {'ok', marks, out}
