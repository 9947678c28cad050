-- idemflow: one batch of one pipeline, atomically (see src/store/redis/batch.rs for the argument layout).
--
-- 0. See below: a retry of a batch that ran gets that run's answer.
-- 1. The stored positions of the batch's partitions are checked against the owner epoch and the position this
--    worker last stored: nothing is written when a partition was claimed by another worker ("fenced") or when
--    Redis lost writes this worker had seen ("lost").
-- 2. Records in order. A record to apply claims its dedup key with SET NX PX (insert-then-check); only a new key
--    runs the record's commands (the ACL was asked first, for every record of the batch, before any write), each with redis.pcall so that a failing command (WRONGTYPE, a number that is not
--    one) ends that record only. Redis has no rollback: commands of the record that ran before the failure stay,
--    the dead letter says how many. A key that existed is a duplicate: its value is returned for classification
--    and its duplicate count raised (KEEPTTL: the retention clock is the applied record's).
-- 3. Dead letters are appended to a stream, once per Kafka position.
-- 4. The new positions are stored last, so a script that stops half-way (an error raised by Redis itself) leaves
--    them where they were and the retried batch finds its finished records' keys.
-- 5. The answer is kept under the batch's token: a retry whose earlier attempt's answer was lost gets it again
--    (step 0) instead of running the batch a second time and counting its records as duplicates.
local P = ARGV[1]
local ttl = ARGV[2]
local stream = ARGV[3]
local seq = ARGV[4]
local pipeline = ARGV[5]
-- The batch's token (the worker's number for it, the same on every attempt; '' for none), whether an earlier
-- attempt of it failed (it may have run, its answer lost), and the lane whose last answer is kept.
local token = ARGV[6]
local again = ARGV[7] == '1'
local answer_key = P .. 'answer:' .. ARGV[8]
local i = 9

-- 0. An earlier attempt of this very batch ran though its answer was lost (a reply cut off, the client's response
--    timeout): its answer, stored by that run, is answered again as it was, and nothing is written again. The
--    batch is counted once, as that run classified it. Only for the same batch (as many partitions and records):
--    one that lost records since (a partition revoked or fenced during the back-off) runs as it is now, its
--    records' keys found claimed.
if again and token ~= '' then
  local stored = redis.call('GET', answer_key)
  local sep = stored and string.find(stored, ':', 1, true)
  if sep and string.sub(stored, 1, sep - 1) == token then
    -- This batch's partitions and records, counted from its arguments (see batch.rs for their layout).
    local j = i
    local parts_n = tonumber(ARGV[j])
    j = j + 1 + 4 * parts_n
    j = j + 1 + tonumber(ARGV[j])
    local commands_n = tonumber(ARGV[j])
    j = j + 1
    for _ = 1, commands_n do
      j = j + 1 + tonumber(ARGV[j])
    end
    local a = cjson.decode(string.sub(stored, sep + 1))
    if #a[1] == parts_n and #a[2] == tonumber(ARGV[j]) then
      return {'ok', a[1], a[2], 'again'}
    end
  end
end
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
local replays = {}
for r = 1, nr do
  replays[r] = ARGV[i]
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

-- The commands_done field of dead letter `id` ('0' when it has none or is gone).
local function done_of(id)
  local e = redis.call('XRANGE', stream, id, id)
  if e[1] then
    local f = e[1][2]
    for j = 1, #f, 2 do
      if f[j] == 'commands_done' then
        return f[j + 1]
      end
    end
  end
  return '0'
end

local function dead_letter(topic, part, off, dlpos, reason, err, done, blob)
  local k = nil
  local new = 1
  if dlpos ~= '' then
    k = P .. 'dl:' .. dlpos
    local id = redis.call('GET', k)
    if id then
      -- This position was dead-lettered before (a redelivery). The entry stays, unless more of the record's commands
      -- have taken effect since: then it is replaced, so a replay does not run them again.
      if done == done_of(id) then
        return {0, id}
      end
      redis.call('XDEL', stream, id)
      new = 0
    end
  end
  local nl = string.find(blob, '\n', 1, true)
  -- Ids N-0 from a counter, always above the stream's last entry (should the counter be lost).
  local n = redis.call('INCR', seq)
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  if last[1] then
    local m = tonumber(string.match(last[1][1], '^(%d+)-'))
    if m and n <= m then
      n = m + 1
      redis.call('SET', seq, n)
    end
  end
  local id = n .. '-0'
  redis.call('XADD', stream, id, 'pipeline', pipeline, 'topic', topic, 'partition', part, 'offset', off,
    'reason', reason, 'error', err, 'commands_done', done, 'created_at', now,
    'meta', string.sub(blob, 1, nl - 1), 'payload', string.sub(blob, nl + 1))
  if k then
    redis.call('SET', k, id, 'PX', ttl)
  end
  return {new, id}
end

-- Errors of a command that are not the record's fault: the batch is refused and retried (or the pipeline stops),
-- never a dead letter.
-- Redis 7.0 reports a permission refused inside a script as "ERR The user executing the script can't ...", not
-- NOPERM: matched by its text too.
local function not_the_records(err)
  local code = string.match(err, '^(%u+)')
  return code == 'NOPERM' or code == 'OOM' or code == 'READONLY' or code == 'MASTERDOWN' or code == 'BUSY'
    or code == 'LOADING' or code == 'MISCONF' or code == 'NOREPLICAS' or code == 'TRYAGAIN'
    or string.find(err, "user executing the script can't", 1, true) ~= nil
end

-- Whether the user running the script may run commands `from` + 1 to the last with the record's arguments, its keys
-- included (redis.acl_check_cmd, Redis 7.0+). Asked before any of them runs: a refusal is every record's, never the
-- record's fault, and must not leave a record half applied. Returns the refusal's text, or nil.
local function acl_refused(from)
  if not redis.acl_check_cmd then
    return nil
  end
  for c = from + 1, nc do
    local ok, allowed = pcall(redis.acl_check_cmd, unpack(cmds[c]))
    if ok and not allowed then
      return 'NOPERM the Redis user idemflow connects as may not run command ' .. c .. ' of ' .. nc .. ' (' .. cmds[c][1]
        .. ') on the keys this record names (ACL): grant it, then restart the pipeline; nothing of this record ran'
    end
  end
  return nil
end

-- Before anything is written: the ACL, for every record to apply, with its own arguments. A refusal is never a
-- record's fault and must leave nothing behind: not a record half applied, not a replayed dead letter taken.
do
  local j = i
  local n = tonumber(ARGV[j]); j = j + 1
  for _ = 1, n do
    local kind = ARGV[j]
    j = j + 3
    if kind == 'D' or kind == 'DR' then
      j = j + 5
    else
      j = j + 2
      for c = 1, nc do
        for _, a in ipairs(holes[c]) do
          cmds[c][a] = ARGV[j]
          j = j + 1
        end
      end
      local skip = 0
      if kind ~= 'A' then
        skip = tonumber(string.sub(kind, 2))
      end
      local refused = acl_refused(skip)
      if refused then
        return redis.error_reply(refused)
      end
    end
  end
end

-- Dead letters being replayed are taken first; one already taken (another replay of it ran) refuses the batch.
for r = 1, nr do
  if redis.call('XDEL', stream, replays[r]) == 0 then
    return {'replayed', replays[r]}
  end
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
      -- Only this record's own mark is lifted: another record of the same key marked it for commands of its own.
      local old = redis.call('GET', dk)
      if old and string.sub(old, 1, 2) == 'D|' then
        local op, oo, ot = string.match(old, '^%a|%d+|%d+|%d*|(-?%d+)|(%d+)|%x*|(.*)$')
        local np, no, nt = string.match(value, '^(-?%d+)|(%d+)|%x*|(.*)$')
        if op == np and oo == no and ot == nt then
          redis.call('DEL', dk)
        end
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
        if done == 0 and not_the_records(failed[2]) then
          -- Nothing of this record ran: release its key and refuse the batch; what ran before is kept by its keys.
          redis.call('DEL', dk)
          return redis.error_reply(failed[2])
        end
        local err = 'command ' .. failed[1] .. ' of ' .. nc .. ' (' .. cmds[failed[1]][1] .. ') failed: ' .. failed[2]
        if done == 0 then
          err = err .. '; none of the record\'s commands took effect'
        else
          err = err .. '; the record\'s first ' .. done .. ' command(s) took effect and were not undone (a replay runs the rest)'
        end
        local part, off, topic = string.match(value, '^(-?%d+)|(%d+)|%x*|(.*)$')
        -- The dead letter first: should writing it fail, no mark is left without its dead letter.
        local d = dead_letter(topic, part, off, dlpos, 'side_effect_rejected', err, tostring(done), blob)
        if done == 0 then
          redis.call('DEL', dk)
        else
          -- Some commands took effect: the key stays, marked, so no later copy runs them again; a replay of the
          -- dead letter runs the rest.
          redis.call('SET', dk, 'D|' .. now .. '|0||' .. value, 'KEEPTTL')
        end
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
-- 5. The answer, kept for a retry of this batch whose answer was lost (one key per lane, the last batch's).
if token ~= '' then
  redis.call('SET', answer_key, token .. ':' .. cjson.encode({marks, out}), 'PX', ttl)
end
return {'ok', marks, out}
