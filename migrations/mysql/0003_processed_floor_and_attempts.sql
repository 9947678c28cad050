-- The processed marks get a floor: where the pipeline may consume each partition from again without an operator's
-- `idemflow rewind`. A record below it that comes back (the consumer group's committed offsets expired, a new
-- group_id, auto.offset.reset to the log start) was processed before, and its dedup row may have been purged since:
-- it is skipped (counted redelivered), never claimed or applied again. `idemflow rewind` lowers it; every batch
-- raises it to the batch's next offset. NULL (rows a worker of the previous version inserts during a rolling
-- upgrade) reads as next_offset. The previous version's workers keep working: no fence.
ALTER TABLE idemflow_processed ADD COLUMN resume_from BIGINT NULL;
UPDATE idemflow_processed SET resume_from = next_offset;

-- The last batch attempt each worker lane committed, per pipeline: written first in every batch transaction, so
-- the attempt after one whose COMMIT went unanswered learns whether it committed (see the PostgreSQL migration 9).
CREATE TABLE idemflow_attempts (
    pipeline     VARCHAR(255)  NOT NULL,
    owner        VARCHAR(255)  NOT NULL,
    attempt      BIGINT        NOT NULL,
    previous     BIGINT        NULL,
    updated_at   DATETIME(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (pipeline, owner)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
