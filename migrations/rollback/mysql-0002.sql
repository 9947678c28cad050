-- Undoes MySQL/MariaDB migration 2 (migrations/mysql/0002_ordered_key_ids.sql), for going back to the version
-- before it: every dedup row back at the SHA-256 digest of its key text, the column named key_digest again, the
-- migration's record removed. Stop every worker of the newer version first: its claim names key_id and fails from
-- the rename on (applying nothing). Not transactional (MySQL's DDL commits): should it stop midway, run it again
-- from the first statement that failed.
--   mariadb -h HOST -u USER -p DATABASE < migrations/rollback/mysql-0002.sql
-- See docs/operations.md, "Upgrading".
ALTER TABLE idemflow_dedup DROP PRIMARY KEY, CHANGE COLUMN key_id key_digest VARBINARY(64) NOT NULL;
UPDATE idemflow_dedup SET key_digest = UNHEX(SHA2(business_key, 256));
ALTER TABLE idemflow_dedup MODIFY key_digest BINARY(32) NOT NULL, ADD PRIMARY KEY (pipeline, key_digest);
DELETE FROM _sqlx_migrations WHERE version = 2;
