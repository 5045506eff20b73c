//! Opening a queue: its state rebuilt from the store (ready entries, delivery counts,
//! parked returns).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};

use triad_store::store::Store;

use super::limits::refuses_when_full;
use super::tag::{tag_len, TAG_PERSISTENT};
use super::{Applied, Entry, Queue, QueueSpec, State};
use crate::error::CoreError;
use crate::vhost::Vhost;

/// What a queue finds in the store at open: its ready messages and their body bytes,
/// the delivery counts of returned ones not loaded yet, and the returns still waiting
/// out their back-off.
struct Found {
    ready_count: u64,
    ready_bytes: u64,
    restored: HashMap<u64, (u16, bool)>,
    parked: BTreeMap<(u64, u64), Entry>,
}

/// Everything pending in the store is ready: nothing is delivered yet. Transient
/// messages (delivery mode 1) do not outlive the broker, as in RabbitMQ's classic
/// queues: the ones a restart finds are dropped here. Walked in batches, so a backlog
/// of millions is not held as a vector of offsets while the broker starts. Returns the
/// ready count and bytes.
fn count_ready(store: &Store, spec: &QueueSpec) -> Result<(u64, u64), CoreError> {
    const BATCH: usize = 1 << 16;
    let (mut ready_count, mut ready_bytes, mut dropped) = (0u64, 0u64, 0usize);
    let mut from = 0;
    loop {
        let pending = store.unacked_from(spec.id, from, BATCH)?;
        let Some(&last) = pending.last() else {
            break;
        };
        let mut transient = Vec::new();
        for off in &pending {
            if let Some(e) = store.entry(spec.id, *off) {
                if e.tag_hash & TAG_PERSISTENT == 0 {
                    transient.push(*off);
                } else {
                    ready_bytes += tag_len(e.tag_hash);
                }
            }
        }
        ready_count += (pending.len() - transient.len()) as u64;
        if !transient.is_empty() {
            dropped += transient.len();
            drop(store.ack(spec.id, &transient)?);
        }
        if pending.len() < BATCH {
            break;
        }
        from = last + 1;
    }
    if dropped > 0 {
        tracing::debug!(queue = %spec.name, dropped, "dropping transient messages after a restart");
    }
    Ok((ready_count, ready_bytes))
}

/// Delivery counts of returned messages; those of entries acked since (the ack and the
/// count's removal are separate writes) are forgotten now. Those still waiting out a
/// back-off step are parked again until its end (and are not ready meanwhile).
fn restore_returns(
    store: &Store,
    spec: &QueueSpec,
    next: u64,
    f: &mut Found,
) -> Result<(), CoreError> {
    let mut stale = Vec::new();
    let now = spec.clock.now_ms();
    for r in store.take_returns(spec.id) {
        let off = r.offset;
        if off < next && !store.is_acked(spec.id, off).unwrap_or(true) {
            let returns = u16::try_from(r.count).unwrap_or(u16::MAX);
            let waiting = match store.entry(spec.id, off) {
                Some(e) if r.ready_at_ms > now && e.tag_hash & TAG_PERSISTENT != 0 => {
                    f.parked.insert(
                        (r.ready_at_ms, off),
                        Entry {
                            commit_offset: e.commit_offset,
                            tag: e.tag_hash,
                            redelivered: true,
                            returns,
                            count_stored: true,
                            unmatched: 0,
                        },
                    );
                    f.ready_count = f.ready_count.saturating_sub(1);
                    f.ready_bytes = f.ready_bytes.saturating_sub(tag_len(e.tag_hash));
                    true
                }
                _ => false,
            };
            f.restored.insert(off, (returns, waiting));
        } else {
            stale.push(off);
        }
    }
    if !stale.is_empty() {
        drop(store.drop_delivery_counts(spec.id, &stale)?);
    }
    Ok(())
}

impl Queue {
    pub(crate) fn new(
        spec: QueueSpec,
        store: Arc<Store>,
        vhost: Weak<Vhost>,
    ) -> Result<Arc<Queue>, CoreError> {
        let stream = match crate::stream::spec::is_stream(&spec.arguments) {
            true => Some(crate::stream::Stream::open(
                store.clone(),
                spec.id,
                &spec.vhost_name,
                &spec.name,
                crate::stream::StreamArgs::parse(&spec.arguments)?,
            )?),
            false => None,
        };
        // a stream keeps every entry (transient ones too) and counts its own
        let (ready_count, ready_bytes) = match stream {
            None => count_ready(&store, &spec)?,
            Some(_) => (0, 0),
        };
        let head = store.queue_info(spec.id)?.ack_head;
        let next = store.queue_next_offset(spec.id)?;
        let mut found = Found {
            ready_count,
            ready_bytes,
            restored: HashMap::new(),
            parked: BTreeMap::new(),
        };
        restore_returns(&store, &spec, next, &mut found)?;
        let Found {
            ready_count,
            ready_bytes,
            restored,
            parked,
        } = found;
        let state = State {
            ready: BTreeMap::new(),
            loaded_upto: head,
            recovered_next: next,
            cq_next: next,
            unacked: HashMap::new(),
            ready_count,
            ready_bytes,
            replication_wait: false,
            consumers: Vec::new(),
            sac_handover: 0,
            sac_old: 0,
            filtered: 0,
            filter_epoch: 1,
            rr: 0,
            next_consumer: 1,
            had_consumers: false,
            last_used: spec.clock.instant(),
            deleted: false,
            throttled: false,
            credit: 0,
            flow: None,
            counts: Default::default(),
            rate: None,
            restored: (!restored.is_empty()).then(|| Box::new(restored)),
            parked: (!parked.is_empty()).then(|| Box::new(parked)),
            args: Arc::new(spec.args.clone()),
        };
        Ok(Arc::new_cyclic(|me| Queue {
            name: spec.name,
            vhost_name: spec.vhost_name,
            id: spec.id,
            durable: spec.durable,
            exclusive_owner: spec.exclusive_owner,
            auto_delete: spec.auto_delete,
            rejecting: AtomicBool::new(refuses_when_full(&spec.args)),
            applied: std::sync::RwLock::new(Applied {
                args: state.args.clone(),
                policy: None,
            }),
            arguments: spec.arguments,
            declared: spec.args,
            window: spec.window.max(16),
            store,
            vhost,
            me: me.clone(),
            tick_wanted: AtomicBool::new(state.parked.is_some()),
            state: Mutex::new(state),
            stream,
            clock: spec.clock,
        }))
    }
}
