-- Undoes PostgreSQL migration 10 (migrations/postgres/0010_dead_letter_payload_digest.sql): dead letters unique by
-- position alone again, the digest column dropped, the migration's record removed. It stops with an error and changes
-- nothing while a position holds more than one dead letter (a topic created again): replay them (`idemflow
-- dead-letters replay`) or delete the older rows first (`idemflow dead-letters list` shows them). This version's
-- workers refuse to start afterwards ("this binary needs 10"). To go back further, run this first, then
-- postgres-0009.sql. In one transaction:
--   psql "$DATABASE_URL" -1 -v ON_ERROR_STOP=1 -f migrations/rollback/postgres-0010.sql
-- See docs/operations.md, "Upgrading".
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM idemflow.dead_letters GROUP BY pipeline, topic, partition, "offset" HAVING count(*) > 1) THEN
        RAISE EXCEPTION 'positions with more than one dead letter (idemflow dead-letters list shows them): replay them or delete the older rows first';
    END IF;
END $$;
ALTER TABLE idemflow.dead_letters ADD CONSTRAINT dead_letters_pipeline_topic_partition_offset_key UNIQUE (pipeline, topic, partition, "offset");
ALTER TABLE idemflow.dead_letters DROP COLUMN payload_digest;
DELETE FROM _sqlx_migrations WHERE version = 10;
