//! The publish path: routing a message to its queues, storing it once, handing it to
//! them; delayed messages (`x-delay`), direct replies and dead-lettering.

use super::*;

impl Vhost {
    /// Routes a message to its queues: names, resolved to queue objects.
    pub(crate) fn route(
        &self,
        exchange: &str,
        key: &str,
        props: &Properties,
    ) -> Result<Vec<Arc<Queue>>, CoreError> {
        let topo = self.topology_read();
        let queues = self.queues_read();
        let lookup = |n: &str| queues.contains_key(n);
        let names = topo.route_message(exchange, key, props, &lookup)?;
        // no exchange routes to the broker's own queues (see `publish_reserved`)
        Ok(names
            .iter()
            .filter(|n| !reserved::is_reserved_queue(n))
            .filter_map(|n| queues.get(n).cloned())
            .collect())
    }

    /// Publishes to the broker's own queue `p.routing_key` ([`crate::reserved`]), which
    /// no exchange routes to; `p.exchange` must be the default one.
    pub fn publish_reserved(&self, p: Publish) -> Result<Published, CoreError> {
        if !p.exchange.is_empty() || !reserved::is_reserved_queue(&p.routing_key) {
            return Err(CoreError::Internal(format!(
                "'{}' is not a reserved queue",
                p.routing_key
            )));
        }
        if p.body.len() > self.max_message_size {
            return Err(CoreError::PreconditionFailed(format!(
                "message size {} is larger than configured max size {}",
                p.body.len(),
                self.max_message_size
            )));
        }
        let q = self.queue_for(&p.routing_key, p.conn)?;
        self.publish_to(
            vec![q],
            "",
            &p.routing_key,
            p.properties,
            &p.body,
            Some(p.conn),
        )
    }

    /// The vhost's direct reply-to names.
    pub fn direct_replies(&self) -> &Arc<crate::direct_reply::Registry> {
        &self.replies
    }

    /// The vhost's per-exchange publish counters ([`crate::exchange_stats`]).
    pub fn exchange_stats(&self) -> &crate::exchange_stats::ExchangeStats {
        &self.exchange_stats
    }

    /// A publish to the default exchange with a direct reply-to name as routing key: to
    /// that channel's consumer, or nowhere (unroutable) when it is gone.
    pub(super) fn publish_reply(&self, p: Publish) -> Result<Published, CoreError> {
        self.check_size(&p)?;
        let routed = self.replies.deliver(&p.routing_key, p.properties, &p.body);
        Ok(Published {
            routed,
            rejected: false,
            durable: None,
            backpressure: None,
            queues: 0,
        })
    }

    pub(super) fn is_reply(p: &Publish) -> bool {
        p.exchange.is_empty() && p.routing_key.starts_with(crate::direct_reply::REPLY_PREFIX)
    }

    /// `basic.publish` (and STOMP SEND, MQTT PUBLISH).
    pub fn publish(&self, p: Publish) -> Result<Published, CoreError> {
        self.publish_keyed(p, false)
    }

    /// [`Vhost::publish`], the stored message also indexed under [`topic_key`] of this
    /// vhost and its routing key (MQTT's publishes: found by topic and time). A delayed
    /// publish is not indexed (it is routed when due).
    pub fn publish_topic_indexed(&self, p: Publish) -> Result<Published, CoreError> {
        self.publish_keyed(p, true)
    }

    pub(super) fn publish_keyed(
        &self,
        p: Publish,
        index_topic: bool,
    ) -> Result<Published, CoreError> {
        if Self::is_reply(&p) {
            return self.publish_reply(p);
        }
        // the broker's own `$SYS` publishes are not client traffic
        if !reserved::is_reserved_topic(&p.exchange, &p.routing_key) {
            self.published.add(1);
        }
        if let Some(ms) = crate::delayed::requested_delay(p.properties.headers.as_ref())? {
            return self.publish_delayed(&p, ms);
        }
        let targets = self.check_and_route(&p)?;
        if index_topic && !targets.is_empty() {
            return with_topic_key(&self.name, &p.routing_key, |key| {
                self.publish_to_keyed(
                    targets,
                    &p.exchange,
                    &p.routing_key,
                    p.properties,
                    &p.body,
                    Some(p.conn),
                    key,
                )
            });
        }
        self.publish_to(
            targets,
            &p.exchange,
            &p.routing_key,
            p.properties,
            &p.body,
            Some(p.conn),
        )
    }

    /// A transaction's publishes (AMQP `tx.commit`, STOMP `COMMIT`), all or nothing as
    /// far as the publisher can cause it: every message is checked and routed (its delay
    /// read) before the first is stored, so one whose exchange is gone, that is too large
    /// or whose `x-delay` is bad stores none.
    pub fn publish_all(&self, batch: Vec<Publish>) -> Result<Vec<Published>, CoreError> {
        /// Where a checked message goes in phase 2.
        enum Plan {
            Reply,
            Delayed(u64),
            Now(Vec<Arc<Queue>>),
        }
        self.published.add(batch.len() as u64);
        let mut routed = Vec::with_capacity(batch.len());
        for p in batch {
            if Self::is_reply(&p) {
                self.check_size(&p)?;
                routed.push((p, Plan::Reply));
                continue;
            }
            if let Some(ms) = crate::delayed::requested_delay(p.properties.headers.as_ref())? {
                self.check_delayed(&p)?;
                routed.push((p, Plan::Delayed(ms)));
                continue;
            }
            let targets = self.check_and_route(&p)?;
            routed.push((p, Plan::Now(targets)));
        }
        routed
            .into_iter()
            .map(|(p, plan)| match plan {
                Plan::Reply => self.publish_reply(p),
                Plan::Delayed(ms) => self.store_delayed(&p, ms),
                Plan::Now(targets) => self.publish_to(
                    targets,
                    &p.exchange,
                    &p.routing_key,
                    p.properties,
                    &p.body,
                    Some(p.conn),
                ),
            })
            .collect()
    }

    /// What a delayed publish is checked for: its size, and that its exchange exists
    /// and is not internal (where it goes is decided when it is due).
    pub(super) fn check_delayed(&self, p: &Publish) -> Result<(), CoreError> {
        self.check_size(p)?;
        let topo = self.topology_read();
        let x = topo
            .exchange(&p.exchange)
            .ok_or_else(|| CoreError::exchange_not_found(&p.exchange))?;
        if x.internal {
            return Err(CoreError::AccessRefused(format!(
                "cannot publish to internal exchange '{}'",
                p.exchange
            )));
        }
        Ok(())
    }

    /// A publish with `x-delay` / `x-delay-level` ([`crate::delayed`]): stored in the
    /// delay queue now (its exchange must exist), routed when it is due.
    pub(super) fn publish_delayed(
        &self,
        p: &Publish,
        delay_ms: u64,
    ) -> Result<Published, CoreError> {
        self.check_delayed(p)?;
        self.store_delayed(p, delay_ms)
    }

    /// Stores a checked delayed publish ([`Vhost::check_delayed`]) in the delay queue.
    pub(super) fn store_delayed(&self, p: &Publish, delay_ms: u64) -> Result<Published, CoreError> {
        let d = {
            let mut slot = self.delayed.lock().unwrap_or_else(|e| e.into_inner());
            match &*slot {
                Some(d) => d.clone(),
                None => {
                    let d =
                        crate::delayed::Delayed::open(&self.store, &self.name, true, &self.clock)?
                            .ok_or_else(|| CoreError::Internal("no delay queue".into()))?;
                    *slot = Some(d.clone());
                    if let Some(me) = self.me.upgrade() {
                        crate::delayed::spawn(&me, d.clone());
                    }
                    d
                }
            }
        };
        let appended = d.store(
            &self.store,
            &p.exchange,
            &p.routing_key,
            &p.properties,
            &p.body,
            delay_ms,
        )?;
        // where it goes is decided when it is due
        Ok(Published::held(appended.durable.into()))
    }

    /// Routes delayed messages that are due (queue offsets in `d`'s queue) through
    /// their exchanges, then acks them in the delay queue. A routed message's `x-delay`
    /// is the negative of its delay, as the delayed-message plugin sets it, so a consumer
    /// that republishes it with the same headers does not delay it again. Returns the
    /// offsets not routed (routing one failed: it and the ones after it), for the
    /// scheduler to try again.
    pub(crate) fn fire_delayed(&self, d: &crate::delayed::Delayed, due: &[u64]) -> Vec<u64> {
        let qid = d.queue_id();
        let mut done = 0;
        for off in due {
            let Some(e) = self.store.entry(qid, *off) else {
                done += 1;
                continue;
            };
            let rec = match self.store.read_entry(qid, *off, e.commit_offset) {
                Ok(r) => r,
                Err(err) => {
                    tracing::warn!(vhost = %self.name, error = %err, "dropping an unreadable delayed message");
                    done += 1;
                    continue;
                }
            };
            let Ok((exchange, routing_key, mut props)) = envelope::decode(&rec.properties) else {
                tracing::warn!(vhost = %self.name, "dropping a delayed message with undecodable properties");
                done += 1;
                continue;
            };
            crate::delayed::mark_fired(&mut props);
            let targets = match self.route(&exchange, &routing_key, &props) {
                Ok(t) => t,
                Err(err) => {
                    tracing::debug!(vhost = %self.name, exchange, error = %err, "delayed message's exchange is gone; dropped");
                    done += 1;
                    continue;
                }
            };
            // connection 0: the broker (not a dead-lettering, which `None` would mean)
            if let Err(err) =
                self.publish_to(targets, &exchange, &routing_key, props, &rec.body, Some(0))
            {
                tracing::warn!(vhost = %self.name, error = %err, "routing a delayed message failed; it and the ones after it are tried again in a second");
                break;
            }
            done += 1;
        }
        let (acked, left) = due.split_at(done.min(due.len()));
        if !acked.is_empty() {
            if let Err(err) = self.store.ack(qid, acked) {
                tracing::warn!(vhost = %self.name, error = %err, "acking delayed messages failed");
            }
        }
        left.to_vec()
    }

    /// Delayed messages waiting for their time.
    pub fn delayed_pending(&self) -> u64 {
        self.delayed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(0, |d| d.pending())
    }

    pub(crate) fn check_size(&self, p: &Publish) -> Result<(), CoreError> {
        if p.body.len() > self.max_message_size {
            return Err(CoreError::PreconditionFailed(format!(
                "message size {} is larger than configured max size {}",
                p.body.len(),
                self.max_message_size
            )));
        }
        Ok(())
    }

    pub(super) fn check_and_route(&self, p: &Publish) -> Result<Vec<Arc<Queue>>, CoreError> {
        self.check_size(p)?;
        self.route(&p.exchange, &p.routing_key, &p.properties)
    }

    /// That a publish to `exchange` would be routed (it exists and is not internal),
    /// without routing it: what storing a half message ([`crate::txn`]) checks.
    pub(crate) fn check_publishable(&self, exchange: &str) -> Result<(), CoreError> {
        let topo = self.topology_read();
        if topo.check_exchange(exchange)?.internal {
            return Err(CoreError::AccessRefused(format!(
                "cannot publish to internal exchange '{exchange}'"
            )));
        }
        Ok(())
    }

    /// A committed half message ([`crate::txn`]): routed as published, its copy indexed
    /// under `commit_key` too.
    pub(crate) fn publish_committed(
        &self,
        exchange: &str,
        routing_key: &str,
        props: Properties,
        body: &Bytes,
        commit_key: &[u8],
        conn: ConnectionId,
    ) -> Result<Published, CoreError> {
        self.published.add(1);
        let targets = self.route(exchange, routing_key, &props)?;
        self.publish_to_keyed(
            targets,
            exchange,
            routing_key,
            props,
            body,
            Some(conn),
            Some(commit_key),
        )
    }

    pub(super) fn publish_to(
        &self,
        targets: Vec<Arc<Queue>>,
        exchange: &str,
        routing_key: &str,
        props: Properties,
        body: &Bytes,
        publisher: Option<ConnectionId>,
    ) -> Result<Published, CoreError> {
        self.publish_to_keyed(targets, exchange, routing_key, props, body, publisher, None)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn publish_to_keyed(
        &self,
        targets: Vec<Arc<Queue>>,
        exchange: &str,
        routing_key: &str,
        props: Properties,
        body: &Bytes,
        publisher: Option<ConnectionId>,
        extra_key: Option<&[u8]>,
    ) -> Result<Published, CoreError> {
        if targets.is_empty() {
            return Ok(Published {
                routed: false,
                rejected: false,
                durable: None,
                backpressure: None,
                queues: 0,
            });
        }
        let mut rejected = false;
        let targets: Vec<Arc<Queue>> = targets
            .into_iter()
            .filter(|q| {
                let r = q.rejects(body.len());
                rejected |= r;
                !r
            })
            .collect();
        if targets.is_empty() {
            return Ok(Published {
                routed: true,
                rejected,
                durable: None,
                backpressure: None,
                queues: 0,
            });
        }
        let persistent = props.delivery_mode == Some(2);
        let has_ttl = props.expiration.is_some();
        let tag = make_tag(body.len(), props.priority.unwrap_or(0), has_ttl, persistent)
            | crate::filter::tag_bits(&props);
        let env = envelope::encode(exchange, routing_key, &props)?;
        let ids: Vec<u32> = targets.iter().map(|q| q.store_id()).collect();
        let mut key_buf: [&[u8]; 2] = [&[], &[]];
        let mut n = 0;
        if let Some(id) = props.message_id.as_deref() {
            if !id.is_empty() && id.len() <= 1024 {
                key_buf[0] = id.as_bytes();
                n = 1;
            }
        }
        if let Some(k) = extra_key {
            if let Some(slot) = key_buf.get_mut(n) {
                *slot = k;
                n += 1;
            }
        }
        let keys: &[&[u8]] = key_buf.get(..n).unwrap_or(&[]);
        let appended = self.store.append(&NewMessage {
            queues: &ids,
            flags: if persistent { FLAG_PERSISTENT } else { 0 }
                | if publisher.is_none() {
                    FLAG_DEAD_LETTERED
                } else {
                    0
                },
            born_ts_ms: now_ms(),
            tag_hash: tag,
            keys,
            properties: &env,
            body,
        })?;
        let wants_disk = persistent && targets.iter().any(|q| q.durable());
        let hot = Hot {
            exchange: Arc::from(exchange),
            routing_key: Arc::from(routing_key),
            properties: Arc::new(props),
            // the stored copy (page cache), not the publisher's read buffer: deliveries
            // waiting on a slow consumer must not pin heap
            body: appended.body.clone().unwrap_or_else(|| body.clone()),
        };
        let mut throttled = Vec::new();
        for (q, (_, off)) in targets.iter().zip(&appended.queue_offsets) {
            if q.enqueue(*off, appended.commit_offset, tag, publisher, Some(&hot)) {
                throttled.push(q.clone());
            }
        }
        Ok(Published {
            routed: true,
            rejected,
            durable: wants_disk.then_some(appended.durable.into()),
            backpressure: (!throttled.is_empty()).then(|| Backpressure::new(throttled)),
            queues: u32::try_from(targets.len()).unwrap_or(u32::MAX),
        })
    }

    /// Republishes a message leaving `from` to its dead-letter exchange.
    pub(crate) fn dead_letter(&self, from: &Queue, rec: &StoredRecord, reason: &str) {
        let Ok((exchange, routing_key, mut props)) = envelope::decode(&rec.properties) else {
            return;
        };
        // Only an x-death the broker wrote counts (RabbitMQ 4 no longer interprets one a
        // client published): a forged one could make a message look like a cycle.
        let own_deaths = rec.flags & FLAG_DEAD_LETTERED != 0;
        let Some((dlx, key)) =
            from.dead_letter_target(reason, &exchange, &routing_key, &mut props, own_deaths)
        else {
            return;
        };
        let targets = match self.route(&dlx, &key, &props) {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(queue = from.name(), dlx, error = %e, "dead-letter exchange unusable; message dropped");
                return;
            }
        };
        if let Err(e) = self.publish_to(targets, &dlx, &key, props, &rec.body, None) {
            tracing::warn!(queue = from.name(), error = %e, "dead-lettering failed; message dropped");
        }
    }
}
