//! `triad-bench amqp`: a minimal AMQP 0-9-1 client (PLAIN login, one channel per
//! connection, no heartbeats) driving producers and consumers, after RabbitMQ PerfTest.
//!
//! Topology: `--queues N` queues `triad-bench-<pid>-<i>` on the default exchange
//! (producer p publishes to queue p % N, consumer c reads queue c % N), or with
//! `--fanout N` a fanout exchange with N queues bound (every message to every queue). The
//! queues (and the exchange) are deleted at the end.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::args::{AmqpArgs, QueueType};
use crate::e2e::{self, Checker, Counters, Harness, Pacer};
use crate::report::{latency_json, new_histogram};
use crate::wire::{Rd, ReadBuf};

pub(crate) const FRAME_METHOD: u8 = 1;
pub(crate) const FRAME_HEADER: u8 = 2;
pub(crate) const FRAME_BODY: u8 = 3;
const FRAME_HEARTBEAT: u8 = 8;
const FRAME_END: u8 = 0xCE;
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Written out once this much is buffered.
const FLUSH_AT: usize = 64 << 10;

// (class, method) ids
const CONN_START: (u16, u16) = (10, 10);
const CONN_START_OK: (u16, u16) = (10, 11);
const CONN_TUNE: (u16, u16) = (10, 30);
const CONN_TUNE_OK: (u16, u16) = (10, 31);
const CONN_OPEN: (u16, u16) = (10, 40);
const CONN_OPEN_OK: (u16, u16) = (10, 41);
pub(crate) const CONN_CLOSE: (u16, u16) = (10, 50);
const CONN_CLOSE_OK: (u16, u16) = (10, 51);
const CH_OPEN: (u16, u16) = (20, 10);
const CH_OPEN_OK: (u16, u16) = (20, 11);
pub(crate) const CH_CLOSE: (u16, u16) = (20, 40);
const CH_CLOSE_OK: (u16, u16) = (20, 41);
const EX_DECLARE: (u16, u16) = (40, 10);
const EX_DECLARE_OK: (u16, u16) = (40, 11);
const EX_DELETE: (u16, u16) = (40, 20);
const EX_DELETE_OK: (u16, u16) = (40, 21);
pub(crate) const Q_DECLARE: (u16, u16) = (50, 10);
pub(crate) const Q_DECLARE_OK: (u16, u16) = (50, 11);
const Q_BIND: (u16, u16) = (50, 20);
pub(crate) const Q_BIND_OK: (u16, u16) = (50, 21);
pub(crate) const Q_DELETE: (u16, u16) = (50, 40);
pub(crate) const Q_DELETE_OK: (u16, u16) = (50, 41);
pub(crate) const B_QOS: (u16, u16) = (60, 10);
pub(crate) const B_QOS_OK: (u16, u16) = (60, 11);
pub(crate) const B_CONSUME: (u16, u16) = (60, 20);
pub(crate) const B_CONSUME_OK: (u16, u16) = (60, 21);
pub(crate) const B_CANCEL: (u16, u16) = (60, 30);
pub(crate) const B_PUBLISH: (u16, u16) = (60, 40);
pub(crate) const B_RETURN: (u16, u16) = (60, 50);
pub(crate) const B_DELIVER: (u16, u16) = (60, 60);
pub(crate) const B_ACK: (u16, u16) = (60, 80);
pub(crate) const B_NACK: (u16, u16) = (60, 120);
const CONFIRM_SELECT: (u16, u16) = (85, 10);
const CONFIRM_SELECT_OK: (u16, u16) = (85, 11);

// ---- encoding ----

pub(crate) fn shortstr(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.len().min(255)];
    out.push(b.len() as u8);
    out.extend_from_slice(b);
}

pub(crate) fn longstr(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

/// Appends one frame whose payload `f` writes.
pub(crate) fn frame(out: &mut Vec<u8>, typ: u8, ch: u16, f: impl FnOnce(&mut Vec<u8>)) {
    out.push(typ);
    out.extend_from_slice(&ch.to_be_bytes());
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    f(out);
    let len = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
    out.push(FRAME_END);
}

pub(crate) fn method(out: &mut Vec<u8>, ch: u16, id: (u16, u16), args: impl FnOnce(&mut Vec<u8>)) {
    frame(out, FRAME_METHOD, ch, |o| {
        o.extend_from_slice(&id.0.to_be_bytes());
        o.extend_from_slice(&id.1.to_be_bytes());
        args(o);
    });
}

/// basic.publish + content header (delivery-mode) + body frames of at most frame_max.
fn publish(
    out: &mut Vec<u8>,
    exchange: &str,
    routing_key: &str,
    persistent: bool,
    body: &[u8],
    frame_max: usize,
) {
    method(out, 1, B_PUBLISH, |o| {
        o.extend_from_slice(&0u16.to_be_bytes());
        shortstr(o, exchange);
        shortstr(o, routing_key);
        o.push(0); // mandatory, immediate
    });
    frame(out, FRAME_HEADER, 1, |o| {
        o.extend_from_slice(&60u16.to_be_bytes());
        o.extend_from_slice(&0u16.to_be_bytes());
        o.extend_from_slice(&(body.len() as u64).to_be_bytes());
        o.extend_from_slice(&(1u16 << 12).to_be_bytes()); // delivery-mode present
        o.push(if persistent { 2 } else { 1 });
    });
    for chunk in body.chunks(frame_max.saturating_sub(8).max(1)) {
        frame(out, FRAME_BODY, 1, |o| o.extend_from_slice(chunk));
    }
}

fn ack(out: &mut Vec<u8>, tag: u64, multiple: bool) {
    method(out, 1, B_ACK, |o| {
        o.extend_from_slice(&tag.to_be_bytes());
        o.push(u8::from(multiple));
    });
}

// ---- decoding ----

/// A complete frame at the front of the buffer: (type, channel, payload range length).
pub(crate) fn frame_at(data: &[u8]) -> Result<Option<(u8, u16, usize)>, String> {
    if data.len() < 7 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([data[3], data[4], data[5], data[6]]) as usize;
    if data.len() < len + 8 {
        return Ok(None);
    }
    if data[7 + len] != FRAME_END {
        return Err("bad frame end octet".into());
    }
    Ok(Some((data[0], u16::from_be_bytes([data[1], data[2]]), len)))
}

pub(crate) fn method_id(payload: &[u8]) -> Result<((u16, u16), &[u8]), String> {
    let mut r = Rd(payload);
    Ok(((r.u16()?, r.u16()?), r.0))
}

/// reply-code and reply-text of connection.close / channel.close.
pub(crate) fn close_reason(args: &[u8]) -> String {
    let mut r = Rd(args);
    match (r.u16(), r.shortstr()) {
        (Ok(code), Ok(text)) => format!("{code} {}", String::from_utf8_lossy(text)),
        _ => "(unparsable close)".into(),
    }
}

/// Frame bytes still needed before the frame at the front is complete (a hint for fill).
pub(crate) fn want(data: &[u8]) -> usize {
    if data.len() < 7 {
        7
    } else {
        u32::from_be_bytes([data[3], data[4], data[5], data[6]]) as usize + 8
    }
}

/// One connection with channel 1 open.
pub struct Conn {
    pub(crate) r: ReadBuf,
    pub(crate) w: OwnedWriteHalf,
    pub(crate) out: Vec<u8>,
    pub(crate) frame_max: usize,
}

impl Conn {
    pub async fn open(a: &AmqpArgs) -> Result<Conn, String> {
        let l = &a.load;
        Self::connect(&l.host, l.port, &l.user, &l.pass, &a.vhost).await
    }

    /// Connects, logs in with PLAIN, opens `vhost` and channel 1.
    pub async fn connect(
        host: &str,
        port: u16,
        user: &str,
        pass: &str,
        vhost: &str,
    ) -> Result<Conn, String> {
        let s = tokio::time::timeout(SETUP_TIMEOUT, TcpStream::connect((host, port)))
            .await
            .map_err(|_| format!("connect {host}:{port}: timed out"))?
            .map_err(|e| format!("connect {host}:{port}: {e}"))?;
        let _ = s.set_nodelay(true);
        let (rd, w) = s.into_split();
        let mut c = Conn {
            r: ReadBuf::new(rd),
            w,
            out: Vec::with_capacity(FLUSH_AT * 2),
            frame_max: 131072,
        };
        c.out.extend_from_slice(b"AMQP\x00\x00\x09\x01");
        c.flush().await?;
        let start = c.expect(0, CONN_START).await?;
        let mut r = Rd(&start);
        let (_maj, _min) = (r.u8()?, r.u8()?);
        r.longstr()?; // server-properties
        let mechs = r.longstr()?;
        if !String::from_utf8_lossy(mechs)
            .split(' ')
            .any(|m| m == "PLAIN")
        {
            return Err(format!(
                "broker offers no PLAIN login: {}",
                String::from_utf8_lossy(mechs)
            ));
        }
        method(&mut c.out, 0, CONN_START_OK, |o| {
            // client-properties: product and the capabilities we handle
            let mut t = Vec::new();
            shortstr(&mut t, "product");
            t.push(b'S');
            longstr(&mut t, b"triad-bench");
            shortstr(&mut t, "capabilities");
            t.push(b'F');
            let mut caps = Vec::new();
            for cap in ["publisher_confirms", "basic.nack", "consumer_cancel_notify"] {
                shortstr(&mut caps, cap);
                caps.push(b't');
                caps.push(1);
            }
            longstr(&mut t, &caps);
            longstr(o, &t);
            shortstr(o, "PLAIN");
            longstr(o, format!("\0{user}\0{pass}").as_bytes());
            shortstr(o, "en_US");
        });
        c.flush().await?;
        let tune = c.expect(0, CONN_TUNE).await?;
        let mut r = Rd(&tune);
        let (channel_max, frame_max, _hb) = (r.u16()?, r.u32()?, r.u16()?);
        c.frame_max = if frame_max == 0 {
            131072
        } else {
            (frame_max as usize).min(131072)
        };
        method(&mut c.out, 0, CONN_TUNE_OK, |o| {
            o.extend_from_slice(&channel_max.to_be_bytes());
            o.extend_from_slice(&(c.frame_max as u32).to_be_bytes());
            o.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        });
        method(&mut c.out, 0, CONN_OPEN, |o| {
            shortstr(o, vhost);
            shortstr(o, "");
            o.push(0);
        });
        c.flush().await?;
        c.expect(0, CONN_OPEN_OK).await?;
        method(&mut c.out, 1, CH_OPEN, |o| shortstr(o, ""));
        c.flush().await?;
        c.expect(1, CH_OPEN_OK).await?;
        Ok(c)
    }

    pub(crate) async fn flush(&mut self) -> Result<(), String> {
        if !self.out.is_empty() {
            self.w
                .write_all(&self.out)
                .await
                .map_err(|e| format!("write: {e}"))?;
            self.out.clear();
        }
        Ok(())
    }

    /// Reads until method `id` arrives on channel `ch` and returns its arguments; a
    /// connection.close or channel.close is an error. Other frames are skipped.
    pub(crate) async fn expect(&mut self, ch: u16, id: (u16, u16)) -> Result<Vec<u8>, String> {
        loop {
            let Some((typ, fch, len)) = frame_at(self.r.data())? else {
                let w = want(self.r.data());
                self.r.fill_within(w, SETUP_TIMEOUT).await?;
                continue;
            };
            let payload = self.r.data()[7..7 + len].to_vec();
            self.r.consume(len + 8);
            if typ != FRAME_METHOD {
                continue;
            }
            let (mid, args) = method_id(&payload)?;
            if mid == CONN_CLOSE {
                method(&mut self.out, 0, CONN_CLOSE_OK, |_| {});
                let _ = self.flush().await;
                return Err(format!(
                    "connection closed by broker: {}",
                    close_reason(args)
                ));
            }
            if mid == CH_CLOSE {
                return Err(format!("channel closed by broker: {}", close_reason(args)));
            }
            if fch == ch && mid == id {
                return Ok(args.to_vec());
            }
        }
    }

    /// connection.close, then waits (briefly) for close-ok.
    pub(crate) async fn close(mut self) {
        method(&mut self.out, 0, CONN_CLOSE, |o| {
            o.extend_from_slice(&200u16.to_be_bytes());
            shortstr(o, "bye");
            o.extend_from_slice(&[0, 0, 0, 0]);
        });
        if self.flush().await.is_err() {
            return;
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.expect(0, CONN_CLOSE_OK)).await;
    }

    /// Queues a queue.declare (not sent until [`Conn::send`]); `passive` only checks
    /// that it exists.
    pub(crate) fn push_declare(&mut self, name: &str, durable: bool, passive: bool) {
        method(&mut self.out, 1, Q_DECLARE, |o| {
            o.extend_from_slice(&0u16.to_be_bytes());
            shortstr(o, name);
            // passive, durable, exclusive, auto-delete, nowait
            o.push(u8::from(passive) | if durable { 0b10 } else { 0 });
            longstr(o, &[]);
        });
    }

    /// Queues a transient basic.publish of `body`, mandatory if asked.
    pub(crate) fn push_publish(&mut self, exchange: &str, key: &str, mandatory: bool, body: &[u8]) {
        method(&mut self.out, 1, B_PUBLISH, |o| {
            o.extend_from_slice(&0u16.to_be_bytes());
            shortstr(o, exchange);
            shortstr(o, key);
            o.push(u8::from(mandatory));
        });
        frame(&mut self.out, FRAME_HEADER, 1, |o| {
            o.extend_from_slice(&60u16.to_be_bytes());
            o.extend_from_slice(&0u16.to_be_bytes());
            o.extend_from_slice(&(body.len() as u64).to_be_bytes());
            o.extend_from_slice(&0u16.to_be_bytes()); // no properties
        });
        frame(&mut self.out, FRAME_BODY, 1, |o| o.extend_from_slice(body));
    }

    /// Bytes queued and not yet sent.
    pub(crate) fn pending(&self) -> usize {
        self.out.len()
    }

    /// Sends what is queued.
    pub(crate) async fn send(&mut self) -> Result<(), String> {
        self.flush().await
    }

    /// The next method frame on any channel, within `limit`: (method id, arguments). A
    /// connection.close or channel.close is an error; other frames are skipped.
    pub(crate) async fn next_method(
        &mut self,
        limit: Duration,
    ) -> Result<((u16, u16), Vec<u8>), String> {
        let deadline = Instant::now() + limit;
        loop {
            let Some((typ, _ch, len)) = frame_at(self.r.data())? else {
                let w = want(self.r.data());
                let left = deadline.saturating_duration_since(Instant::now());
                self.r.fill_within(w, left).await?;
                continue;
            };
            let payload = self.r.data()[7..7 + len].to_vec();
            self.r.consume(len + 8);
            if typ != FRAME_METHOD {
                continue;
            }
            let (mid, args) = method_id(&payload)?;
            if mid == CONN_CLOSE {
                return Err(format!(
                    "connection closed by broker: {}",
                    close_reason(args)
                ));
            }
            if mid == CH_CLOSE {
                return Err(format!("channel closed by broker: {}", close_reason(args)));
            }
            return Ok((mid, args.to_vec()));
        }
    }

    /// confirm.select on channel 1.
    pub(crate) async fn confirm_select(&mut self) -> Result<(), String> {
        method(&mut self.out, 1, CONFIRM_SELECT, |o| o.push(0));
        self.flush().await?;
        self.expect(1, CONFIRM_SELECT_OK).await.map(|_| ())
    }

    async fn declare_queue(&mut self, name: &str, durable: bool) -> Result<(), String> {
        self.declare_queue_with(name, durable, &[]).await
    }

    pub(crate) async fn declare_queue_with(
        &mut self,
        name: &str,
        durable: bool,
        args: &[u8],
    ) -> Result<(), String> {
        method(&mut self.out, 1, Q_DECLARE, |o| {
            o.extend_from_slice(&0u16.to_be_bytes());
            shortstr(o, name);
            o.push(if durable { 0b10 } else { 0 }); // passive, durable, exclusive, auto-delete, nowait
            longstr(o, args);
        });
        self.flush().await?;
        self.expect(1, Q_DECLARE_OK).await.map(|_| ())
    }
}

/// A field table of string entries, AMQP-encoded (without its length).
pub(crate) fn string_table(entries: &[(&str, &str)]) -> Vec<u8> {
    let mut t = Vec::new();
    for (k, v) in entries {
        shortstr(&mut t, k);
        t.push(b'S');
        longstr(&mut t, v.as_bytes());
    }
    t
}

fn queue_name(i: usize) -> String {
    format!("triad-bench-{}-{i}", std::process::id())
}

fn exchange_name() -> String {
    format!("triad-bench-{}-fanout", std::process::id())
}

/// Confirms received so far: everything up to `upto`, plus single acks above it.
#[derive(Default)]
pub(crate) struct Confirms {
    upto: u64,
    above: BTreeSet<u64>,
}

impl Confirms {
    /// Records an ack/nack of `tag`; returns how many tags it newly settles.
    pub(crate) fn settle(&mut self, tag: u64, multiple: bool) -> u64 {
        if tag <= self.upto {
            return 0;
        }
        if multiple {
            let already = self.above.range(..=tag).count() as u64;
            let n = tag - self.upto - already;
            self.above = self.above.split_off(&(tag + 1));
            self.upto = tag;
            self.advance();
            n
        } else if self.above.insert(tag) {
            self.advance();
            1
        } else {
            0
        }
    }

    fn advance(&mut self) {
        while self.above.remove(&(self.upto + 1)) {
            self.upto += 1;
        }
    }
}

/// Send times of unconfirmed publishes by delivery tag, in tag order, for the confirm
/// latency (the publish's stamp to its `basic.ack`). At most `--confirm-window` entries:
/// the producer adds one only with a window permit, and a settle removes what it settles.
#[derive(Default)]
pub(crate) struct SendTimes {
    q: VecDeque<(u64, u64)>,
}

impl SendTimes {
    pub(crate) fn push(&mut self, tag: u64, t_ns: u64) {
        self.q.push_back((tag, t_ns));
    }

    /// Removes what an ack or nack of `tag` settles, calling `f` with each one's send time.
    pub(crate) fn settle(&mut self, tag: u64, multiple: bool, mut f: impl FnMut(u64)) {
        if multiple {
            while let Some(&(t, ns)) = self.q.front() {
                if t > tag {
                    break;
                }
                self.q.pop_front();
                f(ns);
            }
        } else if let Ok(i) = self.q.binary_search_by_key(&tag, |&(t, _)| t) {
            if let Some((_, ns)) = self.q.remove(i) {
                f(ns);
            }
        }
    }
}

/// The producer's read side: settles confirms, releasing window permits and recording
/// each ack's latency into `confirm_hist` (at the end); a close from the broker ends it
/// (and the producer) with an error.
async fn confirm_reader(
    mut r: ReadBuf,
    window: Arc<Semaphore>,
    counters: Arc<Counters>,
    done: CancellationToken,
    times: Arc<Mutex<SendTimes>>,
    confirm_hist: Arc<Mutex<Histogram<u64>>>,
) -> (u64, u64, Option<String>) {
    let mut confirms = Confirms::default();
    let mut hist = new_histogram();
    let (mut acked, mut nacked) = (0u64, 0u64);
    let res: Result<(), String> = async {
        loop {
            while let Some((typ, _ch, len)) = frame_at(r.data())? {
                let payload = &r.data()[7..7 + len];
                if typ == FRAME_METHOD {
                    let (mid, args) = method_id(payload)?;
                    let mut a = Rd(args);
                    match mid {
                        B_ACK | B_NACK => {
                            let tag = a.u64()?;
                            let multiple = a.u8()? & 1 != 0;
                            let n = confirms.settle(tag, multiple);
                            let now = e2e::now_ns();
                            if let Ok(mut t) = times.lock() {
                                t.settle(tag, multiple, |sent| {
                                    if mid == B_ACK {
                                        hist.saturating_record(now.saturating_sub(sent).max(1));
                                    }
                                });
                            }
                            if mid == B_ACK {
                                acked += n;
                                counters.confirmed.fetch_add(n, Ordering::Relaxed);
                            } else {
                                nacked += n;
                            }
                            window.add_permits(n as usize);
                        }
                        CONN_CLOSE_OK => return Ok(()),
                        CONN_CLOSE => {
                            return Err(format!(
                                "connection closed by broker: {}",
                                close_reason(args)
                            ))
                        }
                        CH_CLOSE => {
                            return Err(format!("channel closed by broker: {}", close_reason(args)))
                        }
                        B_RETURN => return Err("message returned (unroutable)".into()),
                        _ => {}
                    }
                }
                r.consume(len + 8);
            }
            let w = want(r.data());
            r.fill(w).await?;
        }
    }
    .await;
    let err = res.err();
    if err.is_some() {
        window.close();
    }
    if let Ok(mut h) = confirm_hist.lock() {
        let _ = h.add(&hist);
    }
    done.cancel();
    (acked, nacked, err)
}

struct ProducerPlan {
    id: u32,
    exchange: String,
    routing_key: String,
    quota: Option<u64>,
    deadline: Option<Instant>,
}

/// Publishes its plan; returns what it sent, the error that ended it, and the nacks. With
/// `--confirm`, each ack's latency goes into `confirm_hist`.
async fn producer(
    c: Conn,
    a: Arc<AmqpArgs>,
    p: ProducerPlan,
    counters: Arc<Counters>,
    confirm_hist: Arc<Mutex<Histogram<u64>>>,
) -> (u64, Option<String>, u64) {
    let Conn {
        r,
        mut w,
        mut out,
        frame_max,
    } = c;
    let window = Arc::new(Semaphore::new(if a.confirm {
        a.confirm_window
    } else {
        Semaphore::MAX_PERMITS
    }));
    let reader_done = CancellationToken::new();
    let times = Arc::new(Mutex::new(SendTimes::default()));
    let reader = tokio::spawn(confirm_reader(
        r,
        window.clone(),
        counters.clone(),
        reader_done.clone(),
        times.clone(),
        confirm_hist,
    ));
    let pacer = Pacer::new(a.load.rate.map(|r| r / a.load.producers as f64));
    let mut body = e2e::body_template(a.load.size);
    let mut sent = 0u64;
    let res: Result<(), String> = async {
        loop {
            if p.quota.is_some_and(|q| sent >= q)
                || p.deadline.is_some_and(|d| Instant::now() >= d)
                || reader_done.is_cancelled()
            {
                break;
            }
            if let Some(d) = pacer.wait(sent) {
                write_out(&mut w, &mut out).await?;
                tokio::time::sleep(d).await;
            }
            if a.confirm {
                match window.try_acquire() {
                    Ok(permit) => permit.forget(),
                    Err(_) => {
                        write_out(&mut w, &mut out).await?;
                        match window.acquire().await {
                            Ok(permit) => permit.forget(),
                            Err(_) => break, // closed: the reader saw an error
                        }
                    }
                }
            }
            let t = e2e::now_ns();
            e2e::stamp(&mut body, p.id, sent as u32, t);
            if a.confirm {
                // delivery tags count the channel's publishes from 1
                if let Ok(mut times) = times.lock() {
                    times.push(sent + 1, t);
                }
            }
            publish(
                &mut out,
                &p.exchange,
                &p.routing_key,
                a.persistent,
                &body,
                frame_max,
            );
            sent += 1;
            counters.sent.fetch_add(1, Ordering::Relaxed);
            if out.len() >= FLUSH_AT {
                write_out(&mut w, &mut out).await?;
            }
        }
        write_out(&mut w, &mut out).await?;
        if a.confirm {
            // wait for the outstanding confirms (bounded)
            let t = Instant::now() + a.load.drain_timeout.max(Duration::from_secs(10));
            while window.available_permits() < a.confirm_window
                && !reader_done.is_cancelled()
                && Instant::now() < t
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        method(&mut out, 0, CONN_CLOSE, |o| {
            o.extend_from_slice(&200u16.to_be_bytes());
            shortstr(o, "bye");
            o.extend_from_slice(&[0, 0, 0, 0]);
        });
        write_out(&mut w, &mut out).await
    }
    .await;
    let (acked, nacked, rerr) = match tokio::time::timeout(Duration::from_secs(5), reader).await {
        Ok(Ok(x)) => x,
        _ => (0, 0, Some("no close-ok from the broker".into())),
    };
    let mut err = res.err().or(rerr);
    if a.confirm && err.is_none() && acked + nacked < sent {
        err = Some(format!(
            "{} publishes never confirmed",
            sent - acked - nacked
        ));
    }
    (sent, err, nacked)
}

async fn write_out(w: &mut OwnedWriteHalf, out: &mut Vec<u8>) -> Result<(), String> {
    if !out.is_empty() {
        w.write_all(out).await.map_err(|e| format!("write: {e}"))?;
        out.clear();
    }
    Ok(())
}

async fn start_consumer(a: &AmqpArgs, id: usize, queue: &str) -> Result<Conn, String> {
    let mut c = Conn::open(a).await?;
    if a.manual_ack && a.prefetch > 0 {
        method(&mut c.out, 1, B_QOS, |o| {
            o.extend_from_slice(&0u32.to_be_bytes());
            o.extend_from_slice(&a.prefetch.to_be_bytes());
            o.push(0);
        });
        c.flush().await?;
        c.expect(1, B_QOS_OK).await?;
    }
    method(&mut c.out, 1, B_CONSUME, |o| {
        o.extend_from_slice(&0u16.to_be_bytes());
        shortstr(o, queue);
        shortstr(o, &format!("c{id}"));
        o.push(if a.manual_ack { 0 } else { 0b10 }); // no-local, no-ack, exclusive, nowait
        let args = if a.stream {
            string_table(&[("x-stream-offset", "first")])
        } else {
            Vec::new()
        };
        longstr(o, &args);
    });
    c.flush().await?;
    c.expect(1, B_CONSUME_OK).await?;
    Ok(c)
}

/// Where a delivery stands: method seen, header seen (body bytes expected), body so far.
enum Delivery {
    Idle,
    Header(u64),
    Body { tag: u64, size: usize },
}

/// A consumer's deliveries as their frames arrive: checked when complete.
struct Deliveries {
    chk: Checker,
    state: Delivery,
    body: Vec<u8>,
    last_tag: u64,
}

impl Deliveries {
    /// Takes one frame; `Ok(true)`: it completed a delivery.
    fn frame(&mut self, typ: u8, payload: &[u8]) -> Result<bool, String> {
        let mut done = false;
        match (typ, &self.state) {
            (FRAME_METHOD, Delivery::Idle) => {
                let (mid, args) = method_id(payload)?;
                match mid {
                    B_DELIVER => {
                        let mut r = Rd(args);
                        r.shortstr()?;
                        self.state = Delivery::Header(r.u64()?);
                    }
                    CONN_CLOSE => {
                        return Err(format!(
                            "connection closed by broker: {}",
                            close_reason(args)
                        ))
                    }
                    CH_CLOSE => {
                        return Err(format!("channel closed by broker: {}", close_reason(args)))
                    }
                    B_CANCEL => return Err("consumer cancelled by the broker".into()),
                    _ => {}
                }
            }
            (FRAME_HEADER, Delivery::Header(tag)) => {
                let mut r = Rd(payload);
                r.u16()?;
                r.u16()?;
                let size = r.u64()? as usize;
                self.body.clear();
                if size == 0 {
                    self.chk.check(&self.body);
                    done = true;
                    self.last_tag = *tag;
                    self.state = Delivery::Idle;
                } else {
                    self.state = Delivery::Body { tag: *tag, size };
                }
            }
            (FRAME_BODY, Delivery::Body { tag, size }) => {
                let complete = if self.body.is_empty() && payload.len() == *size {
                    self.chk.check(payload);
                    true
                } else {
                    self.body.extend_from_slice(payload);
                    if self.body.len() >= *size {
                        self.chk.check(&self.body);
                        true
                    } else {
                        false
                    }
                };
                if complete {
                    done = true;
                    self.last_tag = *tag;
                    self.state = Delivery::Idle;
                }
            }
            (FRAME_HEARTBEAT, _) => {}
            (t, _) => return Err(format!("unexpected frame type {t} mid-delivery")),
        }
        Ok(done)
    }
}

async fn consumer(
    mut c: Conn,
    a: Arc<AmqpArgs>,
    producers: usize,
    counters: Arc<Counters>,
    stop: CancellationToken,
) -> e2e::ConsumerResult {
    let mut d = Deliveries {
        chk: Checker::new(producers, a.load.size),
        state: Delivery::Idle,
        body: Vec::new(),
        last_tag: 0,
    };
    let mut acked = 0u64;
    let res: Result<(), String> = async {
        loop {
            let mut n = 0u64;
            while let Some((typ, _ch, len)) = frame_at(c.r.data())? {
                let payload = &c.r.data()[7..7 + len];
                if d.frame(typ, payload)? {
                    n += 1;
                }
                c.r.consume(len + 8);
            }
            if n > 0 {
                counters.received.fetch_add(n, Ordering::Relaxed);
            }
            if a.manual_ack && d.last_tag > acked {
                ack(&mut c.out, d.last_tag, true);
                acked = d.last_tag;
                c.flush().await?;
            }
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
        c.close().await;
    }
    (d.chk, err)
}

/// `--stream`: publishes `--count` messages into the streams (confirmed) before anything
/// is measured; returns what each producer sent.
async fn fill_streams(a: &Arc<AmqpArgs>, queues: &[String]) -> Result<Vec<u64>, String> {
    let l = &a.load;
    let quotas = e2e::quotas(l.count, l.producers);
    let counters = Arc::new(e2e::Counters::default());
    let mut tasks = Vec::new();
    for (i, quota) in quotas.into_iter().enumerate() {
        let mut c = Conn::open(a).await?;
        method(&mut c.out, 1, CONFIRM_SELECT, |o| o.push(0));
        c.flush().await?;
        c.expect(1, CONFIRM_SELECT_OK).await?;
        let plan = ProducerPlan {
            id: i as u32,
            exchange: String::new(),
            routing_key: queues[i % queues.len()].clone(),
            quota,
            deadline: None,
        };
        let unused = Arc::new(Mutex::new(new_histogram()));
        tasks.push(tokio::spawn(producer(
            c,
            a.clone(),
            plan,
            counters.clone(),
            unused,
        )));
    }
    if !l.quiet {
        eprintln!(
            "filling the stream(s) with {} messages",
            l.count.unwrap_or(0)
        );
    }
    let mut sent = Vec::new();
    for t in tasks {
        let (n, err, nacked) = t.await.map_err(|e| e.to_string())?;
        if let Some(e) = err {
            return Err(format!("filling the stream: {e}"));
        }
        if nacked > 0 {
            return Err(format!("filling the stream: {nacked} publishes nacked"));
        }
        sent.push(n);
    }
    Ok(sent)
}

pub fn run(a: &AmqpArgs) -> Result<Value, String> {
    e2e::runtime(a.load.threads)?.block_on(run_async(Arc::new(a.clone())))
}

async fn run_async(a: Arc<AmqpArgs>) -> Result<Value, String> {
    let l = &a.load;
    let groups = a.fanout.unwrap_or(a.queues);
    let queues: Vec<String> = (0..groups).map(queue_name).collect();
    let mut setup = Conn::open(&a).await?;
    let exchange = declare_topology(&a, &mut setup, &queues).await?;
    // --stream: the stream is filled before the consumers start
    let prefilled = if a.stream {
        Some(fill_streams(&a, &queues).await?)
    } else {
        None
    };
    let mut consumer_conns = Vec::new();
    for j in 0..l.consumers {
        consumer_conns.push(start_consumer(&a, j, &queues[j % groups]).await?);
    }
    let producer_conns = open_producers(&a).await?;

    let h = Harness::start(l)?;
    let consumers: Vec<_> = consumer_conns
        .into_iter()
        .map(|c| {
            tokio::spawn(consumer(
                c,
                a.clone(),
                l.producers,
                h.counters.clone(),
                h.stop.clone(),
            ))
        })
        .collect();
    let nacked = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let confirm_hist = Arc::new(Mutex::new(new_histogram()));
    let producers = spawn_producers(
        &a,
        producer_conns,
        &h,
        (&exchange, &queues),
        &nacked,
        &confirm_hist,
    );
    let fanout = a.fanout.is_some();
    let feeds = move |g: usize, p: usize| fanout || p % groups == g;
    let expected = move |sent: &[u64]| -> u64 {
        (0..groups)
            .map(|g| {
                sent.iter()
                    .enumerate()
                    .filter(|(p, _)| feeds(g, *p))
                    .map(|(_, n)| n)
                    .sum::<u64>()
            })
            .sum()
    };
    let mut fin = match &prefilled {
        Some(sent) => {
            let sent = sent.clone();
            h.finish(l, producers, consumers, move |_| expected(&sent))
                .await
        }
        None => h.finish(l, producers, consumers, expected).await,
    };
    if let Some(sent) = prefilled {
        fin.sent = sent;
        fin.send_seconds = 0.0;
    }

    // clean up: delete the queues and the exchange
    clean_up(setup, &queues, fanout.then_some(exchange.as_str())).await;

    let group_of: Vec<usize> = (0..l.consumers).map(|j| j % groups).collect();
    let o = fin.outcome(&group_of, groups, feeds);
    Ok(e2e::result(
        "amqp",
        l,
        &o,
        json!({
            "variant": variant(&a),
            "queues": groups,
            "fanout": a.fanout,
            "persistent": a.persistent,
            "confirm": a.confirm,
            "confirm_window": a.confirm.then_some(a.confirm_window),
            "manual_ack": a.manual_ack,
            "prefetch": a.prefetch,
            "stream": a.stream,
            "queue_type": if a.stream { "stream" } else { a.queue_type.name() },
            "nacked": nacked.load(Ordering::Relaxed),
            // publish (stamp) to basic.ack; the latency above is publish to delivery
            "confirm_lat_us": confirm_hist.lock().ok().map(|h| latency_json(&h)),
        }),
    ))
}

/// Declares the queues (streams with `--stream`) and, with `--fanout`, the fanout
/// exchange they are bound to; returns the exchange's name ("" without `--fanout`).
async fn declare_topology(
    a: &Arc<AmqpArgs>,
    setup: &mut Conn,
    queues: &[String],
) -> Result<String, String> {
    let exchange = if a.fanout.is_some() {
        let x = exchange_name();
        method(&mut setup.out, 1, EX_DECLARE, |o| {
            o.extend_from_slice(&0u16.to_be_bytes());
            shortstr(o, &x);
            shortstr(o, "fanout");
            o.push(if a.persistent { 0b10 } else { 0 });
            longstr(o, &[]);
        });
        setup.flush().await?;
        setup.expect(1, EX_DECLARE_OK).await?;
        x
    } else {
        String::new()
    };
    let stream_args = string_table(&[("x-queue-type", "stream")]);
    let quorum_args = string_table(&[("x-queue-type", "quorum")]);
    for q in queues {
        if a.stream {
            setup.declare_queue_with(q, true, &stream_args).await?;
        } else if a.queue_type == QueueType::Quorum {
            // durable, not exclusive, not auto-delete: what RabbitMQ requires of one
            setup
                .declare_queue_with(q, true, &quorum_args)
                .await
                .map_err(|e| {
                    format!("declaring {q} with x-queue-type=quorum: {e} (does the broker have quorum queues?)")
                })?;
        } else {
            setup.declare_queue(q, a.persistent).await?;
        }
        if a.fanout.is_some() {
            method(&mut setup.out, 1, Q_BIND, |o| {
                o.extend_from_slice(&0u16.to_be_bytes());
                shortstr(o, q);
                shortstr(o, &exchange);
                shortstr(o, "");
                o.push(0);
                longstr(o, &[]);
            });
            setup.flush().await?;
            setup.expect(1, Q_BIND_OK).await?;
        }
    }
    Ok(exchange)
}

/// The producers' connections (in confirm mode with `--confirm`); none with `--stream`,
/// whose streams are filled before the run.
async fn open_producers(a: &Arc<AmqpArgs>) -> Result<Vec<Conn>, String> {
    let l = &a.load;
    let mut producer_conns = Vec::new();
    let producers_n = if a.stream { 0 } else { l.producers };
    for _ in 0..producers_n {
        let mut c = Conn::open(a).await?;
        if a.confirm {
            method(&mut c.out, 1, CONFIRM_SELECT, |o| o.push(0));
            c.flush().await?;
            c.expect(1, CONFIRM_SELECT_OK).await?;
        }
        producer_conns.push(c);
    }

    Ok(producer_conns)
}

/// Starts a producer task per connection, each with its share of `--count`; publish
/// nacks are added to `nacked`, ack latencies to `confirm_hist`.
fn spawn_producers(
    a: &Arc<AmqpArgs>,
    producer_conns: Vec<Conn>,
    h: &Harness,
    (exchange, queues): (&str, &[String]),
    nacked: &Arc<std::sync::atomic::AtomicU64>,
    confirm_hist: &Arc<Mutex<Histogram<u64>>>,
) -> Vec<tokio::task::JoinHandle<(u64, Option<String>)>> {
    let l = &a.load;
    let groups = queues.len();
    let quotas = e2e::quotas(l.count, l.producers);
    producer_conns
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let plan = ProducerPlan {
                id: i as u32,
                exchange: exchange.to_owned(),
                routing_key: if a.fanout.is_some() {
                    String::new()
                } else {
                    queues[i % groups].clone()
                },
                quota: quotas[i],
                deadline: h.deadline(l),
            };
            let (a, counters, nacked) = (a.clone(), h.counters.clone(), nacked.clone());
            let confirm_hist = confirm_hist.clone();
            tokio::spawn(async move {
                let (sent, err, n) = producer(c, a, plan, counters, confirm_hist).await;
                nacked.fetch_add(n, Ordering::Relaxed);
                (sent, err)
            })
        })
        .collect()
}

/// Deletes the queues and the exchange (if any), closes the setup connection; failures
/// are ignored.
async fn clean_up(mut setup: Conn, queues: &[String], exchange: Option<&str>) {
    for q in queues {
        method(&mut setup.out, 1, Q_DELETE, |o| {
            o.extend_from_slice(&0u16.to_be_bytes());
            shortstr(o, q);
            o.push(0);
        });
        if setup.flush().await.is_ok() {
            let _ = setup.expect(1, Q_DELETE_OK).await;
        }
    }
    if let Some(exchange) = exchange {
        method(&mut setup.out, 1, EX_DELETE, |o| {
            o.extend_from_slice(&0u16.to_be_bytes());
            shortstr(o, exchange);
            o.push(0);
        });
        if setup.flush().await.is_ok() {
            let _ = setup.expect(1, EX_DELETE_OK).await;
        }
    }
    method(&mut setup.out, 1, CH_CLOSE, |o| {
        o.extend_from_slice(&200u16.to_be_bytes());
        shortstr(o, "bye");
        o.extend_from_slice(&[0, 0, 0, 0]);
    });
    if setup.flush().await.is_ok() {
        let _ = setup.expect(1, CH_CLOSE_OK).await;
    }
    setup.close().await;
}

fn variant(a: &AmqpArgs) -> String {
    let mut v = vec![if a.persistent {
        "persistent"
    } else {
        "transient"
    }];
    if a.stream {
        v.push("stream-replay");
    }
    if a.queue_type == QueueType::Quorum {
        v.push("quorum");
    }
    if a.confirm {
        v.push("confirm");
    }
    if a.manual_ack {
        v.push("manual-ack");
    }
    if a.fanout.is_some() {
        v.push("fanout");
    }
    v.join("+")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confirms_settle_once() {
        let mut c = Confirms::default();
        assert_eq!(c.settle(2, false), 1);
        assert_eq!(c.settle(1, false), 1);
        assert_eq!(c.upto, 2);
        assert_eq!(c.settle(5, false), 1);
        assert_eq!(c.settle(5, false), 0, "twice");
        assert_eq!(c.settle(6, true), 3, "3 and 4 and 6 (5 was settled)");
        assert_eq!(c.upto, 6);
        assert!(c.above.is_empty());
        assert_eq!(c.settle(4, true), 0);
    }

    #[test]
    fn send_times_settle_what_confirms_settle() {
        let mut t = SendTimes::default();
        for tag in 1..=6 {
            t.push(tag, tag * 100);
        }
        let mut got = Vec::new();
        t.settle(3, false, |ns| got.push(ns));
        assert_eq!(got, vec![300], "a single ack takes its own tag only");
        t.settle(3, false, |ns| got.push(ns));
        assert_eq!(got, vec![300], "twice: nothing more");
        t.settle(4, true, |ns| got.push(ns));
        assert_eq!(got, vec![300, 100, 200, 400], "multiple: every tag up to 4");
        t.settle(9, false, |ns| got.push(ns));
        assert_eq!(got.len(), 4, "an unknown tag settles nothing");
        t.settle(6, true, |ns| got.push(ns));
        assert_eq!(got, vec![300, 100, 200, 400, 500, 600]);
        assert!(t.q.is_empty());
    }

    #[test]
    fn frames_round_trip() {
        let mut out = Vec::new();
        let body = vec![7u8; 300];
        publish(&mut out, "x", "rk", true, &body, 108);
        // method, header, then 300 bytes in frames of at most 108 - 8 = 100
        let mut data = &out[..];
        let mut types = Vec::new();
        let mut got = Vec::new();
        while let Some((typ, ch, len)) = frame_at(data).unwrap() {
            assert_eq!(ch, 1);
            types.push(typ);
            if typ == FRAME_BODY {
                assert!(len <= 100);
                got.extend_from_slice(&data[7..7 + len]);
            }
            if typ == FRAME_METHOD {
                let (mid, args) = method_id(&data[7..7 + len]).unwrap();
                assert_eq!(mid, B_PUBLISH);
                let mut r = Rd(args);
                r.u16().unwrap();
                assert_eq!(r.shortstr().unwrap(), b"x");
                assert_eq!(r.shortstr().unwrap(), b"rk");
            }
            data = &data[len + 8..];
        }
        assert!(data.is_empty());
        assert_eq!(types, vec![1, 2, 3, 3, 3]);
        assert_eq!(got, body);
        assert_eq!(frame_at(&out[..5]).unwrap(), None);
        let mut bad = out.clone();
        let first_len = u32::from_be_bytes([bad[3], bad[4], bad[5], bad[6]]) as usize;
        bad[7 + first_len] = 0;
        assert!(frame_at(&bad).is_err());
    }
}
