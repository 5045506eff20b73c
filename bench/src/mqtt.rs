//! `triad-bench mqtt`: a minimal MQTT 3.1.1 client (CONNECT, PUBLISH with
//! QoS 0/1/2 flows, SUBSCRIBE, PINGREQ, DISCONNECT), after emqtt-bench.
//!
//! `mqtt`: publisher i publishes to `<topic>/<i % topics>`, subscriber j subscribes to
//! `<topic>/<j % topics>`; each subscriber must see every message of its topic's publishers
//! (so `--topics 1` with many subscribers is fan-out). Clean sessions, no keep-alive.
//! `mqtt-idle` is in [`crate::idle`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::args::MqttArgs;
use crate::e2e::{self, Checker, Counters, Harness, Pacer};
use crate::wire::{Rd, ReadBuf};

pub(crate) const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
const FLUSH_AT: usize = 64 << 10;

const CONNECT: u8 = 1;
pub(crate) const CONNACK: u8 = 2;
pub(crate) const PUBLISH: u8 = 3;
pub(crate) const PUBACK: u8 = 4;
const PUBREC: u8 = 5;
const PUBREL: u8 = 6;
const PUBCOMP: u8 = 7;
pub(crate) const SUBSCRIBE: u8 = 8;
pub(crate) const SUBACK: u8 = 9;
pub(crate) const DISCONNECT: u8 = 14;

// ---- encoding ----

fn put_len(out: &mut Vec<u8>, mut n: usize) {
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

pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends a packet: fixed header byte, remaining length, then what `f` writes.
pub(crate) fn packet(out: &mut Vec<u8>, first: u8, f: impl FnOnce(&mut Vec<u8>)) {
    let mut body = Vec::new();
    f(&mut body);
    out.push(first);
    put_len(out, body.len());
    out.extend_from_slice(&body);
}

pub(crate) fn connect(
    out: &mut Vec<u8>,
    client_id: &str,
    keepalive: u16,
    user: Option<&str>,
    pass: Option<&str>,
) {
    connect_with(out, client_id, keepalive, true, user, pass)
}

/// CONNECT with the clean-session flag as given (`false`: a persistent session).
pub(crate) fn connect_with(
    out: &mut Vec<u8>,
    client_id: &str,
    keepalive: u16,
    clean: bool,
    user: Option<&str>,
    pass: Option<&str>,
) {
    packet(out, CONNECT << 4, |o| {
        put_str(o, "MQTT");
        o.push(4);
        let mut flags = if clean { 0x02 } else { 0 };
        if user.is_some() {
            flags |= 0x80;
        }
        if pass.is_some() {
            flags |= 0x40;
        }
        o.push(flags);
        o.extend_from_slice(&keepalive.to_be_bytes());
        put_str(o, client_id);
        if let Some(u) = user {
            put_str(o, u);
        }
        if let Some(p) = pass {
            put_str(o, p);
        }
    });
}

/// PUBLISH, written without the intermediate buffer `packet` uses (the hot path).
pub(crate) fn publish(out: &mut Vec<u8>, topic: &str, qos: u8, pid: u16, payload: &[u8]) {
    out.push(PUBLISH << 4 | qos << 1);
    let len = 2 + topic.len() + if qos > 0 { 2 } else { 0 } + payload.len();
    put_len(out, len);
    put_str(out, topic);
    if qos > 0 {
        out.extend_from_slice(&pid.to_be_bytes());
    }
    out.extend_from_slice(payload);
}

pub(crate) fn pid_packet(out: &mut Vec<u8>, typ: u8, pid: u16) {
    out.push(typ << 4 | if typ == PUBREL { 0x02 } else { 0 });
    out.push(2);
    out.extend_from_slice(&pid.to_be_bytes());
}

// ---- decoding ----

/// The packet at the front of `data`: (first byte, offset of its body, body length).
pub(crate) fn packet_at(data: &[u8]) -> Result<Option<(u8, usize, usize)>, String> {
    let mut len = 0usize;
    for i in 0..4 {
        let Some(&b) = data.get(1 + i) else {
            return Ok(None);
        };
        len |= ((b & 0x7f) as usize) << (7 * i);
        if b & 0x80 == 0 {
            let off = 2 + i;
            return Ok((data.len() >= off + len).then_some((data[0], off, len)));
        }
    }
    Err("malformed remaining length".into())
}

pub(crate) fn want(data: &[u8]) -> usize {
    match packet_at(data) {
        Ok(None) if data.len() >= 5 => {
            let mut len = 0usize;
            for i in 0..4 {
                len |= ((data[1 + i] & 0x7f) as usize) << (7 * i);
                if data[1 + i] & 0x80 == 0 {
                    return 2 + i + len;
                }
            }
            4096
        }
        _ => 4096,
    }
}

/// A PUBLISH body: (packet id if QoS > 0, payload).
pub(crate) fn parse_publish(first: u8, body: &[u8]) -> Result<(u8, u16, &[u8]), String> {
    let qos = (first >> 1) & 3;
    let mut r = Rd(body);
    let tl = r.u16()? as usize;
    r.take(tl)?;
    let pid = if qos > 0 { r.u16()? } else { 0 };
    Ok((qos, pid, r.0))
}

struct Conn {
    r: ReadBuf,
    w: OwnedWriteHalf,
    out: Vec<u8>,
}

impl Conn {
    async fn open(
        host: &str,
        port: u16,
        client_id: &str,
        keepalive: u16,
        user: Option<&str>,
        pass: Option<&str>,
        bufsize: usize,
    ) -> Result<Conn, String> {
        let s = tokio::time::timeout(SETUP_TIMEOUT, TcpStream::connect((host, port)))
            .await
            .map_err(|_| format!("connect {host}:{port}: timed out"))?
            .map_err(|e| format!("connect {host}:{port}: {e}"))?;
        let _ = s.set_nodelay(true);
        let (rd, w) = s.into_split();
        let mut c = Conn {
            r: ReadBuf::with_capacity(rd, bufsize),
            w,
            out: Vec::new(),
        };
        connect(&mut c.out, client_id, keepalive, user, pass);
        c.flush().await?;
        let b = c.expect(CONNACK).await?;
        match b.get(1) {
            Some(0) => Ok(c),
            Some(rc) => Err(format!("CONNACK return code {rc}")),
            None => Err("short CONNACK".into()),
        }
    }

    async fn flush(&mut self) -> Result<(), String> {
        write_out(&mut self.w, &mut self.out).await
    }

    /// Reads until a packet of type `typ` and returns its body; others are skipped.
    async fn expect(&mut self, typ: u8) -> Result<Vec<u8>, String> {
        loop {
            match packet_at(self.r.data())? {
                Some((first, off, len)) => {
                    let body = self.r.data()[off..off + len].to_vec();
                    self.r.consume(off + len);
                    if first >> 4 == typ {
                        return Ok(body);
                    }
                }
                None => {
                    let w = want(self.r.data());
                    self.r.fill_within(w, SETUP_TIMEOUT).await?
                }
            }
        }
    }

    async fn disconnect(mut self) {
        self.out.extend_from_slice(&[DISCONNECT << 4, 0]);
        let _ = self.flush().await;
        let _ = self.w.shutdown().await;
    }
}

async fn write_out(w: &mut OwnedWriteHalf, out: &mut Vec<u8>) -> Result<(), String> {
    if !out.is_empty() {
        w.write_all(out).await.map_err(|e| format!("write: {e}"))?;
        out.clear();
    }
    Ok(())
}

pub(crate) fn client_id(kind: char, i: usize) -> String {
    format!("tb-{}-{kind}{i}", std::process::id())
}

fn creds(l: &crate::args::LoadArgs) -> (Option<&str>, Option<&str>) {
    (Some(l.user.as_str()), Some(l.pass.as_str()))
}

/// The publisher's read side: PUBACK / PUBCOMP free a window slot, PUBREC asks the writer
/// for a PUBREL. EOF after `closing` is the normal end.
async fn ack_reader(
    mut r: ReadBuf,
    window: Arc<Semaphore>,
    rel: mpsc::UnboundedSender<u16>,
    counters: Arc<Counters>,
    closing: Arc<AtomicBool>,
    done: CancellationToken,
) -> (u64, Option<String>) {
    let mut acked = 0u64;
    let res: Result<(), String> = async {
        loop {
            while let Some((first, off, len)) = packet_at(r.data())? {
                let body = &r.data()[off..off + len];
                match first >> 4 {
                    PUBACK | PUBCOMP => {
                        acked += 1;
                        counters.confirmed.fetch_add(1, Ordering::Relaxed);
                        window.add_permits(1);
                    }
                    PUBREC => {
                        let pid = Rd(body).u16()?;
                        let _ = rel.send(pid);
                    }
                    _ => {}
                }
                r.consume(off + len);
            }
            let w = want(r.data());
            if let Err(e) = r.fill(w).await {
                return if closing.load(Ordering::Relaxed) {
                    Ok(())
                } else {
                    Err(e)
                };
            }
        }
    }
    .await;
    let err = res.err();
    if err.is_some() {
        window.close();
    }
    done.cancel();
    (acked, err)
}

/// Finishes a QoS 1/2 publisher's outstanding flows (PUBREL for each PUBREC) until its
/// window is whole again, for at most `--drain-timeout` (10 s at least).
async fn finish_flows(
    a: &MqttArgs,
    window: &Semaphore,
    rel_rx: &mut mpsc::UnboundedReceiver<u16>,
    done: &CancellationToken,
    w: &mut OwnedWriteHalf,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let t = tokio::time::Instant::now() + a.load.drain_timeout.max(Duration::from_secs(10));
    while window.available_permits() < a.inflight && !done.is_cancelled() {
        tokio::select! {
            _ = tokio::time::sleep_until(t) => break,
            _ = tokio::time::sleep(Duration::from_millis(2)) => {}
            Some(pid) = rel_rx.recv() => {
                pid_packet(out, PUBREL, pid);
                while let Ok(pid) = rel_rx.try_recv() {
                    pid_packet(out, PUBREL, pid);
                }
                write_out(w, out).await?;
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn publisher(
    c: Conn,
    a: Arc<MqttArgs>,
    id: u32,
    topic: String,
    quota: Option<u64>,
    deadline: Option<Instant>,
    counters: Arc<Counters>,
) -> e2e::ProducerResult {
    let Conn { r, mut w, mut out } = c;
    let qos = a.qos;
    let window = Arc::new(Semaphore::new(if qos > 0 {
        a.inflight
    } else {
        Semaphore::MAX_PERMITS
    }));
    let (rel_tx, mut rel_rx) = mpsc::unbounded_channel::<u16>();
    let closing = Arc::new(AtomicBool::new(false));
    let done = CancellationToken::new();
    let reader = tokio::spawn(ack_reader(
        r,
        window.clone(),
        rel_tx,
        counters.clone(),
        closing.clone(),
        done.clone(),
    ));
    let pacer = Pacer::new(a.load.rate.map(|r| r / a.load.producers as f64));
    let mut body = e2e::body_template(a.load.size);
    let mut sent = 0u64;
    let res: Result<(), String> = async {
        loop {
            while let Ok(pid) = rel_rx.try_recv() {
                pid_packet(&mut out, PUBREL, pid);
            }
            if quota.is_some_and(|q| sent >= q)
                || deadline.is_some_and(|d| Instant::now() >= d)
                || done.is_cancelled()
            {
                break;
            }
            if let Some(d) = pacer.wait(sent) {
                write_out(&mut w, &mut out).await?;
                tokio::time::sleep(d).await;
            }
            if qos > 0 {
                match window.try_acquire() {
                    Ok(p) => p.forget(),
                    Err(_) => {
                        write_out(&mut w, &mut out).await?;
                        tokio::select! {
                            p = window.acquire() => match p {
                                Ok(p) => p.forget(),
                                Err(_) => break,
                            },
                            Some(pid) = rel_rx.recv() => {
                                pid_packet(&mut out, PUBREL, pid);
                                continue;
                            }
                        }
                    }
                }
            }
            e2e::stamp(&mut body, id, sent as u32, e2e::now_ns());
            let pid = (sent % 65535) as u16 + 1;
            publish(&mut out, &topic, qos, pid, &body);
            sent += 1;
            counters.sent.fetch_add(1, Ordering::Relaxed);
            if out.len() >= FLUSH_AT {
                write_out(&mut w, &mut out).await?;
            }
        }
        write_out(&mut w, &mut out).await?;
        if qos > 0 {
            finish_flows(&a, &window, &mut rel_rx, &done, &mut w, &mut out).await?;
        }
        closing.store(true, Ordering::Relaxed);
        out.extend_from_slice(&[DISCONNECT << 4, 0]);
        write_out(&mut w, &mut out).await?;
        let _ = w.shutdown().await;
        Ok(())
    }
    .await;
    closing.store(true, Ordering::Relaxed);
    let (acked, rerr) = match tokio::time::timeout(Duration::from_secs(5), reader).await {
        Ok(Ok(x)) => x,
        _ => (0, Some("the broker did not close after DISCONNECT".into())),
    };
    let mut err = res.err().or(rerr);
    if qos > 0 && err.is_none() && acked < sent {
        err = Some(format!("{} publishes never acknowledged", sent - acked));
    }
    (sent, err)
}

async fn subscriber(
    mut c: Conn,
    a: Arc<MqttArgs>,
    counters: Arc<Counters>,
    stop: CancellationToken,
) -> e2e::ConsumerResult {
    let mut chk = Checker::new(a.load.producers, a.load.size);
    let res: Result<(), String> = async {
        loop {
            let mut n = 0u64;
            while let Some((first, off, len)) = packet_at(c.r.data())? {
                let body = &c.r.data()[off..off + len];
                match first >> 4 {
                    PUBLISH => {
                        let (qos, pid, payload) = parse_publish(first, body)?;
                        chk.check(payload);
                        n += 1;
                        match qos {
                            1 => pid_packet(&mut c.out, PUBACK, pid),
                            2 => pid_packet(&mut c.out, PUBREC, pid),
                            _ => {}
                        }
                    }
                    PUBREL => {
                        let pid = Rd(body).u16()?;
                        pid_packet(&mut c.out, PUBCOMP, pid);
                    }
                    _ => {}
                }
                c.r.consume(off + len);
            }
            if n > 0 {
                counters.received.fetch_add(n, Ordering::Relaxed);
            }
            c.flush().await?;
            let w = want(c.r.data());
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                r = c.r.fill(w) => r?,
            }
        }
    }
    .await;
    let err = res.err();
    if err.is_none() {
        c.disconnect().await;
    }
    (chk, err)
}

pub fn run(a: &MqttArgs) -> Result<Value, String> {
    e2e::runtime(a.load.threads)?.block_on(run_async(Arc::new(a.clone())))
}

async fn run_async(a: Arc<MqttArgs>) -> Result<Value, String> {
    let l = &a.load;
    let (user, pass) = creds(l);
    let groups = l.consumers;
    let topic = |i: usize| format!("{}/{}", a.topic, i % a.topics);
    let mut subs = Vec::new();
    for j in 0..l.consumers {
        let mut c =
            Conn::open(&l.host, l.port, &client_id('s', j), 0, user, pass, 64 << 10).await?;
        packet(&mut c.out, SUBSCRIBE << 4 | 0x02, |o| {
            o.extend_from_slice(&1u16.to_be_bytes());
            put_str(o, &topic(j));
            o.push(a.qos);
        });
        c.flush().await?;
        let ack = c.expect(SUBACK).await?;
        match ack.get(2) {
            Some(&q) if q == a.qos => {}
            Some(&q) => return Err(format!("SUBACK granted QoS {q}, asked {}", a.qos)),
            None => return Err("short SUBACK".into()),
        }
        subs.push(c);
    }
    let mut pubs = Vec::new();
    for i in 0..l.producers {
        pubs.push(Conn::open(&l.host, l.port, &client_id('p', i), 0, user, pass, 16 << 10).await?);
    }
    let h = Harness::start(l)?;
    let consumers: Vec<_> = subs
        .into_iter()
        .map(|c| tokio::spawn(subscriber(c, a.clone(), h.counters.clone(), h.stop.clone())))
        .collect();
    let quotas = e2e::quotas(l.count, l.producers);
    let producers: Vec<_> = pubs
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            tokio::spawn(publisher(
                c,
                a.clone(),
                i as u32,
                topic(i),
                quotas[i],
                h.deadline(l),
                h.counters.clone(),
            ))
        })
        .collect();
    let topics = a.topics;
    // each subscriber is its own group; it is fed by the publishers on its topic
    let feeds = move |g: usize, p: usize| g % topics == p % topics;
    let fin = h
        .finish(l, producers, consumers, |sent| {
            (0..groups)
                .map(|g| {
                    sent.iter()
                        .enumerate()
                        .filter(|(p, _)| feeds(g, *p))
                        .map(|(_, n)| n)
                        .sum::<u64>()
                })
                .sum()
        })
        .await;
    let group_of: Vec<usize> = (0..groups).collect();
    let o = fin.outcome(&group_of, groups, feeds);
    Ok(e2e::result(
        "mqtt",
        l,
        &o,
        json!({
            "variant": format!("qos{}", a.qos),
            "qos": a.qos,
            "topics": a.topics,
            "inflight": (a.qos > 0).then_some(a.inflight),
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remaining_length() {
        for n in [
            0usize,
            1,
            127,
            128,
            16383,
            16384,
            2_097_151,
            2_097_152,
            268_435_455,
        ] {
            let mut out = vec![0x30];
            put_len(&mut out, n);
            out.resize(out.len() + n.min(300), 0);
            match packet_at(&out).unwrap() {
                Some((_, off, len)) => {
                    assert_eq!(len, n);
                    assert_eq!(off, out.len() - n);
                }
                None => assert!(n > 300),
            }
        }
        assert!(packet_at(&[0x30, 0xff, 0xff, 0xff, 0xff, 1]).is_err());
        assert_eq!(packet_at(&[0x30, 0x80]).unwrap(), None);
    }

    #[test]
    fn publish_round_trip() {
        for qos in 0..=2u8 {
            let mut out = Vec::new();
            publish(&mut out, "a/b", qos, 513, b"payload");
            let (first, off, len) = packet_at(&out).unwrap().unwrap();
            assert_eq!(off + len, out.len());
            let (q, pid, p) = parse_publish(first, &out[off..]).unwrap();
            assert_eq!((q, p), (qos, &b"payload"[..]));
            assert_eq!(pid, if qos > 0 { 513 } else { 0 });
        }
        let mut out = Vec::new();
        pid_packet(&mut out, PUBREL, 7);
        assert_eq!(out, [0x62, 2, 0, 7]);
        let mut c = Vec::new();
        connect(&mut c, "id", 60, Some("u"), Some("p"));
        assert_eq!(&c[..2], &[0x10, 20]);
        assert_eq!(c[9], 0xc2);
    }
}
