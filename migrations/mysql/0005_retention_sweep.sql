-- Retention without an index written on every insert: the worker sweeps the dedup table in slices of its clustered
-- primary key, (pipeline, key_id), instead of finding old rows through (pipeline, applied_at), which every claimed key
-- paid for. `idemflow_retention_sweeps` holds each pipeline's sweep: its cursor (`swept_to`, the last key id swept;
-- NULL at the start of a pass; so a sweep resumes where it stopped after a restart), the replica sweeping the pass
-- under way and until when its lease holds (`owner`, `lease_until`: one replica at a time), and the last full pass
-- (`last_pass_ended_at`, `last_pass_seconds`): a row lives at most its retention plus one full pass and
-- purge_interval (docs/operations.md, "Retention and growth"). Workers of the previous version keep claiming
-- correctly, but their purge (`DELETE ... ORDER BY applied_at LIMIT n`) reads and sorts the pipeline's whole key
-- range per statement without the index: stop them before migrating.
ALTER TABLE idemflow_dedup DROP INDEX dedup_pipeline_applied_at;
CREATE TABLE idemflow_retention_sweeps (
    pipeline           VARCHAR(255)   NOT NULL PRIMARY KEY,
    swept_to           VARBINARY(64)  NULL,
    owner              VARCHAR(255)   NULL,
    lease_until        DATETIME(6)    NULL,
    pass_started_at    DATETIME(6)    NULL,
    last_pass_ended_at DATETIME(6)    NULL,
    passes             BIGINT         NOT NULL DEFAULT 0,
    last_pass_seconds  DOUBLE         NULL,
    updated_at         DATETIME(6)    NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
