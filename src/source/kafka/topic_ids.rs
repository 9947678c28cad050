//! Kafka topic ids (KIP-516, brokers from Kafka 2.8): the identity of a topic beyond its name. A topic deleted and
//! created again under the same name gets another id, so the processed marks, which remember the id they were raised
//! on ([`crate::offsets::Mark::log`]), tell its records from the old topic's without trusting record timestamps.
//!
//! Asked of the cluster with the Admin API's DescribeTopics (librdkafka's `rd_kafka_DescribeTopics`, a Metadata
//! request of version 12; rust-rdkafka does not wrap it), off the batch path: a thread of the source's own, on a
//! client of its own (no group), asks for the topics it watches every [`FRESH_FOR`], and the batches read what it
//! last learnt. The request goes to the broker that answers a metadata request for the topics (librdkafka would send
//! it to the controller, which some clusters do not name to clients: its mock cluster). Each answer waits at most
//! [`DESCRIBE_TIMEOUT`]; after a lookup that failed the ids known are kept and the cluster is asked again after
//! [`RETRY_AFTER`], and [`KNOWN_FOR`] after the last answer none is known any more. A broker that gives no id (before 2.8: the all-zero UUID) gives `None`, and the marks are then
//! judged on where the log ends ([`crate::offsets::Processed::renewals`]).
//!
//! So an id is at most [`FRESH_FOR`] (plus a lookup) old when a batch is judged on it. The one wait on the batch
//! path is a topic's first: [`TopicIds::ids`] waits at most [`FIRST_WAIT`] for the first lookup to cover it.

use rdkafka::bindings as rd;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::ffi::{CStr, CString};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How often the ids of the watched topics are asked again.
pub const FRESH_FOR: Duration = Duration::from_secs(10);
/// The longest wait for each of the cluster's two answers (the metadata that names a broker, then DescribeTopics).
pub const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(2);
/// After a lookup that failed, how long the ids known are used before the cluster is asked again.
pub const RETRY_AFTER: Duration = Duration::from_secs(30);
/// The longest a batch waits for the first lookup of its topic (both answers, and a margin).
pub const FIRST_WAIT: Duration = Duration::from_secs(5);
/// How long ids are used after the last lookup that answered: past it (the cluster has not answered for this long),
/// none is known, and the marks are judged on where the log ends alone, never on an id that may be stale.
pub const KNOWN_FOR: Duration = Duration::from_secs(60);
/// Kafka's all-zero topic id (`Uuid.ZERO_UUID`), which brokers without topic ids answer, in base64.
const ZERO: &str = "AAAAAAAAAAAAAAAAAAAAAA";

/// The topic ids of a source's topics, kept fresh by a thread of their own.
pub struct TopicIds {
    shared: Arc<Shared>,
    /// Whether a thread asks the cluster (its client could be created).
    asking: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// The topics whose ids are kept fresh.
    watched: BTreeSet<String>,
    /// Each topic's id from the last lookup that answered (`None`: the cluster gives none).
    known: HashMap<String, Option<Arc<str>>>,
    /// The topics a lookup has covered, answered or not: a batch of them does not wait.
    asked: HashSet<String>,
    /// When a lookup last answered.
    answered_at: Option<Instant>,
    /// A lookup is wanted now (a topic not asked yet).
    wanted: bool,
    /// The source is gone: the thread ends.
    stop: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl TopicIds {
    /// Starts asking the cluster for the ids of `topics` (regular expressions, `^...`, are left out until a batch
    /// names the topics they match), on a client made of `config` without its `group.id`. A client librdkafka
    /// refuses is logged, and the ids are then never known (the marks are judged on where the log ends).
    pub fn start(mut config: ClientConfig, pipeline: &str, topics: &[String]) -> Self {
        let shared = Arc::new(Shared::default());
        shared.lock().watched.extend(topics.iter().filter(|t| !t.starts_with('^')).cloned());
        config.remove("group.id");
        let client: BaseConsumer = match config.create().map_err(super::client::hide_config_value) {
            Ok(client) => client,
            Err(e) => {
                tracing::warn!(pipeline, error = %e, "no client to ask the cluster for topic ids; a topic deleted and created \
                    again is told only by its log ending below the processed marks");
                return TopicIds { shared, asking: false };
            }
        };
        let (thread_shared, pipeline) = (shared.clone(), pipeline.to_owned());
        let spawned = std::thread::Builder::new()
            .name(format!("topic-ids-{pipeline}"))
            .spawn(move || keep_fresh(&thread_shared, &client, &pipeline));
        TopicIds { shared, asking: spawned.is_ok() }
    }

    /// The id of each of `topics` as last learnt (`None`: not known). Each is watched from now on; one that no lookup
    /// has covered yet is asked for at once, waiting at most [`FIRST_WAIT`] (blocking the calling thread: call it
    /// where a short wait is fine, never in a librdkafka callback).
    pub fn ids(&self, topics: &[&str]) -> HashMap<String, Option<Arc<str>>> {
        let mut state = self.shared.lock();
        let new: Vec<&str> = topics.iter().copied().filter(|t| !state.asked.contains(*t)).collect();
        if !new.is_empty() {
            state.watched.extend(new.iter().map(|t| t.to_string()));
            if !self.asking {
                state.asked.extend(new.iter().map(|t| t.to_string()));
            } else {
                state.wanted = true;
                self.shared.changed.notify_all();
                let wait = |state| {
                    let covered = |s: &mut State| s.stop || new.iter().all(|t| s.asked.contains(*t));
                    self.shared.changed.wait_timeout_while(state, FIRST_WAIT, |s| !covered(s)).unwrap_or_else(PoisonError::into_inner).0
                };
                state = blocking(|| wait(state));
            }
        }
        pick(&state, topics)
    }
}

impl Drop for TopicIds {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
    }
}

fn pick(state: &State, topics: &[&str]) -> HashMap<String, Option<Arc<str>>> {
    let fresh = state.answered_at.is_some_and(|at| at.elapsed() < KNOWN_FOR);
    topics.iter().map(|t| (t.to_string(), state.known.get(*t).cloned().flatten().filter(|_| fresh))).collect()
}

/// Runs `f` where it may block: through `block_in_place` on a multi-threaded tokio runtime, as it is elsewhere.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The thread's loop: a lookup of every watched topic when one is wanted, or [`FRESH_FOR`] after the last that
/// answered ([`RETRY_AFTER`] after one that failed), until the source is gone.
fn keep_fresh(shared: &Shared, client: &BaseConsumer, pipeline: &str) {
    let (mut last, mut failing) = (None::<Instant>, false);
    loop {
        let topics: Vec<String> = {
            let mut state = shared.lock();
            loop {
                if state.stop {
                    return;
                }
                let every = if failing { RETRY_AFTER } else { FRESH_FOR };
                let wait = last.map_or(Duration::ZERO, |at| every.saturating_sub(at.elapsed()));
                if !state.watched.is_empty() && (state.wanted || wait.is_zero()) {
                    break;
                }
                let wait = if state.watched.is_empty() { FRESH_FOR } else { wait };
                state = shared.changed.wait_timeout(state, wait).unwrap_or_else(PoisonError::into_inner).0;
            }
            state.wanted = false;
            state.watched.iter().cloned().collect()
        };
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        let asked = client
            .fetch_metadata(Some(names[0]), DESCRIBE_TIMEOUT)
            .map_err(|e| e.to_string())
            .and_then(|metadata| {
                // The broker that answered, by its id; a bootstrap broker's is not known yet (-1), so then the first
                // broker the answer names.
                let broker = Some(metadata.orig_broker_id()).filter(|id| *id >= 0).or_else(|| metadata.brokers().first().map(|b| b.id()));
                let broker = broker.ok_or("the cluster's metadata names no broker")?;
                describe(client.client().native_client(), broker, &names, DESCRIBE_TIMEOUT)
            });
        // The client's own events (errors about its brokers) are served here; it has no other poller.
        let _ = client.poll(Duration::ZERO);
        let mut state = shared.lock();
        match asked {
            Ok(ids) => {
                let ids: HashMap<String, Option<Arc<str>>> = ids.into_iter().collect();
                for topic in &topics {
                    let id = ids.get(topic).cloned().flatten();
                    if let Some(Some(was)) = state.known.get(topic).filter(|was| **was != id) {
                        tracing::info!(pipeline, topic, was = %was, now = ?id, "the topic's id changed: it was deleted and created again");
                    }
                    state.known.insert(topic.clone(), id);
                }
                failing = false;
                state.answered_at = Some(Instant::now());
            }
            Err(e) => {
                if !failing {
                    tracing::info!(pipeline, error = %e, topics = ?topics, retry_in = ?RETRY_AFTER,
                        "the cluster did not give the topics' ids; the ids known are kept meanwhile");
                }
                failing = true;
            }
        }
        state.asked.extend(topics);
        last = Some(Instant::now());
        drop(state);
        shared.changed.notify_all();
    }
}

/// Frees a librdkafka object on every way out.
struct Owned<T>(*mut T, unsafe extern "C" fn(*mut T));

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the pointer came from the librdkafka constructor paired with this destructor, and is freed once.
            unsafe { (self.1)(self.0) }
        }
    }
}

/// DescribeTopics of `topics` on `client`, sent to `broker`: each topic the answer names, with its id (`None`: the
/// broker gave the zero id, or an error for that topic).
///
/// Errors: the request could not be made, timed out, or failed as a whole.
fn describe(
    client: &rdkafka::client::NativeClient,
    broker: i32,
    topics: &[&str],
    timeout: Duration,
) -> Result<Vec<(String, Option<Arc<str>>)>, String> {
    let names: Vec<CString> = topics.iter().map(|t| CString::new(*t).map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    let mut pointers: Vec<*const std::os::raw::c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let rk = client.ptr();
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: every pointer passed is either one librdkafka returned (kept alive by `Owned` until after its last
    // use) or into `names`/`pointers`, which outlive the calls; librdkafka copies the topic names it is given.
    unsafe {
        let collection =
            Owned(rd::rd_kafka_TopicCollection_of_topic_names(pointers.as_mut_ptr(), pointers.len()), rd::rd_kafka_TopicCollection_destroy);
        let options =
            Owned(rd::rd_kafka_AdminOptions_new(rk, rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS), rd::rd_kafka_AdminOptions_destroy);
        let mut errstr = [0 as std::os::raw::c_char; 256];
        rd::rd_kafka_AdminOptions_set_request_timeout(options.0, timeout_ms, errstr.as_mut_ptr(), errstr.len());
        if rd::rd_kafka_AdminOptions_set_broker(options.0, broker, errstr.as_mut_ptr(), errstr.len())
            != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        {
            return Err(text(errstr.as_ptr()));
        }
        let queue = Owned(rd::rd_kafka_queue_new(rk), rd::rd_kafka_queue_destroy);
        rd::rd_kafka_DescribeTopics(rk, collection.0, options.0, queue.0);
        let event = Owned(rd::rd_kafka_queue_poll(queue.0, timeout_ms.saturating_add(500)), rd::rd_kafka_event_destroy);
        if event.0.is_null() {
            return Err(format!("no answer within {timeout:?}"));
        }
        let err = rd::rd_kafka_event_error(event.0);
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err(text(rd::rd_kafka_event_error_string(event.0)));
        }
        let result = rd::rd_kafka_event_DescribeTopics_result(event.0);
        if result.is_null() {
            return Err("an answer of another kind".into());
        }
        let mut count = 0usize;
        let descriptions = rd::rd_kafka_DescribeTopics_result_topics(result, &mut count);
        let mut out = Vec::with_capacity(count);
        for i in 0..count {
            let d = *descriptions.add(i);
            let name = text(rd::rd_kafka_TopicDescription_name(d));
            let failed = rd::rd_kafka_TopicDescription_error(d);
            let ok = failed.is_null() || rd::rd_kafka_error_code(failed) == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR;
            let id = rd::rd_kafka_TopicDescription_topic_id(d);
            let id = if ok && !id.is_null() { Some(text(rd::rd_kafka_Uuid_base64str(id))) } else { None };
            out.push((name, id.filter(|id| !id.is_empty() && id != ZERO).map(Arc::from)));
        }
        Ok(out)
    }
}

/// A C string librdkafka owns, copied (empty for a null pointer).
///
/// # Safety
/// `s` is null or points to a NUL-terminated string valid for the call.
unsafe fn text(s: *const std::os::raw::c_char) -> String {
    if s.is_null() { String::new() } else { unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned() }
}
