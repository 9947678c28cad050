-- The positions each pipeline has processed: per partition, one past the highest offset whose batch committed.
-- Written in every batch transaction (whichever `[offsets] store`), only ever raised, and never moved by
-- `idemflow rewind`: a record below it was processed before, so when it comes again (a redelivery, a rewind, a
-- rebalance) it is counted as `redelivered`, whatever the reason its first delivery was skipped for.
CREATE TABLE idemflow.processed (
    pipeline      text        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    next_offset   bigint      NOT NULL CHECK (next_offset >= 0),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, topic, partition)
);
