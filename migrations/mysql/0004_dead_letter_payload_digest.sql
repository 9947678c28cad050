-- A dead letter is unique by its position *and its payload* (see the PostgreSQL migration 10): a topic deleted and
-- created again numbers its records from the start again, and a new poison record where an old one was dead-lettered
-- must be kept, not taken for a redelivery. `payload_digest` is the SHA-256 of the whole payload as received (of
-- nothing for a record without one). Workers of the previous version do not write the column (error 1364 at their
-- next dead letter): stop them before migrating.
ALTER TABLE idemflow_dead_letters ADD COLUMN payload_digest BINARY(32) NULL;
UPDATE idemflow_dead_letters SET payload_digest = COALESCE(payload_sha256, UNHEX(SHA2(COALESCE(payload, ''), 256)));
ALTER TABLE idemflow_dead_letters MODIFY payload_digest BINARY(32) NOT NULL,
    ADD UNIQUE KEY dead_letters_position_payload (pipeline, topic, `partition`, `offset`, payload_digest),
    DROP INDEX dead_letters_position;
