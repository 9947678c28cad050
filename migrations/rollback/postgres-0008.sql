-- Undoes PostgreSQL migration 8 (migrations/postgres/0008_dedup_pipeline_bytewise.sql): the dedup store's pipeline
-- column back under the database's default collation (its indexes rebuilt), the migration's record removed.
-- Workers of either version keep working meanwhile (equality is the same under both); this version's refuse to
-- start afterwards ("this binary needs 8"). To go back further, run this first, then postgres-0007.sql. In one
-- transaction:
--   psql "$DATABASE_URL" -1 -v ON_ERROR_STOP=1 -f migrations/rollback/postgres-0008.sql
-- See docs/operations.md, "Upgrading".
ALTER TABLE idemflow.dedup ALTER COLUMN pipeline TYPE text COLLATE "default";
DELETE FROM _sqlx_migrations WHERE version = 8;
