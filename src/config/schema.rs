//! JSON Schemas (draft-07) of the two files a user writes, for editors with a TOML language server (Taplo, Even
//! Better TOML) and for CI: `schemas/idemflow.schema.json` (the settings) and `schemas/pipeline.schema.json` (a
//! pipeline file), embedded so that `idemflow schema` prints the ones this binary's parser takes. They are written
//! by hand, with a description per key; the test suite holds them to the parser (`docs::the_json_schemas_*`): the
//! same keys in every table, every shipped file valid, and the mistakes the parser refuses refused.

/// The schema of `idemflow.toml`.
pub const SETTINGS: &str = include_str!("../../schemas/idemflow.schema.json");

/// The schema of a pipeline file (`pipelines/<name>.toml`).
pub const PIPELINE: &str = include_str!("../../schemas/pipeline.schema.json");
