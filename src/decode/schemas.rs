//! Schemas by id, fetched from the schema registry once each and kept for the process's life: an id never changes
//! meaning, so nothing is ever fetched again or evicted (a deployment has as many ids as its subjects have
//! versions). One [`Schemas`] serves every pipeline of a process ([`crate::config::attach_registry`]).
//!
//! The worker fetches the ids a batch's payloads carry before it decodes them ([`Schemas::fetch_all`]):
//! decoding itself never waits on the network, and a registry outage pauses the pipeline instead of failing
//! records. An id the registry does not know (a follower not caught up yet, a registry being restored, a `url`
//! naming another registry) is waited on too, for `[schema_registry] missing_schema_wait`, asked again with the
//! retries' back-off; after that its records go to the dead letters (`decode_failed`), and the registry is asked
//! again at most once per wait, so an id it learns later is read from then on. A schema that cannot be read (it
//! does not parse, it is of a type idemflow does not read) is kept as such: its records are dead letters at once.

use super::avro::AvroSchema;
use super::protobuf::ProtoFile;
use crate::schema_registry::{Reference, RegistryError, SchemaRegistry, SchemaType};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// The most schemas one schema's references may bring in (transitively), and how deep they may nest.
const MAX_REFERENCES: usize = 256;
const MAX_REFERENCE_DEPTH: usize = 32;

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
}

/// What the cache holds for an id.
#[derive(Debug, Clone)]
enum Entry {
    /// The registry's answer, kept for the process's life.
    Ready(Arc<Known>),
    /// The registry said it has no such schema (or a schema it references): since when, when it was last asked,
    /// and its words.
    Missing { first: Instant, last: Instant, why: String },
}

/// What one fetch of an id found.
enum Answer {
    Found(Known),
    /// No such schema, or no schema it references: may be a registry that has not learned it yet.
    Missing(String),
}

/// Missing ids kept before the stale ones are forgotten (a topic of garbage with random ids).
const MAX_MISSING: usize = 4096;

impl Schemas {
    /// An empty cache in front of `registry`, waiting `missing_schema_wait` on an id it does not know.
    pub fn new(registry: SchemaRegistry, missing_schema_wait: Duration) -> Schemas {
        Schemas { inner: Arc::new(Inner { registry, wait: missing_schema_wait, by_id: RwLock::new(HashMap::new()) }) }
    }

    /// The registry.
    pub fn registry(&self) -> &SchemaRegistry {
        &self.inner.registry
    }

    /// What is known of `id` for decoding: its schema, or why it is unusable (an id the registry has not known for
    /// `missing_schema_wait`); `None` while it must be fetched first ([`Schemas::needs_fetch`]).
    pub fn get(&self, id: u32) -> Option<Arc<Known>> {
        match self.inner.by_id.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id)? {
            Entry::Ready(k) => Some(k.clone()),
            Entry::Missing { first, why, .. } if first.elapsed() >= self.inner.wait => Some(Arc::new(Known::Unusable(why.clone()))),
            Entry::Missing { .. } => None,
        }
    }

    /// Whether `id` must be fetched before a payload naming it is decoded: never asked, missing and still waited
    /// on, or missing and not asked again for `missing_schema_wait` (a registry that learned it since is heard).
    pub fn needs_fetch(&self, id: u32) -> bool {
        match self.inner.by_id.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id) {
            None => true,
            Some(Entry::Ready(_)) => false,
            Some(Entry::Missing { first, last, .. }) => first.elapsed() < self.inner.wait || last.elapsed() >= self.inner.wait,
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
        if let Some(Entry::Ready(_)) = by_id.get(&id) {
            return Ok(());
        }
        match answer {
            Answer::Found(known) => {
                tracing::info!(schema_id = id, kind = known.kind(), registry = self.inner.registry.url(), "schema fetched");
                by_id.insert(id, Entry::Ready(Arc::new(known)));
                Ok(())
            }
            Answer::Missing(why) => {
                let now = Instant::now();
                let first = match by_id.get(&id) {
                    Some(Entry::Missing { first, .. }) => *first,
                    _ => now,
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
        let mut waiting = None;
        for id in ids {
            match self.fetch(id).await {
                Ok(()) => {}
                Err(e @ RegistryError::Missing { .. }) => {
                    waiting.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        waiting.map_or(Ok(()), Err)
    }

    /// Whether `id`'s schema is fetched (not missing, not unknown): a record naming it may be prepared ahead of its
    /// batch, its schema never to change.
    pub fn is_ready(&self, id: u32) -> bool {
        matches!(self.inner.by_id.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id), Some(Entry::Ready(_)))
    }

    /// Asks the registry for `id` and the schemas it references, and reads what it answers.
    async fn ask(&self, id: u32) -> Result<Answer, RegistryError> {
        let registry = &self.inner.registry;
        let Some(s) = registry.schema(id).await? else {
            return Ok(Answer::Missing(format!("schema id {id} is not known to the schema registry {}", registry.url())));
        };
        let refs = match s.schema_type {
            SchemaType::Json => return Ok(Answer::Found(Known::Json)),
            SchemaType::Other(t) => return Ok(Answer::Found(Known::Unusable(format!("schema id {id} is of type {t:?}, which idemflow does not read")))),
            _ => match self.references(id, &s.references).await? {
                Ok(refs) => refs,
                Err(answer) => return Ok(answer),
            },
        };
        Ok(Answer::Found(if s.schema_type == SchemaType::Avro {
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
        }))
    }

    /// The schemas `references` name, and theirs, each with the name it is referred to by (an Avro type's full
    /// name, a `.proto` import path), in no particular order (the parsers resolve them by name). `Ok(Err(answer))`
    /// when one is missing, or there are too many.
    async fn references(&self, id: u32, references: &[Reference]) -> Result<Result<Vec<(String, String)>, Answer>, RegistryError> {
        let mut texts = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut todo: Vec<(Reference, usize)> = references.iter().map(|r| (r.clone(), 1)).collect();
        while let Some((r, depth)) = todo.pop() {
            if !seen.insert((r.subject.clone(), r.version)) {
                continue;
            }
            if depth > MAX_REFERENCE_DEPTH || seen.len() > MAX_REFERENCES {
                let why = format!("schema id {id}: its references nest deeper than {MAX_REFERENCE_DEPTH} or number more than {MAX_REFERENCES}");
                return Ok(Err(Answer::Found(Known::Unusable(why))));
            }
            match self.inner.registry.version(&r.subject, Some(r.version)).await? {
                None => {
                    let why = format!("schema id {id} refers to {:?} (subject {:?} version {}), which the schema registry does not have", r.name, r.subject, r.version);
                    return Ok(Err(Answer::Missing(why)));
                }
                Some(s) => {
                    todo.extend(s.references.iter().map(|n| (n.clone(), depth + 1)));
                    texts.push((r.name.clone(), s.text));
                }
            }
        }
        Ok(Ok(texts))
    }
}
