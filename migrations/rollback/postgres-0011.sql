-- Undoes PostgreSQL migration 11 (migrations/postgres/0011_retention_sweep.sql): the (pipeline, applied_at) index
-- built again, the sweep cursors dropped, the migration's record removed. The index build holds a lock that blocks
-- writes to idemflow.dedup while it runs (about a minute per 10 million rows): stop the workers first. This version's
-- workers refuse to start afterwards ("this binary needs 11"). To go back further, run this first, then
-- postgres-0010.sql. In one transaction:
--   psql "$DATABASE_URL" -1 -v ON_ERROR_STOP=1 -f migrations/rollback/postgres-0011.sql
-- See docs/operations.md, "Upgrading".
CREATE INDEX dedup_pipeline_applied_at ON idemflow.dedup (pipeline, applied_at);
DROP TABLE idemflow.retention_sweeps;
DELETE FROM _sqlx_migrations WHERE version = 11;
