//! Kafka topic ids (KIP-516, brokers from Kafka 2.8): the identity of a topic beyond its name. A topic deleted and
//! created again under the same name gets another id, so the processed marks, which remember the id they were raised
//! on ([`crate::offsets::Mark::log`]), tell its records from the old topic's without trusting record timestamps.
//!
//! Asked of the cluster with the Admin API's DescribeTopics (librdkafka's `rd_kafka_DescribeTopics`, a Metadata
//! request of version 12; rust-rdkafka does not wrap it), on the consumer's own client, sent to the broker that
//! answers a metadata request for the topics (librdkafka would send it to the controller, which some clusters do not
//! name to clients: its mock cluster), and kept for [`FRESH_FOR`]: a batch's id is at most that old. A broker that
//! gives no id (before 2.8: the all-zero UUID, or an older Metadata version) gives `None`; one that does not answer
//! within [`DESCRIBE_TIMEOUT`] is asked again after [`RETRY_AFTER`], the ids known before kept meanwhile. Without an
//! id the marks are judged on where the log ends ([`crate::offsets::Processed::renewals`]).

use rdkafka::bindings as rd;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a topic id asked of the cluster is used before it is asked again.
pub const FRESH_FOR: Duration = Duration::from_secs(5);
/// The longest wait for each of the cluster's two answers (the metadata that names a broker, then DescribeTopics).
pub const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(2);
/// After a lookup that failed, how long the ids known are used before the cluster is asked again (a cluster that does
/// not answer holds up a batch at most once per this).
pub const RETRY_AFTER: Duration = Duration::from_secs(30);
/// Kafka's all-zero topic id (`Uuid.ZERO_UUID`), which brokers without topic ids answer, in base64.
const ZERO: &str = "AAAAAAAAAAAAAAAAAAAAAA";

/// The topic ids a source last asked for, with when.
#[derive(Default)]
pub struct TopicIds {
    known: Mutex<HashMap<String, (Option<Arc<str>>, Instant)>>,
    /// When a lookup last failed.
    failed_at: Mutex<Option<Instant>>,
}

impl TopicIds {
    /// The id of each of `topics` (base64, as Kafka's tools print it), asked of the cluster through `client` where
    /// the one known is older than [`FRESH_FOR`] (and no lookup failed in the last [`RETRY_AFTER`]). Blocks for at
    /// most twice [`DESCRIBE_TIMEOUT`]; on a failure the ids known before are kept (logged at debug), `None` where
    /// none is.
    pub fn of<C: rdkafka::ClientContext>(&self, client: &rdkafka::client::Client<C>, topics: &[&str]) -> HashMap<String, Option<Arc<str>>> {
        let now = Instant::now();
        let stale: Vec<&str> = {
            let known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
            topics.iter().copied().filter(|t| known.get(*t).is_none_or(|(_, at)| now.duration_since(*at) >= FRESH_FOR)).collect()
        };
        let resting = self.failed_at.lock().unwrap_or_else(PoisonError::into_inner).is_some_and(|at| now.duration_since(at) < RETRY_AFTER);
        if !stale.is_empty() && !resting {
            let asked = tokio::task::block_in_place(|| {
                let answering = client.fetch_metadata(Some(stale[0]), DESCRIBE_TIMEOUT).map_err(|e| e.to_string())?.orig_broker_id();
                describe(client.native_client(), answering, &stale, DESCRIBE_TIMEOUT)
            });
            *self.failed_at.lock().unwrap_or_else(PoisonError::into_inner) = asked.is_err().then_some(now);
            match asked {
                Ok(ids) => {
                    let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
                    for (topic, id) in ids {
                        known.insert(topic, (id, now));
                    }
                }
                Err(e) => tracing::debug!(error = %e, topics = ?stale, "the cluster did not give the topics' ids"),
            }
        }
        let known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        topics.iter().map(|t| (t.to_string(), known.get(*t).and_then(|(id, _)| id.clone()))).collect()
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

/// DescribeTopics of `topics` on `client`, sent to `broker`: each topic the answer names, with its id (`None`: the broker gave the
/// zero id, or an error for that topic).
///
/// Errors: the request could not be made, timed out, or failed as a whole.
fn describe(client: &rdkafka::client::NativeClient, broker: i32, topics: &[&str], timeout: Duration) -> Result<Vec<(String, Option<Arc<str>>)>, String> {
    let names: Vec<CString> = topics.iter().map(|t| CString::new(*t).map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    let mut pointers: Vec<*const std::os::raw::c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let rk = client.ptr();
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: every pointer passed is either one librdkafka returned (kept alive by `Owned` until after its last
    // use) or into `names`/`pointers`, which outlive the calls; librdkafka copies the topic names it is given.
    unsafe {
        let collection = Owned(rd::rd_kafka_TopicCollection_of_topic_names(pointers.as_mut_ptr(), pointers.len()), rd::rd_kafka_TopicCollection_destroy);
        let options = Owned(rd::rd_kafka_AdminOptions_new(rk, rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS), rd::rd_kafka_AdminOptions_destroy);
        let mut errstr = [0 as std::os::raw::c_char; 256];
        rd::rd_kafka_AdminOptions_set_request_timeout(options.0, timeout_ms, errstr.as_mut_ptr(), errstr.len());
        if rd::rd_kafka_AdminOptions_set_broker(options.0, broker, errstr.as_mut_ptr(), errstr.len()) != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
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
