-- How many duplicates of each applied key were skipped, and when the last one was (for `idemflow explain`).
ALTER TABLE idemflow.dedup
    ADD COLUMN duplicates bigint NOT NULL DEFAULT 0,
    ADD COLUMN last_duplicate_at timestamptz;
