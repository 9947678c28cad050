//! `idemflow check`: the settings and every pipeline validated, each broker asked for its topics or queues, each
//! side effect prepared against its store; every problem reported at once.

use super::{durability, load, open_stores, prepare_all, report, ConfigArg};
use anyhow::bail;
use idemflow::config;
use idemflow::source;

/// Runs `check`.
///
/// Errors: a problem with the settings, a pipeline, a broker or a store (all of them printed first).
pub async fn run(a: ConfigArg) -> anyhow::Result<()> {
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    config::check_sources(&settings, &pipelines).map_err(|e| report(&e))?;
    let mut source_lines = Vec::new();
    // A broker problem does not hide the database's: every pipeline's statements are still checked, and all
    // problems are reported together.
    let mut broker_problems: Vec<String> = Vec::new();
    let brokers = settings.brokers();
    for p in &pipelines {
        match source::check::check(&brokers, &p.source_context()).await {
            Ok(lines) => source_lines.extend(lines),
            Err(source::check::CheckError::Settings(e)) => bail!("{}: {e}", a.config.display()),
            Err(source::check::CheckError::Broker(e)) => {
                broker_problems.push(format!("{}: pipeline {:?}: {}: {e}", p.file.display(), p.name, p.source.kind()))
            }
        }
    }
    let print_problems = |problems: &[String]| {
        for problem in problems {
            eprintln!("{problem}");
        }
    };
    let database = async {
        let stores = open_stores(&settings, &a.config, &pipelines).await?;
        source_lines.extend(durability(&stores, &pipelines).await);
        prepare_all(&stores, &pipelines).await.map_err(|e| report(&e))
    };
    let ready = match database.await {
        Ok(ready) => ready,
        Err(e) if broker_problems.is_empty() => return Err(e),
        Err(e) => {
            print_problems(&broker_problems);
            bail!("{e}, and {} problem(s) with the brokers", broker_problems.len());
        }
    };
    if !broker_problems.is_empty() {
        print_problems(&broker_problems);
        bail!(
            "{} problem(s) with the brokers (the database, its schema and every pipeline's statements are right)",
            broker_problems.len()
        );
    }
    for r in &ready {
        let p = &r.pipeline;
        println!("pipeline {:?} ({}): ok, {}", p.name, p.file.display(), source::check::summary(&p.source_context()));
    }
    for r in &ready {
        for note in &r.notes {
            println!("pipeline {:?}: {note}", r.pipeline.name);
        }
    }
    for line in source_lines {
        println!("{line}");
    }
    let mut timing: Vec<String> = pipelines.iter().flat_map(|p| source::check::timing_warnings(&brokers, &p.source_context())).collect();
    timing.dedup();
    for w in timing {
        println!("warning: {w}");
    }
    for p in &pipelines {
        for line in source::check::retention_report(&brokers, &p.source_context()).await {
            println!("{line}");
        }
    }
    Ok(())
}
