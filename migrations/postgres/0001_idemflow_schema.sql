-- idemflow's own schema: the dedup store and the dead letters.
-- Business tables (the side effects' targets) are the user's; see pipelines/payments.sql for the example.

CREATE SCHEMA IF NOT EXISTS idemflow;

-- The dedup store: one row per (pipeline, business key) that has been applied.
-- The unique index holds a fixed-size SHA-256 digest of the key, not the key itself, so keys of any length fit
-- (a btree entry is limited to about a third of an 8 kB page). The key text is kept beside it for operators.
CREATE TABLE idemflow.dedup (
    pipeline      text        NOT NULL,
    key_digest    bytea       NOT NULL CHECK (octet_length(key_digest) = 32),
    business_key  text        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    "offset"      bigint      NOT NULL,
    fingerprint   bytea       NOT NULL,
    applied_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, key_digest)
);

-- Retention purges by age, per pipeline.
CREATE INDEX dedup_pipeline_applied_at ON idemflow.dedup (pipeline, applied_at);

-- Records that could not be applied, written in the same transaction as their batch.
-- Unique per source position, so a redelivered poison record is recorded once.
CREATE TABLE idemflow.dead_letters (
    id            bigserial   PRIMARY KEY,
    pipeline      text        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    "offset"      bigint      NOT NULL,
    record_key    bytea,
    header_names  text[]      NOT NULL DEFAULT '{}',
    header_values bytea[]     NOT NULL DEFAULT '{}',
    payload       bytea,
    reason        text        NOT NULL,
    error         text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (pipeline, topic, partition, "offset")
);
