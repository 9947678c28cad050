-- Undoes MySQL/MariaDB migration 5 (migrations/mysql/0005_retention_sweep.sql): the (pipeline, applied_at) index
-- built again, the sweep cursors dropped, the migration's record removed. Stop the workers first. This version's
-- workers refuse to start afterwards ("this binary needs 5"). To go back further, run this first, then
-- mysql-0004.sql:
--   mariadb -u USER -p DATABASE < migrations/rollback/mysql-0005.sql
-- See docs/operations.md, "Upgrading".
ALTER TABLE idemflow_dedup ADD INDEX dedup_pipeline_applied_at (pipeline, applied_at);
DROP TABLE idemflow_retention_sweeps;
DELETE FROM _sqlx_migrations WHERE version = 5;
