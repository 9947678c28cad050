//! Stored positions in Redis: `<prefix><pipeline>:offsets`, a hash `topic/partition` -> `epoch next` (`next` is
//! `-` until a batch stores one), fenced by owner epochs as the database's `idemflow_offsets` rows are (see
//! [`crate::offsets`]). Claims and resets are scripts, so each is atomic against the batches' scripts.

use super::batch::partition_field;
use super::RedisStore;
use crate::offsets::Claimed;

/// Raises each partition's epoch above both the stored one and a floor (the highest this worker held: after Redis
/// lost writes, the stored epoch may be lower than one already handed out) and returns `epoch next` for each, in
/// order. `ARGV`: offsets key, owners key, owner, then field and floor pairs.
const CLAIM: &str = r"
local out = {}
for i = 4, #ARGV, 2 do
  local cur = redis.call('HGET', ARGV[1], ARGV[i])
  local e, n = 0, '-'
  if cur then
    local ce, cn = string.match(cur, '^(%d+) (%S+)$')
    e, n = tonumber(ce), cn
  end
  local v = (math.max(e, tonumber(ARGV[i + 1])) + 1) .. ' ' .. n
  redis.call('HSET', ARGV[1], ARGV[i], v)
  redis.call('HSET', ARGV[2], ARGV[i], ARGV[3])
  out[#out + 1] = v
end
return out
";

/// Sets positions and raises their epochs (a rewind). `ARGV`: offsets key, then field and next pairs.
const RESET: &str = r"
for i = 2, #ARGV, 2 do
  local cur = redis.call('HGET', ARGV[1], ARGV[i])
  local e = 0
  if cur then
    e = tonumber(string.match(cur, '^(%d+) ')) or 0
  end
  redis.call('HSET', ARGV[1], ARGV[i], (e + 1) .. ' ' .. ARGV[i + 1])
end
return (#ARGV - 1) / 2
";

fn parse(v: &str) -> Option<(i64, Option<i64>)> {
    let (e, n) = v.split_once(' ')?;
    Some((e.parse().ok()?, if n == "-" { None } else { Some(n.parse().ok()?) }))
}

impl RedisStore {
    /// Takes ownership of `partitions` for `pipeline`: raises each one's epoch and returns the stored positions
    /// ([`crate::store::Store::claim_offsets`]).
    ///
    /// Errors: Redis's, or a stored value idemflow did not write.
    pub async fn claim_offsets(&self, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> Result<Vec<Claimed>, redis::RedisError> {
        let prefix = self.pipeline_prefix(pipeline);
        let fields: Vec<String> = partitions.iter().map(|(t, p)| partition_field(t, *p)).collect();
        let script = redis::Script::new(CLAIM);
        let mut inv = script.prepare_invoke();
        inv.arg(format!("{prefix}offsets")).arg(format!("{prefix}owners")).arg(owner);
        {
            let expected = self.expected();
            for f in &fields {
                let floor = expected.get(&(pipeline.to_owned(), f.clone())).map_or(0, |(e, _)| *e);
                inv.arg(f).arg(floor);
            }
        }
        let values: Vec<String> = match async { inv.invoke_async(&mut self.conn().await?).await }.await {
            Ok(v) => v,
            Err(e) => {
                self.after_failure(&e).await;
                return Err(e);
            }
        };
        let mut claimed = Vec::new();
        for ((topic, partition), v) in partitions.iter().zip(&values) {
            let (epoch, next_offset) = parse(v).ok_or_else(|| invalid(v))?;
            // Redis keeps no time with a position.
            claimed.push(Claimed { topic: topic.clone(), partition: *partition, next_offset, epoch, stored_at_ms: None, log: None });
        }
        self.claimed(pipeline, fields.into_iter().zip(&claimed).map(|(f, c)| (f, c.epoch, c.next_offset)));
        Ok(claimed)
    }

    /// The stored positions of `pipeline`: `(topic, partition, next offset)`.
    ///
    /// Errors: Redis's.
    pub async fn stored_offsets(&self, pipeline: &str) -> Result<Vec<(String, i32, Option<i64>)>, redis::RedisError> {
        let all: Vec<(String, String)> = redis::cmd("HGETALL").arg(format!("{}offsets", self.pipeline_prefix(pipeline))).query_async(&mut self.conn().await?).await?;
        let mut out: Vec<_> = all
            .iter()
            .filter_map(|(f, v)| {
                let (t, p) = f.rsplit_once('/')?;
                Some((t.to_owned(), p.parse().ok()?, parse(v)?.1))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// Sets the stored positions of `pipeline` and raises their epochs (`idemflow rewind`). Returns how many were
    /// written.
    ///
    /// Errors: Redis's.
    pub async fn reset_offsets(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, redis::RedisError> {
        let script = redis::Script::new(RESET);
        let mut inv = script.prepare_invoke();
        inv.arg(format!("{}offsets", self.pipeline_prefix(pipeline)));
        for (t, p, next) in positions {
            inv.arg(partition_field(t, *p)).arg(next);
        }
        inv.invoke_async(&mut self.conn().await?).await
    }
}

fn invalid(v: &str) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "a stored position idemflow did not write", v.to_owned()))
}
