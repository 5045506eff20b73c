//! The consume-queue tag of an entry: what the queue needs without reading the record
//! (body length, priority, "has a per-message TTL", persistent; the `x-tag` hash is
//! [`crate::filter`]'s).

pub(super) const TAG_PRIORITY_SHIFT: u32 = 32;
pub(super) const TAG_HAS_TTL: u64 = 1 << 40;
pub(super) const TAG_PERSISTENT: u64 = 1 << 41;

/// The consume-queue tag for a message.
pub(crate) fn make_tag(body_len: usize, priority: u8, has_ttl: bool, persistent: bool) -> u64 {
    (body_len.min(u32::MAX as usize) as u64)
        | ((priority as u64) << TAG_PRIORITY_SHIFT)
        | if has_ttl { TAG_HAS_TTL } else { 0 }
        | if persistent { TAG_PERSISTENT } else { 0 }
}

pub(super) fn tag_len(tag: u64) -> u64 {
    tag & 0xffff_ffff
}

pub(super) fn tag_priority(tag: u64) -> u8 {
    ((tag >> TAG_PRIORITY_SHIFT) & 0xff) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_pack_and_unpack() {
        let t = make_tag(1234, 7, true, true);
        assert_eq!(tag_len(t), 1234);
        assert_eq!(tag_priority(t), 7);
        assert!(t & TAG_HAS_TTL != 0 && t & TAG_PERSISTENT != 0);
    }
}
