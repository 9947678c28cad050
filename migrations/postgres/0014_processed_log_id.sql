-- The processed marks remember which log they were raised on: the identity the broker gives the partition's log
-- (Kafka's topic id, KIP-516, brokers from 2.8; a JetStream stream's creation time). A topic deleted and created
-- again under the same name has another one, so its records below the old marks are processed as new; records
-- of the same log below a floor are skipped as processed whatever their timestamps say (a producer's clock running
-- ahead, a future business time). NULL where the source gives none, and for marks of earlier versions until a
-- batch raises them. The previous version's workers keep working (they do not name the column): no fence.
ALTER TABLE idemflow.processed ADD COLUMN log_id text;
