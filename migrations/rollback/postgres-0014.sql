-- Undoes PostgreSQL migration 14 (migrations/postgres/0014_processed_log_id.sql): the processed marks forget the
-- identity of their logs, and the migration's record is removed. The previous version then decides again from the
-- records' timestamps whether a topic was created again. In one transaction:
--   psql "$DATABASE_URL" -1 -v ON_ERROR_STOP=1 -f migrations/rollback/postgres-0014.sql
-- See docs/operations.md, "Upgrading".
ALTER TABLE idemflow.processed DROP COLUMN log_id;
DELETE FROM _sqlx_migrations WHERE version = 14;
