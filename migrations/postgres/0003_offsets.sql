-- Consumed positions for pipelines with `[offsets] store = "database"`: per partition, the offset of the next
-- record to consume, written in the same transaction as the batch that consumed up to it.
-- `owner_epoch` fences: a worker that is assigned a partition increments it and keeps the new value; its batch
-- transactions update the row only while the epoch is still theirs, so a worker that lost the partition can
-- neither move the position backwards nor overwrite the new owner's position (its whole batch rolls back).
CREATE TABLE idemflow.offsets (
    pipeline      text        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    next_offset   bigint      CHECK (next_offset >= 0),
    owner_epoch   bigint      NOT NULL DEFAULT 0,
    owner         text,
    claimed_at    timestamptz,
    updated_at    timestamptz,
    PRIMARY KEY (pipeline, topic, partition)
);
