-- Undoes PostgreSQL migration 12 (migrations/postgres/0012_narrow_dedup_row.sql): the dedup rows copied back into
-- the previous shape (the key text of every row, the duplicate counts in the row), `dedup_duplicates` dropped, the
-- migration's record removed (and a heap sweep's cursor put back at the first block). The fingerprints stay 16
-- bytes: the previous version, which compares whole fingerprints, counts a republished copy of a key applied before
-- the rollback (and, on a queue or a JetStream stream, a redelivery) as `payload_mismatch`: a reason's count and its
-- alert, nothing applied twice. Triggers, indexes and policies of yours on the table are not carried over. The copy holds a
-- lock that blocks idemflow.dedup while it runs (about 10 s per million rows): stop the workers first. This version's
-- workers refuse to start afterwards ("this binary needs 12"). To go back further, run this first, then
-- postgres-0011.sql. In one transaction:
--   psql "$DATABASE_URL" -1 -v ON_ERROR_STOP=1 -f migrations/rollback/postgres-0012.sql
-- See docs/operations.md, "Upgrading".
LOCK TABLE idemflow.dedup IN ACCESS EXCLUSIVE MODE;
CREATE TABLE idemflow.dedup_wide (
    pipeline          text COLLATE "C" NOT NULL,
    key_id            bytea            NOT NULL CONSTRAINT dedup_key_id_length CHECK (octet_length(key_id) <= 64),
    business_key      text             NOT NULL,
    topic             text             NOT NULL,
    partition         integer          NOT NULL,
    "offset"          bigint           NOT NULL,
    fingerprint       bytea            NOT NULL,
    applied_at        timestamptz      NOT NULL DEFAULT now(),
    duplicates        bigint           NOT NULL DEFAULT 0,
    last_duplicate_at timestamptz
);
INSERT INTO idemflow.dedup_wide
SELECT d.pipeline, d.key_id, coalesce(d.key_text, convert_from(d.key_id, 'UTF8')), d.topic, d.partition, d."offset",
       d.fingerprint, d.applied_at, coalesce(c.duplicates, 0), c.last_duplicate_at
FROM idemflow.dedup d
LEFT JOIN idemflow.dedup_duplicates c ON c.pipeline = d.pipeline AND c.key_id = d.key_id AND c.applied_at = d.applied_at;
DO $$
DECLARE
    g record;
    old regclass := 'idemflow.dedup'::regclass;
BEGIN
    EXECUTE format('ALTER TABLE idemflow.dedup_wide OWNER TO %I', (SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = old));
    IF (SELECT reloptions FROM pg_class WHERE oid = old) IS NOT NULL THEN
        EXECUTE format('ALTER TABLE idemflow.dedup_wide SET (%s)', (SELECT array_to_string(reloptions, ', ') FROM pg_class WHERE oid = old));
    END IF;
    FOR g IN
        SELECT a.privilege_type, a.grantee, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'idemflow.dedup'::regclass AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON idemflow.dedup_wide TO %s%s', g.privilege_type,
                       CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(g.grantee)) END,
                       CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END $$;
DROP TABLE idemflow.dedup, idemflow.dedup_duplicates;
ALTER TABLE idemflow.dedup_wide RENAME TO dedup;
ALTER TABLE idemflow.dedup ADD CONSTRAINT dedup_pkey PRIMARY KEY (pipeline, key_id);
ANALYZE idemflow.dedup;
UPDATE idemflow.retention_sweeps SET next_block = 0;
DELETE FROM _sqlx_migrations WHERE version = 12;
