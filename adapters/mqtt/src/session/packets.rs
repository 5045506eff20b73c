//! The packet state of one MQTT session, without I/O: subscriptions with their
//! granted QoS, outbound packet identifiers and in-flight messages, and the inbound
//! QoS 2 identifiers held between PUBREC and PUBREL. Generic over the handle `T` that
//! acks an outbound message in the core, so it is testable without a broker.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::topic::{filter_matches, is_shared};

/// An outbound QoS 1 or 2 PUBLISH awaiting PUBACK or PUBREC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outbound<T> {
    /// The QoS it was sent with.
    pub qos: u8,
    /// What to ack in the core once the client has it (`None` for retained messages,
    /// which come from the retained store, not a queue).
    pub target: Option<T>,
}

/// State that outlives a connection of a persistent session (clean session 0) while the
/// broker runs: QoS 2 identifiers of both directions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Carry {
    /// Inbound QoS 2 ids PUBREC'd but not yet released.
    pub inbound_qos2: BTreeSet<u16>,
    /// Outbound QoS 2 ids PUBREL'd but not yet completed: PUBREL is resent on reconnect.
    pub pubrel: BTreeSet<u16>,
}

/// One session's protocol state.
#[derive(Debug)]
pub struct Packets<T> {
    /// Topic filter → granted QoS.
    pub subs: BTreeMap<String, u8>,
    next_id: u16,
    outbound: HashMap<u16, Outbound<T>>,
    carry: Carry,
}

impl<T> Default for Packets<T> {
    fn default() -> Self {
        Packets {
            subs: BTreeMap::new(),
            next_id: 1,
            outbound: HashMap::new(),
            carry: Carry::default(),
        }
    }
}

/// What a PUBREC did.
#[derive(Debug, PartialEq, Eq)]
pub enum PubRec<T> {
    /// First PUBREC for an in-flight QoS 2 message: ack this in the core, send PUBREL.
    Released(Option<T>),
    /// A repeated PUBREC: send PUBREL again.
    Again,
    /// Unknown identifier: ignore.
    Unknown,
}

impl<T> Packets<T> {
    /// Lets go of the in-flight table's memory if nothing is in flight (the connection
    /// is going idle): one QoS 1 delivery leaves a table for three more behind.
    pub fn release_idle(&mut self) {
        if self.outbound.is_empty() && self.outbound.capacity() > 0 {
            self.outbound = HashMap::new();
        }
    }

    /// A session resuming `carry` with `subs`.
    pub fn resume(subs: BTreeMap<String, u8>, carry: Carry) -> Self {
        Packets {
            subs,
            carry,
            ..Packets::default()
        }
    }

    /// The highest QoS granted by a filter matching `topic`; `None` when none matches
    /// (the message is not for this client under the MQTT rules). Shared
    /// subscriptions (`$share/...`) do not count: their messages come from their
    /// group's queue.
    pub fn granted_for(&self, topic: &str) -> Option<u8> {
        self.subs
            .iter()
            .filter(|(f, _)| !is_shared(f) && filter_matches(f, topic))
            .map(|(_, q)| *q)
            .max()
    }

    /// Identifiers awaiting PUBCOMP (resent as PUBREL on reconnect).
    pub fn pending_pubrel(&self) -> impl Iterator<Item = u16> + '_ {
        self.carry.pubrel.iter().copied()
    }

    /// Outbound messages in flight: QoS 1/2 PUBLISHes not yet acknowledged, and QoS 2
    /// messages PUBREL'd but not yet completed (their identifiers are still taken, and
    /// Mosquitto's `max_inflight_messages` counts them too).
    pub fn inflight(&self) -> usize {
        self.outbound.len() + self.carry.pubrel.len()
    }

    /// A free packet identifier, or `None` when all 65,535 are in use.
    pub fn alloc_id(&mut self) -> Option<u16> {
        for _ in 0..u16::MAX {
            let id = self.next_id;
            self.next_id = if id == u16::MAX { 1 } else { id + 1 };
            if !self.outbound.contains_key(&id) && !self.carry.pubrel.contains(&id) {
                return Some(id);
            }
        }
        None
    }

    /// Records an outbound QoS 1/2 PUBLISH under `id`.
    pub fn sent(&mut self, id: u16, qos: u8, target: Option<T>) {
        self.outbound.insert(id, Outbound { qos, target });
    }

    /// PUBACK: the handle to ack, if `id` was a QoS 1 message in flight.
    pub fn on_puback(&mut self, id: u16) -> Option<Option<T>> {
        match self.outbound.get(&id) {
            Some(o) if o.qos == 1 => self.outbound.remove(&id).map(|o| o.target),
            _ => None,
        }
    }

    /// PUBREC for an outbound QoS 2 message.
    pub fn on_pubrec(&mut self, id: u16) -> PubRec<T> {
        match self.outbound.get(&id) {
            Some(o) if o.qos == 2 => {
                let o = self.outbound.remove(&id);
                self.carry.pubrel.insert(id);
                PubRec::Released(o.and_then(|o| o.target))
            }
            _ if self.carry.pubrel.contains(&id) => PubRec::Again,
            _ => PubRec::Unknown,
        }
    }

    /// PUBCOMP: the identifier is free again.
    pub fn on_pubcomp(&mut self, id: u16) -> bool {
        self.carry.pubrel.remove(&id)
    }

    /// An inbound QoS 2 PUBLISH: `true` if it is new (route it), `false` if `id` is
    /// still held from an earlier PUBLISH (a DUP resend: only PUBREC again), which
    /// makes inbound QoS 2 exactly once.
    pub fn inbound_qos2(&mut self, id: u16) -> bool {
        self.carry.inbound_qos2.insert(id)
    }

    /// PUBREL: releases an inbound QoS 2 identifier.
    pub fn on_pubrel(&mut self, id: u16) -> bool {
        self.carry.inbound_qos2.remove(&id)
    }

    /// Ends the connection: the handles of every unacked outbound message (to give back
    /// to their queue) and the state a persistent session keeps.
    pub fn finish(mut self) -> (Vec<T>, Carry) {
        let mut ids: Vec<u16> = self.outbound.keys().copied().collect();
        ids.sort_unstable();
        let targets = ids
            .into_iter()
            .filter_map(|id| self.outbound.remove(&id).and_then(|o| o.target))
            .collect();
        (targets, self.carry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_filters_give_the_highest_qos() {
        let mut s: Packets<u64> = Packets::default();
        s.subs.insert("a/+".into(), 0);
        s.subs.insert("a/#".into(), 2);
        s.subs.insert("#".into(), 1);
        assert_eq!(s.granted_for("a/b"), Some(2));
        assert_eq!(s.granted_for("x"), Some(1));
        assert_eq!(s.granted_for("$SYS/x"), None);
        s.subs.insert("$share/g/$share/g/t".into(), 2);
        assert_eq!(
            s.granted_for("$share/g/t"),
            None,
            "a shared filter is not plain"
        );
    }

    #[test]
    fn an_empty_in_flight_table_is_let_go_when_idle() {
        let mut s: Packets<u64> = Packets::default();
        let a = s.alloc_id().unwrap();
        s.sent(a, 1, Some(10));
        let b = s.alloc_id().unwrap();
        s.sent(b, 1, Some(11));
        assert_eq!(s.on_puback(a), Some(Some(10)));
        s.release_idle();
        assert!(
            s.outbound.capacity() > 0,
            "kept while a message is in flight"
        );
        assert_eq!(s.on_puback(b), Some(Some(11)));
        s.release_idle();
        assert_eq!(s.outbound.capacity(), 0);
    }

    #[test]
    fn qos1_and_qos2_outbound_flows() {
        let mut s: Packets<u64> = Packets::default();
        let a = s.alloc_id().unwrap();
        s.sent(a, 1, Some(10));
        let b = s.alloc_id().unwrap();
        assert_ne!(a, b);
        s.sent(b, 2, Some(11));
        assert_eq!(s.on_puback(b), None, "PUBACK for a QoS 2 id is ignored");
        assert_eq!(s.on_puback(a), Some(Some(10)));
        assert_eq!(s.on_puback(a), None);
        assert_eq!(s.on_pubrec(b), PubRec::Released(Some(11)));
        assert_eq!(s.on_pubrec(b), PubRec::Again);
        assert_eq!(s.pending_pubrel().collect::<Vec<_>>(), [b]);
        assert_eq!(s.inflight(), 1, "in flight until PUBCOMP");
        // b is still taken until PUBCOMP
        for _ in 0..10 {
            let id = s.alloc_id().unwrap();
            assert_ne!(id, b);
        }
        assert!(s.on_pubcomp(b));
        assert!(!s.on_pubcomp(b));
        assert_eq!(s.on_pubrec(999), PubRec::Unknown);
    }

    #[test]
    fn ids_wrap_and_skip_those_in_use() {
        let mut s: Packets<u64> = Packets {
            next_id: u16::MAX,
            ..Default::default()
        };
        s.sent(1, 1, None);
        assert_eq!(s.alloc_id(), Some(u16::MAX));
        assert_eq!(s.alloc_id(), Some(2));
    }

    #[test]
    fn inbound_qos2_is_exactly_once_across_a_reconnect() {
        let mut s: Packets<u64> = Packets::default();
        assert!(s.inbound_qos2(5));
        assert!(!s.inbound_qos2(5), "DUP resend before PUBREL");
        let (_, carry) = s.finish();
        let mut s2: Packets<u64> = Packets::resume(BTreeMap::new(), carry);
        assert!(!s2.inbound_qos2(5), "still held after reconnect");
        assert!(s2.on_pubrel(5));
        assert!(s2.inbound_qos2(5), "a new message may reuse the id");
    }

    #[test]
    fn finish_returns_unacked_in_id_order() {
        let mut s: Packets<u64> = Packets::default();
        for t in [3u64, 1, 2] {
            let id = s.alloc_id().unwrap();
            s.sent(id, 1, Some(t));
        }
        let id = s.alloc_id().unwrap();
        s.sent(id, 1, None);
        assert_eq!(s.finish().0, [3, 1, 2]);
    }
}
