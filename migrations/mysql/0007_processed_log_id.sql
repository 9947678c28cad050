-- The processed marks remember which log they were raised on (see the PostgreSQL migration 14): the identity the
-- broker gives the partition's log (Kafka's topic id; a JetStream stream's creation time). NULL where the source
-- gives none, and for marks of earlier versions until a batch raises them. No fence: the previous version's
-- workers do not name the column.
ALTER TABLE idemflow_processed ADD COLUMN log_id VARCHAR(128) NULL;
