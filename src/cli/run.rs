//! `idemflow run`: the worker, every pipeline, until SIGTERM or SIGINT; `/metrics`, `/healthz` and `/readyz`
//! served from the start.

use super::workspace::{durability, load, open_stores, prepare_all, report, unsent, ConfigArg};
use anyhow::{bail, Context as _};
use idemflow::store::contract::NotReady;
use idemflow::store::spec::StoreKind;
use idemflow::store::Store;
use idemflow::{config, http, metrics, shutdown, worker};
use std::time::Duration;

/// Opens the stores and prepares every pipeline, waiting out what a store could not answer (it went away after
/// [`idemflow::store::open::Stores::wait_for`] saw it, or a pooler failed a statement) with the same backoff, saying
/// why on every attempt: `None` if shutdown came meanwhile.
///
/// Errors: what an operator must fix (the schema missing or behind, a side effect that does not fit its tables),
/// reported against the settings file `config` or each pipeline's file.
async fn start(
    settings: &config::Settings,
    config: &std::path::Path,
    pipelines: &[config::Pipeline],
    stop: &mut idemflow::shutdown::Shutdown,
) -> anyhow::Result<Option<(Vec<(StoreKind, Store)>, Vec<worker::Ready>)>> {
    let mut backoff = idemflow::retry::backoff(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        // Shutdown ends an attempt too (a read waiting on a lock, a connection that does not answer).
        let attempt = async {
            let stores = open_stores(settings, pipelines).await.map_err(|e| match e {
                NotReady::Unavailable(why) => (true, why),
                NotReady::Refused(why) => (false, format!("{}: {why}", config.display())),
            })?;
            match prepare_all(&stores, pipelines).await {
                Ok(ready) => Ok((stores, ready)),
                Err(e) if e.unavailable => Err((true, e.to_string())),
                Err(e) => Err((false, report(&e.problems).to_string())),
            }
        };
        let why = tokio::select! {
            attempt = attempt => match attempt {
                Ok((stores, ready)) => {
                    for line in durability(&stores, pipelines).await.into_iter().chain(unsent(&stores, pipelines).await) {
                        log_line(&line);
                    }
                    return Ok(Some((stores, ready)));
                }
                Err((false, why)) => bail!("{why}"),
                Err((true, why)) => why,
            },
            _ = stop.wait() => return Ok(None),
        };
        let delay = backoff.next().unwrap_or(Duration::from_secs(10));
        tracing::warn!(retry_in = ?delay, "starting: {why}");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait() => return Ok(None),
        }
    }
}

/// Runs the worker.
///
/// Errors: the settings or a pipeline are wrong, a store cannot be opened, or pipelines failed.
pub async fn run(a: ConfigArg) -> anyhow::Result<()> {
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    config::check_sources(&settings, &pipelines).map_err(|e| report(&e))?;
    // Serve /healthz from the start: the process is alive while it waits for the database.
    let metrics = metrics::Metrics::new();
    metrics.set_stall_after(settings.metrics.stall_after);
    let health = http::Health::default();
    health.database(false);
    let server = http::serve(settings.metrics.listen, metrics.clone(), health.clone())
        .with_context(|| format!("binding metrics.listen = {}", settings.metrics.listen))?;
    tracing::info!(address = %server.addr(), "serving /metrics, /healthz and /readyz");
    let (trigger, mut stop) = shutdown::channel();
    let timeout = settings.shutdown.timeout;
    let signals = shutdown::Signals::new();
    tokio::spawn(async move {
        signals.first().await;
        trigger.trigger();
        tokio::time::sleep(timeout).await;
        eprintln!("shutdown took longer than shutdown.timeout = {timeout:?}; exiting");
        std::process::exit(1);
    });
    let needed = idemflow::store::open::needed(pipelines.iter().map(|p| p.sink.store()));
    let stores = settings.stores();
    tokio::select! {
        waited = stores.wait_for(&needed) => waited.map_err(|e| anyhow::anyhow!("{}: {e}", a.config.display()))?,
        _ = stop.wait() => {
            tracing::info!("stopped before the stores were reachable");
            return Ok(());
        }
    }
    health.database(true);
    let Some((stores, ready)) = start(&settings, &a.config, &pipelines, &mut stop).await? else {
        tracing::info!("stopped before the stores were ready");
        return Ok(());
    };
    for p in &pipelines {
        let (brokers, context) = (settings.brokers(), p.source_context());
        tokio::spawn(async move {
            for line in idemflow::source::retention_report(&brokers, &context).await {
                log_line(&line);
            }
        });
    }
    let faults = worker::Faults::from_env().map_err(anyhow::Error::msg)?;
    if faults != worker::Faults::default() {
        tracing::warn!(?faults, "FAULT INJECTION ON ({}, {}, {} or {}): this worker will fail on purpose; for tests only",
            worker::CRASH_AFTER_COMMITS_VAR, worker::LOSE_COMMIT_ANSWER_VAR, idemflow::outbox::relay::CRASH_AFTER_DELIVERIES_VAR, worker::PANIC_ON_PAYLOAD_VAR);
    }
    let failures = worker::run_with_faults(&settings, ready, &metrics, &health, stop.clone(), faults).await;
    if !failures.is_empty() && !stop.is_triggered() {
        // Every pipeline stopped on a fatal error: keep /metrics and /readyz up (pipeline_up 0, not ready)
        // so monitoring sees why, rather than exiting into a restart loop. Exit 1 on SIGTERM/SIGINT.
        tracing::error!("every pipeline has stopped on a fatal error; serving /metrics until stopped");
        stop.wait().await;
    }
    for (_, store) in &stores {
        store.close().await;
    }
    if failures.is_empty() {
        tracing::info!("stopped cleanly");
        Ok(())
    } else {
        bail!("{} pipeline(s) failed: {}", failures.len(), failures.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("; "))
    }
}

/// A line of a report, logged as a warning when it is one (`warning: ...`).
fn log_line(line: &str) {
    match line.strip_prefix("warning: ") {
        Some(w) => tracing::warn!("{w}"),
        None => tracing::info!("{line}"),
    }
}
