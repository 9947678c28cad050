-- Oversized payloads (over the pipeline's max_payload_bytes) are not kept whole, in memory or in the dead letters:
-- the row keeps the first 1 KiB in `payload`, and here the full size and the SHA-256 of the whole payload (to check
-- a payload supplied for a replay). Both are NULL for a payload kept whole.
ALTER TABLE idemflow.dead_letters
    ADD COLUMN payload_bytes bigint CHECK (payload_bytes >= 0),
    ADD COLUMN payload_sha256 bytea;
