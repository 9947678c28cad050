//! Schemas by id, fetched from the schema registry once each and kept while they are used: an id never changes
//! meaning, so a schema is fetched again only after it was evicted. The cache is bounded ([`MAX_CACHE_BYTES`] of
//! schema text): past it, the schemas unused for longest are evicted, never one used in the last
//! [`EVICT_AFTER_IDLE`] (a batch's schemas are touched when it is fetched and when it is decoded). One [`Schemas`]
//! serves every pipeline of a process ([`crate::config::attach_registry`]).
//!
//! The worker fetches the ids a batch's payloads carry before it decodes them ([`Schemas::fetch_all`], up to
//! [`FETCH_CONCURRENCY`] ids at once): decoding itself never waits on the network, and a registry outage pauses the
//! pipeline instead of failing records. An id the registry does not know (a follower not caught up yet, a registry
//! being restored, a `url` naming another registry) is waited on too, for `[schema_registry] missing_schema_wait`,
//! asked again with the retries' back-off; after that its records go to the dead letters (`decode_failed`). A
//! record is dead-lettered for a missing schema only on an answer at most [`FRESH_ANSWER`] old: an id the registry
//! learns later is read from then on. The wait is one per burst: an id first missing while others have been missing
//! for the whole wait already (a stream of payloads naming random ids, each new) is not waited on again, so a burst of
//! unknown ids costs one wait, not one per batch; a burst ends when an id is found, or when no new id has been
//! missing for `missing_schema_wait` (an old id asked again does not keep it going). A schema that cannot be read (it does not parse, it is of a type
//! idemflow does not read, it and its references are over [`MAX_SCHEMA_BYTES`]) is kept as such: its records are
//! dead letters at once.

use super::avro::AvroSchema;
use super::protobuf::ProtoFile;
use crate::schema_registry::{Reference, RegistryError, SchemaRegistry, SchemaType};
use futures_util::StreamExt as _;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// The most schemas one schema's references may bring in (transitively), and how deep they may nest.
const MAX_REFERENCES: usize = 256;
const MAX_REFERENCE_DEPTH: usize = 32;

/// The most text one schema and its references may hold together: 16 MiB each answer ([`crate::schema_registry`]),
/// 256 references, would be 4 GiB.
pub const MAX_SCHEMA_BYTES: usize = 32 << 20;

/// The most schema text the cache keeps before it evicts the schemas unused for longest.
pub const MAX_CACHE_BYTES: usize = 256 << 20;

/// A schema used within this long is never evicted (its batch may be being decoded).
pub const EVICT_AFTER_IDLE: Duration = Duration::from_secs(600);

/// The oldest "no such schema" answer a record is dead-lettered on: older, the registry is asked again first.
pub const FRESH_ANSWER: Duration = Duration::from_secs(5);

/// How many ids one batch asks the registry for at once.
pub const FETCH_CONCURRENCY: usize = 8;

/// What is known of a schema id.
#[derive(Debug)]
pub enum Known {
    /// An Avro schema, its references resolved.
    Avro(AvroSchema),
    /// A JSON Schema (its payloads are JSON documents).
    Json,
    /// A Protobuf schema (`schemaType` `PROTOBUF`): its file, whose messages the payloads' message indexes name.
    Protobuf(ProtoFile),
    /// Not usable: the registry does not know the id, or the schema does not parse. Why, for the dead letters.
    Unusable(String),
}

impl Known {
    /// The schema's kind as the registry names it, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Known::Avro(_) => "AVRO",
            Known::Json => "JSON",
            Known::Protobuf(_) => "PROTOBUF",
            Known::Unusable(_) => "unusable",
        }
    }
}

/// The schemas of one registry, by id. Cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct Schemas {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: SchemaRegistry,
    /// How long an id the registry does not know is waited on ([`crate::schema_registry::RegistrySettings::missing_schema_wait`]).
    wait: Duration,
    by_id: RwLock<HashMap<u32, Entry>>,
    /// When the process's clock for [`Entry::Ready`]'s last use started.
    epoch: Instant,
    /// Since when some id has been missing without a pause of `wait` (a burst of unknown ids shares one wait).
    missing_since: std::sync::Mutex<Option<(Instant, Instant)>>,
}

/// What the cache holds for an id.
#[derive(Debug)]
enum Entry {
    /// The registry's answer, with its text's size and its last use (milliseconds since [`Inner::epoch`]).
    Ready(Arc<Known>, usize, AtomicU64),
    /// The registry said it has no such schema (or a schema it references): since when, when it was last asked,
    /// and its words.
    Missing { first: Instant, last: Instant, why: String },
}

/// What one fetch of an id found.
enum Answer {
    /// What the schema is, and the bytes of text it and its references hold (its weight in the cache).
    Found(Known, usize),
    /// No such schema, or no schema it references: may be a registry that has not learned it yet.
    Missing(String),
}

/// Missing ids kept before the stale ones are forgotten (a topic of garbage with random ids).
const MAX_MISSING: usize = 4096;

impl Schemas {
    /// An empty cache in front of `registry`, waiting `missing_schema_wait` on an id it does not know.
    pub fn new(registry: SchemaRegistry, missing_schema_wait: Duration) -> Schemas {
        let inner = Inner {
            registry,
            wait: missing_schema_wait,
            by_id: RwLock::new(HashMap::new()),
            epoch: Instant::now(),
            missing_since: std::sync::Mutex::new(None),
        };
        Schemas { inner: Arc::new(inner) }
    }

    /// Now, on the clock of [`Entry::Ready`]'s last use.
    fn now_ms(&self) -> u64 {
        self.inner.epoch.elapsed().as_millis() as u64
    }

    /// The registry.
    pub fn registry(&self) -> &SchemaRegistry {
        &self.inner.registry
    }

    /// What is known of `id` for decoding: its schema, or why it is unusable (an id the registry has not known for
    /// `missing_schema_wait`); `None` while it must be fetched first ([`Schemas::needs_fetch`]).
    pub fn get(&self, id: u32) -> Option<Arc<Known>> {
        match self.inner.by_id.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id)? {
            Entry::Ready(k, _, used) => {
                used.store(self.now_ms(), Ordering::Relaxed);
                Some(k.clone())
            }
            Entry::Missing { first, why, .. } if first.elapsed() >= self.inner.wait => Some(Arc::new(Known::Unusable(why.clone()))),
            Entry::Missing { .. } => None,
        }
    }

    /// Whether `id` must be fetched before a payload naming it is decoded: never asked (or evicted), missing and
    /// still waited on, or missing on an answer older than [`FRESH_ANSWER`] (a registry that learned it since is
    /// heard, and no record is dead-lettered on a stale answer). A schema known is marked used.
    pub fn needs_fetch(&self, id: u32) -> bool {
        match self.inner.by_id.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id) {
            None => true,
            Some(Entry::Ready(_, _, used)) => {
                used.store(self.now_ms(), Ordering::Relaxed);
                false
            }
            Some(Entry::Missing { first, last, .. }) => first.elapsed() < self.inner.wait || last.elapsed() >= FRESH_ANSWER,
        }
    }

    /// Fetches `id` when [it must be](Schemas::needs_fetch), and remembers what the registry said.
    ///
    /// Errors: the registry gave no answer ([`RegistryError`]); or it does not know `id` (or a schema it refers
    /// to) and has not for less than `missing_schema_wait` ([`RegistryError::Missing`]): the caller pauses and
    /// asks again; once the wait is over, the id's records are dead letters.
    pub async fn fetch(&self, id: u32) -> Result<(), RegistryError> {
        if !self.needs_fetch(id) {
            return Ok(());
        }
        let answer = self.ask(id).await?;
        let mut by_id = self.inner.by_id.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Another lane's fetch found it meanwhile: a follower's late "no such schema" never undoes that.
        if let Some(Entry::Ready(..)) = by_id.get(&id) {
            return Ok(());
        }
        match answer {
            Answer::Found(known, bytes) => {
                tracing::info!(schema_id = id, kind = known.kind(), registry = self.inner.registry.url(), "schema fetched");
                // The registry knows what it was asked: a burst of unknown ids is over.
                *self.inner.missing_since.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                self.evict(&mut by_id, bytes);
                by_id.insert(id, Entry::Ready(Arc::new(known), bytes, AtomicU64::new(self.now_ms())));
                Ok(())
            }
            Answer::Missing(why) => {
                let now = Instant::now();
                // A new id's miss, or a miss of an id still waited on, keeps the burst going (a new id's wait starts
                // with it); asking again for an id past its wait (its verdict refreshed) does not.
                let first = match by_id.get(&id) {
                    Some(Entry::Missing { first, .. }) if first.elapsed() >= self.inner.wait => *first,
                    Some(Entry::Missing { first, .. }) => {
                        self.burst_started(now);
                        *first
                    }
                    _ => self.burst_started(now),
                };
                if by_id.len() >= MAX_MISSING {
                    let stale = self.inner.wait.saturating_mul(10);
                    by_id.retain(|_, e| !matches!(e, Entry::Missing { last, .. } if last.elapsed() > stale));
                }
                by_id.insert(id, Entry::Missing { first, last: now, why: why.clone() });
                if first.elapsed() < self.inner.wait {
                    Err(RegistryError::Missing { why, wait: self.inner.wait })
                } else {
                    tracing::warn!(schema_id = id, registry = self.inner.registry.url(), %why, waited = ?self.inner.wait,
                        "the schema registry still does not know this schema: its records go to the dead letters");
                    Ok(())
                }
            }
        }
    }

    /// Fetches each of `ids` that [must be](Schemas::needs_fetch), each once. Every id is asked even when one is
    /// missing, so the waits on several missing ids run at once, not one after another.
    ///
    /// Errors: as [`Schemas::fetch`]: the registry gave no answer (at once), or the first id still waited on.
    pub async fn fetch_all(&self, mut ids: Vec<u32>) -> Result<(), RegistryError> {
        ids.sort_unstable();
        ids.dedup();
        let mut answers = futures_util::stream::iter(ids).map(|id| self.fetch(id)).buffer_unordered(FETCH_CONCURRENCY);
        let mut waiting = None;
        while let Some(answer) = answers.next().await {
            match answer {
                Ok(()) => {}
                Err(e @ RegistryError::Missing { .. }) => {
                    waiting.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        waiting.map_or(Ok(()), Err)
    }

    /// A "missing" answer of a new id, or of one still waited on, came `now`: returns when the wait of an id first
    /// missing now starts: `now`, or the start of the burst of missing ids under way (every such answer since it began
    /// came within `missing_schema_wait` of the one before, and no id was found since).
    fn burst_started(&self, now: Instant) -> Instant {
        let mut since = self.inner.missing_since.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let start = match *since {
            Some((start, last)) if now.duration_since(last) < self.inner.wait => start,
            _ => now,
        };
        *since = Some((start, now));
        start
    }

    /// Makes room for `bytes` more of schema text: while the cache would be over [`MAX_CACHE_BYTES`], the schema
    /// unused for longest is evicted, if unused for [`EVICT_AFTER_IDLE`] and held by no decoder.
    fn evict(&self, by_id: &mut HashMap<u32, Entry>, bytes: usize) {
        let held: usize = by_id.values().map(|e| if let Entry::Ready(_, b, _) = e { *b } else { 0 }).sum();
        if held + bytes <= MAX_CACHE_BYTES {
            return;
        }
        let idle_before = self.now_ms().saturating_sub(EVICT_AFTER_IDLE.as_millis() as u64);
        let mut idle: Vec<(u64, u32, usize)> = by_id
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Ready(k, b, used) if Arc::strong_count(k) == 1 && used.load(Ordering::Relaxed) <= idle_before => {
                    Some((used.load(Ordering::Relaxed), *id, *b))
                }
                _ => None,
            })
            .collect();
        idle.sort_unstable();
        let mut over = held + bytes - MAX_CACHE_BYTES;
        for (_, id, b) in idle {
            if over == 0 {
                break;
            }
            by_id.remove(&id);
            over = over.saturating_sub(b);
            tracing::debug!(schema_id = id, "schema evicted from the cache (unused; fetched again if a record names it)");
        }
    }

    /// Whether `id`'s schema is fetched (not missing, not unknown): a record naming it may be prepared ahead of its
    /// batch, its schema never to change.
    pub fn is_ready(&self, id: u32) -> bool {
        match self.inner.by_id.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id) {
            Some(Entry::Ready(_, _, used)) => {
                used.store(self.now_ms(), Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Asks the registry for `id` and the schemas it references, and reads what it answers.
    async fn ask(&self, id: u32) -> Result<Answer, RegistryError> {
        let registry = &self.inner.registry;
        let Some(s) = registry.schema(id).await? else {
            return Ok(Answer::Missing(format!("schema id {id} is not known to the schema registry {}", registry.url())));
        };
        let unusable = |why: String| Ok(Answer::Found(Known::Unusable(why), 0));
        let refs = match s.schema_type {
            SchemaType::Json => return Ok(Answer::Found(Known::Json, s.text.len())),
            SchemaType::Other(t) => return unusable(format!("schema id {id} is of type {t:?}, which idemflow does not read")),
            _ => match self.references(id, &s.references, s.text.len()).await? {
                Ok(refs) => refs,
                Err(answer) => return Ok(answer),
            },
        };
        let bytes = s.text.len() + refs.iter().map(|(_, text)| text.len()).sum::<usize>();
        Ok(Answer::Found(
            if s.schema_type == SchemaType::Avro {
                let texts: Vec<String> = refs.into_iter().map(|(_, text)| text).collect();
                match AvroSchema::parse(&s.text, &texts) {
                    Ok(a) => Known::Avro(a),
                    Err(e) => Known::Unusable(format!("schema id {id} is not a valid Avro schema: {e}")),
                }
            } else {
                match ProtoFile::compile(&format!("registry/schema-{id}.proto"), &s.text, &refs) {
                    Ok(file) => Known::Protobuf(file),
                    Err(e) => Known::Unusable(format!("schema id {id} is not a valid Protobuf schema: {e}")),
                }
            },
            bytes,
        ))
    }

    /// The schemas `references` name, and theirs, each with the name it is referred to by (an Avro type's full
    /// name, a `.proto` import path), in no particular order (the parsers resolve them by name); `root_bytes` is the
    /// referring schema's own text. `Ok(Err(answer))` when one is missing, or there are too many, too deep, or more
    /// than [`MAX_SCHEMA_BYTES`] of text in all.
    async fn references(&self, id: u32, references: &[Reference], root_bytes: usize) -> Result<Result<Vec<(String, String)>, Answer>, RegistryError> {
        let mut texts = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut todo: Vec<(Reference, usize)> = references.iter().map(|r| (r.clone(), 1)).collect();
        let mut bytes = root_bytes;
        while let Some((r, depth)) = todo.pop() {
            if !seen.insert((r.subject.clone(), r.version)) {
                continue;
            }
            if depth > MAX_REFERENCE_DEPTH || seen.len() > MAX_REFERENCES {
                let why = format!("schema id {id}: its references nest deeper than {MAX_REFERENCE_DEPTH} or number more than {MAX_REFERENCES}");
                return Ok(Err(Answer::Found(Known::Unusable(why), 0)));
            }
            match self.inner.registry.version(&r.subject, Some(r.version)).await? {
                None => {
                    let why = format!("schema id {id} refers to {:?} (subject {:?} version {}), which the schema registry does not have", r.name, r.subject, r.version);
                    return Ok(Err(Answer::Missing(why)));
                }
                Some(s) => {
                    bytes += s.text.len();
                    if bytes > MAX_SCHEMA_BYTES {
                        let why = format!("schema id {id}: it and its references hold more than {MAX_SCHEMA_BYTES} bytes of schema text");
                        return Ok(Err(Answer::Found(Known::Unusable(why), 0)));
                    }
                    todo.extend(s.references.iter().map(|n| (n.clone(), depth + 1)));
                    texts.push((r.name.clone(), s.text));
                }
            }
        }
        Ok(Ok(texts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schemas() -> Schemas {
        let settings: crate::schema_registry::RegistrySettings = toml::from_str("url = \"http://127.0.0.1:9\"").unwrap();
        Schemas::new(SchemaRegistry::new(&settings).unwrap(), Duration::from_secs(60))
    }

    /// Past [`MAX_CACHE_BYTES`], the schemas unused for longest go first; one used within [`EVICT_AFTER_IDLE`], or held
    /// by a decoder, never goes.
    #[test]
    fn the_cache_evicts_the_longest_unused_schemas_and_never_one_in_use() {
        let s = schemas();
        let chunk = MAX_CACHE_BYTES / 4;
        let idle = EVICT_AFTER_IDLE.as_millis() as u64;
        {
            let mut by_id = s.inner.by_id.write().unwrap();
            // Used long ago (the clock starts at 0: "now" below is far past it).
            for (id, used) in [(1, 0), (2, 10), (3, 20)] {
                by_id.insert(id, Entry::Ready(Arc::new(Known::Json), chunk, AtomicU64::new(used)));
            }
            by_id.insert(4, Entry::Ready(Arc::new(Known::Json), chunk, AtomicU64::new(u64::MAX)));
        }
        // Pretend the process has run for a while: everything but id 4 is idle.
        let s = Schemas { inner: Arc::new(Inner { epoch: Instant::now() - Duration::from_millis(idle * 3), ..Arc::try_unwrap(s.inner).unwrap() }) };
        // A decoder holds id 3 (its last use stays long ago).
        let held = match s.inner.by_id.read().unwrap().get(&3) {
            Some(Entry::Ready(k, ..)) => k.clone(),
            _ => unreachable!("inserted above"),
        };
        let mut by_id = s.inner.by_id.write().unwrap();
        s.evict(&mut by_id, chunk);
        assert!(!by_id.contains_key(&1), "the longest unused goes first");
        assert!(by_id.contains_key(&2) && by_id.contains_key(&3) && by_id.contains_key(&4));
        s.evict(&mut by_id, 3 * chunk);
        assert!(!by_id.contains_key(&2));
        assert!(by_id.contains_key(&3), "one in use is never evicted");
        assert!(by_id.contains_key(&4), "one used within EVICT_AFTER_IDLE is never evicted");
        drop(held);
    }
}
