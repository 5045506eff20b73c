//! Per-queue ack state.
//!
//! The head is the lowest logical offset not yet acked; offsets above it that are acked
//! are kept as disjoint half-open ranges, merged as they grow, and the head advances over
//! any range that starts at it. Encoded snapshots are versioned and CRC32C-checked.
//!
//! Memory is proportional to the number of gaps (one map entry per maximal acked run
//! above the head), not to the number of acked offsets.
//!
//! Offsets are `u64`, ranges half-open, so `u64::MAX` itself can never be acked
//! (`ack(u64::MAX)` returns false); logical queue offsets never get there.
//!
//! Encoding (little-endian): magic `b"TACK"`, `u8` version (1), `u64` head, `u32` range
//! count, then `count` pairs of `u64` start / `u64` end, then the CRC32C (`u32`) of all
//! the preceding bytes.

use std::collections::BTreeMap;

use crate::error::{Result, StoreError};

const MAGIC: &[u8; 4] = b"TACK";
const VERSION: u8 = 1;
/// magic + version + head + count.
const HEADER_LEN: usize = 4 + 1 + 8 + 4;
const RANGE_LEN: usize = 16;
const CRC_LEN: usize = 4;

/// Ack head plus the acked set above it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AckState {
    /// Lowest offset not acked.
    head: u64,
    /// Acked runs above the head: start -> end (half-open). Invariants: every start is
    /// `> head`, `start < end`, and consecutive ranges are separated by at least one
    /// unacked offset (`prev.end < next.start`).
    ranges: BTreeMap<u64, u64>,
    /// Sum of the lengths of `ranges` (derived; kept for O(1) `acked_above_head`).
    acked: u64,
}

impl AckState {
    /// Nothing acked below `head` is pending; nothing above it is acked.
    pub fn new(head: u64) -> AckState {
        AckState {
            head,
            ranges: BTreeMap::new(),
            acked: 0,
        }
    }
    /// Lowest logical offset not yet acked.
    pub fn head(&self) -> u64 {
        self.head
    }
    /// Whether `offset` has been acked.
    pub fn is_acked(&self, offset: u64) -> bool {
        offset < self.head
            || self
                .ranges
                .range(..=offset)
                .next_back()
                .is_some_and(|(_, &end)| offset < end)
    }
    /// Marks `offset` acked; returns false when it already was.
    pub fn ack(&mut self, offset: u64) -> bool {
        match offset.checked_add(1) {
            Some(end) => self.ack_range(offset, end) == 1,
            None => false,
        }
    }
    /// Marks `start..end` acked (used by purge); returns how many were newly acked.
    pub fn ack_range(&mut self, start: u64, end: u64) -> u64 {
        let start = start.max(self.head);
        if start >= end {
            return 0;
        }
        // Ranges overlapping or adjacent to start..end: those with r.start <= end and
        // r.end >= start. Walk down from the last range starting at or below `end`.
        let mut merged_start = start;
        let mut merged_end = end;
        let mut already: u64 = 0;
        let mut touched: Vec<u64> = Vec::new();
        for (&s, &e) in self.ranges.range(..=end).rev() {
            if e < start {
                break;
            }
            touched.push(s);
            let lo = s.max(start);
            let hi = e.min(end);
            already = already.saturating_add(hi.saturating_sub(lo));
            merged_start = merged_start.min(s);
            merged_end = merged_end.max(e);
        }
        for s in touched {
            self.ranges.remove(&s);
        }
        let newly = (end - start).saturating_sub(already);
        self.acked = self.acked.saturating_add(newly);
        if merged_start == self.head {
            // The head advances over the whole merged run; those offsets are no longer
            // "above the head".
            self.acked = self.acked.saturating_sub(merged_end - merged_start);
            self.head = merged_end;
        } else {
            self.ranges.insert(merged_start, merged_end);
        }
        newly
    }
    /// How many offsets above the head are acked.
    pub fn acked_above_head(&self) -> u64 {
        self.acked
    }
    /// Number of acked runs above the head (the gaps between them and the head are what
    /// is still pending).
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }
    /// The acked runs above the head, ascending, as half-open `(start, end)` pairs.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&s, &e)| (s, e))
    }
    /// Offsets in `head..end` not acked (for walking a queue's pending entries), ascending,
    /// at most `max` of them.
    pub fn unacked(&self, end: u64, max: usize) -> Vec<u64> {
        self.unacked_from(0, end, max)
    }
    /// As [`AckState::unacked`], from `from` on (to walk a long queue in batches).
    pub fn unacked_from(&self, from: u64, end: u64, max: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut cur = self.head.max(from);
        // start at the acked range holding `cur`, if there is one
        let first = self
            .ranges
            .range(..=cur)
            .next_back()
            .filter(|(_, &e)| e > cur)
            .map_or(cur, |(&s, _)| s);
        let mut ranges = self.ranges.range(first..end.max(first));
        while out.len() < max && cur < end {
            let (gap_end, next_cur) = match ranges.next() {
                Some((&s, &e)) => (s, e),
                None => (end, end),
            };
            let gap_end = gap_end.min(end);
            while cur < gap_end && out.len() < max {
                out.push(cur);
                cur += 1;
            }
            cur = next_cur;
        }
        out
    }
    /// Serialises the state (magic, version, head, ranges, CRC32C).
    pub fn encode(&self) -> Vec<u8> {
        // More than u32::MAX ranges would need > 64 GiB of memory; cannot happen.
        let count = u32::try_from(self.ranges.len()).unwrap_or(u32::MAX);
        let mut out = Vec::with_capacity(HEADER_LEN + self.ranges.len() * RANGE_LEN + CRC_LEN);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.head.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        for (&s, &e) in self.ranges.iter().take(count as usize) {
            out.extend_from_slice(&s.to_le_bytes());
            out.extend_from_slice(&e.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }
    /// Parses what `encode` wrote; any damage is `StoreError::Corrupt`-free
    /// `StoreError::Invalid` (never a panic; lengths are bounded by the input size).
    pub fn decode(bytes: &[u8]) -> Result<AckState> {
        let bad = |why: &str| StoreError::Invalid(format!("ack state: {why}"));
        if bytes.len() < HEADER_LEN + CRC_LEN {
            return Err(bad("too short"));
        }
        let mut r = Reader { buf: bytes };
        if r.take::<4>().ok_or_else(|| bad("too short"))? != *MAGIC {
            return Err(bad("bad magic"));
        }
        let [version] = r.take::<1>().ok_or_else(|| bad("too short"))?;
        if version != VERSION {
            return Err(bad(&format!("unsupported version {version}")));
        }
        let head = r.u64().ok_or_else(|| bad("too short"))?;
        let count = r.u32().ok_or_else(|| bad("too short"))?;
        let expected = (count as u64)
            .checked_mul(RANGE_LEN as u64)
            .and_then(|n| n.checked_add((HEADER_LEN + CRC_LEN) as u64))
            .ok_or_else(|| bad("range count overflows"))?;
        if expected != bytes.len() as u64 {
            return Err(bad(&format!(
                "length {} does not match {count} ranges",
                bytes.len()
            )));
        }
        let body_len = bytes.len() - CRC_LEN;
        let (body, crc_bytes) = bytes.split_at(body_len);
        let stored = <[u8; 4]>::try_from(crc_bytes).map_err(|_| bad("too short"))?;
        if crc32c::crc32c(body) != u32::from_le_bytes(stored) {
            return Err(bad("checksum mismatch"));
        }
        let mut ranges = BTreeMap::new();
        let mut acked: u64 = 0;
        // Each range must start strictly above the previous end (and above the head).
        let mut floor = head;
        for _ in 0..count {
            let s = r.u64().ok_or_else(|| bad("too short"))?;
            let e = r.u64().ok_or_else(|| bad("too short"))?;
            if s <= floor {
                return Err(bad("ranges not sorted, disjoint and above the head"));
            }
            if e <= s {
                return Err(bad("empty or reversed range"));
            }
            acked = acked
                .checked_add(e - s)
                .ok_or_else(|| bad("acked count overflows"))?;
            ranges.insert(s, e);
            floor = e;
        }
        Ok(AckState {
            head,
            ranges,
            acked,
        })
    }
}

/// Bounds-checked little-endian cursor.
struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.buf.split_first_chunk::<N>()?;
        self.buf = rest;
        Some(*head)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn check_invariants(s: &AckState) {
        let mut floor = s.head;
        let mut sum = 0;
        for (st, e) in s.ranges() {
            assert!(st > floor, "range {st}..{e} not above {floor}");
            assert!(e > st);
            sum += e - st;
            floor = e;
        }
        assert_eq!(sum, s.acked_above_head());
    }

    #[test]
    fn merges_and_advances() {
        let mut s = AckState::new(10);
        assert!(!s.ack(5));
        assert!(s.is_acked(9));
        assert!(!s.is_acked(10));
        assert!(s.ack(12));
        assert!(!s.ack(12));
        assert!(s.ack(14));
        assert_eq!(s.range_count(), 2);
        assert!(s.ack(13)); // joins 12..13 and 14..15
        assert_eq!(s.ranges().collect::<Vec<_>>(), vec![(12, 15)]);
        assert_eq!(s.acked_above_head(), 3);
        assert_eq!(s.unacked(20, 100), vec![10, 11, 15, 16, 17, 18, 19]);
        assert_eq!(s.unacked(20, 3), vec![10, 11, 15]);
        assert_eq!(s.unacked(13, 100), vec![10, 11]);
        assert!(s.ack(11));
        assert_eq!(s.head(), 10);
        assert!(s.ack(10)); // head runs over 10..15
        assert_eq!(s.head(), 15);
        assert_eq!(s.range_count(), 0);
        assert_eq!(s.acked_above_head(), 0);
        check_invariants(&s);
    }

    #[test]
    fn ack_range_counts_overlaps() {
        let mut s = AckState::new(0);
        assert_eq!(s.ack_range(5, 10), 5);
        assert_eq!(s.ack_range(20, 30), 10);
        assert_eq!(s.ack_range(8, 22), 10); // 10..20 new
        assert_eq!(s.ranges().collect::<Vec<_>>(), vec![(5, 30)]);
        assert_eq!(s.ack_range(0, 40), 15);
        assert_eq!(s.head(), 40);
        assert_eq!(s.ack_range(0, 40), 0);
        assert_eq!(s.ack_range(45, 45), 0);
        assert_eq!(s.ack_range(50, 40), 0);
        assert!(!s.ack(u64::MAX));
        assert_eq!(s.ack_range(u64::MAX - 1, u64::MAX), 1);
        check_invariants(&s);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Ack(u64),
        Range(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u64..200).prop_map(Op::Ack),
            1 => (0u64..200, 0u64..30).prop_map(|(s, l)| Op::Range(s, s + l)),
        ]
    }

    fn arb_state() -> impl Strategy<Value = AckState> {
        (0u64..1000, proptest::collection::vec(op(), 0..60)).prop_map(|(h, ops)| {
            let mut s = AckState::new(h);
            for o in ops {
                match o {
                    Op::Ack(x) => {
                        s.ack(h + x);
                    }
                    Op::Range(a, b) => {
                        s.ack_range(h + a, h + b);
                    }
                }
            }
            s
        })
    }

    proptest! {
        #[test]
        fn matches_set_model(head in 0u64..50, ops in proptest::collection::vec(op(), 0..200)) {
            let mut s = AckState::new(head);
            let mut model: BTreeSet<u64> = BTreeSet::new();
            for o in ops {
                match o {
                    Op::Ack(x) => {
                        let exp = x >= head && model.insert(x);
                        prop_assert_eq!(s.ack(x), exp);
                    }
                    Op::Range(a, b) => {
                        let mut n = 0;
                        for x in a.max(head)..b {
                            if model.insert(x) { n += 1; }
                        }
                        prop_assert_eq!(s.ack_range(a, b), n);
                    }
                }
                let mut mhead = head;
                while model.contains(&mhead) { mhead += 1; }
                prop_assert_eq!(s.head(), mhead);
                prop_assert_eq!(s.acked_above_head(), model.range(mhead..).count() as u64);
                check_invariants(&s);
            }
            for x in 0..260 {
                prop_assert_eq!(s.is_acked(x), x < head || model.contains(&x));
            }
            let end = 240;
            let want: Vec<u64> = (s.head()..end).filter(|x| !model.contains(x)).collect();
            prop_assert_eq!(s.unacked(end, usize::MAX), want.clone());
            prop_assert_eq!(s.unacked(end, 7), want.iter().copied().take(7).collect::<Vec<_>>());
            // walked in batches from any point, inside an acked run or not
            for from in [0, 3, 17, 49, 50, 51, 120, 239, 240, 300] {
                let tail: Vec<u64> = want.iter().copied().filter(|x| *x >= from).collect();
                prop_assert_eq!(s.unacked_from(from, end, usize::MAX), tail.clone());
                prop_assert_eq!(s.unacked_from(from, end, 5), tail.iter().copied().take(5).collect::<Vec<_>>());
            }
            let mut walked = Vec::new();
            let mut from = 0;
            loop {
                let batch = s.unacked_from(from, end, 4);
                let Some(&last) = batch.last() else { break };
                walked.extend_from_slice(&batch);
                from = last + 1;
            }
            prop_assert_eq!(walked, want);
        }

        #[test]
        fn encode_round_trips(s in arb_state()) {
            let enc = s.encode();
            let dec = AckState::decode(&enc).unwrap();
            prop_assert_eq!(&dec, &s);
            prop_assert_eq!(dec.encode(), enc);
        }

        #[test]
        fn decode_arbitrary_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = AckState::decode(&bytes);
        }

        #[test]
        fn decode_arbitrary_with_valid_header(count in any::<u32>(), body in proptest::collection::vec(any::<u8>(), 0..100)) {
            let mut b = b"TACK\x01".to_vec();
            b.extend_from_slice(&7u64.to_le_bytes());
            b.extend_from_slice(&count.to_le_bytes());
            b.extend_from_slice(&body);
            let _ = AckState::decode(&b);
        }

        #[test]
        fn damage_is_detected(s in arb_state()) {
            let enc = s.encode();
            for len in 0..enc.len() {
                prop_assert!(matches!(AckState::decode(&enc[..len]), Err(StoreError::Invalid(_))));
            }
            for i in 0..enc.len() {
                for bit in [0x01u8, 0x80, 0xff] {
                    let mut b = enc.clone();
                    b[i] ^= bit;
                    prop_assert!(matches!(AckState::decode(&b), Err(StoreError::Invalid(_))));
                }
            }
        }
    }

    #[test]
    fn decode_rejects_bad_ranges_with_good_crc() {
        let build = |head: u64, ranges: &[(u64, u64)]| {
            let mut b = b"TACK\x01".to_vec();
            b.extend_from_slice(&head.to_le_bytes());
            b.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
            for (s, e) in ranges {
                b.extend_from_slice(&s.to_le_bytes());
                b.extend_from_slice(&e.to_le_bytes());
            }
            let crc = crc32c::crc32c(&b);
            b.extend_from_slice(&crc.to_le_bytes());
            b
        };
        assert!(AckState::decode(&build(5, &[(7, 9), (11, 12)])).is_ok());
        for bad in [
            build(5, &[(5, 9)]),           // starts at head
            build(5, &[(3, 9)]),           // below head
            build(5, &[(7, 7)]),           // empty
            build(5, &[(9, 7)]),           // reversed
            build(5, &[(7, 9), (9, 12)]),  // adjacent
            build(5, &[(11, 12), (7, 9)]), // unsorted
        ] {
            assert!(matches!(
                AckState::decode(&bad),
                Err(StoreError::Invalid(_))
            ));
        }
        let mut v2 = build(5, &[]);
        v2[4] = 2;
        let n = v2.len() - 4;
        let crc = crc32c::crc32c(&v2[..n]);
        v2[n..].copy_from_slice(&crc.to_le_bytes());
        assert!(AckState::decode(&v2).is_err());
    }
}
