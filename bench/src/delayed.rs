//! `triad-bench amqp --delayed MS`: delayed-message throughput and delivery-time error.
//!
//! One producer publishes `--count` messages (confirmed, at most `--confirm-window`
//! unconfirmed), each due `MS` after it is sent; one consumer (no-ack) reads the target
//! queue and records, per message, its arrival time minus its due time (the due time is
//! in the body: the send time plus `MS`, as the client sees it, so the error includes
//! the publish's way to the broker). With `MS` longer than the publish phase every
//! message is pending at once before the first is due.
//!
//! `--delay-via x-delay` (Triad, RabbitMQ's delayed-message plugin): an `x-delay` header
//! on a publish to the target queue. `--delay-via ttl-dlx`: RabbitMQ's workaround
//! without the plugin, a queue of its own whose messages carry a per-message
//! `expiration` of `MS` and dead-letter into the target queue when it passes.
//!
//! `--no-consume`: publish only and report the broker's RssAnon (heap) and RssFile
//! (mapped files: Triad's consume queues and commitlog pages) before and after (the
//! messages stay pending: run it on a broker you throw away).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::amqp::{
    frame, frame_at, longstr, method, method_id, shortstr, want, Confirms, Conn, B_ACK, B_CONSUME,
    B_CONSUME_OK, B_NACK, FRAME_BODY, FRAME_HEADER, FRAME_METHOD, Q_DELETE, Q_DELETE_OK,
};
use crate::args::{AmqpArgs, DelayVia};
use crate::e2e;
use crate::fleet::status_kib;
use crate::report::round;
use crate::sys::loadavg;
use crate::wire::Rd;

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Header table entries, AMQP-encoded: `x-delay` as a signed 64-bit integer.
fn delay_headers(ms: u64) -> Vec<u8> {
    let mut t = Vec::new();
    shortstr(&mut t, "x-delay");
    t.push(b'l');
    t.extend_from_slice(&(ms as i64).to_be_bytes());
    t
}

/// basic.publish with delivery-mode, and headers or expiration, on channel 1.
fn publish(
    out: &mut Vec<u8>,
    key: &str,
    persistent: bool,
    headers: Option<&[u8]>,
    expiration: Option<&str>,
    body: &[u8],
) {
    method(out, 1, crate::amqp::B_PUBLISH, |o| {
        o.extend_from_slice(&0u16.to_be_bytes());
        shortstr(o, "");
        shortstr(o, key);
        o.push(0);
    });
    frame(out, FRAME_HEADER, 1, |o| {
        o.extend_from_slice(&60u16.to_be_bytes());
        o.extend_from_slice(&0u16.to_be_bytes());
        o.extend_from_slice(&(body.len() as u64).to_be_bytes());
        let mut flags = 1u16 << 12; // delivery-mode
        if headers.is_some() {
            flags |= 1 << 13;
        }
        if expiration.is_some() {
            flags |= 1 << 8;
        }
        o.extend_from_slice(&flags.to_be_bytes());
        if let Some(h) = headers {
            longstr(o, h);
        }
        o.push(if persistent { 2 } else { 1 });
        if let Some(e) = expiration {
            shortstr(o, e);
        }
    });
    frame(out, FRAME_BODY, 1, |o| o.extend_from_slice(body));
}

async fn delete_queue(c: &mut Conn, name: &str) -> Result<(), String> {
    method(&mut c.out, 1, Q_DELETE, |o| {
        o.extend_from_slice(&0u16.to_be_bytes());
        shortstr(o, name);
        o.push(0);
    });
    c.flush().await?;
    c.expect(1, Q_DELETE_OK).await.map(|_| ())
}

fn anon(pid: Option<u32>) -> Option<u64> {
    pid.and_then(|p| status_kib(p, "RssAnon"))
}

fn file_kib(pid: Option<u32>) -> Option<u64> {
    pid.and_then(|p| status_kib(p, "RssFile"))
}

fn cpu_s(pid: Option<u32>) -> Option<f64> {
    pid.and_then(e2e::proc_sample).map(|s| s.cpu.as_secs_f64())
}

/// Receives until `count` messages arrived or `until` passed; returns each arrival
/// minus due (µs) and the first and last arrival times.
async fn consume(mut c: Conn, count: u64, until: Instant) -> Result<(Vec<i64>, u64, u64), String> {
    let mut errs = Vec::with_capacity(count as usize);
    let mut body: Vec<u8> = Vec::new();
    let (mut in_body, mut size) = (false, 0usize);
    let (mut first, mut last) = (0u64, 0u64);
    while (errs.len() as u64) < count {
        while let Some((typ, _ch, len)) = frame_at(c.r.data())? {
            let payload = &c.r.data()[7..7 + len];
            match typ {
                FRAME_METHOD => {
                    let (mid, args) = method_id(payload)?;
                    if mid == crate::amqp::CONN_CLOSE || mid == crate::amqp::CH_CLOSE {
                        return Err(format!(
                            "closed by broker: {}",
                            crate::amqp::close_reason(args)
                        ));
                    }
                    in_body = false;
                }
                FRAME_HEADER => {
                    let mut r = Rd(payload);
                    r.u16()?;
                    r.u16()?;
                    size = r.u64()? as usize;
                    body.clear();
                    in_body = true;
                }
                FRAME_BODY if in_body => {
                    body.extend_from_slice(payload);
                    if body.len() >= size {
                        let at = now_us();
                        let due = body
                            .get(..8)
                            .and_then(|b| b.try_into().ok())
                            .map_or(0, u64::from_be_bytes);
                        errs.push(at as i64 - due as i64);
                        if first == 0 {
                            first = at;
                        }
                        last = at;
                        in_body = false;
                    }
                }
                _ => {}
            }
            c.r.consume(len + 8);
        }
        let left = until.saturating_duration_since(Instant::now());
        if (errs.len() as u64) >= count || left.is_zero() {
            break;
        }
        let w = want(c.r.data());
        if left.is_zero() {
            break;
        }
        if c.r.fill_within(w, left).await.is_err() {
            break;
        }
    }
    c.close().await;
    Ok((errs, first, last))
}

fn pct(sorted: &[i64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).map(|us| round(*us as f64 / 1000.0, 2))
}

pub fn run(a: &AmqpArgs, delay_ms: u64) -> Result<Value, String> {
    e2e::runtime(a.load.threads)?.block_on(run_async(a, delay_ms))
}

async fn run_async(a: &AmqpArgs, delay_ms: u64) -> Result<Value, String> {
    let l = &a.load;
    let count = l.count.ok_or("--delayed needs --count")?;
    let pid = l.broker_pid.first().copied();
    let tag = std::process::id();
    let target = format!("triad-bench-{tag}-delayed");
    let parking = format!("triad-bench-{tag}-ttl");
    let mut setup = Conn::open(a).await?;
    declare_queues(a, &mut setup, &target, &parking).await?;
    let consumer = delayed_consumer(a, &target).await?;
    let before = Sample::now(pid);
    let load_before = loadavg();
    let run_until = Instant::now()
        + Duration::from_millis(delay_ms)
        + l.duration.unwrap_or(Duration::from_secs(600))
        + l.drain_timeout;
    let consuming = consumer.map(|c| tokio::spawn(consume(c, count, run_until)));

    // the producer: confirmed, a bounded window
    let mut p = Conn::open(a).await?;
    p.confirm_select().await?;
    if !l.quiet {
        eprintln!("publishing {count}, each due {delay_ms} ms after it is sent");
    }
    let started = Instant::now();
    publish_all(a, &mut p, count, delay_ms, &target, &parking).await?;
    let publish_s = started.elapsed().as_secs_f64();
    if !l.quiet {
        eprintln!("published {count} in {publish_s:.2} s; waiting for the deliveries");
    }
    let pending = Sample::now(pid);
    let load_published = loadavg();
    p.close().await;

    let (errs, first, last) = match consuming {
        Some(h) => h.await.map_err(|e| format!("consumer: {e}"))??,
        None => (Vec::new(), 0, 0),
    };
    let cpu_after = cpu_s(pid);
    let load_after = loadavg();
    if !a.no_consume {
        delete_queue(&mut setup, &target).await?;
        if a.delay_via == DelayVia::TtlDlx {
            delete_queue(&mut setup, &parking).await?;
        }
    }
    setup.close().await;
    let mut sorted = errs.clone();
    sorted.sort_unstable();
    let delivered = errs.len() as u64;
    let deliver_span_s = (last.saturating_sub(first)) as f64 / 1e6;
    Ok(json!({
        "bench": "amqp-delayed",
        "via": match a.delay_via { DelayVia::XDelay => "x-delay", DelayVia::TtlDlx => "ttl-dlx" },
        "port": l.port,
        "count": count,
        "size": l.size,
        "persistent": a.persistent,
        "delay_ms": delay_ms,
        "publish_s": round(publish_s, 3),
        "publish_msgs_s": round(count as f64 / publish_s.max(1e-9), 0),
        "rate": l.rate,
        "all_pending_before_first_due": publish_s * 1000.0 < delay_ms as f64,
        "delivered": delivered,
        "lost": count.saturating_sub(delivered),
        "deliver_msgs_s": (delivered > 1 && deliver_span_s > 0.0)
            .then(|| round(delivered as f64 / deliver_span_s, 0)),
        "error_ms": {
            "min": pct(&sorted, 0.0),
            "p50": pct(&sorted, 0.5),
            "p99": pct(&sorted, 0.99),
            "max": pct(&sorted, 1.0),
        },
        "broker": broker_json(pid, &before, &pending, cpu_after, count),
        "loadavg_1m": {"before": load_before, "published": load_published, "after": load_after},
        "note": "shared machine: other work runs alongside; see loadavg",
    }))
}

/// The broker's memory and CPU at one moment (with `--broker-pid`).
struct Sample {
    anon: Option<u64>,
    file: Option<u64>,
    cpu: Option<f64>,
}

impl Sample {
    fn now(pid: Option<u32>) -> Sample {
        Sample {
            anon: anon(pid),
            file: file_kib(pid),
            cpu: cpu_s(pid),
        }
    }
}

/// The broker's cost: CPU per message published and in all, memory per pending message.
fn broker_json(
    pid: Option<u32>,
    before: &Sample,
    pending: &Sample,
    cpu_after: Option<f64>,
    count: u64,
) -> Value {
    let per_msg_us = |a: Option<f64>, b: Option<f64>, n: u64| match (a, b) {
        (Some(x), Some(y)) if n > 0 => Some(round((y - x) * 1e6 / n as f64, 2)),
        _ => None,
    };
    json!({
        "pid": pid,
        "cpu_us_per_msg_publish": per_msg_us(before.cpu, pending.cpu, count),
        "cpu_us_per_msg_total": per_msg_us(before.cpu, cpu_after, count),
        "rss_anon_kib_before": before.anon,
        "rss_anon_kib_all_pending": pending.anon,
        "rss_file_kib_before": before.file,
        "rss_file_kib_all_pending": pending.file,
        "rss_anon_bytes_per_pending_msg": match (before.anon, pending.anon) {
            (Some(b), Some(p)) => Some(round((p as f64 - b as f64) * 1024.0 / count as f64, 1)),
            _ => None,
        },
    })
}

/// The target queue and, with `--delay-via ttl-dlx`, the parking queue whose TTL
/// dead-letters into it.
async fn declare_queues(
    a: &AmqpArgs,
    setup: &mut Conn,
    target: &str,
    parking: &str,
) -> Result<(), String> {
    setup.declare_queue_with(target, a.persistent, &[]).await?;
    if a.delay_via == DelayVia::TtlDlx {
        let mut t = Vec::new();
        for (k, v) in [
            ("x-dead-letter-exchange", ""),
            ("x-dead-letter-routing-key", target),
        ] {
            shortstr(&mut t, k);
            t.push(b'S');
            longstr(&mut t, v.as_bytes());
        }
        setup.declare_queue_with(parking, a.persistent, &t).await?;
    }
    Ok(())
}

/// A no-ack consumer of the target queue (none with `--no-consume`).
async fn delayed_consumer(a: &AmqpArgs, target: &str) -> Result<Option<Conn>, String> {
    Ok(if a.no_consume {
        None
    } else {
        let mut c = Conn::open(a).await?;
        method(&mut c.out, 1, B_CONSUME, |o| {
            o.extend_from_slice(&0u16.to_be_bytes());
            shortstr(o, target);
            shortstr(o, "delayed");
            o.push(0b10); // no-ack
            longstr(o, &[]);
        });
        c.flush().await?;
        c.expect(1, B_CONSUME_OK).await?;
        Some(c)
    })
}

/// Publishes `count` messages, each due `delay_ms` after it is sent, with at most
/// `--confirm-window` unconfirmed (and at `--rate`); returns once all are confirmed.
async fn publish_all(
    a: &AmqpArgs,
    p: &mut Conn,
    count: u64,
    delay_ms: u64,
    target: &str,
    parking: &str,
) -> Result<(), String> {
    let l = &a.load;
    let headers = delay_headers(delay_ms);
    let expiration = delay_ms.to_string();
    let (key, hdr, exp) = match a.delay_via {
        DelayVia::XDelay => (target, Some(headers.as_slice()), None),
        DelayVia::TtlDlx => (parking, None, Some(expiration.as_str())),
    };
    let mut body = vec![0u8; l.size.max(16)];
    let mut confirms = Confirms::default();
    let (mut sent, mut done) = (0u64, 0u64);
    let window = a.confirm_window as u64;
    let pacer = e2e::Pacer::new(l.rate);
    while done < count {
        while sent < count && sent - done < window {
            if let Some(d) = pacer.wait(sent) {
                // send what is queued, then keep to the rate
                p.flush().await?;
                if sent > done {
                    break;
                }
                tokio::time::sleep(d).await;
            }
            let due = now_us() + delay_ms * 1000;
            body[..8].copy_from_slice(&due.to_be_bytes());
            body[8..16].copy_from_slice(&sent.to_be_bytes());
            publish(&mut p.out, key, a.persistent, hdr, exp, &body);
            sent += 1;
            if p.out.len() >= 64 << 10 {
                p.flush().await?;
            }
        }
        p.flush().await?;
        let (mid, args) = p.next_method(Duration::from_secs(60)).await?;
        if mid == B_ACK || mid == B_NACK {
            let mut r = Rd(&args);
            let t = r.u64()?;
            let multiple = r.u8()? & 1 != 0;
            if mid == B_NACK {
                return Err(format!("publish {t} nacked"));
            }
            done += confirms.settle(t, multiple);
        }
    }
    Ok(())
}
