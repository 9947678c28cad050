-- The dedup store's primary key moves from the business key's SHA-256 digest to its key id (src/key.rs,
-- BusinessKey::key_id): the key text's own UTF-8 bytes when there are at most 64 of them, otherwise its first 31
-- bytes, a zero byte and its SHA-256 (64 bytes). Ids keep the keys' order: InnoDB clusters the table on its primary
-- key, so a batch of keys that grow (order numbers, time-ordered ids) appends to a few pages instead of splitting
-- random ones. See migrations/postgres/0007_ordered_key_ids.sql for the same change there.
--
-- The rename fences workers of the previous version during a rolling upgrade: their claim names key_digest, so from
-- then on each of their batches fails before it applies anything. The UPDATE then moves every stored row to its
-- id, computed from business_key exactly as the worker computes it: a key applied before the upgrade is still a
-- duplicate after it. DDL is not transactional here: until the last statement has run, sqlx records this migration
-- as not successful and workers of this version refuse to start. Should the migration stop between its statements,
-- `idemflow migrate` reports it as partially applied; docs/mysql.md says how to finish it.
--
-- First, every row's key text must still be the bytes its digest was made of (a key edited by hand is not the key
-- that was hashed): a row that is not cannot get the id the worker would compute. The count of such rows goes into a
-- table whose CHECK refuses anything but 0, so the migration stops there, before anything changed (MySQL enforces
-- CHECK from 8.0.16, MariaDB from 10.2).
DROP TEMPORARY TABLE IF EXISTS idemflow_migration_2;
CREATE TEMPORARY TABLE idemflow_migration_2 (
    mismatched BIGINT NOT NULL,
    CONSTRAINT every_key_text_is_what_its_digest_was_made_of CHECK (mismatched = 0)
);
INSERT INTO idemflow_migration_2 SELECT COUNT(*) FROM idemflow_dedup WHERE key_digest <> UNHEX(SHA2(business_key, 256));
DROP TEMPORARY TABLE idemflow_migration_2;
-- Then the rename, without the primary key while the ids change (InnoDB checks a unique key row by row during an
-- UPDATE, and a new id may equal another row's old digest until that row is moved too); the UPDATE computes the ids
-- from the key text alone, so it may run again; the primary key comes back last. Workers of this version refuse
-- a table without it.
ALTER TABLE idemflow_dedup DROP PRIMARY KEY, CHANGE COLUMN key_digest key_id VARBINARY(64) NOT NULL;
UPDATE idemflow_dedup SET key_id = IF(
    OCTET_LENGTH(business_key) <= 64,
    CAST(business_key AS BINARY),
    CONCAT(SUBSTRING(CAST(business_key AS BINARY), 1, 31), X'00', UNHEX(SHA2(business_key, 256)))
);
ALTER TABLE idemflow_dedup ADD PRIMARY KEY (pipeline, key_id);
