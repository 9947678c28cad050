//! The rows the batch protocol reads and writes in every store: a key claim, the dedup row found for a key
//! already claimed (classified by the sink, `sink::dedup::classify`), and what `idemflow explain` shows.

use crate::key::BusinessKey;
use crate::record::Position;

/// A set of key digests (SHA-256). Digests are uniformly distributed, so the hasher is foldhash's fast one, seeded
/// per process (bucket order is not predictable from outside), instead of the standard SipHash.
pub type Digests = std::collections::HashSet<[u8; 32], foldhash::fast::RandomState>;

/// A map keyed by key digests, hashed as [`Digests`].
pub type DigestMap<V> = std::collections::HashMap<[u8; 32], V, foldhash::fast::RandomState>;

/// The key ids of keys ([`BusinessKey::key_id`], the SQL dedup stores' primary key), in their order, and the way
/// back from an id a statement returned to the key's digest (the batch protocol's sets and maps are keyed by
/// digests; a store that returns ids answers in digests).
pub struct KeyIds<'k> {
    ids: Vec<std::borrow::Cow<'k, [u8]>>,
    digests: Vec<[u8; 32]>,
}

impl<'k> KeyIds<'k> {
    /// The ids of `keys`.
    pub fn new(keys: impl IntoIterator<Item = &'k BusinessKey>) -> Self {
        let (ids, digests) = keys.into_iter().map(|k| (k.key_id(), k.digest)).unzip();
        KeyIds { ids, digests }
    }

    /// The ids, in the keys' order, for binding.
    pub fn ids(&self) -> Vec<&[u8]> {
        self.ids.iter().map(|id| &id[..]).collect()
    }

    /// From id to digest, for the ids a statement returns.
    pub fn digests(&self) -> IdDigests<'_> {
        IdDigests(self.ids.iter().map(|id| &id[..]).zip(self.digests.iter().copied()).collect())
    }
}

/// From key id to digest ([`KeyIds::digests`]).
pub struct IdDigests<'a>(std::collections::HashMap<&'a [u8], [u8; 32], foldhash::fast::RandomState>);

impl IdDigests<'_> {
    /// The digest of the key whose id a statement returned.
    ///
    /// Errors: `sqlx::Error::Decode` (which stops the pipeline) for an id that is none of these keys': the store
    /// returned other bytes than it was sent. Skipping it instead would take a key this batch inserted for one
    /// that was there before, and its record would never be applied.
    pub fn get(&self, id: &[u8]) -> Result<[u8; 32], sqlx::Error> {
        self.0.get(id).copied().ok_or_else(|| {
            sqlx::Error::Decode(format!("the dedup store returned the key id {} that no key of the statement has", crate::terminal::hex(id)).into())
        })
    }
}

/// A key claim for one record.
pub struct Claim<'a> {
    /// The key.
    pub key: &'a BusinessKey,
    /// Where the record is.
    pub position: &'a Position,
    /// SHA-256 of its payload.
    pub fingerprint: &'a [u8; 32],
}

/// The fewest bytes of a payload's SHA-256 a dedup store keeps as its fingerprint: PostgreSQL stores these 16
/// (migration 12), MySQL/MariaDB and Redis all 32. 128 bits tell a changed payload from the applied one as surely as
/// 256 do for this use (no adversary gains anything by a collision: both copies carry the same business key).
pub const FINGERPRINT_BYTES: usize = 16;

/// The dedup row that was already there for a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Existing {
    /// Where the applied record was.
    pub position: Position,
    /// Its payload fingerprint: the first 16 ([`FINGERPRINT_BYTES`]) or all 32 bytes of the payload's SHA-256, as
    /// the store keeps it.
    pub fingerprint: Vec<u8>,
}

impl Existing {
    /// Whether the applied payload is the one whose SHA-256 is `fingerprint`: the stored fingerprint is a prefix of
    /// it of at least [`FINGERPRINT_BYTES`].
    pub fn same_payload(&self, fingerprint: &[u8; 32]) -> bool {
        self.fingerprint.len() >= FINGERPRINT_BYTES && fingerprint.starts_with(&self.fingerprint)
    }
}

/// What the dedup store knows of one business key (`idemflow explain`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Explained {
    /// The key's canonical text.
    pub business_key: String,
    /// When it was applied (the batch transaction's start).
    pub applied_at: String,
    /// Where the applied record was.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its payload's fingerprint, hex: the first 16 bytes of its SHA-256 (PostgreSQL since migration 12) or all 32.
    pub fingerprint: String,
    /// Duplicates of it skipped since.
    pub duplicates: i64,
    /// When the last one was skipped.
    pub last_duplicate_at: Option<String>,
}

/// Which dedup rows `idemflow dedup forget` takes out of a pipeline's dedup store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Forget {
    /// These business keys.
    Keys(Vec<BusinessKey>),
    /// The keys applied from the records of one partition between two offsets, both included.
    Positions {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// First offset.
        from: i64,
        /// Last offset.
        to: i64,
    },
}

/// What `idemflow dedup forget` did, or with `--dry-run` would do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// The dedup rows deleted (or that would be), as they were.
    pub rows: Vec<Explained>,
    /// The processed floors lowered (or that would be): `(topic, partition, from, to)`; a floor already at or below
    /// where it would go is not listed.
    pub floors: Vec<(String, i32, i64, i64)>,
    /// The worker lanes of the pipeline that ran a batch recently (`(lane, when)`): a real run is refused while
    /// there are any.
    pub running: Vec<(String, String)>,
}

/// The lowest offset of `rows` on each of their partitions.
pub fn lowest_per_partition(rows: &[Explained]) -> std::collections::BTreeMap<(&str, i32), i64> {
    let mut lowest = std::collections::BTreeMap::new();
    for r in rows {
        let e = lowest.entry((r.topic.as_str(), r.partition)).or_insert(r.offset);
        *e = (*e).min(r.offset);
    }
    lowest
}

/// Where `idemflow dedup forget` lowers the processed floors: the lowest offset of `rows` on each of their
/// partitions, and for a range of offsets its start, also where it found no row (keys claimed by a transaction a
/// side effect committed early may be below a floor without a dedup row of their own).
pub fn floors_to_lower<'a>(what: &'a Forget, rows: &'a [Explained]) -> std::collections::BTreeMap<(&'a str, i32), i64> {
    let mut lowest = lowest_per_partition(rows);
    if let Forget::Positions { topic, partition, from, .. } = what {
        let e = lowest.entry((topic.as_str(), *partition)).or_insert(*from);
        *e = (*e).min(*from);
    }
    lowest
}

/// An [`Explained`] as the stores read it: `(business_key, applied_at, topic, partition, offset, fingerprint,
/// duplicates, last_duplicate_at)`.
pub type ExplainedRow = (String, String, String, i32, i64, String, i64, Option<String>);

impl From<ExplainedRow> for Explained {
    fn from(row: ExplainedRow) -> Self {
        let (business_key, applied_at, topic, partition, offset, fingerprint, duplicates, last_duplicate_at) = row;
        Explained { business_key, applied_at, topic, partition, offset, fingerprint, duplicates, last_duplicate_at }
    }
}

/// A record ready to claim and apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Apply {
    /// The business key.
    pub key: BusinessKey,
    /// SHA-256 of the raw payload bytes: equal for a producer retry, different for another payload.
    pub fingerprint: [u8; 32],
    /// One value per binding of the sink, in binding order; `None` binds SQL NULL.
    pub values: Vec<Option<String>>,
    /// The outbox requests of the record (`[[sink.http]]`), written in the batch's transaction only when its key was
    /// new; empty for a pipeline without an outbox.
    pub requests: Vec<OutboxRequest>,
}

/// One request for the outbox ([`crate::outbox`]), rendered from a record when it was prepared: written in the batch's
/// transaction when the record's business key was new ([`crate::store::BatchTx::write_outbox`]), delivered by the
/// relay after the commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRequest {
    /// The target's name (`[[sink.http]] name`): the `target` label of the outbox metrics.
    pub target: String,
    /// The HTTP method, or [`PRODUCE`] for a Kafka record.
    pub method: String,
    /// The URL, placeholders filled in (each value percent-encoded); a Kafka record's topic.
    pub url: String,
    /// The headers, the idempotency key's among them, in order.
    pub headers: Vec<(String, String)>,
    /// The body: the rendered JSON template, or the record's payload (a Kafka record's value).
    pub body: Vec<u8>,
    /// A Kafka record's key (`[[sink.kafka]]`); `None` for an HTTP request.
    pub key: Option<Vec<u8>>,
}

/// The method of an outbox row that is a Kafka record (`[[sink.kafka]]`): its `url` is the topic.
pub const PRODUCE: &str = "PRODUCE";

/// An outbox row the relay leased ([`crate::store::Store::outbox_lease`]): its request, and how it stands.
#[derive(Clone, Debug, PartialEq)]
pub struct Leased {
    /// The row's id (increasing in the order rows were written).
    pub id: i64,
    /// The request.
    pub request: OutboxRequest,
    /// Attempts so far, this one included (the lease counts it).
    pub attempts: i32,
    /// Seconds since the row was written (its batch's commit, near enough).
    pub age_seconds: f64,
}

/// What became of one leased outbox row ([`crate::store::Store::outbox_settle`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Settled {
    /// The target confirmed it: the row is deleted.
    Confirmed(i64),
    /// Worth trying again: the row waits `after` (the back-off, or the target's `Retry-After`), its lease is given
    /// up, and `error` is kept as its last error.
    Retry {
        /// The row.
        id: i64,
        /// How long until the next attempt.
        after: std::time::Duration,
        /// Why this attempt failed.
        error: String,
    },
    /// It can never succeed, or ran out of attempts: the row moves to the dead letters with reason
    /// `delivery_failed` and `error` (the status and the head of the answer), its request kept whole for
    /// `idemflow dead-letters replay`.
    Failed {
        /// The row.
        id: i64,
        /// Why.
        error: String,
    },
}

impl Settled {
    /// The row it is about.
    pub fn id(&self) -> i64 {
        match self {
            Settled::Confirmed(id) | Settled::Retry { id, .. } | Settled::Failed { id, .. } => *id,
        }
    }
}

/// One pipeline's history on one topic ([`crate::store::Store::histories`]): what its processed marks say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct History {
    /// The pipeline.
    pub pipeline: String,
    /// The topic (queue, stream).
    pub topic: String,
    /// Partitions with a mark.
    pub partitions: i64,
    /// The sum of the marks (the records processed, if the partitions started at 0).
    pub processed: i64,
    /// When a mark was last raised, as the store writes a time.
    pub last: String,
}

/// One outbox request of a business key not yet confirmed ([`crate::store::Store::key_requests`], `idemflow explain`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRequest {
    /// Its target's name.
    pub target: String,
    /// `Some(id)`: a `delivery_failed` dead letter; `None`: waiting in the outbox.
    pub dead_letter: Option<i64>,
    /// Attempts made so far (waiting rows).
    pub attempts: i64,
    /// When it is due again, on the store's clock (waiting rows).
    pub next_attempt: String,
    /// Whether a relay holds it now (being sent).
    pub leased: bool,
    /// The last failure (waiting rows), or the dead letter's error.
    pub error: Option<String>,
}

/// Outbox requests of one pipeline's target not yet delivered ([`crate::store::Store::unsent`]): waiting in the outbox,
/// or `delivery_failed` dead letters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Unsent {
    /// The pipeline the rows were written under.
    pub pipeline: String,
    /// The target's name (`[[sink.http]]` or `[[sink.kafka]]` `name`).
    pub target: String,
    /// Rows waiting in the outbox.
    pub waiting: i64,
    /// Seconds since the oldest of them was written; 0 without any.
    pub oldest_seconds: f64,
    /// Its `delivery_failed` dead letters.
    pub dead_letters: i64,
    /// Of the rows waiting: due now (and not held by a relay).
    pub due: i64,
    /// Of the rows waiting: waiting out a back-off (and not held by a relay).
    pub backing_off: i64,
    /// Of the rows waiting: held by a relay now (being sent).
    pub leased: i64,
    /// The earliest next attempt of a row in back-off, on the store's clock.
    pub next_attempt: Option<String>,
    /// The last failure recorded of its rows (the newest row's that has one).
    pub last_error: Option<String>,
}

/// [`Unsent`] as the stores read it: pipeline, target, waiting, the oldest's age in seconds, dead letters, due, in
/// back-off, leased, the next attempt, the last error.
pub type UnsentRow = (String, String, i64, f64, i64, i64, i64, i64, Option<String>, Option<String>);

impl From<UnsentRow> for Unsent {
    fn from((pipeline, target, waiting, oldest, dead_letters, due, backing_off, leased, next_attempt, last_error): UnsentRow) -> Self {
        Unsent { pipeline, target, waiting, oldest_seconds: oldest.max(0.0), dead_letters, due, backing_off, leased, next_attempt, last_error }
    }
}

/// What `idemflow pipeline rename` moved ([`crate::store::Store::rename_pipeline`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Renamed {
    /// Each table that keeps a pipeline's history, with how many of its rows were moved (or would be, in a dry run).
    pub tables: Vec<(&'static str, u64)>,
}

/// How an outbox stands ([`crate::store::Store::outbox_depth`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OutboxDepth {
    /// Rows waiting for delivery, counted up to the bound asked for.
    pub rows: i64,
    /// Seconds since the oldest of them was written; 0 when there are none.
    pub oldest_seconds: f64,
    /// The longest a row the relay could send now has waited since it was due, in seconds: rows due (not waiting out
    /// a back-off) and first of their business key (a key's later rows wait for its first); 0 when there are none.
    /// A key or a host in back-off never adds to it.
    pub due_seconds: f64,
}
