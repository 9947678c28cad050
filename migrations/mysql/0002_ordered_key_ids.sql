-- The dedup store's primary key moves from the business key's SHA-256 digest to its key id (src/key.rs,
-- BusinessKey::key_id): the key text's own UTF-8 bytes when there are at most 64 of them, otherwise its first 31
-- bytes, a zero byte and its SHA-256 (64 bytes). Ids keep the keys' order: InnoDB clusters the table on its primary
-- key, so a batch of keys that grow (order numbers, time-ordered ids) appends to a few pages instead of splitting
-- random ones. See migrations/postgres/0007_ordered_key_ids.sql for the same change there.
--
-- The rename comes first and fences workers of the previous version during a rolling upgrade: their claim names
-- key_digest, so from then on each of their batches fails before it applies anything. The UPDATE then moves every
-- stored row to its id, computed from business_key exactly as the worker computes it: a key applied before the
-- upgrade is still a duplicate after it. DDL is not transactional here: until the UPDATE has committed, sqlx records
-- this migration as not successful and workers of this version refuse to start. Should the migration stop between
-- the two statements, `idemflow migrate` reports it as partially applied; docs/mysql.md says how to finish it.
ALTER TABLE idemflow_dedup CHANGE COLUMN key_digest key_id VARBINARY(64) NOT NULL;
UPDATE idemflow_dedup SET key_id = IF(
    LENGTH(business_key) <= 64,
    CAST(business_key AS BINARY),
    CONCAT(SUBSTRING(CAST(business_key AS BINARY), 1, 31), X'00', UNHEX(SHA2(business_key, 256)))
);
