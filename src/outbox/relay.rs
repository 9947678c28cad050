//! The relay: beside each pipeline with `[[sink.http]]`, delivers the outbox's rows after their batches committed,
//! and says when the outbox has grown past its bounds so the pipeline stops consuming ([`Signals`]).
//!
//! A round: lease up to `[outbox] concurrency` due rows ([`Store::outbox_lease`]: rows no other relay holds, the
//! oldest of each business key only), send each once, at the same time, and record what came of them in one
//! transaction ([`Store::outbox_settle`]): confirmed rows deleted, others given their next attempt, or moved to the
//! dead letters. A crash, a lost connection or a stop between a target's answer and that transaction leaves the row
//! leased: once its lease runs out (`[outbox] lease`: the longest `timeout` plus [`LEASE_MARGIN`]) a relay sends it again, with the same
//! idempotency key, which the target recognises. See `src/lib.rs`, "The outbox".

use super::deliver::{self, AttemptResult, Outcome};
use super::spec::{HttpTarget, KafkaTarget, OutboxSpec};
use crate::metrics::OutboxMetrics;
use crate::shutdown::Shutdown;
use crate::store::rows::{Leased, Settled};
use crate::store::Store;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How much longer than the longest request `timeout` a lease holds by default (`[outbox] lease`): time to record
/// the answer.
pub const LEASE_MARGIN: Duration = Duration::from_secs(30);

/// How often the relay counts the rows waiting (back-pressure, `idemflow_outbox_rows`): a pipeline over its bounds
/// consumes at most this long more. The count reads at most twice `max_rows` index entries.
pub const MEASURE_EVERY: Duration = Duration::from_millis(250);

/// The variable that makes `idemflow run` abort right after the Nth request a target confirmed, before the outbox
/// records it: `IDEMFLOW_FAULT_CRASH_AFTER_DELIVERIES=N`. For tests; a worker started with it says so loudly.
pub const CRASH_AFTER_DELIVERIES_VAR: &str = "IDEMFLOW_FAULT_CRASH_AFTER_DELIVERIES";

/// What the relay and the pipeline's lanes share: whether consumption is paused for the outbox, and the wake-up a
/// committed batch gives the relay. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Signals {
    inner: Arc<SignalsInner>,
}

#[derive(Debug, Default)]
struct SignalsInner {
    paused: AtomicBool,
    why: Mutex<String>,
    wake: tokio::sync::Notify,
}

impl Signals {
    /// Why the pipeline must not consume now, while the outbox is over a bound.
    pub fn paused(&self) -> Option<String> {
        self.inner.paused.load(Ordering::Relaxed).then(|| self.inner.why.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone())
    }

    /// A batch committed rows: the relay looks at once instead of at its next poll.
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    fn set(&self, why: Option<String>) {
        if let Some(why) = &why {
            *self.inner.why.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = why.clone();
        }
        self.inner.paused.store(why.is_some(), Ordering::Relaxed);
    }
}

/// One pipeline's relay.
pub struct Relay {
    store: Store,
    pipeline: String,
    /// This worker's name as the owner of its leases.
    owner: String,
    spec: OutboxSpec,
    /// One client per HTTP target, in [`OutboxSpec::http`]'s order.
    clients: Vec<reqwest::Client>,
    /// One producer per Kafka target, in [`OutboxSpec::kafka`]'s order.
    #[cfg(feature = "kafka")]
    producers: Vec<crate::source::kafka::outbox::OutboxProducer>,
    lease: Duration,
    signals: Signals,
    metrics: OutboxMetrics,
    health: crate::http::Health,
    /// [`CRASH_AFTER_DELIVERIES_VAR`].
    crash_after: Option<u64>,
    confirmed: AtomicU64,
    /// Outcomes whose record failed: recorded again with the next round's, and a row among them confirmed by its
    /// target is not sent again meanwhile, even if this relay leases it again.
    unrecorded: Mutex<Vec<Pending>>,
    /// How each row that failed here last failed ([`Relay::failure_changed`]): a failure is logged once per row and
    /// change of kind, every other attempt at debug level.
    failing: Mutex<HashMap<i64, AttemptResult>>,
}

/// The most rows [`Relay::failing`] remembers; past it, it starts over (rows sent meanwhile by another worker are
/// never settled here, so their entries would otherwise stay).
const FAILING_REMEMBERED: usize = 100_000;

impl Relay {
    /// The relay of `pipeline`'s outbox in `store`, leasing as `owner`; its Kafka records go to the brokers of
    /// `kafka`.
    ///
    /// Errors: a target's client or producer cannot be built (`[kafka] bootstrap_servers` missing, a property
    /// librdkafka refuses).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        pipeline: String,
        owner: String,
        spec: OutboxSpec,
        kafka: &crate::source::kafka::KafkaSettings,
        signals: Signals,
        metrics: OutboxMetrics,
        health: crate::http::Health,
        crash_after: Option<u64>,
    ) -> Result<Relay, String> {
        // A secret that cannot be read now could never be (an environment variable), or not yet (a file being
        // mounted): the pipeline does not start without it.
        let unreadable = spec.unreadable_secrets();
        if !unreadable.is_empty() {
            let said: Vec<String> = unreadable.iter().map(|(field, why)| format!("{field}: {why}")).collect();
            return Err(format!("the outbox's secrets cannot be used: {}", said.join("; ")));
        }
        for (field, warning) in spec.warnings() {
            tracing::warn!(pipeline = %pipeline, field, "{warning}");
        }
        let clients = spec.http.iter().map(deliver::client).collect::<Result<Vec<_>, _>>()?;
        if !spec.kafka.is_empty() && kafka.bootstrap_servers.trim().is_empty() {
            return Err("[[sink.kafka]] produces to the brokers of [kafka]: set [kafka] bootstrap_servers".to_owned());
        }
        #[cfg(feature = "kafka")]
        let producers = spec
            .kafka
            .iter()
            .map(|t| crate::source::kafka::outbox::OutboxProducer::new(kafka, &pipeline, &t.name, t.timeout).map_err(|e| format!("sink.kafka {}: {e}", t.name)))
            .collect::<Result<Vec<_>, _>>()?;
        let longest = spec.http.iter().map(|t| t.timeout).chain(spec.kafka.iter().map(|t| t.timeout + Duration::from_secs(1))).max().unwrap_or_default();
        let lease = spec.settings.lease.unwrap_or(longest + LEASE_MARGIN);
        for name in spec.http.iter().map(|t| &t.name).chain(spec.kafka.iter().map(|t| &t.name)) {
            metrics.target(name);
        }
        Ok(Relay {
            store,
            pipeline,
            owner,
            spec,
            clients,
            #[cfg(feature = "kafka")]
            producers,
            lease,
            signals,
            metrics,
            health,
            crash_after,
            confirmed: AtomicU64::new(0),
            unrecorded: Mutex::new(Vec::new()),
            failing: Mutex::new(HashMap::new()),
        })
    }

    /// Delivers until `shutdown`: round after round, each at once after the last while rows are due, otherwise at
    /// the next wake-up or `poll_interval`. Returns at the end of the round under way when shutdown is asked for;
    /// [`Relay::release`] then gives up what it still holds.
    pub async fn run(&self, shutdown: Shutdown) {
        tokio::join!(self.deliver_rounds(shutdown.clone()), self.measure_every(shutdown));
    }

    /// Rounds of deliveries until `shutdown`.
    async fn deliver_rounds(&self, mut shutdown: Shutdown) {
        let settings = self.spec.settings;
        while !shutdown.is_triggered() {
            let leased = match self.store.outbox_lease(&self.pipeline, &self.owner, settings.concurrency as i64, self.lease).await {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(pipeline = %self.pipeline, error = %e, "cannot lease outbox rows; trying again");
                    self.wait(&mut shutdown, settings.poll_interval).await;
                    continue;
                }
            };
            let mut pending = std::mem::take(&mut *self.unrecorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
            if leased.is_empty() && pending.is_empty() {
                self.wait(&mut shutdown, settings.poll_interval).await;
                continue;
            }
            let started = Instant::now();
            let confirmed_before: Vec<i64> =
                pending.iter().filter_map(|p| if let Settled::Confirmed(id) = p.settled { Some(id) } else { None }).collect();
            let to_send: Vec<&Leased> = leased.iter().filter(|r| !confirmed_before.contains(&r.id)).collect();
            let outcomes = futures_util::future::join_all(to_send.iter().map(|row| self.deliver(row))).await;
            let round: Vec<Pending> = to_send
                .iter()
                .zip(outcomes)
                .map(|(row, outcome)| Pending { target: row.request.target.clone(), attempts: row.attempts, settled: self.settle(row, outcome) })
                .collect();
            if started.elapsed() >= self.lease {
                tracing::warn!(pipeline = %self.pipeline, took = ?started.elapsed(), lease = ?self.lease,
                    "an outbox round outlasted its lease: another relay may have sent its rows again (with the same idempotency keys)");
            }
            // An earlier outcome of a row sent again now is stale.
            pending.retain(|p| !round.iter().any(|r| r.settled.id() == p.settled.id()));
            pending.extend(round);
            if let Some(moved) = self.record(&pending).await {
                self.recorded(&pending, &moved);
            } else {
                *self.unrecorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = pending;
            }
        }
    }

    /// Says what a recorded round dead-lettered (an outcome carried from an earlier round's failed record included):
    /// only the rows the store moved (`moved`); a failed row another relay held by then is left to it, not counted.
    fn recorded(&self, pending: &[Pending], moved: &[i64]) {
        for p in pending {
            if let Settled::Failed { id, error } = &p.settled {
                if !moved.contains(id) {
                    tracing::info!(pipeline = %self.pipeline, row = id, target = %p.target,
                        "outbox request not dead-lettered: another relay holds it now (its lease ran out), and it goes on there");
                    continue;
                }
                tracing::warn!(pipeline = %self.pipeline, row = id, target = %p.target, attempts = p.attempts, error = %error,
                    "outbox request dead-lettered (delivery_failed)");
                self.metrics.dead_lettered(&p.target);
            }
        }
    }

    /// Counts the rows waiting every [`MEASURE_EVERY`] until `shutdown`, whatever the rounds take.
    async fn measure_every(&self, mut shutdown: Shutdown) {
        while !shutdown.is_triggered() {
            self.measure().await;
            tokio::select! {
                () = tokio::time::sleep(MEASURE_EVERY) => {}
                () = shutdown.wait() => {}
            }
        }
    }

    /// Gives up this worker's leases (the relay stopped): another relay sends those rows at once. Outcomes whose
    /// record failed are recorded first (once, bounded), so that a row its target confirmed is not sent again.
    pub async fn release(&self) {
        let pending = std::mem::take(&mut *self.unrecorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        if !pending.is_empty() {
            let settled: Vec<Settled> = pending.iter().map(|p| p.settled.clone()).collect();
            match tokio::time::timeout(Duration::from_secs(5), self.store.outbox_settle(&self.pipeline, &self.owner, &settled)).await {
                Ok(Ok(moved)) => self.recorded(&pending, &moved),
                _ => tracing::warn!(pipeline = %self.pipeline, rows = pending.len(),
                    "cannot record the outbox's last outcomes: those rows are sent again (with the same idempotency keys)"),
            }
        }
        match tokio::time::timeout(Duration::from_secs(5), self.store.outbox_release(&self.pipeline, &self.owner)).await {
            Ok(Ok(n)) if n > 0 => tracing::info!(pipeline = %self.pipeline, rows = n, "outbox leases given up"),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(pipeline = %self.pipeline, error = %e, "cannot give up the outbox leases; they run out by themselves"),
            Err(_) => tracing::warn!(pipeline = %self.pipeline, "giving up the outbox leases timed out; they run out by themselves"),
        }
    }

    /// The longest time the relay may take to end its round once shutdown is asked for.
    pub fn round_bound(&self) -> Duration {
        self.lease
    }

    async fn wait(&self, shutdown: &mut Shutdown, poll: Duration) {
        tokio::select! {
            () = self.signals.inner.wake.notified() => {}
            () = tokio::time::sleep(poll) => {}
            () = shutdown.wait() => {}
        }
    }

    /// Counts the rows waiting and sets the back-pressure from them.
    async fn measure(&self) {
        let s = self.spec.settings;
        let depth = match self.store.outbox_depth(&self.pipeline, s.max_rows.saturating_mul(2).min(i64::MAX as u64) as i64 + 1).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(pipeline = %self.pipeline, error = %e, "cannot count the outbox's rows");
                return;
            }
        };
        self.metrics.depth(depth.rows, depth.oldest_seconds, depth.due_seconds);
        let over = if depth.rows as u64 > s.max_rows {
            Some(format!("the outbox holds {}{} rows, over [outbox] max_rows = {}", depth.rows, if depth.rows as u64 > 2 * s.max_rows { " or more" } else { "" }, s.max_rows))
        } else if depth.due_seconds > s.max_age.as_secs_f64() {
            Some(format!(
                "a row of the outbox due for sending has waited {:.0} s, over [outbox] max_age = {}",
                depth.due_seconds,
                humantime::format_duration(s.max_age)
            ))
        } else {
            None
        };
        let was = self.signals.paused().is_some();
        match (&over, was) {
            (Some(why), false) => tracing::warn!(pipeline = %self.pipeline, "consumption paused: {why}; it resumes when the relay catches up"),
            (None, true) => tracing::info!(pipeline = %self.pipeline, rows = depth.rows, "consumption resumed: the outbox is back within its bounds"),
            _ => {}
        }
        self.metrics.paused(over.is_some());
        self.health.outbox_paused(&self.pipeline, over.clone());
        self.signals.set(over);
    }

    fn target(&self, name: &str) -> Option<Target<'_>> {
        if let Some(i) = self.spec.http.iter().position(|t| t.name == name) {
            return Some(Target::Http(&self.spec.http[i], &self.clients[i]));
        }
        let i = self.spec.kafka.iter().position(|t| t.name == name)?;
        #[cfg(feature = "kafka")]
        return Some(Target::Kafka(&self.spec.kafka[i], &self.producers[i]));
        #[cfg(not(feature = "kafka"))]
        return Some(Target::Kafka(&self.spec.kafka[i]));
    }

    async fn deliver(&self, row: &Leased) -> Outcome {
        // Past its attempts without an outcome recorded (a worker that stopped or crashed mid-request each time):
        // never sent again, whatever made those attempts end.
        if row.attempts as u32 > self.target(&row.request.target).map_or(u32::MAX, |t| t.max_attempts()) {
            return Outcome::Rejected {
                error: format!("{} attempts leased and none recorded an answer (the worker stopped during each): not sent again", row.attempts - 1),
            };
        }
        let Some(target) = self.target(&row.request.target) else {
            return Outcome::Rejected {
                error: format!(
                    "its target {:?} is not among the pipeline's [[sink.http]] names any more (renamed or removed since the row was written): \
                     `idemflow dead-letters replay` sends it once the target is back",
                    row.request.target
                ),
            };
        };
        let started = Instant::now();
        let outcome = target.send(&row.request).await;
        if outcome == Outcome::Confirmed {
            self.metrics.confirmed(target.name(), row.age_seconds + started.elapsed().as_secs_f64());
            let n = self.confirmed.fetch_add(1, Ordering::Relaxed) + 1;
            if self.crash_after == Some(n) {
                eprintln!(
                    "injected crash ({CRASH_AFTER_DELIVERIES_VAR}): pipeline {} aborts the process after its target confirmed outbox row {}, before the outbox records it",
                    self.pipeline, row.id
                );
                std::process::abort();
            }
        }
        self.metrics.attempt(target.name(), outcome.result());
        outcome
    }

    /// What to record of one row's attempt.
    fn settle(&self, row: &Leased, outcome: Outcome) -> Settled {
        let max_attempts = self.target(&row.request.target).map_or(1, |t| t.max_attempts());
        let failed = |error: String| Settled::Failed { id: row.id, error };
        let retry = match outcome {
            Outcome::Retry { after, error, result } if (row.attempts as u32) < max_attempts => (after, error, result),
            outcome => {
                self.failing.lock().unwrap_or_else(PoisonError::into_inner).remove(&row.id);
                return match outcome {
                    Outcome::Confirmed => Settled::Confirmed(row.id),
                    Outcome::Rejected { error } => failed(error),
                    Outcome::Retry { error, .. } => failed(format!("{error} (the last of {} attempts)", row.attempts)),
                };
            }
        };
        let (after, error, result) = retry;
        let after = wait_before_retry(backoff(self.spec.settings.backoff, self.spec.settings.max_backoff, row.attempts), after);
        let (id, attempts) = (row.id, row.attempts);
        if !self.failure_changed(row.id, result) {
            tracing::debug!(pipeline = %self.pipeline, row = id, attempts, error = %error, retry_in = ?after, "outbox request failed again the same way; retrying");
        } else if result == AttemptResult::RetryStatus && row.attempts == 1 {
            tracing::info!(pipeline = %self.pipeline, row = id, attempts, error = %error, retry_in = ?after, "outbox request answered a retry status; retrying");
        } else {
            tracing::warn!(pipeline = %self.pipeline, row = id, attempts, error = %error, retry_in = ?after,
                "outbox request failed; retrying (said again when its failure changes; each attempt at debug level)");
        }
        Settled::Retry { id: row.id, after, error }
    }

    /// Whether row `id`'s failure is of another kind than its last one here (or its first): what is logged.
    fn failure_changed(&self, id: i64, result: AttemptResult) -> bool {
        let mut failing = self.failing.lock().unwrap_or_else(PoisonError::into_inner);
        if failing.len() >= FAILING_REMEMBERED {
            failing.clear();
        }
        failing.insert(id, result) != Some(result)
    }

    /// Records a round's outcomes, trying three times; the failed rows moved to the dead letters once they were
    /// recorded, `None` when they were not. Not recorded, the caller keeps them for the next round (a confirmed row
    /// is then not sent again by this relay; another relay may, after the lease, with the same idempotency key).
    async fn record(&self, pending: &[Pending]) -> Option<Vec<i64>> {
        let settled: Vec<Settled> = pending.iter().map(|p| p.settled.clone()).collect();
        for attempt in 0..3u32 {
            match self.store.outbox_settle(&self.pipeline, &self.owner, &settled).await {
                Ok(moved) => return Some(moved),
                Err(e) if attempt == 2 => {
                    tracing::error!(pipeline = %self.pipeline, error = %e, rows = settled.len(),
                        "cannot record the outbox's outcomes; kept to record with the next round (confirmed rows are not sent again by this worker)");
                }
                Err(e) => {
                    tracing::warn!(pipeline = %self.pipeline, error = %e, attempt = attempt + 1, "cannot record the outbox round's outcomes; trying again");
                    tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
                }
            }
        }
        None
    }
}

/// One row's outcome, with what its log line and metrics need.
struct Pending {
    target: String,
    attempts: i32,
    settled: Settled,
}

/// One target of the relay, with what sends to it.
enum Target<'a> {
    Http(&'a HttpTarget, &'a reqwest::Client),
    #[cfg(feature = "kafka")]
    Kafka(&'a KafkaTarget, &'a crate::source::kafka::outbox::OutboxProducer),
    #[cfg(not(feature = "kafka"))]
    Kafka(&'a KafkaTarget),
}

impl Target<'_> {
    fn name(&self) -> &str {
        match self {
            Target::Http(t, ..) => &t.name,
            Target::Kafka(t, ..) => &t.name,
        }
    }

    fn max_attempts(&self) -> u32 {
        match self {
            Target::Http(t, ..) => t.max_attempts,
            Target::Kafka(t, ..) => t.max_attempts,
        }
    }

    /// One attempt. A Kafka record's failure is the brokers' answer: a retryable code counts as a retry status, the
    /// producer's time-out as a time-out.
    async fn send(&self, request: &crate::store::rows::OutboxRequest) -> Outcome {
        match self {
            Target::Http(t, client) => deliver::send(client, t, request).await,
            #[cfg(feature = "kafka")]
            Target::Kafka(t, producer) => {
                use crate::source::kafka::outbox::ProduceError;
                // A topic from a record's values is still one of allow_topics, a fixed topic still the row's (a row of
                // an older configuration goes nowhere with today's headers; a replay re-homes it).
                if t.topics.as_ref().is_some_and(|rule| !rule.allows(&request.url)) {
                    return Outcome::Rejected { error: format!("producing to {}: not one of allow_topics", request.url) };
                }
                if let Some(topic) = t.topic.literal().filter(|topic| *topic != request.url) {
                    return Outcome::Rejected {
                        error: format!(
                            "producing to {}: written for that topic, and the target now produces to {topic}: not sent with today's headers; `idemflow dead-letters replay` re-homes it",
                            request.url
                        ),
                    };
                }
                if let Err(error) = super::render::fits(&t.value, &request.body) {
                    return Outcome::Rejected { error: format!("producing to {}: {error}", request.url) };
                }
                // The target's headers without placeholders and its secrets, as configured now, then the row's.
                let mut headers: Vec<(String, String)> = t.headers.iter().filter_map(|(n, a)| a.literal().map(|v| (n.clone(), v))).collect();
                for (name, secret) in &t.secret_headers {
                    match secret.resolve() {
                        Ok(v) => headers.push((name.clone(), v)),
                        Err(why) => return Outcome::Retry { after: None, error: format!("header {name}: {why}"), result: AttemptResult::Connection },
                    }
                }
                headers.extend(request.headers.iter().cloned());
                let value = match super::render::with_secrets(&t.value, &request.body) {
                    Ok(v) => v,
                    Err(error) => return Outcome::Retry { after: None, error, result: AttemptResult::Connection },
                };
                match producer.produce(&request.url, request.key.as_deref(), &headers, &value).await {
                    Ok(()) => Outcome::Confirmed,
                    Err(ProduceError::Rejected(error)) => Outcome::Rejected { error: format!("producing to {}: {error}", request.url) },
                    Err(ProduceError::Retry(error)) => {
                        Outcome::Retry { after: None, error: format!("producing to {}: {error}", request.url), result: AttemptResult::RetryStatus }
                    }
                    Err(ProduceError::TimedOut(error)) => {
                        Outcome::Retry { after: None, error: format!("producing to {}: {error}", request.url), result: AttemptResult::Timeout }
                    }
                }
            }
            #[cfg(not(feature = "kafka"))]
            Target::Kafka(t) => Outcome::Rejected { error: format!("{}: {}", t.name, crate::store::not_built("Kafka", "kafka")) },
        }
    }
}

/// The wait before the next attempt: the schedule's ([`backoff`]), lengthened by the target's `Retry-After`
/// (`retry_after`, already bounded by [`super::spec::MAX_RETRY_AFTER`]) but never shortened by it. A provider that
/// answers `Retry-After: 2` through a long outage would otherwise spend a row's `max_attempts` in seconds and
/// dead-letter it minutes into the outage; the doubling schedule is what bounds the attempts in time.
pub fn wait_before_retry(schedule: Duration, retry_after: Option<Duration>) -> Duration {
    retry_after.map_or(schedule, |asked| asked.max(schedule))
}

/// The wait before attempt `attempts + 1`: `first` doubled for each attempt after the first, at most `max`.
pub fn backoff(first: Duration, max: Duration, attempts: i32) -> Duration {
    let doublings = attempts.saturating_sub(1).clamp(0, 30) as u32;
    first.saturating_mul(1u32 << doublings).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Retry-After` lengthens the schedule's wait, never shortens it.
    #[test]
    fn retry_after_lengthens_the_wait_but_never_shortens_it() {
        let schedule = backoff(Duration::from_secs(1), Duration::from_secs(300), 6);
        assert_eq!(schedule, Duration::from_secs(32));
        assert_eq!(wait_before_retry(schedule, Some(Duration::from_secs(2))), schedule, "a short Retry-After through an outage");
        assert_eq!(wait_before_retry(schedule, Some(Duration::from_secs(600))), Duration::from_secs(600));
        assert_eq!(wait_before_retry(schedule, None), schedule);
        assert_eq!(wait_before_retry(Duration::from_secs(1), Some(Duration::ZERO)), Duration::from_secs(1), "a date in the past");
    }

    #[test]
    fn backoff_doubles_up_to_its_bound() {
        let (first, max) = (Duration::from_secs(1), Duration::from_secs(60));
        let waits: Vec<u64> = (1..=8).map(|a| backoff(first, max, a).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(backoff(first, max, 1000), max);
    }
}
