-- Sources without stable positions (RabbitMQ queues): a delivery tag numbers deliveries on one channel only, so a
-- dead letter from a queue is stored with partition -1 and an "offset" drawn from this sequence, which keeps the
-- unique constraint on (pipeline, topic, partition, "offset") as it is (workers of the previous version, still
-- running during a rolling upgrade, rely on it). A poison message redelivered after a crash between COMMIT and its
-- ack therefore gets a second row: a queue gives nothing to recognise it by.
CREATE SEQUENCE idemflow.queue_dead_letter_seq;
-- The message properties of a dead letter (RabbitMQ: message_id, correlation_id, exchange, routing_key, ...), as
-- name/value pairs like the headers.
ALTER TABLE idemflow.dead_letters
    ADD COLUMN property_names  text[] NOT NULL DEFAULT '{}',
    ADD COLUMN property_values text[] NOT NULL DEFAULT '{}';
