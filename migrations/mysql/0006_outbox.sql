-- The outbox (docs/outbox.md), as PostgreSQL's migration 13: effects outside the database (HTTP calls) written in
-- the batch's transaction for records whose business key was new, delivered after the commit by the worker's relay
-- (rows leased with FOR UPDATE SKIP LOCKED: MySQL 8.0 and MariaDB 10.6 or later), deleted once their target
-- confirmed them, moved to the dead letters (`delivery_failed`) when they can never succeed. A Kafka record
-- (`[[sink.kafka]]`) has method `PRODUCE`, its topic in `url`, its key in `record_key`. Headers are JSON arrays
-- as the dead letters keep them: names as strings, values as hex strings.
CREATE TABLE idemflow_outbox (
    id              BIGINT        NOT NULL AUTO_INCREMENT PRIMARY KEY,
    pipeline        VARCHAR(255)  NOT NULL,
    key_digest      BINARY(32)    NOT NULL,
    target          VARCHAR(255)  NOT NULL,
    method          VARCHAR(32)   NOT NULL,
    url             LONGTEXT      NOT NULL,
    header_names    LONGTEXT      NOT NULL,
    header_values   LONGTEXT      NOT NULL,
    body            LONGBLOB      NOT NULL,
    record_key      LONGBLOB      NULL,
    topic           VARCHAR(255)  NOT NULL,
    `partition`     INT           NOT NULL,
    `offset`        BIGINT        NULL,
    created_at      DATETIME(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    attempts        INT           NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    leased_until    DATETIME(6)   NULL,
    lease_owner     VARCHAR(255)  NULL,
    last_error      LONGTEXT      NULL,
    KEY outbox_pipeline_id (pipeline, id),
    KEY outbox_pipeline_key (pipeline, key_digest, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
ALTER TABLE idemflow_dead_letters ADD COLUMN request LONGTEXT NULL;
