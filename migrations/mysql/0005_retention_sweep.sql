-- Retention without an index written on every insert: the worker sweeps the dedup table in slices of its clustered
-- primary key, (pipeline, key_id), instead of finding old rows through (pipeline, applied_at), which every claimed key
-- paid for. `idemflow_retention_sweeps` keeps each pipeline's sweep cursor (the last key id swept; NULL at the start
-- of a pass) so a sweep resumes where it stopped after a restart, and the last full pass's duration: a row lives at
-- most its retention plus one full pass (docs/operations.md, "Retention and growth"). Workers of the previous version
-- keep working (their purge finds old rows by a scan instead of the index): stop them soon after migrating.
ALTER TABLE idemflow_dedup DROP INDEX dedup_pipeline_applied_at;
CREATE TABLE idemflow_retention_sweeps (
    pipeline          VARCHAR(255)   NOT NULL PRIMARY KEY,
    swept_to          VARBINARY(64)  NULL,
    pass_started_at   DATETIME(6)    NULL,
    passes            BIGINT         NOT NULL DEFAULT 0,
    last_pass_seconds DOUBLE         NULL,
    updated_at        DATETIME(6)    NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
