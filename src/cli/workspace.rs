//! What the commands share: the settings loaded (`--config`), a pipeline named, its store opened, the pipelines
//! prepared against their stores, and problems reported.

use anyhow::bail;
use idemflow::config::{self, PipelineError, Settings};
use idemflow::store::contract::NotReady;
use idemflow::store::spec::StoreKind;
use idemflow::store::Store;
use idemflow::{telemetry, worker};
use std::path::{Path, PathBuf};

/// `--config`, for the commands that need nothing else.
#[derive(clap::Args)]
pub struct ConfigArg {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    pub(super) config: PathBuf,
}

/// The settings of `path` (and `IDEMFLOW_*` variables), with logging set up from them.
///
/// Errors: a `--config` file that is not there, or settings that do not parse (file, line and key named).
pub(super) fn load(path: &Path) -> anyhow::Result<Settings> {
    // Only the default settings file may be absent (settings then come from IDEMFLOW_* variables alone): a file
    // named with --config that is not there is a mistake, not a fallback.
    if !path.exists() && path != Path::new(DEFAULT_CONFIG) {
        bail!("{}: no such settings file (given with --config)", path.display());
    }
    let loaded = config::load_settings(path)?;
    telemetry::init(&loaded.settings.log);
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    Ok(loaded.settings)
}


/// The settings file read when `--config` is not given.
const DEFAULT_CONFIG: &str = "idemflow.toml";

/// Prints every pipeline problem, one per line; the error counts them.
pub(super) fn report(errors: &[PipelineError]) -> anyhow::Error {
    for e in errors {
        eprintln!("{e}");
    }
    anyhow::anyhow!("{} problem(s) in the pipelines", errors.len())
}

/// The pipeline named `name`, or an error saying where pipelines were looked for.
pub(super) fn named<'p>(pipelines: &'p [config::Pipeline], name: &str, settings: &Settings) -> anyhow::Result<&'p config::Pipeline> {
    pipelines
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| anyhow::anyhow!("no pipeline named {name:?} in {}", settings.pipelines.display()))
}

/// The store of `kind`, reachable and with idemflow's schema, or the reason against the settings file `config`.
pub(super) async fn open_store(settings: &Settings, config: &Path, kind: StoreKind) -> anyhow::Result<Store> {
    settings.stores().open(kind).await.map_err(|why| anyhow::anyhow!("{}: {why}", config.display()))
}

/// Every store `pipelines` write to, opened, the database first.
///
/// Errors: as [`idemflow::store::open::Stores::open`]; the caller names the settings file.
pub(super) async fn open_stores(settings: &Settings, pipelines: &[config::Pipeline]) -> Result<Vec<(StoreKind, Store)>, NotReady> {
    let mut stores = Vec::new();
    for kind in idemflow::store::open::needed(pipelines.iter().map(|p| p.sink.store())) {
        stores.push((kind, settings.stores().open(kind).await?));
    }
    Ok(stores)
}

/// What each store's durability means for the pipelines writing to it: one line each, `warning: ` first where it
/// is one.
pub(super) async fn durability(stores: &[(StoreKind, Store)], pipelines: &[config::Pipeline]) -> Vec<String> {
    let mut lines = Vec::new();
    for (kind, store) in stores {
        let tenants: Vec<idemflow::store::contract::Tenant> = pipelines.iter().filter(|p| p.sink.store() == *kind).map(|p| p.tenant()).collect();
        lines.extend(store.durability(&tenants).await);
    }
    lines
}

/// How long each pipeline's dedup rows live, from its retention and its store's sweep
/// ([`idemflow::retention::lifetime_note`]); nothing for a store whose keys expire by themselves (Redis says its own).
pub(super) async fn lifetimes(stores: &[(StoreKind, Store)], pipelines: &[config::Pipeline]) -> Vec<String> {
    let mut lines = Vec::new();
    for p in pipelines.iter().filter(|p| !p.sink.store().expires_dedup_keys()) {
        let Some((_, store)) = stores.iter().find(|(kind, _)| *kind == p.sink.store()) else { continue };
        match store.sweep_state(&p.name).await {
            Ok(state) => lines.push(idemflow::retention::lifetime_note(&p.name, p.dedup.retention, p.dedup.purge_interval, p.dedup.purge_rate, state.as_ref())),
            Err(e) => lines.push(format!("warning: pipeline {:?}: could not read its retention sweep's state: {e}", p.name)),
        }
    }
    lines
}

/// Outbox requests no relay sends, one warning line per pipeline and target: rows waiting, or `delivery_failed` dead
/// letters, of a pipeline that is not configured (renamed, removed) or of a target it no longer has (renamed,
/// removed), each with its counts, its oldest row's age and the remedy.
pub(super) async fn unsent(stores: &[(StoreKind, Store)], pipelines: &[config::Pipeline]) -> Vec<String> {
    let mut lines = Vec::new();
    for (kind, store) in stores {
        let rows = match store.unsent().await {
            Ok(rows) => rows,
            Err(e) => {
                lines.push(format!("warning: could not read which outbox requests wait: {e}"));
                continue;
            }
        };
        for u in rows {
            let Some(why) = unsent_because(pipelines, *kind, &u) else { continue };
            let waiting = if u.waiting > 0 {
                format!("{} request(s) waiting in the outbox (the oldest for {})", u.waiting, idemflow::terminal::duration(std::time::Duration::from_secs_f64(u.oldest_seconds)))
            } else {
                String::new()
            };
            let failed = if u.dead_letters > 0 { format!("{} delivery_failed dead letter(s)", u.dead_letters) } else { String::new() };
            let what: Vec<String> = [waiting, failed].into_iter().filter(|s| !s.is_empty()).collect();
            lines.push(format!("warning: target {:?} of pipeline {:?}: {}, which no relay sends: {why}", u.target, u.pipeline, what.join(" and ")));
        }
    }
    lines
}

/// Why no relay sends the rows of `u` (in the store of `kind`), with the remedy: its pipeline is not configured with
/// that store, or has no such target now. `None` where a relay of a configured pipeline sends them.
pub(super) fn unsent_because(pipelines: &[config::Pipeline], kind: StoreKind, u: &idemflow::store::rows::Unsent) -> Option<String> {
    let Some(p) = pipelines.iter().find(|p| p.name == u.pipeline && p.sink.store() == kind) else {
        return Some(format!(
            "no pipeline {:?} is configured here. Run by another deployment sharing this database? Then nothing is \
             wrong. Renamed? With every worker of it stopped, `idemflow pipeline rename {} <new name>` moves them with \
             its history (docs/operations.md, \"Renaming a pipeline\")",
            u.pipeline, u.pipeline
        ));
    };
    if p.outbox.as_ref().is_some_and(|o| o.target_names().any(|t| t == u.target)) {
        return None;
    }
    Some(format!(
        "pipeline {:?} has no target {:?} now: give the renamed target its old name back (name = {:?}), or configure it \
         again; then waiting rows are sent, and dead letters with `idemflow dead-letters replay` (docs/outbox.md, \
         \"Adding a target to a running pipeline\")",
        u.pipeline, u.target, u.target
    ))
}

/// Checks every pipeline against its store, all problems at once.
pub(super) async fn prepare_all(stores: &[(StoreKind, Store)], pipelines: &[config::Pipeline]) -> Result<Vec<worker::Ready>, worker::Unprepared> {
    let mut ready = Vec::new();
    let mut errors = worker::Unprepared { problems: Vec::new(), unavailable: false };
    for (kind, store) in stores {
        let mine: Vec<config::Pipeline> = pipelines.iter().filter(|p| p.sink.store() == *kind).cloned().collect();
        match worker::prepare(store, &mine).await {
            Ok(r) => ready.extend(r),
            Err(e) => {
                errors.unavailable |= e.unavailable;
                errors.problems.extend(e.problems);
            }
        }
    }
    if errors.problems.is_empty() { Ok(ready) } else { Err(errors) }
}
