-- Retention without an index written on every insert: the worker sweeps the dedup table in slices of its heap (TID
-- range scans, PostgreSQL 14 and later) instead of finding old rows through (pipeline, applied_at), which every
-- claimed key paid for in WAL and CPU. `retention_sweeps` keeps each pipeline's sweep cursor (the next heap block) so
-- a sweep resumes where it stopped after a restart, and the last full pass's duration: a row lives at most its
-- retention plus one full pass (docs/operations.md, "Retention and growth"). Workers of the previous version keep
-- working (their purge finds old rows by a scan instead of the index): stop them soon after migrating.
DROP INDEX IF EXISTS idemflow.dedup_pipeline_applied_at;
CREATE TABLE idemflow.retention_sweeps (
    pipeline          text COLLATE "C" PRIMARY KEY,
    next_block        bigint           NOT NULL DEFAULT 0 CHECK (next_block >= 0),
    pass_started_at   timestamptz,
    passes            bigint           NOT NULL DEFAULT 0,
    last_pass_seconds double precision,
    updated_at        timestamptz      NOT NULL DEFAULT now()
);
