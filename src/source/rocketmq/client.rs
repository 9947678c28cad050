//! The RocketMQ client's runtime, its ACL signing, and the admin client `check` and `rewind` ask with.

use super::spec::RocketMqSettings;
use rocketmq_client_rust::{
    AclClientRPCHook, ClientRuntime, ClientRuntimeConfig, SessionCredentials, TelemetryHandle,
};
use std::sync::Arc;

/// How long closing the consumer, then the client's runtime, may each take at shutdown before they are left to
/// stop in the background. Nothing of the guarantee waits on them: each batch's consume offsets were sent to the
/// broker after its commit (the consumer's `commit`). The client's own shutdown has been seen to
/// wait 5 s per task after a failed rebalance sync ("lite pull task shutdown report is unhealthy"), past
/// `shutdown.timeout`.
pub const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The RocketMQ client's own runtime (heartbeats, pulls, rebalances, requests), with the client runtime built on
/// it. One per source, `check` and `rewind`; dropping it stops its tasks.
pub struct Runtime {
    pub(super) owner: rocketmq_runtime::RuntimeOwner,
    client: Arc<ClientRuntime>,
}

impl Runtime {
    /// A runtime of two worker threads named `idemflow-rocketmq-<scope>`.
    ///
    /// Errors: the runtime could not be built, as text.
    pub fn new(scope: &str) -> Result<Runtime, String> {
        let config = rocketmq_runtime::RuntimeConfig::for_parallelism(format!("idemflow-rocketmq-{scope}"), 2);
        let owner = rocketmq_runtime::RuntimeOwner::plan(config)
            .map_err(|e| format!("RocketMQ client runtime: {e}"))?
            .build()
            .map_err(|e| format!("RocketMQ client runtime: {e}"))?;
        let client = ClientRuntime::try_new(owner.root_context().component("client"), ClientRuntimeConfig::default(), TelemetryHandle::noop())
            .map_err(|e| format!("RocketMQ client runtime: {e}"))?;
        Ok(Runtime { owner, client })
    }

    /// The client runtime, for building consumers, producers and admin clients.
    pub fn client(&self) -> Arc<ClientRuntime> {
        self.client.clone()
    }

    /// Stops the client's tasks and the runtime's threads, waiting at most [`CLOSE_TIMEOUT`] for
    /// the tasks (then they are left to end with the process).
    pub async fn shutdown(self) {
        let tasks = async {
            let _ = self.client.shutdown().await;
            let _ = self.owner.shutdown_tasks().await;
        };
        if tokio::time::timeout(CLOSE_TIMEOUT, tasks).await.is_err() {
            tracing::warn!(timeout = ?CLOSE_TIMEOUT, "the RocketMQ client's tasks did not stop in time; left to end with the process");
        }
        self.owner.shutdown_background();
    }
}

/// The ACL hook signing every request with `[rocketmq] access_key` / `secret_key`; `None` when neither is set.
///
/// Errors: only one of them is set (requests would go out unsigned).
pub fn acl_hook(settings: &RocketMqSettings) -> Result<Option<Arc<AclClientRPCHook>>, String> {
    match (&settings.access_key, &settings.secret_key) {
        (Some(ak), Some(sk)) => Ok(Some(Arc::new(AclClientRPCHook::new(SessionCredentials::with_keys(ak.as_str(), sk.expose()))))),
        (None, None) => Ok(None),
        _ => Err("[rocketmq] access_key and secret_key go together: set both (ACL) or neither".to_owned()),
    }
}

/// An admin client on `runtime` for `settings`' name servers (signed with the ACL keys when set), started.
///
/// Errors: the client could not start, as text.
pub async fn admin(runtime: &Runtime, settings: &RocketMqSettings) -> Result<rocketmq_client_rust::DefaultMQAdminExt, String> {
    use rocketmq_client_rust::DefaultMQAdminExt;
    let mut admin = match acl_hook(settings)? {
        Some(hook) => DefaultMQAdminExt::with_rpc_hook(runtime.client(), hook),
        None => DefaultMQAdminExt::new(runtime.client()),
    };
    admin.set_namesrv_addr(settings.name_server.as_str());
    admin.start().await.map_err(|e| format!("cannot start a RocketMQ admin client: {e}"))?;
    Ok(admin)
}

/// `topic/broker`, the topic part of a RocketMQ position.
pub fn position_topic(topic: &str, broker: &str) -> String {
    format!("{topic}/{broker}")
}
