//! MySQL and MariaDB as a store connector ([`crate::store::contract`]): the pool's calls outside a batch, and a batch
//! transaction ([`MyTx`]), each step one call into this folder's modules.

use super::{dead_letter, dedup, offsets, outbox, retention, side_effect};
use crate::dead_letter::Stored;
use crate::key::BusinessKey;
use crate::metrics::DeadLetterReason;
use crate::offsets::{Claimed, Logs, NextOffsets, Positions, Processed, Renewal};
use crate::record::{Position, Record};
use crate::retention::{Slice, Sweep, SweepState};
use crate::store::contract::{BatchTx, Connector, Session, StoreError};
use crate::store::rows::{Apply, Claim, Digests, Existing, Explained, Forget, Forgotten, Leased, OutboxDepth, Renamed, Settled};
use crate::store::contract::ATTEMPT_ROWS_KEPT;
use super::{ClaimForm, MySqlStore};
use std::time::Duration;

impl Connector for MySqlStore {
    async fn migrate(&self) -> Result<i64, sqlx::migrate::MigrateError> {
        super::check_binlog(&self.pool).await.map_err(|why| sqlx::migrate::MigrateError::Execute(sqlx::Error::Configuration(why.to_string().into())))?;
        super::MIGRATOR.run(&self.pool).await?;
        Ok(super::MIGRATOR.iter().map(|m| m.version).max().unwrap_or_default())
    }

    async fn check_schema(&self) -> Result<(), crate::store::contract::NotReady> {
        super::check_schema(&self.pool).await
    }

    async fn close(&self) {
        self.pool.close().await
    }

    async fn claim_offsets(&self, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> Result<Vec<Claimed>, StoreError> {
        Ok(offsets::claim(&self.pool, pipeline, owner, partitions).await?)
    }

    async fn stored_offsets(&self, pipeline: &str) -> Result<Vec<(String, i32, Option<i64>)>, StoreError> {
        Ok(offsets::stored(&self.pool, pipeline).await?)
    }

    async fn reset_offsets(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, StoreError> {
        Ok(offsets::reset(&self.pool, pipeline, positions).await?)
    }

    async fn recent_attempts(&self, pipeline: &str, within: Duration) -> Result<Vec<(String, String)>, StoreError> {
        Ok(dedup::recent_attempts(&self.pool, pipeline, within).await?)
    }

    async fn forget(&self, pipeline: &str, what: &Forget, dry_run: bool) -> Result<Forgotten, StoreError> {
        Ok(dedup::forget(&self.pool, pipeline, what, dry_run).await?)
    }

    async fn key_requests(&self, pipeline: &str, digest: &[u8]) -> Result<Vec<crate::store::rows::KeyRequest>, StoreError> {
        Ok(outbox::key_requests(&self.pool, pipeline, digest).await?)
    }

    async fn outbox_retry_now(&self, pipeline: &str, target: Option<&str>, digest: Option<&[u8]>) -> Result<u64, StoreError> {
        Ok(outbox::retry_now(&self.pool, pipeline, target, digest).await?)
    }

    async fn unsent(&self) -> Result<Vec<crate::store::rows::Unsent>, StoreError> {
        Ok(outbox::unsent(&self.pool).await?)
    }

    async fn rename_pipeline(&self, old: &str, new: &str, dry_run: bool) -> Result<Renamed, StoreError> {
        super::rename::rename(&self.pool, old, new, dry_run).await?.map_err(StoreError::Refused)
    }

    async fn lower_floors(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, StoreError> {
        Ok(offsets::lower_floors(&self.pool, pipeline, positions).await?)
    }

    async fn sweep_slice(&self, sweep: &Sweep<'_>, restart: bool) -> Result<Slice, StoreError> {
        let slice = retention::sweep_slice(&self.pool, sweep, restart).await?;
        if slice.pass_seconds.is_some() {
            offsets::forget_attempts(&self.pool, sweep.pipeline, ATTEMPT_ROWS_KEPT).await?;
        }
        Ok(slice)
    }

    async fn release_sweep(&self, sweep: &Sweep<'_>) -> Result<(), StoreError> {
        Ok(retention::release(&self.pool, sweep).await?)
    }

    async fn sweep_state(&self, pipeline: &str) -> Result<Option<SweepState>, StoreError> {
        Ok(retention::sweep_state(&self.pool, pipeline).await?)
    }

    async fn explain(&self, pipeline: &str, key: &BusinessKey) -> Result<Option<Explained>, StoreError> {
        Ok(dedup::explain(&mut *self.pool.acquire().await?, pipeline, key).await?)
    }

    async fn dead_letters(&self, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, StoreError> {
        Ok(dead_letter::list(&mut *self.pool.acquire().await?, pipeline, limit).await?)
    }

    async fn dead_letter(&self, id: i64) -> Result<Option<Stored>, StoreError> {
        Ok(dead_letter::get(&mut *self.pool.acquire().await?, id).await?)
    }

    async fn outbox_ready(&self) -> Result<(), crate::store::contract::NotReady> {
        use crate::store::contract::NotReady;
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| NotReady::after(super::error::classify_error(&e), format!("cannot read the server's version: {e}")))?;
        outbox::supported(&version).map_err(NotReady::Refused)
    }

    async fn outbox_lease(&self, pipeline: &str, owner: &str, limit: i64, lease: Duration) -> Result<Vec<Leased>, StoreError> {
        Ok(outbox::lease(&self.pool, pipeline, owner, limit, lease).await?)
    }

    async fn outbox_settle(&self, pipeline: &str, owner: &str, settled: &[Settled]) -> Result<Vec<i64>, StoreError> {
        Ok(outbox::settle(&self.pool, pipeline, owner, settled).await?)
    }

    async fn outbox_depth(&self, pipeline: &str, up_to: i64) -> Result<OutboxDepth, StoreError> {
        Ok(outbox::depth(&self.pool, pipeline, up_to).await?)
    }

    async fn outbox_release(&self, pipeline: &str, owner: &str) -> Result<u64, StoreError> {
        Ok(outbox::release(&self.pool, pipeline, owner).await?)
    }

    async fn histories(&self, topics: &[String]) -> Result<Vec<crate::store::rows::History>, StoreError> {
        if topics.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT CONVERT(pipeline USING utf8mb4), CONVERT(topic USING utf8mb4), COUNT(*), CAST(SUM(next_offset) AS SIGNED),
                    CONVERT(CAST(MAX(updated_at) AS CHAR) USING utf8mb4) FROM idemflow_processed
             WHERE topic IN ({}) GROUP BY pipeline, topic ORDER BY pipeline, topic",
            vec!["?"; topics.len()].join(", ")
        );
        let mut query = sqlx::query_as::<_, (String, String, i64, i64, String)>(&sql);
        for t in topics {
            query = query.bind(t);
        }
        let rows = query.fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(|(pipeline, topic, partitions, processed, last)| crate::store::rows::History { pipeline, topic, partitions, processed, last }).collect())
    }

    async fn outbox_requeue(&self, id: i64, rehome: &str) -> Result<Option<i64>, StoreError> {
        Ok(outbox::requeue(&self.pool, id, rehome).await?)
    }
}

/// A MySQL/MariaDB batch transaction with the side effect it runs, and how its claim learns which keys were new.
pub struct MyTx<'a> {
    /// The transaction.
    pub tx: sqlx::Transaction<'static, sqlx::MySql>,
    /// The claim's form for this server.
    pub form: ClaimForm,
    /// The side effect it runs.
    pub effect: &'a side_effect::SideEffect,
}

impl BatchTx for MyTx<'_> {
    async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }

    async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }

    async fn still_open(&mut self) -> Result<bool, sqlx::Error> {
        super::transaction_open(&mut self.tx).await
    }

    async fn raw(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        use sqlx::Executor as _;
        self.tx.execute(sqlx::raw_sql(sql)).await.map(drop)
    }

    async fn begin_side_effect(&mut self) -> Result<bool, sqlx::Error> {
        self.effect.begin(&mut self.tx).await
    }

    async fn apply_all(&mut self, rows: &[&Apply]) -> Result<(), sqlx::Error> {
        self.effect.apply_all(&mut self.tx, rows).await
    }

    async fn apply_one(&mut self, row: &Apply) -> Result<(), sqlx::Error> {
        self.effect.apply_one(&mut self.tx, row).await
    }

    async fn claim(&mut self, pipeline: &str, claims: &[Claim<'_>]) -> Result<Digests, sqlx::Error> {
        dedup::claim(&mut self.tx, self.form, pipeline, claims).await
    }

    async fn existing(&mut self, pipeline: &str, keys: &[&BusinessKey]) -> Result<Vec<([u8; 32], Existing)>, sqlx::Error> {
        dedup::existing(&mut self.tx, pipeline, keys).await
    }

    async fn count_duplicates(&mut self, pipeline: &str, counts: &[(&BusinessKey, i64)]) -> Result<(), sqlx::Error> {
        dedup::count_duplicates(&mut self.tx, pipeline, counts).await
    }

    async fn write_outbox(&mut self, pipeline: &str, rows: &[(&Record, &Apply)]) -> Result<(), sqlx::Error> {
        outbox::write(&mut self.tx, pipeline, rows).await
    }

    async fn write_dead_letter(&mut self, pipeline: &str, record: &Record, reason: DeadLetterReason, error: &str) -> Result<bool, sqlx::Error> {
        dead_letter::write(&mut self.tx, pipeline, record, reason, error).await
    }

    async fn dead_letters_at(&mut self, pipeline: &str, records: &[&Record]) -> Result<Vec<(Position, String, String)>, sqlx::Error> {
        dead_letter::at(&mut self.tx, pipeline, records).await
    }

    async fn delete_dead_letters(&mut self, pipeline: &str, ids: &[i64]) -> Result<u64, sqlx::Error> {
        dead_letter::delete(&mut self.tx, pipeline, ids).await
    }

    async fn advance_offsets(&mut self, pipeline: &str, positions: &Positions) -> Result<Vec<(String, i32)>, sqlx::Error> {
        offsets::advance(&mut self.tx, pipeline, positions).await
    }

    async fn processed(&mut self, pipeline: &str, first: &NextOffsets) -> Result<Processed, sqlx::Error> {
        offsets::processed(&mut self.tx, pipeline, first).await
    }

    async fn raise_processed(&mut self, pipeline: &str, next: &NextOffsets, logs: &Logs) -> Result<(), sqlx::Error> {
        offsets::raise_processed(&mut self.tx, pipeline, next, logs).await
    }

    async fn mark_attempt(&mut self, pipeline: &str, owner: &str, attempt: i64) -> Result<(Option<i64>, Session), sqlx::Error> {
        offsets::mark_attempt(&mut self.tx, pipeline, owner, attempt).await
    }

    async fn renew_processed(&mut self, pipeline: &str, renewed: &[Renewal]) -> Result<(), sqlx::Error> {
        offsets::renew_processed(&mut self.tx, pipeline, renewed).await
    }
}
