-- The processed marks get a floor: where the pipeline may consume each partition from again without an operator's
-- `idemflow rewind`. A record below it that comes back (the consumer group's committed offsets expired after
-- offsets.retention.minutes, a new group_id, auto.offset.reset to the log start) was processed before, and its
-- dedup row may have been purged since: it is skipped (counted redelivered), never claimed or applied again.
-- `idemflow rewind` lowers it to where it moves the group; every batch raises it to the batch's next offset.
-- NULL (rows a worker of the previous version inserts during a rolling upgrade) reads as next_offset. The previous
-- version's workers keep working (they do not name the column): no fence.
ALTER TABLE idemflow.processed ADD COLUMN resume_from bigint CHECK (resume_from >= 0);
UPDATE idemflow.processed SET resume_from = next_offset;

-- The last batch attempt each worker lane committed, per pipeline: written first in every batch transaction, so
-- the attempt after one whose COMMIT went unanswered (a connection lost, `batch_timeout`) learns whether it
-- committed: if so, the batch is not run again and its counts are the committed attempt's (no `redelivered` or
-- `republished` for the worker's own records), and an attempt that ended before its COMMIT but is found committed
-- (a side effect that ended the transaction itself) stops the pipeline. `owner` is the lane (`host/pid[/lane]`);
-- rows of lanes gone for a day are deleted by the purge.
CREATE TABLE idemflow.attempts (
    pipeline     text        NOT NULL,
    owner        text        NOT NULL,
    attempt      bigint      NOT NULL,
    previous     bigint,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, owner)
);
