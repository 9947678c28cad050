-- A dead letter is unique by its position *and its payload*: a topic deleted and created again, or a JetStream
-- stream, numbers its records from the start again, so a new poison record can sit where an old one was
-- dead-lettered. Unique by position alone, the new one was taken for a redelivery of the old one (counted as a
-- duplicate) and its body kept nowhere. `payload_digest` is the SHA-256 of the whole payload as received (of nothing
-- for a record without one; for an oversized one the digest it already kept); a redelivery of the same record has
-- the same bytes at the same position and is still recognised. Workers of the previous version name the old unique
-- constraint in their insert (42P10 stops their pipeline at their next dead letter): stop them before migrating.
ALTER TABLE idemflow.dead_letters ADD COLUMN payload_digest bytea;
UPDATE idemflow.dead_letters SET payload_digest = coalesce(payload_sha256, sha256(coalesce(payload, ''::bytea)));
ALTER TABLE idemflow.dead_letters ALTER COLUMN payload_digest SET NOT NULL,
    ADD CONSTRAINT dead_letters_position_payload_key UNIQUE (pipeline, topic, partition, "offset", payload_digest),
    ADD CHECK (octet_length(payload_digest) = 32);
ALTER TABLE idemflow.dead_letters DROP CONSTRAINT dead_letters_pipeline_topic_partition_offset_key;
