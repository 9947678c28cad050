//! `idemflow purge`: one full pass of the retention sweep by hand, from the start of the table, unpaced (PostgreSQL, MySQL/MariaDB; Redis expires its dedup keys by
//! themselves).

use super::workspace::{load, named, open_store, report};
use idemflow::config;
use idemflow::retention::{Pace, Sweep};
use idemflow::store::spec::StoreKind;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PurgeArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// Only this pipeline.
    #[arg(long)]
    pipeline: Option<String>,
}

/// Runs `purge`.
///
/// Errors: the settings, the pipelines or the database cannot be read, or a purge transaction failed.
pub async fn run(a: PurgeArgs) -> anyhow::Result<()> {
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    if let Some(name) = &a.pipeline {
        named(&pipelines, name, &settings)?;
    }
    let chosen: Vec<&config::Pipeline> = pipelines.iter().filter(|p| a.pipeline.as_ref().is_none_or(|n| *n == p.name)).collect();
    for p in chosen.iter().filter(|p| p.sink.store().expires_dedup_keys()) {
        println!(
            "pipeline {:?}: nothing to purge, its dedup keys in Redis expire by themselves after [dedup] retention = {}",
            p.name, idemflow::terminal::duration(p.dedup.retention)
        );
    }
    let chosen: Vec<&config::Pipeline> = chosen.into_iter().filter(|p| !p.sink.store().expires_dedup_keys()).collect();
    if chosen.is_empty() {
        return Ok(());
    }
    let store = open_store(&settings, &a.config, StoreKind::Database).await?;
    let owner = format!("idemflow purge/{}", std::process::id());
    for p in chosen {
        let sweep = Sweep {
            pipeline: &p.name,
            owner: &owner,
            retention: p.dedup.retention,
            rows: p.dedup.purge_batch,
            interval: p.dedup.purge_interval,
            pace: Pace::FromStartAtOnce,
        };
        let o = store.sweep_pass(&sweep, |_| {}).await?;
        if o.skipped.is_some() {
            println!("pipeline {:?}: skipped, another process is sweeping it", p.name);
        } else {
            println!(
                "pipeline {:?}: purged {} dedup rows older than {}; {} rows of the dedup table examined in {} slice(s), {:.1} s",
                p.name,
                o.purged,
                idemflow::terminal::duration(p.dedup.retention),
                o.examined,
                o.slices,
                o.pass_seconds.unwrap_or_default()
            );
        }
    }
    Ok(())
}
