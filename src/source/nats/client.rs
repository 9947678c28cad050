//! The JetStream client's side of the connector: connecting with the `[nats]` settings, the consumer idemflow
//! creates and the checks an existing one must pass ([`verify_consumer`], [`creation_refusal`]), pull requests, and
//! the server's answers told apart by their error codes.

use super::spec::{add_command, NatsSettings, NatsSpec};
use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, consumer::IntoConsumerConfig};
use std::time::Duration;

/// The durable pull consumer idemflow creates when `spec.consumer` does not exist: explicit acks, the spec's
/// `ack_wait` and `max_ack_pending`, no delivery limit (a message is never dropped by the server for its
/// redeliveries), from the stream's first message.
pub fn consumer_config(spec: &NatsSpec) -> pull::Config {
    let (filter_subject, filter_subjects) = match spec.filter_subjects.as_slice() {
        [one] => (one.clone(), Vec::new()),
        many => (String::new(), many.to_vec()),
    };
    pull::Config {
        durable_name: Some(spec.consumer.clone()),
        description: Some("idemflow: exactly-once effects, acknowledged after the store's COMMIT".to_owned()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: spec.ack_wait,
        max_ack_pending: spec.max_ack_pending,
        max_deliver: -1,
        filter_subject,
        filter_subjects,
        ..Default::default()
    }
}

/// What a consumer's settings must be for the guarantee, as `check` and `run` verify them (`batch`: the pipeline's
/// `max_records` and `max_wait`):
///
/// - a pull consumer (no deliver subject) with explicit acks: with `none` the server forgets a delivery when it
///   sends it; with `all`, one worker's ack would acknowledge what another still holds;
/// - every message delivered whole (`headers_only` off);
/// - no delivery limit (`max_deliver` -1): the server drops a message delivered that many times and only publishes
///   an advisory, so a crash loop would lose it (a `backoff` list needs a limit, so it is refused with it);
/// - an `ack_wait` above `max_wait`, or deliveries would expire while their batch is still being cut;
/// - a bounded `max_ack_pending` (the memory a worker may hold) of at least `max_records`, or no batch could fill;
/// - when the pipeline names filter subjects, exactly those.
///
/// Errors: the first setting that cannot work, as a sentence naming the consumer and the way to change it.
pub fn verify_consumer(config: &async_nats::jetstream::consumer::Config, spec: &NatsSpec, batch: (usize, Duration)) -> Result<(), String> {
    let (max_records, max_wait) = batch;
    let name = &spec.consumer;
    let edit = "(change it with `nats consumer edit`, or name another consumer in [source] consumer)";
    let other = "(a consumer's type and ack policy cannot be changed: create another one and name it in [source] consumer)";
    if config.deliver_subject.is_some() {
        return Err(format!("consumer {name:?} is a push consumer (it has a deliver subject): idemflow needs a pull consumer {other}"));
    }
    if config.ack_policy != AckPolicy::Explicit {
        return Err(format!(
            "consumer {name:?} has ack_policy {:?}: idemflow needs explicit acks (with `none` the server forgets a delivery \
             when it sends it; with `all` one worker's ack would acknowledge what another still holds) {other}",
            config.ack_policy
        ));
    }
    if config.headers_only {
        return Err(format!("consumer {name:?} delivers headers only: idemflow needs every message's payload {edit}"));
    }
    if config.max_deliver > 0 {
        return Err(format!(
            "consumer {name:?} has max_deliver {}: the consumer stops delivering a message after that many attempts (a crash \
             loop, a worker killed mid-batch again and again) and only reports it in an advisory, so the message would \
             never be applied; set max_deliver = -1 {edit}",
            config.max_deliver
        ));
    }
    if config.ack_wait <= max_wait {
        return Err(format!(
            "consumer {name:?} has ack_wait {:?}, not above batch.max_wait = {max_wait:?}: its deliveries would be redelivered \
             while their batch is still being cut {edit}",
            config.ack_wait
        ));
    }
    if config.max_ack_pending < 0 {
        return Err(format!(
            "consumer {name:?} has no max_ack_pending limit (-1): the server would send without bound while a batch waits \
             for the database; set it to at least batch.max_records = {max_records} {edit}"
        ));
    }
    if (config.max_ack_pending as usize) < max_records {
        return Err(format!(
            "consumer {name:?} has max_ack_pending {}, below batch.max_records = {max_records}: no batch could fill, every \
             one would wait batch.max_wait {edit}",
            config.max_ack_pending
        ));
    }
    if !spec.filter_subjects.is_empty() {
        let mut has: Vec<String> = config.filter_subjects.clone();
        if !config.filter_subject.is_empty() {
            has.push(config.filter_subject.clone());
        }
        let (mut want, mut got) = (spec.filter_subjects.clone(), has);
        want.sort();
        got.sort();
        if want != got {
            return Err(format!("consumer {name:?} filters {got:?}, not [source] filter_subjects = {want:?} {edit}"));
        }
    }
    Ok(())
}

/// Why idemflow must not create `spec`'s consumer on `stream` itself, if it must not: the consumer it would create
/// fails [`verify_consumer`]; several filter subjects on a server older than 2.10 (`version`), which would ignore
/// them; or a stream holding messages older than `[dedup] retention`. A created consumer starts at the stream's
/// first message: messages older than the retention may have had their dedup rows purged (or were applied before
/// idemflow), and would be applied again. Then the user creates the consumer, with the start they mean.
pub fn creation_refusal(
    stream: &async_nats::jetstream::stream::Info,
    spec: &NatsSpec,
    batch: (usize, Duration),
    retention: Duration,
    version: &str,
) -> Option<String> {
    let create = format!("create the consumer yourself ({}) and run again", add_command(spec, batch.0, &spec.consumer));
    if let Err(why) = verify_consumer(&consumer_config(spec).into_consumer_config(), spec, batch) {
        return Some(format!("the consumer idemflow would create cannot work: {why}"));
    }
    if spec.filter_subjects.len() > 1 && !at_least_2_10(version) {
        return Some(format!(
            "[source] filter_subjects names {} subjects: a consumer with several filter subjects needs nats-server 2.10 or \
             later (this server is {version}); name one subject, or a wildcard",
            spec.filter_subjects.len()
        ));
    }
    let oldest = stream.state.first_timestamp.unix_timestamp();
    let now = jiff::Timestamp::now().as_second();
    let age = Duration::from_secs(u64::try_from(now - oldest).unwrap_or(0));
    if stream.state.messages > 0 && age > retention {
        return Some(format!(
            "consumer {:?} does not exist, and stream {:?} holds messages from {} ago, older than [dedup] retention = {}: a \
             consumer idemflow creates starts at the stream's first message, and a message older than the retention may have \
             had its dedup row purged (or been applied before idemflow) and would be applied again; {create}",
            spec.consumer,
            spec.stream,
            crate::terminal::duration(Duration::from_secs(age.as_secs())),
            crate::terminal::duration(retention)
        ));
    }
    None
}

/// Whether a server `version` (`2.9.10`) is 2.10 or later.
pub(super) fn at_least_2_10(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (2, 10)
}

/// The pull requests the worker sends a consumer: at most `max_records` messages (and the consumer's `max_batch`),
/// expiring after 30 s (or the consumer's `max_expires`, if shorter), so the server never refuses them.
pub(super) fn pull_request(config: &async_nats::jetstream::consumer::Config, max_records: usize) -> (usize, Duration) {
    let mut batch = max_records.max(1);
    if config.max_batch > 0 {
        batch = batch.min(config.max_batch as usize);
    }
    let mut expires = Duration::from_secs(30);
    if !config.max_expires.is_zero() {
        expires = expires.min(config.max_expires);
    }
    (batch, expires.max(Duration::from_secs(1)))
}

/// Whether a consumer lookup's error says the consumer does not exist: JetStream's error code 10014
/// (`CONSUMER_NOT_FOUND`), as the client classifies it; never the words of the answer.
pub(super) fn not_found(e: &jetstream::context::ConsumerInfoError) -> bool {
    matches!(e.kind(), jetstream::context::ConsumerInfoErrorKind::NotFound)
}

/// A stream lookup's error as a sentence, decided by JetStream's error codes and the client's error kinds (never by
/// the words of the answer): a missing stream (10059, `STREAM_NOT_FOUND`), JetStream not enabled (10076, 10039, or
/// no responder to the JetStream API), or the server's answer. `scrub` takes any credential out of the text.
pub(super) fn stream_error(stream: &str, e: &jetstream::context::GetStreamError, scrub: impl Fn(&str) -> String) -> String {
    use jetstream::context::{GetStreamErrorKind, RequestError, RequestErrorKind};
    use jetstream::ErrorCode;
    let text = scrub(&e.to_string());
    let no_responders = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<RequestError>())
        .is_some_and(|r| r.kind() == RequestErrorKind::NoResponders);
    let code = match e.kind() {
        GetStreamErrorKind::JetStream(j) => Some(j.error_code()),
        _ => None,
    };
    if code == Some(ErrorCode::STREAM_NOT_FOUND) {
        format!(
            "stream {stream:?} does not exist: create it first (`nats stream add`, or see docs/nats.md); idemflow consumes \
             streams, it does not create them"
        )
    } else if no_responders || code.is_some_and(|c| c == ErrorCode::JETSTREAM_NOT_ENABLED || c == ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT) {
        format!("JetStream is not enabled on the server (or for this account): nothing answered the JetStream API ({text}); start nats-server with -js (or enable JetStream for the account)")
    } else {
        format!("reading stream {stream:?}: {text}")
    }
}

/// A JetStream context on `client` whose API requests wait at most `request_timeout`.
pub(super) fn context(settings: &NatsSettings, client: async_nats::Client) -> jetstream::Context {
    let mut js = jetstream::new(client);
    js.set_timeout(settings.request_timeout);
    js
}

/// Connects with `[nats]`'s credentials and TLS settings, as `name` (shown by the server's monitoring).
///
/// Errors: the problem as text, with the URL's credentials masked.
pub async fn connect(settings: &NatsSettings, name: &str) -> Result<async_nats::Client, String> {
    crate::install_tls_provider();
    let scrub = |e: &dyn std::fmt::Display| settings.url.scrub(&e.to_string());
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(settings.connect_timeout)
        .request_timeout(Some(settings.request_timeout))
        .event_callback({
            // The first connection is not news (`check` would print it); one after a loss is.
            let lost = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            move |event| {
                let lost = lost.clone();
                async move {
                    use std::sync::atomic::Ordering;
                    match event {
                        async_nats::Event::Disconnected => {
                            lost.store(true, Ordering::SeqCst);
                            tracing::warn!("NATS connection lost; the client reconnects")
                        }
                        async_nats::Event::Connected if lost.swap(false, Ordering::SeqCst) => tracing::info!("NATS connection re-established"),
                        async_nats::Event::Connected => tracing::debug!("NATS connection established"),
                        other => tracing::debug!(event = %other, "NATS client event"),
                    }
                }
            }
        });
    match (&settings.user, &settings.password) {
        (Some(user), Some(password)) => options = options.user_and_password(user.clone(), password.expose().to_owned()),
        (None, None) => {}
        _ => return Err("[nats] user and password go together".to_owned()),
    }
    if let Some(token) = &settings.token {
        options = options.token(token.expose().to_owned());
    }
    if let Some(seed) = &settings.nkey_seed {
        options = options.nkey(seed.expose().to_owned());
    }
    if let Some(path) = &settings.credentials_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| format!("[nats] credentials_file = {:?}: cannot read it: {e}", path.display()))?;
    }
    if let Some(ca) = &settings.tls_ca_file {
        if !ca.is_file() {
            return Err(format!("[nats] tls_ca_file = {:?}: no such file", ca.display()));
        }
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    match (&settings.tls_cert_file, &settings.tls_key_file) {
        (Some(cert), Some(key)) => options = options.add_client_certificate(cert.clone(), key.clone()).require_tls(true),
        (None, None) => {}
        _ => return Err("[nats] tls_cert_file and tls_key_file go together".to_owned()),
    }
    let servers: Vec<async_nats::ServerAddr> = settings
        .url
        .expose()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<async_nats::ServerAddr>().map_err(|e| format!("[nats] url {}: {}", settings.url, scrub(&e))))
        .collect::<Result<_, _>>()?;
    if servers.is_empty() {
        return Err("[nats] url names no server".to_owned());
    }
    // The client does not read credentials from a server URL itself: the first URL's user and password (or its
    // token, `nats://TOKEN@host`) are the connection's, unless the settings give a user.
    if settings.user.is_none() {
        if let Some(addr) = servers.iter().find(|a| a.has_user_pass()) {
            let decode = |text: &str| {
                let text = text.replace('+', "%2B");
                url::form_urlencoded::parse(format!("v={text}").as_bytes()).next().map(|(_, v)| v.into_owned()).unwrap_or_default()
            };
            let user = decode(addr.username().unwrap_or_default());
            options = match addr.password() {
                Some(password) => options.user_and_password(user, decode(password)),
                // `nats://TOKEN@host`: NATS's form of a token in a URL.
                None => options.token(user),
            };
        }
    }
    match tokio::time::timeout(settings.connect_timeout + Duration::from_secs(1), options.connect(servers)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("connecting to {}: {}", settings.url, scrub(&e))),
        Err(_) => Err(format!("connecting to {}: no answer within {:?}", settings.url, settings.connect_timeout)),
    }
}
