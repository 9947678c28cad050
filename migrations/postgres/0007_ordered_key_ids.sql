-- The dedup store's primary key moves from the business key's SHA-256 digest to its key id (src/key.rs,
-- BusinessKey::key_id): the key text's own UTF-8 bytes when there are at most 64 of them, otherwise its first 31
-- bytes, a zero byte and its SHA-256 (64 bytes). Ids keep the keys' order, so a batch of keys that grow (order
-- numbers, time-ordered ids) lands on a few leaf pages of the index instead of one random page per key.
--
-- Every stored row moves to its id, computed here from business_key exactly as the worker computes it: a key applied
-- before the upgrade is still a duplicate after it.
--
-- The column is renamed in the same transaction. That fences workers of the previous version during a rolling
-- upgrade: their claim names key_digest, so from this commit on each of their batches fails before it applies
-- anything, where it would otherwise insert a digest beside an id for the same key and apply it twice. A batch of
-- theirs under way holds a lock on the table: this migration waits for it to end and then moves its rows too.
-- Workers of this version refuse to start until the migration is recorded as applied.
--
-- The check and the UPDATE read and rewrite every row (8.9 s for a million rows on a 2-core machine); VACUUM
-- reclaims the old row versions afterwards (autovacuum does it on its own).
--
-- First, with the table locked, every row's key text must still be the bytes its digest was made of: a database
-- encoding other than UTF8 can store a character as another (EUC_JP maps some one way only), and a key edited by
-- hand is not the key that was hashed. Such a row's id cannot be computed from its text; rather than give it an id
-- the worker would never compute (its key would be applied again), the migration stops and changes nothing.
LOCK TABLE idemflow.dedup IN ACCESS EXCLUSIVE MODE;
DO $$
DECLARE
    mismatched bigint;
    example text;
BEGIN
    SELECT count(*), min(business_key) INTO mismatched, example
    FROM idemflow.dedup WHERE key_digest <> sha256(convert_to(business_key, 'UTF8'));
    IF mismatched > 0 THEN
        RAISE EXCEPTION 'idemflow migration 7: % dedup rows hold a key text that is not what their digest was made of (for example %, database encoding %): their key ids cannot be computed; nothing was changed', mismatched, quote_literal(example), current_setting('server_encoding')
            USING HINT = 'docs/operations.md, "Upgrading", says what to do';
    END IF;
END $$;
ALTER TABLE idemflow.dedup DROP CONSTRAINT IF EXISTS dedup_pkey;
ALTER TABLE idemflow.dedup DROP CONSTRAINT IF EXISTS dedup_key_digest_check;
ALTER TABLE idemflow.dedup RENAME COLUMN key_digest TO key_id;
UPDATE idemflow.dedup SET key_id = CASE
    WHEN octet_length(convert_to(business_key, 'UTF8')) <= 64 THEN convert_to(business_key, 'UTF8')
    ELSE substring(convert_to(business_key, 'UTF8') FROM 1 FOR 31) || decode('00', 'hex')
         || sha256(convert_to(business_key, 'UTF8'))
END;
ALTER TABLE idemflow.dedup
    ADD CONSTRAINT dedup_key_id_length CHECK (octet_length(key_id) <= 64),
    ADD PRIMARY KEY (pipeline, key_id);
