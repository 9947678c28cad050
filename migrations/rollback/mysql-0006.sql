-- Undoes MySQL/MariaDB migration 6 (migrations/mysql/0006_outbox.sql): the outbox and the dead letters' request
-- column dropped, the migration's record removed. Requests still in the outbox are lost with it: let the relay
-- drain it first (`idemflow_outbox_rows` at 0), and stop the workers.
--   mariadb -u USER -p DATABASE < migrations/rollback/mysql-0006.sql
-- See docs/operations.md, "Upgrading".
DROP TABLE idemflow_outbox;
ALTER TABLE idemflow_dead_letters DROP COLUMN request;
DELETE FROM _sqlx_migrations WHERE version = 6;
