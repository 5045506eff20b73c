//! MQTT 3.1.1 packets and their pure codec: bytes ⇄ [`Packet`]. No I/O, no core types.
//!
//! [`decode`] has three outcomes, never blurred: `Ok(Some(packet))`, `Ok(None)` (need
//! more bytes; nothing is consumed), and `Err` (a violation: the caller closes the
//! connection). The remaining length is checked against [`Limits::max_packet_size`] as
//! soon as the fixed header is complete, before the body is buffered, so a peer cannot
//! make the server hold more than the limit.
//!
//! # Why not `mqttbytes`
//!
//! The house style names `mqttbytes` (its `v4` module is MQTT 3.1.1). Its framing
//! (`check`) is sound, but its packet readers accept much that the specification
//! forbids and a server must refuse, and reject things a server must answer, so this
//! module replaces it (there is no dependency at all):
//! - reserved fixed-header flag bits are never checked (SUBSCRIBE must be `0x82`,
//!   PUBREL `0x62`, ... [MQTT-2.2.2-1], [MQTT-2.2.2-2]), nor the CONNECT reserved flag
//!   [MQTT-3.1.2-3], nor will QoS / will retain without the will flag [MQTT-3.1.2-11],
//!   [MQTT-3.1.2-13], [MQTT-3.1.2-15], nor a password without a user name
//!   [MQTT-3.1.2-22];
//! - a PUBLISH topic with wildcards [MQTT-3.3.2-2] or empty [MQTT-4.7.3-1] is accepted,
//!   and so are strings containing U+0000 [MQTT-1.5.3-2];
//! - a SUBSCRIBE or UNSUBSCRIBE without a payload is accepted [MQTT-3.8.3-3],
//!   [MQTT-3.10.3-2], as are reserved bits in the requested-QoS byte [MQTT-3-8.3-4];
//! - CONNECT with protocol level 5 is parsed as v4, and "MQIsdp" level 3 (MQTT 3.1,
//!   which Mosquitto accepts) is refused, and an unknown protocol is a parse error
//!   where a server must answer CONNACK 1 [MQTT-3.1.2-2];
//! - the password is a `String` (it is binary data in 3.1.1), and trailing bytes after
//!   a packet's fields are ignored.
//!
//! Packets a client never sends (CONNACK, SUBACK, UNSUBACK, PINGRESP) are decoded too,
//! so that the codec round-trips; the session refuses them.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;

/// Bounds applied while decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest remaining length accepted (the protocol's own cap is 268,435,455).
    pub max_packet_size: usize,
    /// Most topic filters in one SUBSCRIBE or UNSUBSCRIBE.
    pub max_filters: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_packet_size: 16 << 20,
            max_filters: 1024,
        }
    }
}

/// The protocol's largest remaining length (four length bytes).
pub const MAX_REMAINING_LENGTH: usize = 268_435_455;

/// A decoding failure: the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// The remaining length uses more than four bytes.
    #[error("malformed remaining length")]
    MalformedRemainingLength,
    /// The declared remaining length exceeds the limit.
    #[error("packet of {size} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Declared remaining length.
        size: usize,
        /// The limit in force.
        max: usize,
    },
    /// Packet type 0 or 15.
    #[error("reserved packet type {0}")]
    ReservedType(u8),
    /// Fixed-header flags that this packet type does not allow.
    #[error("invalid flags {flags:#x} for packet type {packet_type}")]
    InvalidFlags {
        /// Packet type.
        packet_type: u8,
        /// The low nibble of the first byte.
        flags: u8,
    },
    /// The CONNECT names a protocol or level this server does not speak: answer
    /// CONNACK 1 (unacceptable protocol version), then close [MQTT-3.1.2-2].
    #[error("unacceptable protocol {name:?} level {level}")]
    UnacceptableProtocol {
        /// Protocol name.
        name: String,
        /// Protocol level.
        level: u8,
    },
    /// A string is not well-formed UTF-8 or contains U+0000.
    #[error("invalid UTF-8 string")]
    InvalidUtf8,
    /// A packet identifier of zero where one is required [MQTT-2.3.1-1].
    #[error("packet identifier zero")]
    ZeroPacketId,
    /// QoS 3.
    #[error("invalid QoS")]
    InvalidQos,
    /// A PUBLISH topic that is empty or contains wildcards.
    #[error("invalid topic name")]
    InvalidTopic,
    /// SUBSCRIBE or UNSUBSCRIBE without any topic filter.
    #[error("no topic filters")]
    NoFilters,
    /// More topic filters than [`Limits::max_filters`].
    #[error("too many topic filters")]
    TooManyFilters,
    /// Any other structural violation.
    #[error("malformed packet: {0}")]
    Malformed(&'static str),
}

/// A will message, from CONNECT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Will {
    /// Topic (a valid topic name, no wildcards).
    pub topic: String,
    /// Payload.
    pub payload: Bytes,
    /// QoS 0-2.
    pub qos: u8,
    /// Retain flag.
    pub retain: bool,
}

/// CONNECT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// "MQTT" (3.1.1) or "MQIsdp" (3.1).
    pub protocol_name: String,
    /// 4 (3.1.1) or 3 (3.1).
    pub protocol_level: u8,
    /// Clean session flag.
    pub clean_session: bool,
    /// Keep alive, seconds (0 = off).
    pub keep_alive: u16,
    /// Client identifier (may be empty).
    pub client_id: String,
    /// Will message.
    pub will: Option<Will>,
    /// User name.
    pub username: Option<String>,
    /// Password (binary).
    pub password: Option<Bytes>,
}

/// PUBLISH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    /// DUP flag.
    pub dup: bool,
    /// QoS 0-2.
    pub qos: u8,
    /// RETAIN flag.
    pub retain: bool,
    /// Topic name.
    pub topic: String,
    /// Packet identifier (0 for QoS 0).
    pub pkid: u16,
    /// Payload.
    pub payload: Bytes,
}

/// SUBSCRIBE: the filters are only checked to be UTF-8 here; the session answers an
/// invalid filter with return code 0x80.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscribe {
    /// Packet identifier.
    pub pkid: u16,
    /// (topic filter, requested QoS 0-2).
    pub filters: Vec<(String, u8)>,
}

/// SUBACK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubAck {
    /// Packet identifier.
    pub pkid: u16,
    /// One return code per filter: granted QoS or 0x80.
    pub codes: Vec<u8>,
}

/// UNSUBSCRIBE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsubscribe {
    /// Packet identifier.
    pub pkid: u16,
    /// Topic filters.
    pub filters: Vec<String>,
}

/// An MQTT 3.1.1 control packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet {
    /// CONNECT.
    Connect(Connect),
    /// CONNACK: session present, return code.
    ConnAck {
        /// Session present flag.
        session_present: bool,
        /// Return code 0-5.
        code: u8,
    },
    /// PUBLISH.
    Publish(Publish),
    /// PUBACK.
    PubAck(u16),
    /// PUBREC.
    PubRec(u16),
    /// PUBREL.
    PubRel(u16),
    /// PUBCOMP.
    PubComp(u16),
    /// SUBSCRIBE.
    Subscribe(Subscribe),
    /// SUBACK.
    SubAck(SubAck),
    /// UNSUBSCRIBE.
    Unsubscribe(Unsubscribe),
    /// UNSUBACK.
    UnsubAck(u16),
    /// PINGREQ.
    PingReq,
    /// PINGRESP.
    PingResp,
    /// DISCONNECT.
    Disconnect,
}

/// Whether a topic name is valid for PUBLISH: non-empty, no wildcards.
pub fn valid_topic_name(t: &str) -> bool {
    !t.is_empty() && !t.contains(['+', '#']) && t.len() <= u16::MAX as usize
}

/// Parses the fixed header: `Ok(None)` until the length bytes are complete.
/// Returns (first byte, header length, remaining length).
fn fixed_header(buf: &[u8]) -> Result<Option<(u8, usize, usize)>, DecodeError> {
    let Some(&b1) = buf.first() else {
        return Ok(None);
    };
    let mut len: usize = 0;
    for i in 0..4 {
        let Some(&b) = buf.get(1 + i) else {
            return Ok(None);
        };
        len |= ((b & 0x7f) as usize) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(Some((b1, 2 + i, len)));
        }
    }
    Err(DecodeError::MalformedRemainingLength)
}

/// Decodes one packet from the front of `buf`, consuming its bytes only when a whole
/// packet (or an error) results.
pub fn decode(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Packet>, DecodeError> {
    let Some((b1, hlen, rlen)) = fixed_header(buf)? else {
        return Ok(None);
    };
    let packet_type = b1 >> 4;
    let flags = b1 & 0x0f;
    if packet_type == 0 || packet_type == 15 {
        return Err(DecodeError::ReservedType(packet_type));
    }
    let expected_flags = match packet_type {
        3 => None,
        6 | 8 | 10 => Some(0b0010),
        _ => Some(0),
    };
    if expected_flags.is_some_and(|f| f != flags) {
        return Err(DecodeError::InvalidFlags { packet_type, flags });
    }
    if rlen > limits.max_packet_size {
        return Err(DecodeError::TooLarge {
            size: rlen,
            max: limits.max_packet_size,
        });
    }
    let total = hlen
        .checked_add(rlen)
        .ok_or(DecodeError::MalformedRemainingLength)?;
    if buf.len() < total {
        // reserve what the declared (bounded) length needs, once, but at most 1 MiB
        // before the bytes arrive: a fixed header alone cannot make the broker allocate
        // a whole large packet
        buf.reserve((total - buf.len()).min(1 << 20));
        return Ok(None);
    }
    let mut frame = buf.split_to(total).freeze();
    frame.advance(hlen);
    let mut r = Reader(frame);
    let p = match packet_type {
        1 => r.connect()?,
        2 => r.connack()?,
        3 => r.publish(flags)?,
        4 => Packet::PubAck(r.pkid()?),
        5 => Packet::PubRec(r.pkid()?),
        6 => Packet::PubRel(r.pkid()?),
        7 => Packet::PubComp(r.pkid()?),
        8 => r.subscribe(limits)?,
        9 => r.suback()?,
        10 => r.unsubscribe(limits)?,
        11 => Packet::UnsubAck(r.pkid()?),
        12 => Packet::PingReq,
        13 => Packet::PingResp,
        14 => Packet::Disconnect,
        _ => return Err(DecodeError::ReservedType(packet_type)),
    };
    if r.0.has_remaining() {
        return Err(DecodeError::Malformed("trailing bytes"));
    }
    Ok(Some(p))
}

struct Reader(Bytes);

impl Reader {
    /// CONNACK's body: flags (only session-present may be set) and return code.
    fn connack(&mut self) -> Result<Packet, DecodeError> {
        let f = self.u8()?;
        if f & 0xfe != 0 {
            return Err(DecodeError::Malformed("CONNACK reserved flags"));
        }
        let code = self.u8()?;
        Ok(Packet::ConnAck {
            session_present: f & 1 != 0,
            code,
        })
    }

    /// SUBSCRIBE's body: packet id, then at least one (filter, QoS), at most
    /// `limits.max_filters`.
    fn subscribe(&mut self, limits: &Limits) -> Result<Packet, DecodeError> {
        let pkid = self.pkid()?;
        let mut filters = Vec::new();
        while self.0.has_remaining() {
            if filters.len() >= limits.max_filters {
                return Err(DecodeError::TooManyFilters);
            }
            let f = self.string()?;
            let q = self.u8()?;
            if q & 0xfc != 0 {
                return Err(DecodeError::Malformed("SUBSCRIBE reserved bits"));
            }
            if q > 2 {
                return Err(DecodeError::InvalidQos);
            }
            filters.push((f, q));
        }
        if filters.is_empty() {
            return Err(DecodeError::NoFilters);
        }
        Ok(Packet::Subscribe(Subscribe { pkid, filters }))
    }

    /// SUBACK's body: packet id, then one return code per filter.
    fn suback(&mut self) -> Result<Packet, DecodeError> {
        let pkid = self.pkid()?;
        let codes = self.0.split_to(self.0.len()).to_vec();
        if codes.iter().any(|c| !matches!(c, 0 | 1 | 2 | 0x80)) {
            return Err(DecodeError::Malformed("SUBACK return code"));
        }
        Ok(Packet::SubAck(SubAck { pkid, codes }))
    }

    /// UNSUBSCRIBE's body: packet id, then at least one filter, at most
    /// `limits.max_filters`.
    fn unsubscribe(&mut self, limits: &Limits) -> Result<Packet, DecodeError> {
        let pkid = self.pkid()?;
        let mut filters = Vec::new();
        while self.0.has_remaining() {
            if filters.len() >= limits.max_filters {
                return Err(DecodeError::TooManyFilters);
            }
            filters.push(self.string()?);
        }
        if filters.is_empty() {
            return Err(DecodeError::NoFilters);
        }
        Ok(Packet::Unsubscribe(Unsubscribe { pkid, filters }))
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        if self.0.is_empty() {
            return Err(DecodeError::Malformed("truncated"));
        }
        Ok(self.0.get_u8())
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        if self.0.len() < 2 {
            return Err(DecodeError::Malformed("truncated"));
        }
        Ok(self.0.get_u16())
    }
    fn pkid(&mut self) -> Result<u16, DecodeError> {
        match self.u16()? {
            0 => Err(DecodeError::ZeroPacketId),
            n => Ok(n),
        }
    }
    fn bytes(&mut self) -> Result<Bytes, DecodeError> {
        let n = self.u16()? as usize;
        if self.0.len() < n {
            return Err(DecodeError::Malformed("string longer than the packet"));
        }
        Ok(self.0.split_to(n))
    }
    fn string(&mut self) -> Result<String, DecodeError> {
        let b = self.bytes()?;
        let s = std::str::from_utf8(&b).map_err(|_| DecodeError::InvalidUtf8)?;
        if s.contains('\0') {
            return Err(DecodeError::InvalidUtf8);
        }
        Ok(s.to_owned())
    }

    fn connect(&mut self) -> Result<Packet, DecodeError> {
        let name = self.string()?;
        let level = self.u8()?;
        if !matches!((name.as_str(), level), ("MQTT", 4) | ("MQIsdp", 3)) {
            return Err(DecodeError::UnacceptableProtocol { name, level });
        }
        let flags = self.u8()?;
        if flags & 1 != 0 {
            return Err(DecodeError::Malformed("CONNECT reserved flag"));
        }
        let clean_session = flags & 0x02 != 0;
        let will_flag = flags & 0x04 != 0;
        let will_qos = (flags >> 3) & 0x03;
        let will_retain = flags & 0x20 != 0;
        let has_password = flags & 0x40 != 0;
        let has_username = flags & 0x80 != 0;
        if will_qos > 2 {
            return Err(DecodeError::InvalidQos);
        }
        if !will_flag && (will_qos != 0 || will_retain) {
            return Err(DecodeError::Malformed("will QoS or retain without a will"));
        }
        if has_password && !has_username {
            return Err(DecodeError::Malformed("password without a user name"));
        }
        let keep_alive = self.u16()?;
        let client_id = self.string()?;
        let will = if will_flag {
            let topic = self.string()?;
            if !valid_topic_name(&topic) {
                return Err(DecodeError::InvalidTopic);
            }
            let payload = self.bytes()?;
            Some(Will {
                topic,
                payload,
                qos: will_qos,
                retain: will_retain,
            })
        } else {
            None
        };
        let username = if has_username {
            Some(self.string()?)
        } else {
            None
        };
        let password = if has_password {
            Some(self.bytes()?)
        } else {
            None
        };
        Ok(Packet::Connect(Connect {
            protocol_name: name,
            protocol_level: level,
            clean_session,
            keep_alive,
            client_id,
            will,
            username,
            password,
        }))
    }

    fn publish(&mut self, flags: u8) -> Result<Packet, DecodeError> {
        let dup = flags & 0b1000 != 0;
        let qos = (flags >> 1) & 0b11;
        let retain = flags & 1 != 0;
        if qos > 2 {
            return Err(DecodeError::InvalidQos);
        }
        if qos == 0 && dup {
            return Err(DecodeError::Malformed("DUP set on a QoS 0 PUBLISH"));
        }
        let topic = self.string()?;
        if !valid_topic_name(&topic) {
            return Err(DecodeError::InvalidTopic);
        }
        let pkid = if qos > 0 { self.pkid()? } else { 0 };
        let payload = self.0.split_to(self.0.len());
        Ok(Packet::Publish(Publish {
            dup,
            qos,
            retain,
            topic,
            pkid,
            payload,
        }))
    }
}

fn put_len(out: &mut BytesMut, mut n: usize) {
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.put_u8(b);
        if n == 0 {
            break;
        }
    }
}

fn put_str(out: &mut BytesMut, s: &[u8]) {
    let n = s.len().min(u16::MAX as usize);
    out.put_u16(n as u16);
    out.extend_from_slice(s.get(..n).unwrap_or_default());
}

fn str_len(s: &[u8]) -> usize {
    2 + s.len().min(u16::MAX as usize)
}

/// Encodes a PUBLISH from borrowed parts (what `encode` does for [`Packet::Publish`],
/// without building the packet: the delivery path shares topic and payload).
pub fn encode_publish(
    dup: bool,
    qos: u8,
    retain: bool,
    topic: &str,
    pkid: u16,
    payload: &[u8],
    out: &mut BytesMut,
) {
    let mut b1 = 0x30 | (qos << 1);
    if dup {
        b1 |= 0x08;
    }
    if retain {
        b1 |= 0x01;
    }
    let len = str_len(topic.as_bytes()) + if qos > 0 { 2 } else { 0 } + payload.len();
    out.reserve(5 + len);
    out.put_u8(b1);
    put_len(out, len);
    put_str(out, topic.as_bytes());
    if qos > 0 {
        out.put_u16(pkid);
    }
    out.extend_from_slice(payload);
}

/// Appends the encoding of `p` to `out`. Strings longer than 65,535 bytes are cut (the
/// server only encodes strings it decoded or built within that bound); a remaining
/// length beyond the protocol's cap is the caller's bug and is clamped by the server's
/// own packet limit, which is far below it.
pub fn encode(p: &Packet, out: &mut BytesMut) {
    match p {
        Packet::Connect(c) => {
            let mut body = BytesMut::new();
            put_str(&mut body, c.protocol_name.as_bytes());
            body.put_u8(c.protocol_level);
            let mut flags = 0u8;
            if c.clean_session {
                flags |= 0x02;
            }
            if let Some(w) = &c.will {
                flags |= 0x04 | (w.qos << 3);
                if w.retain {
                    flags |= 0x20;
                }
            }
            if c.password.is_some() {
                flags |= 0x40;
            }
            if c.username.is_some() {
                flags |= 0x80;
            }
            body.put_u8(flags);
            body.put_u16(c.keep_alive);
            put_str(&mut body, c.client_id.as_bytes());
            if let Some(w) = &c.will {
                put_str(&mut body, w.topic.as_bytes());
                put_str(&mut body, &w.payload);
            }
            if let Some(u) = &c.username {
                put_str(&mut body, u.as_bytes());
            }
            if let Some(pw) = &c.password {
                put_str(&mut body, pw);
            }
            out.put_u8(0x10);
            put_len(out, body.len());
            out.extend_from_slice(&body);
        }
        Packet::ConnAck {
            session_present,
            code,
        } => {
            out.extend_from_slice(&[0x20, 2, *session_present as u8, *code]);
        }
        Packet::Publish(p) => {
            encode_publish(p.dup, p.qos, p.retain, &p.topic, p.pkid, &p.payload, out)
        }
        Packet::PubAck(id) => ack(out, 0x40, *id),
        Packet::PubRec(id) => ack(out, 0x50, *id),
        Packet::PubRel(id) => ack(out, 0x62, *id),
        Packet::PubComp(id) => ack(out, 0x70, *id),
        Packet::Subscribe(s) => {
            let len = 2 + s
                .filters
                .iter()
                .map(|(f, _)| str_len(f.as_bytes()) + 1)
                .sum::<usize>();
            out.put_u8(0x82);
            put_len(out, len);
            out.put_u16(s.pkid);
            for (f, q) in &s.filters {
                put_str(out, f.as_bytes());
                out.put_u8(*q);
            }
        }
        Packet::SubAck(s) => {
            out.put_u8(0x90);
            put_len(out, 2 + s.codes.len());
            out.put_u16(s.pkid);
            out.extend_from_slice(&s.codes);
        }
        Packet::Unsubscribe(u) => {
            let len = 2 + u
                .filters
                .iter()
                .map(|f| str_len(f.as_bytes()))
                .sum::<usize>();
            out.put_u8(0xa2);
            put_len(out, len);
            out.put_u16(u.pkid);
            for f in &u.filters {
                put_str(out, f.as_bytes());
            }
        }
        Packet::UnsubAck(id) => ack(out, 0xb0, *id),
        Packet::PingReq => out.extend_from_slice(&[0xc0, 0]),
        Packet::PingResp => out.extend_from_slice(&[0xd0, 0]),
        Packet::Disconnect => out.extend_from_slice(&[0xe0, 0]),
    }
}

fn ack(out: &mut BytesMut, b1: u8, id: u16) {
    out.put_u8(b1);
    out.put_u8(2);
    out.put_u16(id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lim() -> Limits {
        Limits::default()
    }

    fn enc(p: &Packet) -> BytesMut {
        let mut b = BytesMut::new();
        encode(p, &mut b);
        b
    }

    fn samples() -> Vec<Packet> {
        vec![
            Packet::Connect(Connect {
                protocol_name: "MQTT".into(),
                protocol_level: 4,
                clean_session: true,
                keep_alive: 60,
                client_id: "c1".into(),
                will: Some(Will {
                    topic: "w/t".into(),
                    payload: Bytes::from_static(b"bye"),
                    qos: 1,
                    retain: true,
                }),
                username: Some("guest".into()),
                password: Some(Bytes::from_static(b"\xffpw")),
            }),
            Packet::Connect(Connect {
                protocol_name: "MQIsdp".into(),
                protocol_level: 3,
                clean_session: false,
                keep_alive: 0,
                client_id: String::new(),
                will: None,
                username: None,
                password: None,
            }),
            Packet::ConnAck {
                session_present: true,
                code: 0,
            },
            Packet::Publish(Publish {
                dup: true,
                qos: 2,
                retain: true,
                topic: "a/b".into(),
                pkid: 7,
                payload: Bytes::from(vec![1u8; 300]),
            }),
            Packet::Publish(Publish {
                dup: false,
                qos: 0,
                retain: false,
                topic: "x".into(),
                pkid: 0,
                payload: Bytes::new(),
            }),
            Packet::PubAck(1),
            Packet::PubRec(2),
            Packet::PubRel(3),
            Packet::PubComp(65535),
            Packet::Subscribe(Subscribe {
                pkid: 9,
                filters: vec![("a/+".into(), 1), ("#".into(), 2)],
            }),
            Packet::SubAck(SubAck {
                pkid: 9,
                codes: vec![1, 0x80],
            }),
            Packet::Unsubscribe(Unsubscribe {
                pkid: 10,
                filters: vec!["a/+".into()],
            }),
            Packet::UnsubAck(10),
            Packet::PingReq,
            Packet::PingResp,
            Packet::Disconnect,
        ]
    }

    #[test]
    fn round_trip_and_split_at_every_byte() {
        for p in samples() {
            let bytes = enc(&p);
            let mut b = bytes.clone();
            assert_eq!(decode(&mut b, &lim()).unwrap(), Some(p.clone()));
            assert!(b.is_empty());
            // fed one byte at a time, and split at every point
            for cut in 0..bytes.len() {
                let mut b = BytesMut::from(&bytes[..cut]);
                assert_eq!(decode(&mut b, &lim()).unwrap(), None, "{p:?} cut {cut}");
                assert_eq!(b.len(), cut);
                b.extend_from_slice(&bytes[cut..]);
                assert_eq!(decode(&mut b, &lim()).unwrap(), Some(p.clone()));
            }
        }
    }

    #[test]
    fn two_packets_in_one_buffer() {
        let mut b = enc(&Packet::PingReq);
        b.extend_from_slice(&enc(&Packet::PubAck(5)));
        assert_eq!(decode(&mut b, &lim()).unwrap(), Some(Packet::PingReq));
        assert_eq!(decode(&mut b, &lim()).unwrap(), Some(Packet::PubAck(5)));
        assert_eq!(decode(&mut b, &lim()).unwrap(), None);
    }

    #[test]
    fn oversize_is_rejected_from_the_remaining_length_alone() {
        // PUBLISH declaring 1 MiB, with only the fixed header present
        let mut b = BytesMut::from(&[0x30u8, 0x80, 0x80, 0x40][..]);
        let l = Limits {
            max_packet_size: 65536,
            ..lim()
        };
        assert_eq!(
            decode(&mut b, &l),
            Err(DecodeError::TooLarge {
                size: 1 << 20,
                max: 65536
            })
        );
        // five length bytes
        let mut b = BytesMut::from(&[0x30u8, 0xff, 0xff, 0xff, 0xff, 0x01][..]);
        assert_eq!(
            decode(&mut b, &lim()),
            Err(DecodeError::MalformedRemainingLength)
        );
    }

    fn err(bytes: &[u8]) -> DecodeError {
        decode(&mut BytesMut::from(bytes), &lim()).unwrap_err()
    }

    #[test]
    fn spec_violations_are_errors() {
        // [MQTT-2.2.2-1] SUBSCRIBE with flags 0
        assert!(matches!(
            err(&[0x80, 6, 0, 1, 0, 1, b'a', 0]),
            DecodeError::InvalidFlags { .. }
        ));
        // PUBREL with flags 0
        assert!(matches!(
            err(&[0x60, 2, 0, 1]),
            DecodeError::InvalidFlags { .. }
        ));
        // PINGREQ with flags
        assert!(matches!(err(&[0xc1, 0]), DecodeError::InvalidFlags { .. }));
        // reserved types
        assert_eq!(err(&[0x00, 0]), DecodeError::ReservedType(0));
        assert_eq!(err(&[0xf0, 0]), DecodeError::ReservedType(15));
        // [MQTT-3.3.1-4] QoS 3
        assert_eq!(err(&[0x36, 5, 0, 1, b'a', 0, 1]), DecodeError::InvalidQos);
        // [MQTT-3.3.2-2] wildcard in a PUBLISH topic, and empty topic
        assert_eq!(err(&[0x30, 3, 0, 1, b'+']), DecodeError::InvalidTopic);
        assert_eq!(err(&[0x30, 3, 0, 1, b'#']), DecodeError::InvalidTopic);
        assert_eq!(err(&[0x30, 2, 0, 0]), DecodeError::InvalidTopic);
        // [MQTT-1.5.3-1] invalid UTF-8, [MQTT-1.5.3-2] U+0000
        assert_eq!(err(&[0x30, 3, 0, 1, 0xff]), DecodeError::InvalidUtf8);
        assert_eq!(err(&[0x30, 3, 0, 1, 0]), DecodeError::InvalidUtf8);
        // [MQTT-2.3.1-1] packet id zero
        assert_eq!(err(&[0x32, 5, 0, 1, b'a', 0, 0]), DecodeError::ZeroPacketId);
        assert_eq!(err(&[0x40, 2, 0, 0]), DecodeError::ZeroPacketId);
        // [MQTT-3.8.3-3] SUBSCRIBE without filters, [MQTT-3.10.3-2] UNSUBSCRIBE too
        assert_eq!(err(&[0x82, 2, 0, 1]), DecodeError::NoFilters);
        assert_eq!(err(&[0xa2, 2, 0, 1]), DecodeError::NoFilters);
        // [MQTT-3-8.3-4] reserved bits of the requested QoS
        assert!(matches!(
            err(&[0x82, 6, 0, 1, 0, 1, b'a', 0x04]),
            DecodeError::Malformed(_)
        ));
        // SUBSCRIBE QoS 3
        assert_eq!(
            err(&[0x82, 6, 0, 1, 0, 1, b'a', 3]),
            DecodeError::InvalidQos
        );
        // a PUBACK with trailing bytes, a PINGREQ with a body
        assert!(matches!(
            err(&[0x40, 3, 0, 1, 0]),
            DecodeError::Malformed(_)
        ));
        assert!(matches!(err(&[0xc0, 1, 0]), DecodeError::Malformed(_)));
        // DUP on QoS 0
        assert!(matches!(
            err(&[0x38, 3, 0, 1, b'a']),
            DecodeError::Malformed(_)
        ));
    }

    fn connect_bytes(name: &[u8], level: u8, flags: u8, rest: &[u8]) -> Vec<u8> {
        let mut body = vec![0, name.len() as u8];
        body.extend_from_slice(name);
        body.push(level);
        body.push(flags);
        body.extend_from_slice(&[0, 60]);
        body.extend_from_slice(rest);
        let mut out = vec![0x10, body.len() as u8];
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn connect_violations() {
        // [MQTT-3.1.2-2] unknown level: CONNACK 1, not a plain error
        assert_eq!(
            err(&connect_bytes(b"MQTT", 5, 2, &[0, 0])),
            DecodeError::UnacceptableProtocol {
                name: "MQTT".into(),
                level: 5
            }
        );
        assert!(matches!(
            err(&connect_bytes(b"MQIsdp", 4, 2, &[0, 0])),
            DecodeError::UnacceptableProtocol { .. }
        ));
        // [MQTT-3.1.2-3] reserved flag
        assert!(matches!(
            err(&connect_bytes(b"MQTT", 4, 3, &[0, 0])),
            DecodeError::Malformed(_)
        ));
        // [MQTT-3.1.2-13] will QoS without will flag
        assert!(matches!(
            err(&connect_bytes(b"MQTT", 4, 0x0a, &[0, 0])),
            DecodeError::Malformed(_)
        ));
        // [MQTT-3.1.2-22] password without user name
        assert!(matches!(
            err(&connect_bytes(b"MQTT", 4, 0x42, &[0, 0, 0, 1, b'p'])),
            DecodeError::Malformed(_)
        ));
        // will QoS 3
        assert_eq!(
            err(&connect_bytes(b"MQTT", 4, 0x1e, &[0, 0])),
            DecodeError::InvalidQos
        );
        // missing client id
        assert!(matches!(
            err(&connect_bytes(b"MQTT", 4, 2, &[])),
            DecodeError::Malformed(_)
        ));
        // will topic with a wildcard
        assert_eq!(
            err(&connect_bytes(b"MQTT", 4, 0x06, &[0, 0, 0, 1, b'#', 0, 0])),
            DecodeError::InvalidTopic
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut b = BytesMut::from(&bytes[..]);
            let l = Limits { max_packet_size: 300, max_filters: 8 };
            // decode until an error or need-more; always makes progress or stops
            for _ in 0..600 {
                let before = b.len();
                match decode(&mut b, &l) {
                    Ok(Some(_)) => prop_assert!(b.len() < before),
                    Ok(None) | Err(_) => break,
                }
            }
        }

        #[test]
        fn publish_round_trips(topic in "[a-z/]{1,20}", qos in 0u8..3, retain in any::<bool>(),
                               pkid in 1u16.., payload in proptest::collection::vec(any::<u8>(), 0..200)) {
            let p = Packet::Publish(Publish { dup: qos > 0, qos, retain, topic,
                pkid: if qos > 0 { pkid } else { 0 }, payload: Bytes::from(payload) });
            let mut b = enc(&p);
            prop_assert_eq!(decode(&mut b, &lim()).unwrap(), Some(p));
        }

        #[test]
        fn mutated_packets_never_panic(i in 0usize..16, pos in any::<usize>(), byte in any::<u8>()) {
            let s = samples();
            let p = &s[i % s.len()];
            let mut bytes = enc(p).to_vec();
            let k = pos % bytes.len();
            bytes[k] = byte;
            let _ = decode(&mut BytesMut::from(&bytes[..]), &lim());
            let _ = decode(&mut BytesMut::from(&bytes[..k]), &lim());
        }
    }
}
