-- Undoes PostgreSQL migration 7 (migrations/postgres/0007_ordered_key_ids.sql), for going back to the version
-- before it: every dedup row back at the SHA-256 digest of its key text, the column named key_digest again, the
-- migration's record removed. Stop every worker of the newer version first: its claim names key_id and fails from
-- this commit on (applying nothing), as the previous version's did after migration 7. Run it in one transaction:
--   psql "$DATABASE_URL" -1 -v ON_ERROR_STOP=1 -f migrations/rollback/postgres-0007.sql
-- See docs/operations.md, "Upgrading".
LOCK TABLE idemflow.dedup IN ACCESS EXCLUSIVE MODE;
ALTER TABLE idemflow.dedup DROP CONSTRAINT IF EXISTS dedup_pkey;
ALTER TABLE idemflow.dedup DROP CONSTRAINT IF EXISTS dedup_key_id_length;
ALTER TABLE idemflow.dedup RENAME COLUMN key_id TO key_digest;
UPDATE idemflow.dedup SET key_digest = sha256(convert_to(business_key, 'UTF8'));
ALTER TABLE idemflow.dedup
    ADD CONSTRAINT dedup_key_digest_check CHECK (octet_length(key_digest) = 32),
    ADD PRIMARY KEY (pipeline, key_digest);
DELETE FROM _sqlx_migrations WHERE version = 7;
