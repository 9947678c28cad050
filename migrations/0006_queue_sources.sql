-- Sources without stable positions (RabbitMQ queues): a delivery is stored with partition -1 and its delivery tag as
-- "offset" (it numbers deliveries on one channel only, so it identifies nothing after the channel is gone).
-- Dead letters stay unique per position only where a position means something (partition >= 0: Kafka); a poison
-- message from a queue that is redelivered after a crash between COMMIT and its ack gets a second row.
ALTER TABLE idemflow.dead_letters DROP CONSTRAINT dead_letters_pipeline_topic_partition_offset_key;
CREATE UNIQUE INDEX dead_letters_position ON idemflow.dead_letters (pipeline, topic, partition, "offset")
    WHERE partition >= 0;
-- The message properties of a dead letter (RabbitMQ: message_id, correlation_id, exchange, routing_key, ...), as
-- name/value pairs like the headers.
ALTER TABLE idemflow.dead_letters
    ADD COLUMN property_names  text[] NOT NULL DEFAULT '{}',
    ADD COLUMN property_values text[] NOT NULL DEFAULT '{}';
