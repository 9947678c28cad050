-- Undoes MySQL/MariaDB migration 7 (migrations/mysql/0007_processed_log_id.sql): the processed marks forget the
-- identity of their logs, and the migration's record is removed.
--   mariadb -u USER -p DATABASE < migrations/rollback/mysql-0007.sql
-- See docs/operations.md, "Upgrading".
ALTER TABLE idemflow_processed DROP COLUMN log_id;
DELETE FROM _sqlx_migrations WHERE version = 7;
