-- idemflow's own tables on MySQL (8.0 and later) and MariaDB (10.5 and later), in the database of the connection
-- URL, beside the business tables (a transaction spans both). The same meaning as the PostgreSQL schema
-- (migrations/postgres), in one migration. InnoDB, utf8mb4, binary collation: keys and names compare byte for byte.

-- The dedup store: one row per (pipeline, business key) that has been applied. The primary key holds the SHA-256
-- digest of the key, not the key itself, so keys of any length fit (an InnoDB index entry is limited to 3072 bytes).
-- claim_token: on servers without INSERT ... RETURNING (MySQL), the batch that inserted the row, so the claim can
-- tell which rows it inserted.
CREATE TABLE idemflow_dedup (
    pipeline          VARCHAR(255)  NOT NULL,
    key_digest        BINARY(32)    NOT NULL,
    business_key      LONGTEXT      NOT NULL,
    topic             VARCHAR(255)  NOT NULL,
    `partition`       INT           NOT NULL,
    `offset`          BIGINT        NOT NULL,
    fingerprint       BINARY(32)    NOT NULL,
    applied_at        DATETIME(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    duplicates        BIGINT        NOT NULL DEFAULT 0,
    last_duplicate_at DATETIME(6)   NULL,
    claim_token       BINARY(16)    NULL,
    PRIMARY KEY (pipeline, key_digest),
    KEY dedup_pipeline_applied_at (pipeline, applied_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Records that could not be applied, written in the same transaction as their batch; unique per source position,
-- so a redelivered poison record is recorded once (`redeliveries` counts the others). A queue's dead letter has no
-- stable position: its `offset` is NULL (a unique index allows many), and it is shown numbered by its id.
-- Headers and message properties are JSON arrays: names as strings, header values as hex strings or null.
CREATE TABLE idemflow_dead_letters (
    id              BIGINT        NOT NULL AUTO_INCREMENT PRIMARY KEY,
    pipeline        VARCHAR(255)  NOT NULL,
    topic           VARCHAR(255)  NOT NULL,
    `partition`     INT           NOT NULL,
    `offset`        BIGINT        NULL,
    record_key      LONGBLOB      NULL,
    header_names    LONGTEXT      NOT NULL,
    header_values   LONGTEXT      NOT NULL,
    property_names  LONGTEXT      NOT NULL,
    property_values LONGTEXT      NOT NULL,
    payload         LONGBLOB      NULL,
    payload_bytes   BIGINT        NULL,
    payload_sha256  BINARY(32)    NULL,
    reason          VARCHAR(64)   NOT NULL,
    error           LONGTEXT      NOT NULL,
    redeliveries    BIGINT        NOT NULL DEFAULT 0,
    created_at      DATETIME(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    UNIQUE KEY dead_letters_position (pipeline, topic, `partition`, `offset`)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Consumed positions for pipelines with `[offsets] store = "database"`, fenced by `owner_epoch` (see the PostgreSQL
-- migration 0003 for the protocol).
CREATE TABLE idemflow_offsets (
    pipeline      VARCHAR(255)  NOT NULL,
    topic         VARCHAR(255)  NOT NULL,
    `partition`   INT           NOT NULL,
    next_offset   BIGINT        NULL,
    owner_epoch   BIGINT        NOT NULL DEFAULT 0,
    owner         VARCHAR(255)  NULL,
    claimed_at    DATETIME(6)   NULL,
    updated_at    DATETIME(6)   NULL,
    PRIMARY KEY (pipeline, topic, `partition`),
    CHECK (next_offset >= 0)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The positions each pipeline has processed: per partition, one past the highest offset whose batch committed; only
-- ever raised. A record below it is a redelivery.
CREATE TABLE idemflow_processed (
    pipeline      VARCHAR(255)  NOT NULL,
    topic         VARCHAR(255)  NOT NULL,
    `partition`   INT           NOT NULL,
    next_offset   BIGINT        NOT NULL,
    updated_at    DATETIME(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (pipeline, topic, `partition`),
    CHECK (next_offset >= 0)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
