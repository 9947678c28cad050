//! What a pair's soak must show, judged from its [`Outcome`], and the report that says it.
//!
//! Exact where the pair makes it exact. A broker that keeps each partition's order with the positions in the
//! store (Kafka, RocketMQ: [`BrokerKind::positional`]) gives every figure exactly: the amounts as first
//! published, one dead letter per poison record, the dedup rows' duplicate counts and the counters equal to what
//! was injected. A queue (RabbitMQ) or a JetStream consumer hands a redelivery back after newer messages and keeps
//! no positions, so there a copy with another amount may be applied before its original (the total deducted is
//! then the applied amounts, one cent above the first-published ones per swap), a redelivered poison message gets
//! a dead letter again (one payload each, never another), and a redelivery is one more duplicate counted (at least
//! the injected ones). A record the producer sent again after a lost acknowledgement may be one more copy than
//! was injected ([`Outcome::resent`]: an upper bound, 0 with Kafka and NATS); it may be any record (a poison
//! record, a reused id), so every exact figure it could raise allows that many more.

use super::pair::Outcome;
use super::worker::{flat, Sample};
use crate::demo::{self, broker::BrokerKind};
use std::fmt::Write as _;
use std::time::Duration;

/// `(passed, what was compared)`, in the report's order.
pub fn checks(o: &Outcome) -> Vec<(bool, String)> {
    let i = &o.injected;
    let (t, l) = (&o.totals, &o.ledger);
    let exact = o.broker.positional();
    let injected_duplicates = (i.retries + i.mismatches) as i64;
    let mut checks = vec![(
        t.rows == i.distinct as i64 && t.distinct_rows == t.rows,
        format!("business rows {} (distinct order ids {}) == distinct operations {}", t.rows, t.distinct_rows, i.distinct),
    )];
    let expected = i128::from(i.expected_cents);
    let (deducted, applied) = (demo::money(t.deducted_cents as i64), demo::money(t.applied_cents as i64));
    checks.push(if exact {
        (t.deducted_cents == expected && t.applied_cents == t.deducted_cents,
            format!("total deducted {deducted} == sum of the applied payments {applied} == expected {}", demo::money(i.expected_cents)))
    } else {
        let upper = expected + i128::from(i.mismatches as i64);
        (t.applied_cents == t.deducted_cents && (expected..=upper).contains(&t.applied_cents),
            format!("total deducted {deducted} == sum of the applied payments {applied}, from the first-published {} to {} (a copy applied before its original)",
                demo::money(i.expected_cents), demo::money(upper as i64)))
    });
    checks.push(if exact {
        let upper = (i.poison + o.resent) as i64;
        ((i.poison as i64..=upper).contains(&l.dead_letters), format!("dead letters {} == poison records {}{}", l.dead_letters, i.poison, slack(o.resent)))
    } else {
        (l.dead_payloads == i.poison as i64 && l.dead_letters >= l.dead_payloads,
            format!("dead-lettered payloads {} == poison records {} ({} dead letters: a redelivered poison message again)", l.dead_payloads, i.poison, l.dead_letters))
    });
    let reasons_ok = l.dead_reasons.iter().all(|r| r == "decode_failed");
    checks.push((reasons_ok, format!("dead letters' reasons {:?}: decode_failed only, nothing dead-lettered for an outage", l.dead_reasons)));
    checks.push((l.dedup_rows == i.distinct as i64, format!("dedup rows {} == distinct operations {}", l.dedup_rows, i.distinct)));
    checks.push(if exact {
        let upper = injected_duplicates + o.resent as i64;
        ((injected_duplicates..=upper).contains(&l.duplicates),
            format!("duplicates counted in the dedup rows {} == retries {} + reused order ids {}{}", l.duplicates, i.retries, i.mismatches, slack(o.resent)))
    } else {
        (l.duplicates >= injected_duplicates,
            format!("duplicates counted in the dedup rows {} >= retries {} + reused order ids {} (redeliveries counted too)", l.duplicates, i.retries, i.mismatches))
    });
    checks.push((o.last.received == o.last.parts(),
        format!("last worker: received {} == applied + duplicates + dead letters + tombstones {}", o.last.received, o.last.parts())));
    checks.push((o.stopped.is_some_and(|s| s.success()), format!("last worker stopped by SIGTERM: {:?}", o.stopped)));
    checks.extend(counted(o));
    if o.streamed >= RESOURCES_JUDGED_FROM {
        let resources = [
            ("resident memory (KiB)", flat(&o.samples, |s| s.rss_kib, 8 * 1024)),
            ("open files", flat(&o.samples, |s| s.fds, 8)),
            ("threads", flat(&o.samples, |s| s.threads, 4)),
        ];
        for (what, f) in resources {
            if let Some((middle, last, ok)) = f {
                checks.push((ok, format!("{what}: largest in the last third {last}, in the middle third {middle}")));
            }
        }
    }
    checks
}

/// The shortest run whose resource samples are judged flat or not: in a shorter one the catch-up after a single
/// outage (a backlog read at once, the client's buffers filling) can fall in its last third and look like growth.
pub const RESOURCES_JUDGED_FROM: Duration = Duration::from_secs(600);

/// ` (+ at most N sent again)` when the producer sent records again.
fn slack(resent: u64) -> String {
    if resent == 0 { String::new() } else { format!(" (+ at most {resent} sent again by the producer)") }
}

/// Records applied whose counts a SIGKILLed process took with it before its next scrape.
fn short(o: &Outcome) -> f64 {
    o.injected.distinct as f64 - o.counted.applied
}

/// The counters summed over every worker process: exact unless a SIGKILL took a committed batch's counts with it
/// (then never over).
fn counted(o: &Outcome) -> Vec<(bool, String)> {
    let (c, i) = (&o.counted, &o.injected);
    let short = short(o);
    let relation = |got: f64, want: f64, slack: f64| if short == 0.0 { got >= want && got <= want + slack } else { got <= want + slack };
    let sign = if short == 0.0 { "==" } else { "<=" };
    if o.broker.positional() {
        let resent = o.resent as f64;
        [
            (c.applied, i.distinct as f64, 0.0, "applied"),
            (c.republished, i.retries as f64, resent, "republished"),
            (c.mismatched, i.mismatches as f64, resent, "payload_mismatch"),
            (c.dead_letters, i.poison as f64, resent, "dead letters"),
        ]
        .into_iter()
        .map(|(got, want, s, what)| (relation(got, want, s), format!("{what} counted over every worker process {got} {sign} {want}{}", slack(s as u64))))
        .collect()
    } else {
        let skipped = c.republished + c.redelivered + c.mismatched;
        let injected = (i.retries + i.mismatches) as f64;
        vec![
            (relation(c.applied, i.distinct as f64, 0.0), format!("applied counted over every worker process {} {sign} {}", c.applied, i.distinct)),
            (short > 0.0 || skipped >= injected,
                format!("duplicates counted over every worker process {skipped} (republished {}, redelivered {}, payload_mismatch {}) >= retries + reused order ids {injected}",
                    c.republished, c.redelivered, c.mismatched)),
            (short > 0.0 || c.dead_letters >= i.poison as f64, format!("dead letters counted over every worker process {} >= poison records {}", c.dead_letters, i.poison)),
        ]
    }
}

/// One pair's section of the report.
pub fn report(o: &Outcome, checks: &[(bool, String)], rate: u32, seed: u64) -> String {
    let mut r = String::new();
    let i = &o.injected;
    let store = o.store.name();
    let broker = match o.broker {
        BrokerKind::Kafka => format!("Kafka (embedded, {} partitions)", o.partitions),
        BrokerKind::Rocketmq => format!("RocketMQ ({} queues)", o.partitions),
        BrokerKind::Rabbitmq => "RabbitMQ (a quorum queue)".to_owned(),
        BrokerKind::Nats => "NATS JetStream (a stream, a durable consumer)".to_owned(),
    };
    let _ = writeln!(r, "## {} x {store}\n", o.broker.name());
    let _ = writeln!(r, "{broker} x {store} (durable), the shipped {store} pipeline reading it, the release worker as a child process.\n");
    let _ = writeln!(r, "- stream: {:.0} s at {rate} records/s: {} records, {} operations, {} producer retries, {} reused order ids, {} poison",
        o.streamed.as_secs_f64(), i.produced, i.distinct, i.retries, i.mismatches, i.poison);
    if o.resent > 0 {
        let _ = writeln!(r, "- records the producer sent again after a failure whose first send may have been stored: {}", o.resent);
    }
    let _ = writeln!(r, "- every record processed {:.1} s after the faults and the stream stopped", o.drained.as_secs_f64());
    let _ = writeln!(r, "- the longest time without a record applied while records waited: {:.0} s (faults included)", o.longest_stall.as_secs_f64());
    let mut by_kind = String::new();
    for kind in super::faults::Fault::ALL {
        let n: Vec<_> = o.journal.iter().filter(|(_, f, _)| *f == kind).collect();
        if !n.is_empty() {
            let secs: f64 = n.iter().map(|(_, _, d)| d.as_secs_f64()).sum();
            let _ = write!(by_kind, "{} {} ({secs:.0} s), ", n.len(), kind.name(store));
        }
    }
    let _ = writeln!(r, "- faults ({} in all; seed {seed}): {}", o.journal.len(), by_kind.trim_end_matches(", "));
    if !o.iptables {
        let _ = writeln!(r, "- no packets dropped: iptables unavailable (not root, or not installed)");
    }
    for e in &o.exits {
        let _ = writeln!(r, "- {e}");
    }
    if short(o) > 0.0 {
        let _ = writeln!(r, "- counts taken by SIGKILLed processes before their next scrape: {} applied records", short(o));
    }
    let c = &o.counted;
    let _ = writeln!(r, "- counters summed over every worker process: received {}, applied {}, republished {}, redelivered {}, payload_mismatch {}, dead letters {}",
        c.received, c.applied, c.republished, c.redelivered, c.mismatched, c.dead_letters);
    let _ = writeln!(r, "\n### Checks\n");
    for (ok, text) in checks {
        let _ = writeln!(r, "- {}: {text}", if *ok { "ok" } else { "FAILED" });
    }
    let _ = writeln!(r, "\n### The worker's resources (a sample every 10 s; the largest of each ~5 minutes)\n");
    if o.streamed < RESOURCES_JUDGED_FROM {
        let _ = writeln!(r, "Not judged flat or growing: the run is shorter than {} minutes.\n", RESOURCES_JUDGED_FROM.as_secs() / 60);
    }
    let _ = writeln!(r, "| minutes | pid | resident MiB | open files | threads |\n|---|---|---|---|---|");
    resources(&mut r, &o.samples);
    let _ = writeln!(r, "\nThe faults, in order:\n");
    for (at, fault, lasting) in &o.journal {
        let _ = writeln!(r, "- {:.1} s: {} for {:.1} s", at.as_secs_f64(), fault.name(store), lasting.as_secs_f64());
    }
    r
}

/// The resources table's rows: the largest sample of each 5-minute window.
fn resources(r: &mut String, samples: &[Sample]) {
    let window = Duration::from_secs(300);
    let mut from = Duration::ZERO;
    while samples.iter().any(|s| s.at >= from) {
        let w: Vec<&Sample> = samples.iter().filter(|s| s.at >= from && s.at < from + window).collect();
        if let Some(peak) = w.iter().max_by_key(|s| s.rss_kib) {
            let fds = w.iter().map(|s| s.fds).max().unwrap_or(0);
            let threads = w.iter().map(|s| s.threads).max().unwrap_or(0);
            let _ = writeln!(r, "| {}-{} | {} | {:.1} | {fds} | {threads} |", from.as_secs() / 60, (from + window).as_secs() / 60, peak.pid, peak.rss_kib as f64 / 1024.0);
        }
        from += window;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::database::{Ledger, Totals};
    use crate::demo::store::StoreKind;
    use crate::soak::pair::Injected;
    use crate::soak::worker::Counts;
    use std::os::unix::process::ExitStatusExt as _;

    /// A run where everything came out exact: 1,000 operations, 20 retries, 3 reused ids, 2 poison records.
    fn exact(broker: BrokerKind) -> Outcome {
        let injected = Injected { produced: 1025, distinct: 1000, retries: 20, mismatches: 3, poison: 2, expected_cents: 500_000 };
        let counted = Counts { received: 1025.0, applied: 1000.0, republished: 20.0, redelivered: 0.0, mismatched: 3.0, dead_letters: 2.0, tombstones: 0.0 };
        Outcome {
            broker,
            store: StoreKind::Postgres,
            partitions: 1,
            injected,
            resent: 0,
            totals: Totals { rows: 1000, distinct_rows: 1000, deducted_cents: 500_000, applied_cents: 500_000 },
            ledger: Ledger { dedup_rows: 1000, duplicates: 23, dead_letters: 2, dead_payloads: 2, dead_reasons: vec!["decode_failed".into()] },
            counted,
            last: counted,
            stopped: Some(std::process::ExitStatus::from_raw(0)),
            samples: Vec::new(),
            journal: Vec::new(),
            exits: Vec::new(),
            streamed: Duration::from_secs(5),
            drained: Duration::from_secs(1),
            longest_stall: Duration::ZERO,
            iptables: true,
        }
    }

    fn failed(o: &Outcome) -> Vec<String> {
        checks(o).into_iter().filter(|(ok, _)| !ok).map(|(_, text)| text).collect()
    }

    #[test]
    fn an_exact_run_passes_on_every_broker() {
        for broker in BrokerKind::ALL {
            assert_eq!(failed(&exact(broker)), Vec::<String>::new(), "{broker:?}");
        }
    }

    #[test]
    fn a_positional_broker_is_held_to_exact_figures() {
        // One operation applied twice: a row too many, a deduction too many.
        let mut o = exact(BrokerKind::Kafka);
        o.totals.rows = 1001;
        o.totals.deducted_cents += 100;
        assert_eq!(failed(&o).len(), 2, "{:?}", failed(&o));
        // A poison record dead-lettered twice, a duplicate counted twice.
        let mut o = exact(BrokerKind::Rocketmq);
        o.ledger.dead_letters = 3;
        o.ledger.duplicates = 24;
        assert_eq!(failed(&o).len(), 2, "{:?}", failed(&o));
        // ... unless the producer sent a record again: then one more duplicate is allowed, never two.
        o.ledger.dead_letters = 2;
        o.resent = 1;
        o.counted.republished = 21.0;
        assert_eq!(failed(&o), Vec::<String>::new());
        o.ledger.dead_letters = 3;
        assert_eq!(failed(&o), Vec::<String>::new());
        o.ledger.duplicates = 25;
        assert_eq!(failed(&o).len(), 1);
        // A copy with another amount applied first is an error where the order is kept.
        let mut o = exact(BrokerKind::Kafka);
        o.totals.deducted_cents += 1;
        o.totals.applied_cents += 1;
        assert_eq!(failed(&o).len(), 1);
    }

    #[test]
    fn a_queue_allows_what_redeliveries_and_lost_order_do_and_nothing_more() {
        let mut o = exact(BrokerKind::Rabbitmq);
        // A reused order id applied before its original (one cent more each), a redelivered poison message
        // dead-lettered again, redeliveries counted as duplicates.
        o.totals.deducted_cents += 3;
        o.totals.applied_cents += 3;
        o.ledger.dead_letters = 3;
        o.ledger.duplicates = 40;
        o.counted.redelivered = 17.0;
        assert_eq!(failed(&o), Vec::<String>::new());
        // But never an amount beyond every swap, a deduction that is not the applied amounts, a poison payload
        // missing, or fewer duplicates than were injected.
        o.totals.applied_cents += 1;
        o.totals.deducted_cents += 1;
        assert_eq!(failed(&o).len(), 1);
        let mut o = exact(BrokerKind::Nats);
        o.totals.deducted_cents += 1;
        o.ledger.dead_payloads = 1;
        o.ledger.duplicates = 22;
        assert_eq!(failed(&o).len(), 3, "{:?}", failed(&o));
    }

    #[test]
    fn a_dead_letter_for_an_outage_fails() {
        let mut o = exact(BrokerKind::Nats);
        o.ledger.dead_reasons = vec!["decode_failed".into(), "sink_failed".into()];
        assert_eq!(failed(&o).len(), 1);
    }
}
