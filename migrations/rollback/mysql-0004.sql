-- Undoes MySQL/MariaDB migration 4 (migrations/mysql/0004_dead_letter_payload_digest.sql): dead letters unique by
-- position alone again, the digest column dropped, the migration's record removed. Adding the old unique key fails
-- (error 1062) and changes nothing while a position holds more than one dead letter (a topic created again): replay
-- them (`idemflow dead-letters replay`) or delete the older rows first (`idemflow dead-letters list` shows them).
-- This version's workers refuse to start afterwards ("this binary needs 4"). To go back further, run this first,
-- then mysql-0003.sql:
--   mariadb -u USER -p DATABASE < migrations/rollback/mysql-0004.sql
-- See docs/operations.md, "Upgrading".
ALTER TABLE idemflow_dead_letters ADD UNIQUE KEY dead_letters_position (pipeline, topic, `partition`, `offset`);
ALTER TABLE idemflow_dead_letters DROP INDEX dead_letters_position_payload, DROP COLUMN payload_digest;
DELETE FROM _sqlx_migrations WHERE version = 4;
