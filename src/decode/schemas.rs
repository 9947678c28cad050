//! Schemas by id, fetched from the schema registry once each and kept for the process's life: an id never changes
//! meaning, so nothing is ever fetched again or evicted (a deployment has as many ids as its subjects have
//! versions). One [`Schemas`] serves every pipeline of a process ([`crate::config::attach_registry`]).
//!
//! The worker fetches the ids a batch's payloads carry before it decodes them ([`crate::decode::Decoder::fetch_schemas`]):
//! decoding itself never waits on the network, and a registry outage pauses the pipeline instead of failing
//! records. An id the registry does not know, and a schema that cannot be read, are remembered as such: their
//! records go to the dead letters (`decode_failed`) with why.

use super::avro::AvroSchema;
use crate::schema_registry::{RegistryError, SchemaRegistry, SchemaType};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

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
    /// A Protobuf schema (`schemaType` `PROTOBUF`).
    Protobuf,
    /// Not usable: the registry does not know the id, or the schema does not parse. Why, for the dead letters.
    Unusable(String),
}

impl Known {
    /// The schema's kind as the registry names it, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Known::Avro(_) => "AVRO",
            Known::Json => "JSON",
            Known::Protobuf => "PROTOBUF",
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
    by_id: RwLock<HashMap<u32, Arc<Known>>>,
}

impl Schemas {
    /// An empty cache in front of `registry`.
    pub fn new(registry: SchemaRegistry) -> Schemas {
        Schemas { inner: Arc::new(Inner { registry, by_id: RwLock::new(HashMap::new()) }) }
    }

    /// The registry.
    pub fn registry(&self) -> &SchemaRegistry {
        &self.inner.registry
    }

    /// What is known of `id`, `None` until it was fetched.
    pub fn get(&self, id: u32) -> Option<Arc<Known>> {
        self.inner.by_id.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id).cloned()
    }

    /// Fetches `id` unless it is known, and remembers what the registry said (the schema, or that it has no such
    /// id).
    ///
    /// Errors: the registry gave no answer ([`RegistryError`]); nothing is remembered then.
    pub async fn fetch(&self, id: u32) -> Result<Arc<Known>, RegistryError> {
        if let Some(k) = self.get(id) {
            return Ok(k);
        }
        let registry = &self.inner.registry;
        let known = match registry.schema(id).await? {
            None => Known::Unusable(format!("schema id {id} is not known to the schema registry {}", registry.url())),
            Some(s) => match s.schema_type {
                SchemaType::Json => Known::Json,
                SchemaType::Protobuf => Known::Protobuf,
                SchemaType::Avro => {
                    let references = self.references(&s.references).await?;
                    match references {
                        Err(why) => Known::Unusable(format!("schema id {id}: {why}")),
                        Ok(texts) => match AvroSchema::parse(&s.text, &texts) {
                            Ok(a) => Known::Avro(a),
                            Err(e) => Known::Unusable(format!("schema id {id} is not a valid Avro schema: {e}")),
                        },
                    }
                }
            },
        };
        tracing::info!(schema_id = id, kind = known.kind(), registry = registry.url(), "schema fetched");
        let known = Arc::new(known);
        self.inner.by_id.write().unwrap_or_else(std::sync::PoisonError::into_inner).entry(id).or_insert(known.clone());
        Ok(known)
    }

    /// The texts of the schemas `references` name, and of theirs, in no particular order (the Avro parser
    /// resolves them by name). `Ok(Err(why))` when one is missing or there are too many.
    async fn references(&self, references: &[crate::schema_registry::Reference]) -> Result<Result<Vec<String>, String>, RegistryError> {
        let mut texts = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut todo: Vec<(crate::schema_registry::Reference, usize)> = references.iter().map(|r| (r.clone(), 1)).collect();
        while let Some((r, depth)) = todo.pop() {
            if !seen.insert((r.subject.clone(), r.version)) {
                continue;
            }
            if depth > MAX_REFERENCE_DEPTH || seen.len() > MAX_REFERENCES {
                return Ok(Err(format!("its references nest deeper than {MAX_REFERENCE_DEPTH} or number more than {MAX_REFERENCES}")));
            }
            match self.inner.registry.version(&r.subject, Some(r.version)).await? {
                None => return Ok(Err(format!("the reference {:?} (subject {:?} version {}) is not in the registry", r.name, r.subject, r.version))),
                Some(s) => {
                    todo.extend(s.references.iter().map(|n| (n.clone(), depth + 1)));
                    texts.push(s.text);
                }
            }
        }
        Ok(Ok(texts))
    }
}
