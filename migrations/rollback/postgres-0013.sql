-- Undoes PostgreSQL migration 13 (migrations/postgres/0013_outbox.sql): the outbox and the dead letters' request
-- column dropped, the migration's record removed. Requests still in the outbox are lost with it (they were never
-- confirmed): let the relay drain it first (`idemflow_outbox_rows` at 0), and stop the workers. Their
-- `delivery_failed` dead letters stay, without the request to replay them. In one transaction:
--   psql "$DATABASE_URL" -1 -v ON_ERROR_STOP=1 -f migrations/rollback/postgres-0013.sql
-- See docs/operations.md, "Upgrading".
DROP TABLE idemflow.outbox;
ALTER TABLE idemflow.dead_letters DROP COLUMN request;
DELETE FROM _sqlx_migrations WHERE version = 13;
