//! Faults a process kill does not make: packets that vanish on the way to the database and to the broker (a
//! half-open TCP connection, no RST), for a moment and for longer than every timeout, then healed. Debian's
//! `iptables` drops them on loopback (`-I INPUT -i lo -p tcp --dport PORT -j DROP`, and `--sport` for the answers),
//! only on ports of servers the test started itself; the rules are removed when the test ends, however it ends.
//! Nothing is lost, nothing applied twice, every hang is bounded by a documented timeout (`[database]
//! batch_timeout`, the pool's `acquire_timeout`, librdkafka's `socket.timeout.ms`), and the worker resumes by
//! itself when the link heals. Needs root (the test suite runs as root, as CI does).

use crate::failures::{assert_counters_add_up, assert_exactly_once, payments, payments_db, shipped, wait_all_durable_or_report, Rng};
use crate::support::postgres::Cluster;
use crate::support::*;
use std::process::Command;
use std::time::Duration;

/// Drops every packet to and from a loopback port while it lives.
struct Blackhole {
    port: u16,
}

impl Blackhole {
    fn rules(port: u16) -> [Vec<String>; 2] {
        let p = port.to_string();
        [
            ["INPUT", "-i", "lo", "-p", "tcp", "--dport", &p, "-j", "DROP"].map(str::to_owned).to_vec(),
            ["INPUT", "-i", "lo", "-p", "tcp", "--sport", &p, "-j", "DROP"].map(str::to_owned).to_vec(),
        ]
    }

    fn start(port: u16) -> Blackhole {
        for rule in Self::rules(port) {
            let status = Command::new("iptables").arg("-I").args(&rule).status().expect("iptables (Debian package iptables; root)");
            assert!(status.success(), "iptables -I {rule:?}: run the suite as root");
        }
        Blackhole { port }
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        for rule in Self::rules(self.port) {
            let _ = Command::new("iptables").arg("-D").args(&rule).status();
        }
    }
}

/// The database's packets dropped three times at random moments while the stream flows (so a drop meets a claim,
/// a side effect or a COMMIT in flight), each for longer than `[database] batch_timeout` (5 s here) and the pool's
/// acquire timeout, then once for a moment; the broker's packets dropped for longer than its socket timeout. Every
/// operation applied once, every poison record dead-lettered once, counters add up, and the worker is ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packets_dropped_to_the_database_and_the_broker_then_healed() {
    let cluster = Cluster::start_durable().unwrap();
    let port: u16 = url::Url::parse(&cluster.url()).unwrap().port().unwrap();
    let db = payments_db(Some(&cluster.url())).await;
    // 1 ms a payment, so a batch is in flight long enough for a drop to meet it.
    sqlx::raw_sql(
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.001); RETURN NEW; END $$;
         CREATE TRIGGER slow BEFORE INSERT ON payments FOR EACH ROW EXECUTE FUNCTION slow();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let kafka = Kafka::new();
    kafka.create_topic("payments", 3);
    let s = payments(12_000, 3, false);
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &shipped())], "\"socket.timeout.ms\" = \"10000\"", "");
    let text = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(&setup.config, text.replace("acquire_timeout = \"2s\"", "acquire_timeout = \"2s\"\nbatch_timeout = \"5s\"")).unwrap();
    let chunks: Vec<&[Out]> = s.records.chunks(s.records.len() / 6 + 1).collect();
    kafka.produce("payments", chunks[0]);
    let mut w = BinWorker::start(&setup);
    let mut rng = Rng::from_clock();
    for (i, chunk) in chunks[1..].iter().enumerate() {
        kafka.produce("payments", chunk);
        tokio::time::sleep(Duration::from_millis(200 + rng.below(800))).await;
        let (what, hold) = match i {
            0..=2 => ("the database", Duration::from_secs(8)),
            3 => ("the database", Duration::from_millis(700)),
            _ => ("the broker", Duration::from_secs(12)),
        };
        if what == "the database" {
            // While a batch is in its transaction (a claim, the side effect, or its COMMIT).
            wait_until(Duration::from_secs(30), "a batch in flight", || async {
                db.scalar::<i64>("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state NOT IN ('idle') \
                     AND backend_type = 'client backend' AND pid <> pg_backend_pid()").await > 0
            })
            .await;
            tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
        }
        let target = if what == "the database" { port } else { broker_port(&kafka) };
        let hole = Blackhole::start(target);
        tokio::time::sleep(hold).await;
        drop(hole);
        println!("dropped {what}'s packets for {hold:?}");
    }
    wait_all_durable_or_report(&db, &kafka, "idemflow-payments", "payments", 3, &s, &[&w]).await;
    wait_until(Duration::from_secs(60), "ready again", || async {
        http_get(setup.metrics, "/readyz").is_ok_and(|(status, _)| status == 200)
    })
    .await;
    let m = w.scrape();
    assert_counters_add_up(&m);
    let retries: f64 = ["connection", "unavailable", "pool_timeout"]
        .iter()
        .map(|c| metric(&m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", c)]))
        .sum();
    assert!(retries >= 1.0, "the drops must have been met and retried:\n{m}");
    assert!(w.log_text().contains("batch_timeout"), "a batch attempt was abandoned on its timeout:\n{}", w.log_text());
    assert!(w.sigterm().success());
    assert_exactly_once(&db, &s).await;
}

/// The mock cluster's broker port (its bootstrap address).
fn broker_port(kafka: &Kafka) -> u16 {
    kafka.bootstrap().split(',').next().unwrap().rsplit_once(':').unwrap().1.parse().unwrap()
}
