//! Redis as a store connector ([`crate::store::contract`]): what runs outside a batch. Its batch is one script
//! ([`super::batch`]), so it has no batch transaction; its dedup keys expire by themselves (nothing to purge) and
//! it keeps no processed floors.

use super::RedisStore;
use crate::dead_letter::Stored;
use crate::key::BusinessKey;
use crate::offsets::Claimed;
use crate::store::contract::{Connector, StoreError};
use crate::store::rows::{Explained, Forget, Forgotten};
use std::time::Duration;

/// Why `idemflow dedup forget` does not apply to Redis, and what to do instead.
const FORGET_REFUSED: &str = "a Redis store keeps its dedup keys as keys with a TTL, and no processed floors: delete a key with \
     redis-cli DEL <key_prefix><pipeline>:k:<sha256 of the business key, hex>";

impl Connector for RedisStore {
    // Redis has no schema: its keys are created by the batches.
    async fn migrate(&self) -> Result<i64, sqlx::migrate::MigrateError> {
        Ok(0)
    }

    async fn check_schema(&self) -> Result<(), crate::store::contract::NotReady> {
        self.check_server().await.map(drop)
    }

    async fn claim_offsets(&self, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> Result<Vec<Claimed>, StoreError> {
        Ok(RedisStore::claim_offsets(self, pipeline, owner, partitions).await?)
    }

    async fn lost_positions(&self, pipeline: &str, owned: &[(String, i32)]) -> Result<Vec<(String, i32)>, StoreError> {
        Ok(RedisStore::lost_positions(self, pipeline, owned).await?)
    }

    async fn stored_offsets(&self, pipeline: &str) -> Result<Vec<(String, i32, Option<i64>)>, StoreError> {
        Ok(RedisStore::stored_offsets(self, pipeline).await?)
    }

    async fn reset_offsets(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, StoreError> {
        Ok(RedisStore::reset_offsets(self, pipeline, positions).await?)
    }

    async fn recent_attempts(&self, _pipeline: &str, _within: Duration) -> Result<Vec<(String, String)>, StoreError> {
        Err(StoreError::Refused(FORGET_REFUSED.to_owned()))
    }

    async fn forget(&self, _pipeline: &str, _what: &Forget, _dry_run: bool) -> Result<Forgotten, StoreError> {
        Err(StoreError::Refused(FORGET_REFUSED.to_owned()))
    }

    async fn explain(&self, pipeline: &str, key: &BusinessKey) -> Result<Option<Explained>, StoreError> {
        Ok(RedisStore::explain(self, pipeline, key).await?)
    }

    async fn dead_letters(&self, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, StoreError> {
        Ok(RedisStore::dead_letters(self, pipeline, limit).await?)
    }

    async fn dead_letter(&self, id: i64) -> Result<Option<Stored>, StoreError> {
        Ok(RedisStore::dead_letter(self, id).await?)
    }
}
