//! The Kafka source's partitions and their positions beyond the poll loop: a claim's outcome assigned from the
//! stored positions (a topic created again sent back to its log start), fenced partitions given up and claimed again,
//! positions the store lost claimed anew, and partitions moved on to their processed floors. See the module
//! documentation of [`super`] for the protocol.

use super::*;

impl KafkaSource {
    /// Gives up partitions whose stored positions another worker has claimed (a fenced batch): they count as
    /// revoked (buffered records are dropped, no offset is committed for them) and consumption of them stays
    /// paused (retries do not resume them) until the group assigns them to this worker again, which claims them
    /// anew, or until [`KafkaSource::fenced_for`] has passed while the group still assigns them here: they are then
    /// claimed again and resumed ([`KafkaSource::reclaim_fenced`]; under a cooperative assignor a partition that does
    /// not move is not assigned again, and a claim that fenced this worker may have come late from a worker that no
    /// longer holds the partition). Their records are removed from `batch` too.
    ///
    /// A partition that this worker itself claimed again while the batch was in flight (a rebalance that revoked
    /// and re-assigned it; `used` holds the epochs the batch presented) is not given up: only the batch's records
    /// of it are dropped, and they come again from the stored position the new claim started it at.
    pub(super) fn give_up_fenced(&mut self, partitions: &[(String, i32)], used: Option<&Positions>, batch: &mut dyn Records) {
        let mut pause = TopicPartitionList::new();
        let until = Instant::now() + self.fenced_for;
        {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            for (t, p) in partitions {
                let tp = tp_of(t, *p);
                let presented = used.and_then(|u| u.0.iter().find(|(ut, up, _, _)| **ut == **t && up == p)).map(|u| u.3);
                let reclaimed = st.assigned.contains(&tp) && st.epochs.get(&tp).is_some_and(|e| Some(*e) != presented);
                if reclaimed {
                    // Only the batch's records: what was kept since the new claim follows its stored position.
                    self.revoked_in_flight.insert(tp);
                    continue;
                }
                st.give_up(tp.clone());
                st.fenced.insert(tp, until);
                pause.add_partition(t, *p);
                self.metrics.offset_commit(CommitResult::Fenced);
                // Its stall clock goes on: its records wait, and nothing applies them until it is claimed again
                // (a claim that keeps failing shows as a stall; [`KafkaSource::refresh_lag`] keeps it up to date).
            }
            self.metrics.assigned_partitions(st.assigned.len());
        }
        self.drop_revoked_in_flight(batch);
        if pause.count() > 0 {
            tracing::warn!(pipeline = %self.pipeline, partitions = %describe(&pause),
                "fenced: another worker claimed these partitions; dropping their records");
            if let Err(e) = self.consumer.pause(&pause) {
                tracing::debug!(pipeline = %self.pipeline, error = %e, "pausing fenced partitions failed");
            }
        }
        drop_revoked(&self.state, &self.pipeline, batch, &mut self.stash);
    }

    /// The partitions assigned to this consumer now.
    pub(super) fn assigned_now(&self) -> Vec<(String, i32)> {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.assigned.iter().map(|(t, p)| (t.to_string(), *p)).collect()
    }

    /// Starts partitions again from positions claimed anew (`claimed`), after the store lost positions this worker
    /// had stored (Redis after a crash that lost its last writes; see [`crate::store::redis`]): takes the new epochs,
    /// drops the buffered records of these partitions from `batch` and the kept records, and seeks the consumer to
    /// the stored positions, so what the store lost is consumed and applied again.
    ///
    /// Errors: a seek librdkafka refused (the partition is then left as it was; the caller stops the pipeline).
    pub(super) fn start_again_from(&mut self, claimed: &[offsets::Claimed], batch: &mut dyn Records) -> Result<(), String> {
        let mut moved = HashSet::new();
        let mut gone = HashSet::new();
        {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            for c in claimed {
                let tp = tp_of(&c.topic, c.partition);
                if !st.assigned.contains(&tp) {
                    // Revoked (or given up after a fence) while the claim ran: not this worker's to start. If the
                    // claim fenced the partition's owner, that owner claims it again (see the module documentation).
                    gone.insert(tp.clone());
                    moved.insert(tp);
                    continue;
                }
                st.epochs.insert(tp.clone(), c.epoch);
                if let Some(next) = c.next_offset {
                    st.durable.insert(tp.clone(), next);
                }
                moved.insert(tp);
            }
        }
        drop_records_of(&moved, &self.pipeline, &mut [batch, &mut self.stash]);
        for c in claimed {
            if gone.contains(&tp_of(&c.topic, c.partition)) {
                tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition,
                    "claimed again a partition no longer assigned here (revoked meanwhile): leaving it to its owner");
                continue;
            }
            let Some(next) = c.next_offset else { continue };
            tokio::task::block_in_place(|| self.consumer.seek(&c.topic, c.partition, Offset::Offset(next), Duration::from_secs(10)))
                .map_err(|e| format!("cannot seek {}/{} to {next}: {e}", c.topic, c.partition))?;
            tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, offset = next,
                "consuming the partition again from the position the store kept");
        }
        Ok(())
    }

    /// Moves partitions on to their processed floors (from a committed batch that ended below them: the group started
    /// over below what this pipeline had processed): drops the records kept of them, seeks the consumer to the floor
    /// and commits it to the group, so a group whose offsets expired fetches one batch below the floor, not the whole
    /// topic, and says so. Left as they are, fetched and skipped record by record as before: a partition not owned
    /// (revoked, fenced) or already fetched up to its floor; one whose log does not reach its floor (a seek past the
    /// end would send the consumer back to `auto.offset.reset` again and again); and one holding a record below its
    /// floor produced after the mark was last raised, or whose broker does not say (a topic created again, or a log
    /// truncated and refilled, that the batch did not show: each batch is judged on its records, as
    /// [`offsets::Replay`] says). A seek librdkafka refuses is logged and left the same way.
    pub(super) fn move_on_to_floors(&mut self, floors: &[offsets::PassedFloor]) {
        let fetched = self.fetch_positions();
        let mut moved: Vec<&offsets::PassedFloor> = {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            floors
                .iter()
                .filter(|f| {
                    let tp = tp_of(&f.topic, f.partition);
                    st.assigned.contains(&tp) && !st.fenced.contains_key(&tp) && fetched.get(&tp).is_none_or(|at| *at < f.floor)
                })
                .collect()
        };
        let dated: Vec<(&str, i32, i64)> =
            moved.iter().filter_map(|f| Some((&*f.topic, f.partition, f.raised_at_ms?.saturating_add(1)))).collect();
        let later = if dated.is_empty() { None } else { self.first_at_or_after(&dated) };
        moved.retain(|f| {
            let tp = tp_of(&f.topic, f.partition);
            let nothing_newer = later.as_ref().and_then(|m| m.get(&tp)).is_some_and(|first| first.is_none_or(|o| o >= f.floor));
            let high = self.cached_high_watermark(&f.topic, f.partition).or_else(|| {
                tokio::task::block_in_place(|| self.consumer.fetch_watermarks(&f.topic, f.partition, LOOKUP_TIMEOUT)).ok().map(|(_, high)| high)
            });
            nothing_newer && high.is_some_and(|high| f.floor <= high)
        });
        if moved.is_empty() {
            return;
        }
        // Everything kept of these partitions lies below the consumer's position, so below the floor.
        let parts: HashSet<Tp> = moved.iter().map(|f| tp_of(&f.topic, f.partition)).collect();
        drop_records_of(&parts, &self.pipeline, &mut [&mut self.stash]);
        let mut tpl = TopicPartitionList::new();
        for f in moved {
            let (topic, partition, floor) = (&*f.topic, f.partition, f.floor);
            match tokio::task::block_in_place(|| self.consumer.seek(topic, partition, Offset::Offset(floor), Duration::from_secs(10))) {
                Ok(()) => {
                    let _ = tpl.add_partition_offset(topic, partition, Offset::Offset(floor));
                    self.state.lock().unwrap_or_else(PoisonError::into_inner).durable.insert(tp_of(topic, partition), floor);
                    tracing::warn!(pipeline = %self.pipeline, topic, partition, floor,
                        "the consumer group started over below where this pipeline had processed (its offsets expired or \
                         were reset, a new group_id): moving on to the processed floor without fetching the records \
                         below it; `idemflow rewind` is the way to consume them again");
                }
                Err(e) => tracing::warn!(pipeline = %self.pipeline, topic, partition, floor, error = %e,
                    "cannot move the consumer on to the processed floor: fetching the records below it to skip them"),
            }
        }
        if tpl.count() > 0 {
            self.commit_list(&tpl);
        }
    }
    /// Assigns the partitions of a finished claim from their stored positions (the assign call librdkafka waits
    /// for); after a shutdown during the claim, assigns nothing. Does nothing while no claim has finished.
    pub(super) fn finish_claim(&mut self) {
        self.finish_reclaim();
        let claiming = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &st.claiming {
                Some(c) if c.outcome.is_some() => st.claiming.take(),
                _ => None,
            }
        };
        let Some(claiming) = claiming else { return };
        let claimed = claiming.outcome.flatten();
        let mut tpl = TopicPartitionList::new();
        if let Some(claimed) = &claimed {
            // Asked of the broker before the state is locked: the lookups wait for its answers.
            let starts: Vec<(&offsets::Claimed, Option<Offset>)> = claimed.iter().zip(self.stored_starts(claimed)).collect();
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            for (topic, partition) in &claiming.partitions {
                tpl.add_partition(topic, *partition);
                if let Some((c, start)) = starts.iter().find(|(c, _)| c.topic == *topic && c.partition == *partition) {
                    if let Some(start) = start {
                        let _ = tpl.set_partition_offset(topic, *partition, *start);
                    }
                    st.epochs.insert(tp_of(topic, *partition), c.epoch);
                }
            }
        }
        let consumer = &self.consumer;
        let r = if claiming.cooperative { consumer.incremental_assign(&tpl) } else { consumer.assign(&tpl) };
        match r {
            Ok(()) if tpl.count() > 0 => consumer.context().assigned(consumer, &tpl),
            Ok(()) => tracing::info!(pipeline = %self.pipeline, "shutting down before the claim finished: taking no partitions"),
            Err(e) => tracing::warn!(pipeline = %self.pipeline, error = %e, "applying the rebalance failed"),
        }
    }

    /// `[offsets] store = "database"`: starts a new claim of the partitions given up after a fenced batch whose
    /// [`KafkaSource::fenced_for`] is over, among those the group still assigns here (checked just before: the
    /// consumer's assignment, not lost), as a task that retries while the store is down, like an assignment's claim;
    /// [`KafkaSource::finish_reclaim`] takes them back. One at a time, and not while an assignment's claim is
    /// pending. A revoke drops it.
    pub(super) fn reclaim_fenced(&self) {
        let Some(stored) = self.consumer.context().stored.as_ref() else { return };
        let now = Instant::now();
        {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if st.reclaiming.is_some() || st.claiming.is_some() || !st.fenced.values().any(|at| now >= *at) {
                return;
            }
        }
        // A lost assignment (the session expired) is about to be revoked: nothing of it is claimed.
        if self.consumer.assignment_lost() {
            return;
        }
        let Ok(assignment) = self.consumer.assignment() else { return };
        let held = partitions_in(&assignment);
        // Held until the claim is registered below, so the task cannot record its outcome before it exists.
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.reclaiming.is_some() || st.claiming.is_some() {
            return;
        }
        // A fenced partition the consumer no longer holds is forgotten here: its lag and stall clock go with it.
        for (topic, partition) in st.fenced.keys().filter(|tp| !held.contains(*tp)) {
            self.metrics.forget_lag(topic, *partition);
        }
        let due = st.due_reclaims(now, &held);
        if due.is_empty() {
            return;
        }
        let parts: Vec<(String, i32)> = due.iter().map(|(t, p)| (t.to_string(), *p)).collect();
        let (store, pipeline, owner) = (stored.store.clone(), self.pipeline.clone(), stored.owner.clone());
        let (mut shutdown, done, state) = (stored.shutdown.clone(), self.consumer.context().claimed.clone(), self.state.clone());
        static RECLAIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = RECLAIMS.fetch_add(1, Ordering::SeqCst);
        let names: Vec<String> = parts.iter().map(|(t, p)| format!("{t}/{p}")).collect();
        tracing::info!(pipeline = %self.pipeline, partitions = %names.join(","), after = ?self.fenced_for,
            "still assigned after being fenced: claiming the partitions again");
        let task = stored.runtime.spawn(async move {
            let waiting = "cannot claim the fenced partitions again; retrying (they stay paused)";
            let claimed = claim_while_down(&store, &pipeline, &owner, &parts, &mut shutdown, waiting).await;
            // The outcome is recorded before the notification, so the source finds it when it wakes up.
            let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(r) = st.reclaiming.as_mut().filter(|r| r.id == id) {
                r.outcome = Some(claimed);
            }
            drop(st);
            done.notify_one();
        });
        st.reclaiming = Some(Reclaiming { id, task, outcome: None });
    }

    /// Takes back the partitions of a finished [`KafkaSource::reclaim_fenced`] still fenced and still assigned here
    /// (checked again now: one revoked, or assigned anew, meanwhile is left alone), each sought to its stored position
    /// (without one: the group's committed offset, else where `auto.offset.reset` starts it) under its new epoch, and
    /// resumed (unless a retry has consumption paused; its end resumes it). A partition the consumer cannot seek is
    /// claimed again a few seconds later. Does nothing while no such claim has finished.
    pub(super) fn finish_reclaim(&mut self) {
        let reclaiming = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &st.reclaiming {
                Some(r) if r.outcome.is_some() => st.reclaiming.take(),
                _ => None,
            }
        };
        let Some(reclaiming) = reclaiming else { return };
        let Some(claimed) = reclaiming.outcome.flatten() else { return }; // shutdown came first
        let held = if self.consumer.assignment_lost() {
            HashSet::new()
        } else {
            self.consumer.assignment().map(|a| partitions_in(&a)).unwrap_or_default()
        };
        let (take, gone) = self.state.lock().unwrap_or_else(PoisonError::into_inner).reclaimable(&claimed, &held);
        for c in &gone {
            tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition,
                "claimed again a fenced partition no longer assigned here (revoked meanwhile): leaving it to its owner");
        }
        let starts = self.stored_starts(&take);
        for (c, start) in take.into_iter().zip(starts) {
            // Sent back to its log start (a topic created again): the stored position is not durable for it.
            let c = if start == Some(Offset::Beginning) { offsets::Claimed { next_offset: None, ..c } } else { c };
            let start = match start {
                Some(start) => Some(start),
                None => self.start_without_stored(&c.topic, c.partition),
            };
            let sought = match start {
                Some(offset) => tokio::task::block_in_place(|| {
                    self.consumer.seek(&c.topic, c.partition, offset, Duration::from_secs(10))
                })
                .map_err(|e| e.to_string()),
                None => Err("the group's committed offset could not be read".to_owned()),
            };
            if let Err(e) = sought {
                tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, error = %e,
                    "cannot move the consumer to the stored position of a fenced partition; claiming it again in a few seconds");
                let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(at) = st.fenced.get_mut(&tp_of(&c.topic, c.partition)) {
                    *at = Instant::now() + RESEEK_AFTER;
                }
                continue;
            }
            let (paused, owned) = {
                let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                st.retaken(&c);
                (st.paused, st.assigned.len())
            };
            self.metrics.assigned_partitions(owned);
            self.consumer.context().assignment_changed.store(true, Ordering::SeqCst);
            if !paused {
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition(&c.topic, c.partition);
                if let Err(e) = self.consumer.resume(&tpl) {
                    tracing::debug!(pipeline = %self.pipeline, error = %e, "resuming a partition claimed again failed");
                }
            }
            tracing::info!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, offset = ?c.next_offset,
                "claimed the fenced partition again: consuming it from its stored position");
        }
    }

    /// Each partition's first offset whose record's timestamp is `at_ms` or later (`(topic, partition, at_ms)` each),
    /// asked of the broker in one request (ListOffsets by timestamp, `offsets_for_times`): `None` for a partition
    /// without such a record. `None` altogether when the broker did not answer within [`LOOKUP_TIMEOUT`] (logged).
    pub(super) fn first_at_or_after(&self, asks: &[(&str, i32, i64)]) -> Option<HashMap<Tp, Option<i64>>> {
        let mut tpl = TopicPartitionList::new();
        for (topic, partition, at_ms) in asks {
            // offsets_for_times takes the timestamp in the offset field.
            tpl.add_partition_offset(topic, *partition, Offset::Offset(*at_ms)).ok()?;
        }
        match tokio::task::block_in_place(|| self.consumer.offsets_for_times(tpl, LOOKUP_TIMEOUT)) {
            Ok(list) => Some(
                list.elements()
                    .iter()
                    .map(|e| (tp_of(e.topic(), e.partition()), if let Offset::Offset(o) = e.offset() { Some(o) } else { None }))
                    .collect(),
            ),
            Err(e) => {
                tracing::info!(pipeline = %self.pipeline, error = %e, "the broker did not say which records are later than a time");
                None
            }
        }
    }

    /// Where each claimed partition with a stored position starts, in `claimed`'s order (`None` without one): at its
    /// log start where the topic's id ([`super::super::topic_ids`]) is not the one the partition's processed mark was
    /// raised on ([`offsets::Claimed::log`]: the topic was deleted and created again); else at the stored position,
    /// unless everything the partition holds was produced after the position was stored
    /// ([`offsets::Claimed::stored_at_ms`]: its first record at or after that time is its log start) and lies
    /// partly below it. A partition holding nothing from before its stored position was written is not the one the
    /// position was stored for: the topic was deleted and created again (or its log truncated and refilled), and
    /// starting there would skip its records below the position. It then starts at its log start instead, said in
    /// a warning, and the processed marks decide record by record what was processed ([`offsets::Replay`]). The test
    /// asks that the partition hold nothing older, not merely one newer record, so that producers whose clocks run
    /// ahead of the store's (or records stamped with a later event time) do not send a partition back to its start
    /// at every assignment; a topic whose every record is stamped later than the time its position was stored is
    /// taken for created again. Lookups the broker does not answer within [`LOOKUP_TIMEOUT`] keep the stored
    /// positions. Two requests for all the partitions.
    pub(super) fn stored_starts(&self, claimed: &[offsets::Claimed]) -> Vec<Option<Offset>> {
        let dated: Vec<(&str, i32, i64)> = claimed
            .iter()
            .filter_map(|c| Some((c.topic.as_str(), c.partition, c.stored_at_ms?.saturating_add(1))).filter(|_| c.next_offset.is_some()))
            .collect();
        let (later, start) = if dated.is_empty() {
            (None, None)
        } else {
            let log_start: Vec<(&str, i32, i64)> = dated.iter().map(|(t, p, _)| (*t, *p, 0)).collect();
            (self.first_at_or_after(&dated), self.first_at_or_after(&log_start))
        };
        let mut topics: Vec<&str> = claimed.iter().filter(|c| c.log.is_some() && c.next_offset.is_some()).map(|c| c.topic.as_str()).collect();
        topics.sort_unstable();
        topics.dedup();
        // As the source's thread last learnt them; a topic's first claim waits for its first lookup.
        let ids = self.topic_ids.ids(&topics);
        claimed
            .iter()
            .map(|c| {
                let next = c.next_offset?;
                let now = ids.get(&c.topic).cloned().flatten();
                if let Some((was, now)) = c.log.as_deref().zip(now.as_deref()).filter(|(was, now)| was != now) {
                    tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, stored = next, was = %was,
                        now = %now, "the topic's id is not the one its processed marks were raised on: the topic was deleted and \
                         created again, and the stored position is the old topic's; consuming it from its start");
                    return Some(Offset::Beginning);
                }
                let tp = tp_of(&c.topic, c.partition);
                let first_later = later.as_ref().and_then(|m| m.get(&tp).copied().flatten());
                let log_start = start.as_ref().and_then(|m| m.get(&tp).copied().flatten());
                match (first_later, log_start) {
                    (Some(first_later), Some(log_start)) if first_later == log_start && first_later < next => {
                        tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, stored = next,
                            log_start, "every record of the partition was produced after its position was stored, some below \
                             it: the topic was deleted and created again (or its log truncated and refilled), and the stored \
                             position is the old topic's; consuming it from its start, where the processed marks tell what was \
                             processed");
                        Some(Offset::Beginning)
                    }
                    _ => Some(Offset::Offset(next)),
                }
            })
            .collect()
    }

    /// Where a partition without a stored position starts: the group's committed offset, else where
    /// `auto.offset.reset` starts it. `None` when the committed offset could not be read.
    pub(super) fn start_without_stored(&self, topic: &str, partition: i32) -> Option<Offset> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, partition);
        let committed = tokio::task::block_in_place(|| self.consumer.committed_offsets(tpl, LOOKUP_TIMEOUT)).ok()?;
        Some(match committed.find_partition(topic, partition).map(|e| e.offset()) {
            Some(Offset::Offset(next)) => Offset::Offset(next),
            _ if self.reset_to_earliest => Offset::Beginning,
            _ => Offset::End,
        })
    }

}
