-- Undoes MySQL/MariaDB migration 3 (migrations/mysql/0003_processed_floor_and_attempts.sql): the processed marks' floor
-- and the attempts table dropped, the migration's record removed. Workers of the previous version keep working meanwhile; this version's
-- refuse to start afterwards ("this binary needs 3"). To go back further, run this first, then mysql-0002.sql:
--   mariadb -u USER -p DATABASE < migrations/rollback/mysql-0003.sql
-- See docs/operations.md, "Upgrading".
ALTER TABLE idemflow_processed DROP COLUMN resume_from;
DROP TABLE idemflow_attempts;
DELETE FROM _sqlx_migrations WHERE version = 3;
