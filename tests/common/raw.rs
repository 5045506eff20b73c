//! Minimal blocking raw-socket clients for STOMP and MQTT 3.1.1, a seeded RNG and a
//! reader of a process's resident set size, for the crash-loop, abuse and soak tests.
//!
//! The clients speak just enough of each protocol to publish with a durability
//! acknowledgement (STOMP `receipt`, MQTT QoS 1 PUBACK) and to consume; they never
//! hide an error: every read has a timeout and every failure is returned.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// xorshift64*: small, seeded, reproducible (print the seed, rerun with it).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// The seed from `var` if set, else one from the clock and pid.
    pub fn seed_from_env(var: &str) -> u64 {
        if let Ok(s) = std::env::var(var) {
            return s
                .parse()
                .unwrap_or_else(|_| panic!("{var} is not a u64: {s:?}"));
        }
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        t ^ (u64::from(std::process::id()) << 32)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-ish in `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo)
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// Resident set size of `pid` in KiB (`VmRSS` in `/proc/PID/status`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:")
}

/// Anonymous resident memory (the heap) of `pid` in KiB (`RssAnon`).
pub fn rss_anon_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "RssAnon:")
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// An integer from the environment, or `default`.
pub fn env_u64(var: &str, default: u64) -> u64 {
    match std::env::var(var) {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("{var} is not a number: {s:?}")),
        Err(_) => default,
    }
}

fn connect_tcp(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Appends what the next read returns to `buf`; an error on timeout or close.
fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<()> {
    let mut chunk = [0u8; 16 * 1024];
    let n = stream.read(&mut chunk)?;
    if n == 0 {
        return Err(eof());
    }
    buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
    Ok(())
}

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed")
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

// ---------------------------------------------------------------------------------------
// STOMP

/// One STOMP frame as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StompFrame {
    pub command: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl StompFrame {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Encodes a frame (no header escaping: callers use plain values).
pub fn stomp_frame(command: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + body.len());
    out.extend_from_slice(command.as_bytes());
    out.push(b'\n');
    for (k, v) in headers {
        out.extend_from_slice(k.as_bytes());
        out.push(b':');
        out.extend_from_slice(v.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(format!("content-length:{}\n\n", body.len()).as_bytes());
    out.extend_from_slice(body);
    out.push(0);
    out
}

pub struct StompClient {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl StompClient {
    /// A client over a connected socket (nothing sent yet), with `timeout` for I/O.
    pub fn from_stream(stream: TcpStream, timeout: Option<Duration>) -> StompClient {
        let _ = stream.set_read_timeout(timeout);
        let _ = stream.set_write_timeout(timeout);
        StompClient {
            stream,
            buf: Vec::new(),
        }
    }

    /// Connects and logs in as the default (loopback) user; waits for CONNECTED.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<StompClient> {
        let stream = connect_tcp(addr, timeout)?;
        let mut c = StompClient {
            stream,
            buf: Vec::new(),
        };
        c.send(
            "CONNECT",
            &[
                ("accept-version", "1.2"),
                ("host", "/"),
                ("heart-beat", "0,0"),
            ],
            b"",
        )?;
        let f = c.read_frame()?;
        if f.command != "CONNECTED" {
            return Err(invalid(format!("expected CONNECTED, got {f:?}")));
        }
        Ok(c)
    }

    pub fn send(&mut self, command: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<()> {
        self.stream.write_all(&stomp_frame(command, headers, body))
    }

    /// Reads the next frame (skipping heart-beat EOLs); an error on timeout or close.
    pub fn read_frame(&mut self) -> io::Result<StompFrame> {
        loop {
            if let Some(f) = self.parse()? {
                return Ok(f);
            }
            read_more(&mut self.stream, &mut self.buf)?;
        }
    }

    fn parse(&mut self) -> io::Result<Option<StompFrame>> {
        let skip = self
            .buf
            .iter()
            .take_while(|b| **b == b'\n' || **b == b'\r')
            .count();
        self.buf.drain(..skip);
        let Some(head_end) = self.buf.windows(2).position(|w| w == b"\n\n") else {
            return Ok(None);
        };
        let head =
            String::from_utf8_lossy(self.buf.get(..head_end).unwrap_or_default()).replace('\r', "");
        let mut lines = head.split('\n');
        let command = lines.next().unwrap_or_default().to_owned();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let body_start = head_end + 2;
        let len = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok());
        let (body_end, frame_end) = match len {
            Some(n) => {
                if self.buf.len() < body_start + n + 1 {
                    return Ok(None);
                }
                (body_start + n, body_start + n + 1)
            }
            None => match self
                .buf
                .get(body_start..)
                .and_then(|b| b.iter().position(|x| *x == 0))
            {
                Some(p) => (body_start + p, body_start + p + 1),
                None => return Ok(None),
            },
        };
        let body = self
            .buf
            .get(body_start..body_end)
            .unwrap_or_default()
            .to_vec();
        self.buf.drain(..frame_end);
        Ok(Some(StompFrame {
            command,
            headers,
            body,
        }))
    }
}

// ---------------------------------------------------------------------------------------
// MQTT 3.1.1

/// Appends an MQTT remaining length.
pub fn mqtt_remaining_length(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            break;
        }
    }
}

fn mqtt_str(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn mqtt_packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    mqtt_remaining_length(body.len(), &mut out);
    out.extend_from_slice(body);
    out
}

/// CONNECT, MQTT 3.1.1, no user name (the default loopback user), keep-alive 60 s.
pub fn mqtt_connect_packet(client_id: &str, clean_session: bool) -> Vec<u8> {
    let mut body = Vec::new();
    mqtt_str("MQTT", &mut body);
    body.push(4);
    body.push(if clean_session { 0x02 } else { 0 });
    body.extend_from_slice(&60u16.to_be_bytes());
    mqtt_str(client_id, &mut body);
    mqtt_packet(0x10, &body)
}

pub fn mqtt_publish_packet(topic: &str, qos: u8, pkid: u16, payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(topic.len() + payload.len() + 4);
    mqtt_str(topic, &mut body);
    if qos > 0 {
        body.extend_from_slice(&pkid.to_be_bytes());
    }
    body.extend_from_slice(payload);
    mqtt_packet(0x30 | (qos << 1), &body)
}

/// One MQTT packet as received: the first byte and the rest after the length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MqttPacket {
    pub first: u8,
    pub body: Vec<u8>,
}

impl MqttPacket {
    pub fn kind(&self) -> u8 {
        self.first >> 4
    }
    /// The packet identifier of a PUBACK/SUBACK/...: the first two body bytes.
    pub fn pkid(&self) -> Option<u16> {
        Some(u16::from_be_bytes([
            *self.body.first()?,
            *self.body.get(1)?,
        ]))
    }
    /// (topic, packet id if QoS > 0, payload) of a PUBLISH.
    pub fn publish(&self) -> Option<(String, Option<u16>, Vec<u8>)> {
        let qos = (self.first >> 1) & 3;
        let tlen = usize::from(u16::from_be_bytes([
            *self.body.first()?,
            *self.body.get(1)?,
        ]));
        let topic = String::from_utf8(self.body.get(2..2 + tlen)?.to_vec()).ok()?;
        let mut at = 2 + tlen;
        let pkid = if qos > 0 {
            let id = u16::from_be_bytes([*self.body.get(at)?, *self.body.get(at + 1)?]);
            at += 2;
            Some(id)
        } else {
            None
        };
        Some((topic, pkid, self.body.get(at..)?.to_vec()))
    }
}

pub struct MqttClient {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl MqttClient {
    /// A client over a connected socket (nothing sent yet).
    pub fn from_stream(stream: TcpStream) -> MqttClient {
        MqttClient {
            stream,
            buf: Vec::new(),
        }
    }

    /// Connects; an error unless CONNACK 0 comes back.
    pub fn connect(
        addr: SocketAddr,
        client_id: &str,
        clean_session: bool,
        timeout: Duration,
    ) -> io::Result<MqttClient> {
        Self::connect_session(addr, client_id, clean_session, timeout).map(|(c, _)| c)
    }

    /// Connects; returns the client and CONNACK's session-present flag, an error unless
    /// CONNACK 0 comes back.
    pub fn connect_session(
        addr: SocketAddr,
        client_id: &str,
        clean_session: bool,
        timeout: Duration,
    ) -> io::Result<(MqttClient, bool)> {
        let stream = connect_tcp(addr, timeout)?;
        let mut c = MqttClient {
            stream,
            buf: Vec::new(),
        };
        c.stream
            .write_all(&mqtt_connect_packet(client_id, clean_session))?;
        let p = c.read_packet()?;
        if p.kind() != 2 || p.body.get(1) != Some(&0) {
            return Err(invalid(format!("expected CONNACK 0, got {p:?}")));
        }
        let present = p.body.first().is_some_and(|f| f & 1 == 1);
        Ok((c, present))
    }

    /// Connects with a user name and password (`None`: none, the default loopback
    /// user); returns the client and CONNACK's (session present, return code), whatever
    /// the code.
    pub fn connect_login(
        addr: SocketAddr,
        client_id: &str,
        clean_session: bool,
        login: Option<(&str, &str)>,
        timeout: Duration,
    ) -> io::Result<(MqttClient, bool, u8)> {
        let stream = connect_tcp(addr, timeout)?;
        let mut c = MqttClient {
            stream,
            buf: Vec::new(),
        };
        let mut body = Vec::new();
        mqtt_str("MQTT", &mut body);
        body.push(4);
        let mut flags = if clean_session { 0x02 } else { 0 };
        if login.is_some() {
            flags |= 0xC0;
        }
        body.push(flags);
        body.extend_from_slice(&60u16.to_be_bytes());
        mqtt_str(client_id, &mut body);
        if let Some((u, p)) = login {
            mqtt_str(u, &mut body);
            mqtt_str(p, &mut body);
        }
        c.stream.write_all(&mqtt_packet(0x10, &body))?;
        let p = c.read_packet()?;
        if p.kind() != 2 {
            return Err(invalid(format!("expected CONNACK, got {p:?}")));
        }
        let present = p.body.first().is_some_and(|f| f & 1 == 1);
        let code = p.body.get(1).copied().unwrap_or(0xff);
        Ok((c, present, code))
    }

    pub fn publish(&mut self, topic: &str, qos: u8, pkid: u16, payload: &[u8]) -> io::Result<()> {
        self.stream
            .write_all(&mqtt_publish_packet(topic, qos, pkid, payload))
    }

    /// PUBLISH with the retain flag.
    pub fn publish_retained(
        &mut self,
        topic: &str,
        qos: u8,
        pkid: u16,
        payload: &[u8],
    ) -> io::Result<()> {
        let mut p = mqtt_publish_packet(topic, qos, pkid, payload);
        if let Some(first) = p.first_mut() {
            *first |= 1;
        }
        self.stream.write_all(&p)
    }

    /// SUBSCRIBE to `filters` in one packet (without waiting for the SUBACK).
    pub fn send_subscribe(&mut self, pkid: u16, filters: &[(&str, u8)]) -> io::Result<()> {
        let mut body = pkid.to_be_bytes().to_vec();
        for (f, q) in filters {
            mqtt_str(f, &mut body);
            body.push(*q);
        }
        self.stream.write_all(&mqtt_packet(0x82, &body))
    }

    /// Reads packets until one of `kind` comes; returns it and the ones before it.
    pub fn read_until(&mut self, kind: u8) -> io::Result<(MqttPacket, Vec<MqttPacket>)> {
        let mut before = Vec::new();
        loop {
            let p = self.read_packet()?;
            if p.kind() == kind {
                return Ok((p, before));
            }
            before.push(p);
        }
    }

    pub fn puback(&mut self, pkid: u16) -> io::Result<()> {
        let [a, b] = pkid.to_be_bytes();
        self.stream.write_all(&[0x40, 2, a, b])
    }

    /// SUBSCRIBE to one filter; waits for the SUBACK and returns its return code.
    pub fn subscribe(&mut self, pkid: u16, filter: &str, qos: u8) -> io::Result<u8> {
        let mut body = pkid.to_be_bytes().to_vec();
        mqtt_str(filter, &mut body);
        body.push(qos);
        self.stream.write_all(&mqtt_packet(0x82, &body))?;
        loop {
            let p = self.read_packet()?;
            if p.kind() == 9 {
                return p
                    .body
                    .get(2)
                    .copied()
                    .ok_or_else(|| invalid("short SUBACK".into()));
            }
        }
    }

    pub fn disconnect(mut self) -> io::Result<()> {
        self.stream.write_all(&[0xE0, 0])
    }

    /// Reads the next packet; an error on timeout or close.
    pub fn read_packet(&mut self) -> io::Result<MqttPacket> {
        loop {
            if let Some(p) = self.parse()? {
                return Ok(p);
            }
            read_more(&mut self.stream, &mut self.buf)?;
        }
    }

    fn parse(&mut self) -> io::Result<Option<MqttPacket>> {
        let Some(&first) = self.buf.first() else {
            return Ok(None);
        };
        let mut len = 0usize;
        let mut mult = 1usize;
        let mut at = 1;
        loop {
            let Some(&b) = self.buf.get(at) else {
                return Ok(None);
            };
            len += usize::from(b & 0x7f) * mult;
            mult *= 128;
            at += 1;
            if b & 0x80 == 0 {
                break;
            }
            if at > 4 {
                return Err(invalid("bad remaining length from the broker".into()));
            }
        }
        if self.buf.len() < at + len {
            return Ok(None);
        }
        let body = self.buf.get(at..at + len).unwrap_or_default().to_vec();
        self.buf.drain(..at + len);
        Ok(Some(MqttPacket { first, body }))
    }
}
