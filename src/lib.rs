//! idemflow: exactly-once *effects* from at-least-once delivery (Kafka topics, RabbitMQ queues, RocketMQ topics,
//! NATS JetStream streams).
//!
//! # Layout
//!
//! Data flows one way, and each step is one module:
//!
//! ```text
//! source -> decode -> key -> sink transaction -> offset commit
//! ```
//!
//! - [`config`]: worker settings (`idemflow.toml`, figment) and pipelines (`pipelines/*.toml`), raw TOML turned
//!   into validated [`config::Pipeline`] values; every error names the file, the pipeline and the field.
//! - [`source`]: where records come from, one module per broker behind one enum: [`source::kafka`] (a consumer-group
//!   member: batches, partition ownership across rebalances, offset commits) and [`source::rabbitmq`] (a consumer
//!   per queue: batches acknowledged with `basic.ack` after COMMIT, reconnection after a lost channel) and
//!   [`source::rocketmq`] (a lite pull consumer in clustering mode: queues followed across rebalances, consume
//!   offsets updated after COMMIT) and [`source::nats`] (a durable JetStream pull consumer: each delivery
//!   double-acked after COMMIT, in-progress acks while it waits). Each broker's folder also holds its `check`, its dead-letter publisher
//!   (`[dead_letters] topic` for Kafka, `exchange` for RabbitMQ) and its half of `idemflow rewind`;
//!   [`source::rewind`] is what every rewind shares (never forward, never past the reset policy).
//! - [`record`]: one consumed record (a Kafka record, a RabbitMQ delivery or a RocketMQ message), owned, with its
//!   position.
//! - [`field`]: field paths (RFC 6901 JSON Pointers, or the dotted form) and how a JSON value becomes text;
//!   [`rounding`]: target columns that would round a value (`numeric(12, 2)`, `timestamptz(0)`), refused instead.
//! - [`decode`]: payload bytes to a JSON document, with the size limit checked before parsing: JSON, Avro (by the
//!   schema registry's schema ids or a schema file) and JSON Schema; [`schema_registry`]: the registry's client.
//! - [`key`]: the business key of a record and its SHA-256 digest.
//! - [`prepare`]: one record through decode, key and parameter extraction, into what the sink needs.
//! - [`sink`]: the batch protocol, once for every store: dedup claim, side effect, outbox rows, dead letters,
//!   duplicate and failure classification.
//! - [`outbox`]: effects outside the database (`[[sink.http]]`): the requests of a record rendered when it is
//!   prepared, written by the sink for new keys only, sent after the commit by the relay beside the pipeline.
//! - [`offsets`]: the next offset of each partition after a batch (the only place that adds 1), and the fenced
//!   positions stored in Postgres with `[offsets] store = "database"`.
//! - [`retention`]: the paced sweep that deletes dedup rows older than the pipeline's retention, slice by slice,
//!   resuming at a stored cursor.
//! - [`sweeper`]: the worker's side of it: a pass after another beside each pipeline, and the pass handed over
//!   when the worker stops.
//! - [`metrics`]: every Prometheus metric; [`http`]: `/metrics`, `/healthz`, `/readyz`.
//! - [`worker`]: runs every pipeline until shutdown; [`shutdown`]: the signal that stops it; [`panics`]: a caught
//!   panic's message (a pipeline stopped by one, a schema a parser panicked on).
//! - [`store`]: the database that holds the business data and idemflow's tables, one module per database behind
//!   one enum: [`store::postgres`], [`store::mysql`] (MySQL and MariaDB) and [`store::redis`] (a store whose
//!   side effect is Redis commands, a batch one script). [`telemetry`]: logging.
//! - Small leaves every layer may use: [`batch`] (batch settings), [`retry`] (backoff), [`dead_letter`] (what a
//!   dead letter keeps), [`secret`] (credentials never printed), [`terminal`], [`shutdown`].
//! - The tools, beside the worker's layers and above them (`tools` feature): `bench` (`idemflow bench`, the
//!   benchmark against its baselines), `demo` (`idemflow demo`, the whole job on an embedded broker and a
//!   throwaway store; its `broker` and `store` are the throwaway servers of every broker and store, one shape each,
//!   that the soak shares) and `soak` (`idemflow soak`, the guarantee held for an hour under faults at random
//!   moments, on one broker x store pair or on each in turn).
//!
//! The binary (`src/main.rs`) parses the command line; `src/cli/` has one file per command. Layers point one way:
//!
//! ```text
//! main -> cli -> tools (bench, demo, soak) -> worker -> sink -> prepare -> config -> {source, store} -> leaves
//! ```
//!
//! Sources and stores never import the worker, the sink or `config`: they take what they need of a pipeline
//! ([`source::contract::Context`], [`store::spec`]) and of the settings ([`source::spec::Brokers`], [`store::open::Stores`]).
//! A batch travels as one value ([`batch::Batch`]: its records, each record's prepared form, the positions computed
//! once) from the worker to the sink to the source's commit.
//!
//! # Where things go: a new broker or store
//!
//! A broker is one folder, `src/source/<broker>/`, implementing the contract of [`source::contract`]:
//!
//! - `mod.rs`: the folder's map; `spec.rs` (always built): its `[<broker>]` settings, its `[source]` spec with
//!   `parse` (the raw `[source]` keys to the spec, by the broker's own rules) and its
//!   [`source::contract::BrokerSpec`] (its `CAPABILITIES`, asked by the configuration's checks instead of its name;
//!   what `check` shows of it; what two pipelines must not share; its retention note and rewind refusal, in its own
//!   words);
//! - behind its cargo feature: `consumer.rs`, its [`source::contract::Connector`] (the runtime the worker drives:
//!   batches, `pause_for`, `commit`, and where it has them `drop_revoked`, `positions`, `lose`, `resync`: the
//!   defaults say "this connector cannot"; its `check` against the broker; its rewind), record conversion, and
//!   where it has them `rewind.rs` (its half of `idemflow rewind`, with [`source::rewind`]) and `dead_letters.rs`
//!   (its dead-letter publisher). A runtime grown past one room splits within the folder, as Kafka's has:
//!   `client.rs` (the client's settings), `ownership.rs` (partitions owned, rebalances), `check.rs`, `record.rs`,
//!   and `consumer/` (the runtime, with `claims.rs` for claimed, fenced and floored partitions).
//!
//! Outside its folder a broker is: one variant of [`source::Source`] and of [`source::spec::SourceSpec`], its line in
//! `each_source!` (`source/mod.rs`) and in `with_brokers!` (`source/spec.rs`: its spec type, its raw keys' field,
//! its settings section; every per-broker match there, [`source::spec::ALL`], [`source::spec::SourceKeys`] and
//! [`source::spec::parse`] are made from that list), its field of [`source::spec::Brokers`] and of the settings
//! (and their section name), a feature in `Cargo.toml`, and its row of the guarantee matrix (`tests/it/matrix.rs`:
//! how to publish, and the settings section). Its `[source]` keys are read and checked in its folder
//! ([`source::contract::BrokerSpec::parse`], with its `Raw` keys).
//!
//! A store is the same under `src/store/<store>/`, implementing the contract of [`store::contract`]: its
//! `connector.rs` ([`store::contract::Connector`] for what runs outside a batch, where the defaults say what the
//! store cannot do or need not; [`store::contract::BatchTx`] for a batch transaction, where it has interactive
//! transactions, or its own script as Redis: `sink/script.rs`), its side effect's [`store::contract::PreparedEffect`],
//! its error codes mapped into [`store::disposition::Disposition`]. Outside its folder: its settings and `[sink]`
//! form in [`store::spec`], one variant of [`store::Store`], [`store::SqlSideEffect`] or [`store::SideEffect`], and
//! [`store::Tx`], its line in each dispatch macro (`each_store!`, `each_tx!`, `each_effect!` in `store/mod.rs`), its
//! arms in [`store::open`] with its [`store::open::StoreCapabilities`], a feature in `Cargo.toml`, and its column of the
//! matrix (how its state is read).
//!
//! # Why a crash can neither lose a record nor apply it twice
//!
//! For every batch, one database transaction inserts one dedup row per business key (on PostgreSQL
//! `INSERT ... ON CONFLICT DO NOTHING RETURNING`, the returned ids gathered into one array, on MySQL/MariaDB `INSERT IGNORE ... RETURNING` or its token form,
//! always on the primary key `(pipeline, key_id)`, [`key::BusinessKey::key_id`]), runs the side effect only for the keys that insert
//! returned, writes the dead letters, and commits. In PostgreSQL's table form the claim and the table's `INSERT` are
//! one statement ([`store::Tx::claim_and_apply`]): the claim is a CTE whose `RETURNING` list is the only thing the
//! `INSERT` reads, so a business row is written exactly for a key that statement inserted, with the claim's waiting
//! for another transaction's uncommitted key unchanged; a failure of either part fails the statement, and with it
//! the transaction, as the two statements did. The argument below is PostgreSQL's wording; InnoDB gives the same
//! guarantees (a rolled-back transaction, an insert waiting for another's uncommitted duplicate key). Only after the commit are
//! the Kafka offsets committed, and an offset is only ever committed for records whose outcome is durable.
//!
//! All of it is under the pipeline's name, which is its identity: its dedup rows, processed marks, duplicate counts,
//! attempts, default consumer group and the prefix of its outbox's idempotency keys. A new name is a new history,
//! under which every record still in the topics is new; so a pipeline with no history of its own on topics another
//! pipeline of the store has processed (one not configured beside it: a renamed file, most likely) is refused by
//! `run` and `check` ([`worker::prepare`]) until its file keeps the old `name`, or `[dedup] new_history = true` says
//! a new history is meant (`hardening::a_renamed_pipeline_is_refused_until_it_keeps_its_name_or_starts_a_new_history_on_purpose`).
//! `idemflow pipeline rename` moves a history to a new name: every table's rows of the old name in one transaction
//! (all or nothing: a crash leaves the history whole under one name or the other), refused where the new name has a
//! history of its own or a worker of the old one ran a batch in the last minute; outbox rows keep the idempotency
//! keys they were written with (`[outbox] key_prefix` keeps the old prefix for new ones), and a consumer group new
//! under the new name moves on to the moved processed floors
//! (`outbox::a_pipeline_renamed_on_purpose_keeps_its_history_on_postgres`).
//!
//! - Crash before or inside the transaction: Postgres rolls it back; nothing was applied and no offset was
//!   committed, so the records are delivered again and applied then.
//! - Crash between the database commit and the offset commit: the records come back, their dedup rows exist, the
//!   claim returns nothing for them, and the side effect does not run again. They are counted as `redelivered`.
//!   The guarantee matrix kills the binary at exactly this point for every broker x store pair
//!   ([`worker::CRASH_AFTER_COMMITS_VAR`], `tests/it/matrix.rs`, scenario (b)): the batch comes back as
//!   `redelivered` where the broker keeps the positions, and nothing comes back where they are stored with it.
//! - A connection lost during `COMMIT` (outcome unknown), or an attempt abandoned at `[database] batch_timeout`: the
//!   batch is retried on a new connection. Whichever way the first commit went, the dedup rows decide: applied once.
//!   The counts are right too: every batch transaction first records its attempt's number in the lane's row of the
//!   attempts table ([`store::Tx::mark_attempt`]), which waits for a previous attempt still open on the server and
//!   returns the last committed number. When that is an earlier attempt of this batch that had sent its `COMMIT`, the
//!   retry is rolled back and the batch's outcome is that attempt's ([`sink::Attempt`]): no `redelivered` or
//!   `republished` for the worker's own records, no dead letter counted twice. When it is one that never reached
//!   its `COMMIT` (a side effect that ended the transaction itself, then a retryable failure), the pipeline stops:
//!   part of the batch may be committed without the rest. Tested with a lost answer injected
//!   ([`worker::Faults::lose_commit_answer`]) on PostgreSQL and MariaDB, and a procedure's `COMMIT` followed by a
//!   lock wait timeout (`tests/it/hardening.rs`, `tests/it/mariadb.rs`). On Redis the script keeps its own answer,
//!   in the same atomic run as the effects, under the batch's number (its first attempt's, the same on every
//!   attempt; one key per lane): a retry after an attempt that failed gets that answer back when that attempt ran,
//!   and writes nothing; when it did not run, the key holds another batch's number and the batch runs
//!   (`store/redis/batch.lua`, steps 0 and 5). Tested with the same injected lost answer
//!   (`redis::a_lost_script_answer_counts_the_batch_once`: 2,000 records counted `redelivered` before). On PostgreSQL an attempt abandoned at
//!   `batch_timeout` before its `COMMIT` has its server session ended (`Store::end_session`, on a connection of its
//!   own, matched by the backend pid and the transaction start the attempt marker returned, so a session that
//!   moved on is never touched): its transaction is rolled back there, not left in the statement it was stuck in
//!   holding its claims' row locks (which the retry's claims would wait on) and a pool connection. Ending it loses
//!   nothing: it had not committed. One that sent its `COMMIT` is left alone (and one waiting for a synchronous
//!   standby is never terminated): ended there, its commit could stand without the standby, and the retry would
//!   take it for committed. Tested: `network::an_attempt_abandoned_on_batch_timeout_has_its_session_ended`.
//! - Rebalance: records buffered for a revoked partition are dropped before processing, and an offset is committed
//!   only for partitions this consumer still owns. The new owner may receive records whose effects are already
//!   durable; the dedup rows skip them.
//! - Two workers with the same key at once: the unique constraint makes the second `INSERT` wait for the first
//!   transaction; if it commits, the second claims nothing; if it rolls back, the second claims the key.
//! - Two workers that compute a key's identity differently would each claim it once: the unique index only sees
//!   bytes. So a change of identity (migration 0007 on PostgreSQL, 0002 on MySQL/MariaDB: from a SHA-256 digest to
//!   the ordered `key_id`) moves every stored row to the new identity and renames the column in the same step: a
//!   worker of the previous version, still running in a rolling upgrade, fails every batch from then on (its claim
//!   names `key_digest`) and applies nothing; its batch under way when the migration starts is waited for and
//!   moved with the rest (PostgreSQL's DDL is transactional; on MySQL the rename is the first change, and this
//!   version's workers refuse a schema whose migration is not recorded as complete). A stored row whose key text is
//!   not what its digest was made of (a non-UTF8 database encoding, a hand edit) would get an id the worker never
//!   computes: the migration checks every row first and stops, changing nothing, if one is not. Its rollback
//!   (`migrations/rollback/`) renames the column back, which fences this version the same way. Tested with the
//!   previous version's claim held open across the migration, with an edited key, and after the rollback
//!   (`tests/it/upgrade.rs`).
//!   PostgreSQL's migration 12 (the narrower dedup row) keeps every key id, and fences the previous version the same
//!   way: its rows are copied into a table without `business_key`, which the previous claim names. It changes no
//!   claim: the unique index is still `(pipeline, key_id)`. What it narrows is the classification's input: the
//!   stored fingerprint is the first 16 bytes of the payload's SHA-256, compared as a prefix
//!   ([`store::rows::Existing::same_payload`]), so only a duplicate's reason could change, never whether it is one.
//!   The duplicate counts (`idemflow.dedup_duplicates`) are written in the batch's transaction after the claim, with
//!   the dedup row they count for share-locked (`FOR KEY SHARE`: the retention sweep skips it, and a claim never
//!   waits on it) and its `applied_at`, so a count is never shown for a later row of the same key. What the copy
//!   would not carry over (a trigger, an index, a policy, a publication, a view of the user's) stops the migration
//!   with nothing changed, rather than drop it silently (a publication feeding a failover replica would otherwise
//!   stop carrying dedup rows there).
//!
//! - RabbitMQ: a batch is acknowledged (`basic.ack`, `multiple`) only after its COMMIT; a crash or a lost channel
//!   before that makes the broker requeue it, and the dedup rows skip what was applied (see [`source::rabbitmq`]).
//! - RocketMQ: a queue's consume offset is updated only after COMMIT; a crash before that replays the batch from
//!   the last consume offset, as for Kafka (see [`source::rocketmq`]).
//! - NATS JetStream: every delivery of a batch is acknowledged with a double ack (the server confirms it) only after
//!   COMMIT; the consumer must have explicit acks (checked by `check` and `run`). A crash, a lost connection or an
//!   unconfirmed ack before that leaves the delivery pending on the server, which redelivers it after `ack_wait`
//!   with the same stream sequence: its dedup row skips it as `redelivered`. While a batch waits for its
//!   transaction (or retries through an outage), in-progress acks every third of `ack_wait` keep the server from
//!   redelivering it meanwhile; one that expires anyway is only a redelivery, skipped the same way. A consumer
//!   deleted under the worker stops the pipeline: it is never created again silently (see [`source::nats`]).
//!
//! - A side effect that ends the transaction itself breaks "one transaction": on MySQL/MariaDB a procedure's
//!   `START TRANSACTION`/`COMMIT` (or any statement that commits implicitly) would commit the batch's claims at the
//!   first record, and a later failure would make the redo (or a retry) find every key claimed. So `sink.sql` accepts only
//!   statements that cannot commit (read past comments; `CALL` only with `allow_procedures`), and before the
//!   record-by-record redo and before `COMMIT` the worker checks that the transaction it opened is still open
//!   ([`store::mysql::transaction_open`]); if not, the pipeline stops instead of counting records as duplicates.
//!   Before a retry, the attempt record (above) tells the same: an earlier attempt found committed that never sent
//!   its `COMMIT` stops the pipeline. The keys it left claimed without their effects are released by the operator
//!   (`idemflow dedup forget`, which lowers the processed floor with them). PostgreSQL refuses transaction control inside a function or a procedure called in a transaction block.
//! - A batch stopped by the server's time limit for one statement (PostgreSQL `statement_timeout`, MariaDB
//!   `max_statement_time`, MySQL `max_execution_time`; told by SQLSTATE or error number, never by the message,
//!   [`store::error::time_limit`]) rolls back like any failed attempt; it is redone record by record (each statement
//!   timed on its own) rather than retried whole forever. A record whose side effect alone exceeds the limit rolls
//!   the attempt back and the batch is retried ([`sink::error::SOLO_TIME_LIMIT_ATTEMPTS`], over
//!   [`sink::error::SOLO_TIME_LIMIT_SPAN`] at least): a lock wait or a stall is not the record's fault; only slow alone in
//!   every one of those attempts is it dead-lettered, nothing committed for it, its claim rolled back with its
//!   savepoint.
//! - A worker that vanishes mid-batch (no FIN, no RST) holds nothing for long: its transaction is ended by the
//!   server once idle past [`store::spec::IDLE_IN_TRANSACTION_TIMEOUT`], or once TCP keepalives find the peer gone
//!   while a statement runs; a rollback like any crash. A live worker whose session the server ended that way
//!   (FATAL 25P03, 25P04) retries the batch as after a lost connection. The outbox relay's transactions on
//!   PostgreSQL (a lease, a round's outcomes) are bounded the same way: rows a vanished relay had locked go back to
//!   the other relays' `SKIP LOCKED` within that timeout, not the server's TCP timeout (the lease's own time bounds
//!   the rest).
//! - Each record is applied with its own values: a batch is one value ([`batch::Batch`]) whose records and prepared
//!   forms change only together (records dropped during a back-off, a fenced or lost partition's records taken out,
//!   everything prepared again after the statements were rebuilt), and whose positions are computed from the
//!   records it holds; sources take records out through [`batch::Records`] and never see prepared forms, and the
//!   sink takes the batch whole.
//! - A value its column would round is refused before the transaction (`param_invalid`): the effect applied is the
//!   record's, or none.
//! - Records prepared ahead: while a batch is in its transaction, the records received meanwhile are decoded, keyed
//!   and their values taken ([`prepare::Ahead`]); nothing is claimed, written or acknowledged for them then. A
//!   batch uses an entry only for the record it was made from (found by its [`record::Receipt`], never given twice
//!   in a process; a record received again, on a new channel or after a rebalance, is a new receipt), and preparing
//!   depends on nothing but the record and the statements: what the batch binds is what preparing it then would
//!   give. A rebuild of the statements (a schema change) drops every entry; a record dropped before its batch
//!   leaves its entry unused. Tested with a batch stalled on a lock while the table's column types change
//!   (`tests/it/hardening.rs`).
//! - Schemas from the registry: the schemas a record's payload and record key name (wire format) are fetched
//!   before its batch is prepared (and a record waiting on one is never prepared ahead), while the source serves
//!   its broker; each request is bounded by `[schema_registry] timeout`. While the registry does not answer, the
//!   batch waits with consumption paused and nothing claimed, written or acknowledged. The registry's own "no such
//!   schema" (error codes 40401 to 40403) is waited on too, for `missing_schema_wait` (a follower not caught up
//!   with a new schema must not dead-letter its records); only after that wait is the record a dead letter. A
//!   schema found is kept for the process's life, so a prepared record decodes the same on every retry of its
//!   batch. Tested with the registry answering 503
//!   (`formats::a_registry_outage_pauses_the_pipeline_and_dead_letters_nothing`) and learning an id while it is
//!   waited on (`formats::an_id_the_registry_learns_while_waited_on_is_read_not_dead_lettered`).
//!
//! - Retention deletes a dedup row only once it is older than `[dedup] retention` by the database's clock at the
//!   slice's transaction ([`retention`]): each slice is one transaction with its cursor, so a worker killed in a
//!   slice rolls it back and resumes at the last committed cursor, deleting nothing early. On PostgreSQL a slice never
//!   waits on a row a batch holds (`SKIP LOCKED`: the row waits for the next pass); on MySQL/MariaDB its `DELETE`
//!   waits for one as any statement does (a deadlock rolls one transaction back, and a batch retries). A worker
//!   that stops gives up its lease on a pass once its pipeline has stopped (no slice of its can run then), keeping
//!   the cursor; one killed keeps the lease until it runs out. Either way the pass resumes at the stored cursor. A
//!   row lives at most its retention plus a full pass and `purge_interval`; what a record redelivered after that
//!   meets is the next point. Tested: `tests/it/retention.rs`, `mariadb::the_sweep_walks_the_primary_key_in_slices_one_replica_at_a_time`.
//! - A consumer group that starts over (its committed offsets expired after `offsets.retention.minutes`, a new
//!   `group_id`) replays records whose dedup rows may have been purged since. Every batch's transaction reads its
//!   partitions' processed marks and their floor ([`offsets::Mark`]) first, under the rows' locks, and raises them
//!   last, just before `COMMIT` (so a side effect that ends the transaction itself never commits a floor above
//!   records it did not apply): a record below the floor was processed by a committed batch, so it is neither claimed nor applied
//!   again, whatever its dedup row says (counted `redelivered`); only `idemflow rewind` lowers the floor (the
//!   operator's replay, applied where no dedup row covers it). A floor is undone only by evidence about the log
//!   itself, never by the records' timestamps (a producer's clock, a business time): each mark remembers the
//!   identity of the log it was raised on ([`offsets::Log`]: Kafka's topic id, a JetStream stream's creation time),
//!   and before each attempt the source says the log's identity and end ([`source::contract::Connector::logs`]);
//!   another identity (the topic was deleted and created again), or a log that ends below the mark (created again,
//!   or truncated), renews the partition's marks at the batch's first offset in the same transaction, and its
//!   records are claimed as new, their dedup rows deciding ([`offsets::Processed::renewals`]; a truncated log's last
//!   records were processed recently, so their rows are kept). Kafka's topic ids are asked off the batch path, by a
//!   thread of the source's own every 10 s (a topic's first batch waits at most 5 s for its first answer): a batch
//!   is judged on an id at most that old (and on none 60 s after the cluster last answered), so a topic created again in those seconds and filled past the old mark
//!   before its first batch is skipped below the mark like one without ids. A broker that gives no identity and a
//!   topic created again that already reaches the old mark cannot be told from a replay: its records below the mark
//!   are skipped, with a warning where they are stamped after it (`idemflow rewind` applies them). Tested with records stamped an hour ahead, purged and replayed by a new group
//!   (nothing applied twice), a Kafka topic created again longer than the old mark (another topic id) and shorter
//!   (noida-db, no topic ids), a JetStream stream created again (`nats::a_new_poison_message_at_the_sequence_of_an_old_one_...`), a purge and a new group, and a rewind (`tests/it/offsets.rs`). A committed batch that ended below
//!   a floor moves the Kafka consumer on to it (seek and offset commit after the batch's: [`sink::BatchOutcome::floors`]):
//!   everything below a floor was processed by a committed batch, so nothing is skipped that was not, and a crash
//!   before that commit only fetches the batch below the floor again. Not where a record below the floor is newer
//!   than the mark, or the broker does not say (a topic created again is judged batch by batch, never jumped over),
//!   nor with a dead-letter topic (the dead letters below the floor are published again after a crash). A dead letter is unique by its
//!   position and its payload's digest ([`record::Record::payload_sha256`]): a poison record at a position reused by
//!   a topic or a JetStream stream created again is kept as a dead letter of its own, never taken for a redelivery
//!   of the one dead-lettered there (`nats::a_new_poison_message_at_the_sequence_of_an_old_one_...`).
//!
//! # The outbox: effects outside the database
//!
//! An HTTP request (`[[sink.http]]`, [`outbox`]) cannot join the transaction, so it is written into it: the batch
//! inserts the request's row into the outbox after the claim, only for records whose claim returned their key
//! ([`store::Tx::write_outbox`]), and the row commits or rolls back with the dedup row. A duplicate never writes one,
//! so there is one row per business key (and request). Everything before `COMMIT` is as above. After it, the relay:
//!
//! 1. leases due rows in a short transaction of its own (`FOR UPDATE SKIP LOCKED`, then `leased_until`, the attempt
//!    counted): two relays never hold one row at once, and a key's next row is not due while an older row of the key
//!    is left (it is sent in order, one at a time);
//! 2. sends each with `Idempotency-Key: <pipeline>:<business key>` (with `:<target>` after it where the pipeline
//!    has several targets), the same on every attempt and from every worker ([`outbox::render::idempotency_key`]),
//!    rendered into the row when it was written, bounded by its `timeout`;
//! 3. records the outcomes in one transaction ([`store::Store::outbox_settle`]): a confirmed row deleted (whoever
//!    holds its lease by then: the target confirmed it), a retry given its next attempt and its lease given up (only
//!    by its holder), a failure moved whole to the dead letters (`delivery_failed`, only by its holder).
//!
//! - A crash, kill or lost database connection before 3 commits (the target may have confirmed): the row stays,
//!   leased until `[outbox] lease` (the longest `timeout` plus 5 s at least) runs out; a relay then leases it and sends it
//!   again, with the same key, which a target honouring the IETF httpapi draft "The Idempotency-Key HTTP Header Field"
//!   answers from its record of the first request: applied once. A target that ignores the key applies it again;
//!   that is the at-least-once docs/outbox.md states. Tested with the worker aborted right after the target's
//!   confirmation ([`outbox::relay::CRASH_AFTER_DELIVERIES_VAR`]) on PostgreSQL and MariaDB
//!   (`outbox::a_crash_after_the_target_confirmed_charges_once_on_*`).
//! - A relay stalled past its lease (a frozen process) may find its row leased and sent by another: the target sees
//!   the key twice at once and answers the draft's 409 to one, which is retried; whichever confirms first deletes the
//!   row, and the other's record finds nothing to do. Nothing is sent without its lease having been taken first.
//! - A record of 3 that fails (three tries) keeps the round's outcomes in the relay, recorded with its next round;
//!   a row among them its target confirmed is not sent again by this relay meanwhile, even leased again by it. A
//!   round that outlasts its lease is logged: another relay may have sent its rows again, with the same keys.
//! - A stop: the relay ends its round (bounded by the lease), then gives its leases up: the rows go at once to
//!   another relay.
//! - Kafka records (`[[sink.kafka]]`) go the same way, acknowledged by the brokers (`acks=all`, an idempotent
//!   producer, which removes the duplicates of its own retries). A record produced again after a crash between the
//!   acknowledgement and 3 is another record in the topic, with the same `Idempotency-Key` header: at least once
//!   there, as docs/outbox.md says (`outbox::kafka_records_are_produced_for_new_keys_with_their_idempotency_header`).
//! - A row is deleted only after its target answered a `success` status; a lost answer is a retry. A status that
//!   can never succeed, or the last of `max_attempts`, moves it to the dead letters in the same transaction as its
//!   deletion, its request kept whole, only while its relay still holds it (PostgreSQL in one statement; MySQL and
//!   MariaDB lock the row first, so a row another relay leased meanwhile is never both delivered and dead-lettered),
//!   and only the rows moved are counted and logged as dead letters; `dead-letters replay` moves it back, in one transaction too. Nothing retries
//!   silently forever: attempts are counted at each lease, and a row leased more than `max_attempts` times without an
//!   answer recorded (its worker stopped or crashed during each) is dead-lettered without being sent again.
//! - Back-pressure pauses consumption (the batch in hand held, nothing committed) while the outbox is over its
//!   bounds; it bounds the outbox's growth, never what is applied.
//! - A row is sent only where it was written for, with the credentials configured now ([`outbox::deliver::outgoing`],
//!   [`outbox::guard`]): a row of another origin (the target moved since it was written), a host from a record no
//!   longer in `allow_hosts`, or a topic no longer in `allow_topics` is rejected before any byte is sent (a
//!   `delivery_failed` dead letter saying why; its replay re-homes it to the target's origin now, in the same
//!   transaction that moves it back); a secret that cannot be read now (a file not mounted yet) is a retry with
//!   nothing sent. Neither sends a request twice nor loses one: the row is kept, or moved whole, with its key.
//!   (`outbox_security::a_row_written_for_another_origin_is_re_homed_by_a_replay_never_sent_with_todays_credentials`.)
//!
//! The dedup row and the effect are in the same transaction, so "marked as seen" and "applied" are one fact: there
//! is no window in which a key is claimed but its effect is lost. No cache in memory ever claims a key.
//! The Kafka offset commit is therefore only an optimisation that bounds how much is replayed.
//!
//! Redis ([`store::redis`]) has no transaction to roll back, and its durability is its `appendfsync`. The same
//! argument holds with a script in place of the transaction: Redis runs a script with nothing in between, so a
//! batch's dedup keys (`SET NX PX`), effects and stored positions are written together; a crash of the worker
//! before or after the script is as above. What Redis adds: it may lose its last acknowledged writes (a machine crash
//! under `everysec`); the positions are lost with the effects, each batch checks that the positions it stored last are
//! still there, and the worker resumes from what Redis kept. A command failing inside the script is not undone: the
//! record is dead-lettered with the count of its commands that ran, its key kept so no copy runs them again. What
//! can be known before a record's commands run is checked before them, so that no record is left half applied for
//! a reason that is not its own: every number a command takes, as Redis parses it (else `param_invalid`, nothing
//! run), and the ACL (`redis.acl_check_cmd`, Redis 7.0+), asked for every record of the batch before the script
//! writes anything: a command the user may not run refuses the whole batch with nothing written (no key claimed, no
//! replayed dead letter taken), and the pipeline stops. Dead letters decided inside a script cannot be
//! rolled back: the dead-letter ratio guard counts them after it, and stops the pipeline after that batch.
//!
//! With `[offsets] store = "database"` a claim is made only for partitions this worker still owns (checked before
//! the claim and again after it); a partition fenced by a claim that landed late is claimed again after a delay
//! while it is still assigned here, and then sought to its stored position, so it is never left paused. A stored
//! position is the one place a worker starts without looking at the records below it, so it is not trusted across a
//! topic created again: when the topic's id is not the one its processed mark was raised on ([`offsets::Claimed::log`]),
//! or the partition holds nothing produced before the position was stored and records below it
//! ([`offsets::Claimed::stored_at_ms`]: starting earlier costs fetching, never an effect), the partition starts at its
//! log start instead, and the processed marks above decide, on evidence about the log, what was processed
//! (`tests/it/offsets.rs`).
// The worker's futures (a batch polled beside the Kafka consumer's select) nest deeper than the default 128.
#![recursion_limit = "256"]

pub mod batch;
#[cfg(feature = "tools")]
pub mod bench;
pub mod config;
pub mod dead_letter;
pub mod decode;
pub mod schema_registry;
#[cfg(feature = "tools")]
pub mod demo;
pub mod field;
pub mod http;
pub mod key;
pub mod metrics;
pub mod offsets;
pub mod outbox;
pub mod prepare;
pub mod record;
pub mod retention;
pub mod retry;
pub mod rounding;
pub mod panics;
pub mod secret;
pub mod shutdown;
pub mod sink;
pub mod sweeper;
#[cfg(feature = "tools")]
pub mod soak;
pub mod source;
pub mod store;
pub mod telemetry;
pub mod validate;
pub mod terminal;
pub mod worker;

/// Selects *ring* as the process's TLS crypto provider (rustls), once; later calls do nothing. Every TLS client of
/// idemflow (PostgreSQL, MySQL, RabbitMQ, Redis) uses rustls with *ring*; the RocketMQ client brings rustls with
/// aws-lc-rs too, and with both in the build rustls cannot pick a default by itself (it panics at the first TLS
/// connection that relies on the default). Called at start (`main`) and before building a TLS client in library code.
pub fn install_tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[cfg(not(feature = "postgres"))]
compile_error!(
    "idemflow needs the `postgres` feature: PostgreSQL is the store every build has (the reference batch protocol and \
     the tools run on it); leave out the others: cargo build --no-default-features --features kafka,postgres"
);
