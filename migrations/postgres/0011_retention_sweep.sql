-- Retention without an index written on every insert: the worker sweeps the dedup table in slices (of its heap by
-- TID range scans on PostgreSQL 14 and later, of its primary key before) instead of finding old rows through
-- (pipeline, applied_at), which every claimed key paid for in WAL and CPU. `retention_sweeps` holds each pipeline's
-- sweep: its cursor (`next_block` for heap slices, `swept_to`, the last key id swept, for key slices; so a sweep
-- resumes where it stopped after a restart), the replica sweeping the pass under way and until when its lease holds
-- (`owner`, `lease_until`: one replica at a time), and the last full pass (`last_pass_ended_at`,
-- `last_pass_seconds`): a row lives at most its retention plus one full pass and purge_interval
-- (docs/operations.md, "Retention and growth"). Workers of the previous version keep claiming correctly, but their
-- purge finds old rows by scanning the table: stop them before migrating.
DROP INDEX IF EXISTS idemflow.dedup_pipeline_applied_at;
CREATE TABLE idemflow.retention_sweeps (
    pipeline           text COLLATE "C" PRIMARY KEY,
    next_block         bigint           NOT NULL DEFAULT 0 CHECK (next_block >= 0),
    swept_to           bytea,
    owner              text,
    lease_until        timestamptz,
    pass_started_at    timestamptz,
    last_pass_ended_at timestamptz,
    passes             bigint           NOT NULL DEFAULT 0,
    last_pass_seconds  double precision,
    updated_at         timestamptz      NOT NULL DEFAULT now()
);
