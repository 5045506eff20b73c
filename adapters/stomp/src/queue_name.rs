//! The queue behind a durable topic subscription, named as RabbitMQ's STOMP plugin
//! names it (`rabbit_stomp_util:subscription_queue_name/3`):
//!
//! `stomp-subscription-` ++ base64url(md5(term_to_binary({Name, Id}))), unpadded,
//!
//! where `Name` is the routing-key part of the destination (`K` in `/topic/K` and
//! `/exchange/X/K`: the exchange is left out, as RabbitMQ leaves it out) and `Id` the
//! SUBSCRIBE `id`, both Erlang strings. So a client keeps the queue name it had on
//! RabbitMQ, two ids on different topics get different queues, and the same id on the
//! same topic shares one. md5 only bounds the length; it is not a security measure.
//!
//! Before this, Triad named the queue `stomp-subscription-<id>` ([`legacy`]); the
//! session still finds such a queue for the same id and topic (see
//! `Session::binding_queue`).

/// The prefix of every generated name.
pub const PREFIX: &str = "stomp-subscription-";

/// The durable subscription queue for routing key (or pattern) `name` and subscription
/// `id`, as RabbitMQ names it.
pub fn durable_subscription(name: &str, id: &str) -> String {
    let mut term = Vec::with_capacity(3 + 2 * 5 + name.len() + id.len());
    // external term format, version 131: a 2-tuple of two strings
    term.extend_from_slice(&[131, 104, 2]);
    erlang_string(name.as_bytes(), &mut term);
    erlang_string(id.as_bytes(), &mut term);
    let digest = md5(&term);
    let mut out = String::with_capacity(PREFIX.len() + 22);
    out.push_str(PREFIX);
    base64url(&digest, &mut out);
    out
}

/// Unpadded base64url (RFC 4648 §5), as `rabbit_misc:base64url/1`.
fn base64url(bytes: &[u8], out: &mut String) {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode_string(bytes, out);
}

/// The name Triad used before, kept for existing subscriptions.
pub fn legacy(id: &str) -> String {
    format!("{PREFIX}{id}")
}

/// An Erlang list of bytes (RabbitMQ's STOMP header values) as `term_to_binary`
/// writes it: `NIL_EXT` when empty, `STRING_EXT` up to 65535 bytes, else `LIST_EXT`
/// of `SMALL_INTEGER_EXT`s.
fn erlang_string(s: &[u8], out: &mut Vec<u8>) {
    match u16::try_from(s.len()) {
        Ok(0) => out.push(106),
        Ok(n) => {
            out.push(107);
            out.extend_from_slice(&n.to_be_bytes());
            out.extend_from_slice(s);
        }
        Err(_) => {
            out.push(108);
            out.extend_from_slice(&u32::try_from(s.len()).unwrap_or(u32::MAX).to_be_bytes());
            for b in s {
                out.extend_from_slice(&[97, *b]);
            }
            out.push(106);
        }
    }
}

/// MD5 (RFC 1321), only for naming queues as RabbitMQ does.
fn md5(input: &[u8]) -> [u8; 16] {
    const S: [u32; 64] = [
        7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 5, 9, 14, 20, 5, 9, 14, 20, 5,
        9, 14, 20, 5, 9, 14, 20, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 6, 10,
        15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21,
    ];
    // K[i] = floor(abs(sin(i + 1)) * 2^32)
    let k: [u32; 64] = std::array::from_fn(|i| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let v = ((i as f64 + 1.0).sin().abs() * 4_294_967_296.0) as u32;
        v
    });
    let mut msg = input.to_vec();
    let bit_len = (input.len() as u64).wrapping_mul(8);
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&bit_len.to_le_bytes());
    let (mut a0, mut b0, mut c0, mut d0) = (
        0x6745_2301u32,
        0xefcd_ab89u32,
        0x98ba_dcfeu32,
        0x1032_5476u32,
    );
    for chunk in msg.chunks_exact(64) {
        let m: [u32; 16] = std::array::from_fn(|i| {
            let w = chunk.get(i * 4..i * 4 + 4).unwrap_or(&[0; 4]);
            u32::from_le_bytes([
                w.first().copied().unwrap_or(0),
                w.get(1).copied().unwrap_or(0),
                w.get(2).copied().unwrap_or(0),
                w.get(3).copied().unwrap_or(0),
            ])
        });
        let (mut a, mut b, mut c, mut d) = (a0, b0, c0, d0);
        for (i, (s, k)) in S.iter().zip(k.iter()).enumerate() {
            let (f, g) = match i / 16 {
                0 => ((b & c) | (!b & d), i),
                1 => ((d & b) | (!d & c), (5 * i + 1) % 16),
                2 => (b ^ c ^ d, (3 * i + 5) % 16),
                _ => (c ^ (b | !d), (7 * i) % 16),
            };
            let f = f
                .wrapping_add(a)
                .wrapping_add(*k)
                .wrapping_add(m.get(g).copied().unwrap_or(0));
            a = d;
            d = c;
            c = b;
            b = b.wrapping_add(f.rotate_left(*s));
        }
        a0 = a0.wrapping_add(a);
        b0 = b0.wrapping_add(b);
        c0 = c0.wrapping_add(c);
        d0 = d0.wrapping_add(d);
    }
    let mut out = [0u8; 16];
    for (dst, word) in out.chunks_exact_mut(4).zip([a0, b0, c0, d0]) {
        dst.copy_from_slice(&word.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn base64url_unpadded() {
        let enc = |b: &[u8]| {
            let mut s = String::new();
            base64url(b, &mut s);
            s
        };
        assert_eq!(enc(b""), "");
        assert_eq!(enc(b"f"), "Zg");
        assert_eq!(enc(b"fo"), "Zm8");
        assert_eq!(enc(b"foo"), "Zm9v");
        assert_eq!(enc(b"foob"), "Zm9vYg");
        assert_eq!(enc(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn md5_matches_rfc_1321_vectors() {
        assert_eq!(hex(&md5(b"")), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(hex(&md5(b"abc")), "900150983cd24fb0d6963f7d28e17f72");
        assert_eq!(
            hex(&md5(
                b"12345678901234567890123456789012345678901234567890123456789012345678901234567890"
            )),
            "57edf4a22be3c955ac49da2e2107b67a"
        );
        assert_eq!(
            hex(&md5(b"message digest")),
            "f96b697d7cb7938d525a2f31aaf161d0"
        );
    }

    /// Names read back from RabbitMQ 3.10's management API after SUBSCRIBE with
    /// `id:s1`, `durable:true`, `auto-delete:false` to each destination.
    #[test]
    fn names_match_rabbitmq() {
        // /topic/probe.a
        assert_eq!(
            durable_subscription("probe.a", "s1"),
            "stomp-subscription-hJkjaRgQqrw6WStJrycdAA"
        );
        // /topic/probe.b and /exchange/amq.topic/probe.b
        assert_eq!(
            durable_subscription("probe.b", "s1"),
            "stomp-subscription-c6XQYvyfPFl_watBibEBSA"
        );
        // /exchange/amq.fanout (no routing key: an empty Erlang string)
        assert_eq!(
            durable_subscription("", "s1"),
            "stomp-subscription-qRo1_QO1dY0HY4WZBeQMew"
        );
    }

    #[test]
    fn names_differ_by_topic_and_id_and_stay_short() {
        let a = durable_subscription("a", "x");
        assert_ne!(a, durable_subscription("b", "x"));
        assert_ne!(a, durable_subscription("a", "y"));
        assert_eq!(a, durable_subscription("a", "x"));
        // the pair is the input, not the concatenation
        assert_ne!(
            durable_subscription("ab", "c"),
            durable_subscription("a", "bc")
        );
        let long = "k".repeat(70_000);
        assert_eq!(durable_subscription(&long, "x").len(), PREFIX.len() + 22);
        assert_eq!(legacy("x"), "stomp-subscription-x");
    }
}
