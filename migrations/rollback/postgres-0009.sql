-- Undoes PostgreSQL migration 9 (migrations/postgres/0009_processed_floor_and_attempts.sql): the processed marks' floor
-- and the attempts table dropped, the migration's record removed. Workers of the previous version keep working meanwhile; this version's
-- refuse to start afterwards ("this binary needs 9"). To go back further, run this first, then postgres-0008.sql.
-- In one transaction:
--   psql "$DATABASE_URL" -1 -v ON_ERROR_STOP=1 -f migrations/rollback/postgres-0009.sql
-- See docs/operations.md, "Upgrading".
ALTER TABLE idemflow.processed DROP COLUMN resume_from;
DROP TABLE idemflow.attempts;
DELETE FROM _sqlx_migrations WHERE version = 9;
