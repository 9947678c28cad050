-- A narrower dedup row (issue 44, item 2): every claimed key writes this row and its primary key entry in the
-- batch's transaction, so each byte of it is WAL and PostgreSQL CPU per record. Measured alone (docs/benchmarks.md,
-- issue 44's fourth pass: WAL bytes per row of 2,000-row batches):
--   - the payload's fingerprint is the first 16 bytes of its SHA-256, not all 32 (-16 bytes): it tells a
--     `payload_mismatch` from a `republished` copy, for which 128 bits are as good as 256;
--   - the key's text is stored (`key_text`) only where the key id is not the text, that is for keys over 64 bytes
--     (src/key.rs, BusinessKey::key_id): a shorter key is read back from its id (-16 bytes);
--   - the duplicate counts live in `dedup_duplicates`, a row written only for keys that had duplicates (-8 bytes);
--   - the fixed-width columns first, so that none is padded to its alignment (-16 bytes).
-- A row of the bench's keys: 331 -> 275 bytes of WAL.
--
-- PostgreSQL cannot reorder a table's columns, so the rows are copied into a new table that takes the old one's
-- name, privileges and primary key (about 10 s per million rows on a 2-core machine; the old table's space is freed
-- at COMMIT). Every stored key keeps its key id: a key applied before the upgrade is still a duplicate after it.
--
-- `business_key` is gone, which fences workers of the previous version during a rolling upgrade: their claim names
-- it, so from this commit on each of their batches fails before it applies anything (SQLSTATE 42703). A batch of
-- theirs under way holds a lock on the table: this migration waits for it to end and then copies its rows too.
-- Workers of this version refuse to start until the migration is recorded as applied.
LOCK TABLE idemflow.dedup IN ACCESS EXCLUSIVE MODE;

-- What a copy would not carry over stops the migration, with nothing changed: a trigger, an index or a row security
-- policy of yours on the table, or the table named in a publication (a logical replica or a change capture would
-- stop receiving its rows without a word). Views over it stop it too (the DROP below, without CASCADE).
DO $$
DECLARE
    what text;
BEGIN
    SELECT string_agg(x, ', ') INTO what FROM (
        SELECT 'trigger ' || tgname AS x FROM pg_trigger WHERE tgrelid = 'idemflow.dedup'::regclass AND NOT tgisinternal
        UNION ALL
        SELECT 'index ' || indexrelid::regclass::text FROM pg_index WHERE indrelid = 'idemflow.dedup'::regclass
            AND NOT indisprimary
        UNION ALL
        SELECT 'policy ' || polname FROM pg_policy WHERE polrelid = 'idemflow.dedup'::regclass
        UNION ALL
        SELECT 'publication ' || p.pubname FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
            WHERE r.prrelid = 'idemflow.dedup'::regclass
    ) found;
    IF what IS NOT NULL THEN
        RAISE EXCEPTION 'idemflow migration 12 copies idemflow.dedup into a new table and would not carry over: %; nothing was changed', what
            USING HINT = 'drop them, run idemflow migrate, then create them again on the new table (docs/operations.md, "Upgrading")';
    END IF;
END $$;

-- One row per key that had skipped duplicates, for `idemflow explain`. `applied_at` is the dedup row's it counts
-- for: a count left behind by a key purged and claimed again is not that new row's (the worker starts it over).
CREATE TABLE idemflow.dedup_duplicates (
    pipeline          text COLLATE "C" NOT NULL,
    key_id            bytea            NOT NULL,
    applied_at        timestamptz      NOT NULL,
    duplicates        bigint           NOT NULL CHECK (duplicates > 0),
    last_duplicate_at timestamptz      NOT NULL,
    PRIMARY KEY (pipeline, key_id)
);
INSERT INTO idemflow.dedup_duplicates (pipeline, key_id, applied_at, duplicates, last_duplicate_at)
SELECT pipeline, key_id, applied_at, duplicates, coalesce(last_duplicate_at, applied_at)
FROM idemflow.dedup WHERE duplicates > 0;

CREATE TABLE idemflow.dedup_narrow (
    "offset"    bigint           NOT NULL,
    applied_at  timestamptz      NOT NULL DEFAULT now(),
    partition   integer          NOT NULL,
    pipeline    text COLLATE "C" NOT NULL,
    topic       text             NOT NULL,
    key_id      bytea            NOT NULL CONSTRAINT dedup_key_id_length CHECK (octet_length(key_id) <= 64),
    fingerprint bytea            NOT NULL CONSTRAINT dedup_fingerprint_length CHECK (octet_length(fingerprint) = 16),
    key_text    text
);
INSERT INTO idemflow.dedup_narrow ("offset", applied_at, partition, pipeline, topic, key_id, fingerprint, key_text)
SELECT "offset", applied_at, partition, pipeline, topic, key_id, substring(fingerprint FROM 1 FOR 16),
       -- In a database whose encoding is not UTF8 every key keeps its text (the worker reads a short key's text
       -- back from its id only where that needs no conversion that could fail).
       CASE WHEN current_setting('server_encoding') = 'UTF8' AND key_id = convert_to(business_key, 'UTF8') THEN NULL
            ELSE business_key END
FROM idemflow.dedup;

-- The old table's owner (the role the workers may run as), storage parameters (autovacuum settings, say) and the
-- privileges granted on it (to a monitoring role, say), on both new tables. Column privileges are not carried over.
DO $$
DECLARE
    g record;
    t text;
    old regclass := 'idemflow.dedup'::regclass;
BEGIN
    FOREACH t IN ARRAY ARRAY['idemflow.dedup_narrow', 'idemflow.dedup_duplicates'] LOOP
        EXECUTE format('ALTER TABLE %s OWNER TO %I', t, (SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = old));
    END LOOP;
    IF (SELECT reloptions FROM pg_class WHERE oid = old) IS NOT NULL THEN
        EXECUTE format('ALTER TABLE idemflow.dedup_narrow SET (%s)',
                       (SELECT array_to_string(reloptions, ', ') FROM pg_class WHERE oid = old));
    END IF;
    FOR g IN
        SELECT a.privilege_type, a.grantee, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'idemflow.dedup'::regclass AND a.grantee <> c.relowner
    LOOP
        FOREACH t IN ARRAY ARRAY['idemflow.dedup_narrow', 'idemflow.dedup_duplicates'] LOOP
            EXECUTE format('GRANT %s ON %s TO %s%s', g.privilege_type, t,
                           CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(g.grantee)) END,
                           CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END LOOP;
END $$;

-- Without CASCADE: a view of the user's over the old table stops the migration, with nothing changed.
DROP TABLE idemflow.dedup;
ALTER TABLE idemflow.dedup_narrow RENAME TO dedup;
ALTER TABLE idemflow.dedup ADD CONSTRAINT dedup_pkey PRIMARY KEY (pipeline, key_id);
ANALYZE idemflow.dedup;
-- A heap sweep's cursor named blocks of the old table: a pass under way starts again at the first block of the new
-- one (its start time kept). A key-range cursor stays valid (the key ids do not change).
UPDATE idemflow.retention_sweeps SET next_block = 0;
