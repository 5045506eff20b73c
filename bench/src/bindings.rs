//! `triad-bench bindings`: what a large durable topology costs Triad at rest and at
//! restart, and what routing costs at that size.
//!
//! The bench starts the release broker on a fresh data directory under `--dir`, then:
//!
//! 1. **create**: `--queues` persistent MQTT sessions `dev-<n>` (each a durable queue
//!    `mqtt-subscription-dev-<n>`) with `--bindings` subscriptions in all, spread
//!    evenly and made in one SUBSCRIBE per session: session `n` subscribes at QoS 1 to
//!    `dev/<n>/cmd` and `dev/<n>/f<j>/+/x` for `j = 1, 2, ...` (bindings of `amq.topic`
//!    with `dev.<n>.cmd` and `dev.<n>.f<j>.*.x`: three topic-trie nodes of its own per
//!    binding). `--parallel` sessions at a time; broker RssAnon before and after, CPU
//!    per binding. (MQTT rather than AMQP queue.bind: a SUBSCRIBE carries many filters
//!    and its bindings share one journal wait, where each AMQP bind waits for its own.)
//! 2. **restart**: SIGTERM, start on the same data directory; seconds from spawn until
//!    the listener accepts and until the last session's queue answers an AMQP passive
//!    declare (ready), and RssAnon once ready and 2 s later.
//! 3. **route**: one AMQP connection with publisher confirms publishes `--publish`
//!    transient 16-byte messages to `amq.topic`, mandatory, each with a key that
//!    matches exactly one binding (`dev.<n>.cmd` or `dev.<n>.f<j>.a.x`, sessions taken
//!    in a scattered order), `--window` unconfirmed at most. A returned message (a
//!    binding lost in the restart) is an error. Publish rate and broker CPU per message.
//!
//! Every phase is bounded by `--time-limit`; every wait polls with a deadline.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::amqp::{Conn, B_ACK, B_NACK, B_RETURN, Q_DECLARE_OK};
use crate::args::BindingsArgs;
use crate::e2e;
use crate::fleet::{status_kib, subscribe_session, Kind, Managed};
use crate::report::round;
use crate::sys::{loadavg, Scratch};

/// How long one reply may take.
const STEP: Duration = Duration::from_secs(60);
/// Flush the output buffer once it holds this much.
const FLUSH_AT: usize = 64 << 10;
const EXCHANGE: &str = "amq.topic";
const BODY: &[u8] = b"0123456789abcdef";

/// Source addresses 127.0.0.1..=N the sessions connect from (one closed connection per
/// session: ephemeral ports of a single address would run out).
const SOURCES: u8 = 16;

/// Session `n`'s queue.
fn queue_name(n: usize) -> String {
    format!("mqtt-subscription-dev-{n}")
}

/// Bindings of queue `n`: `total` spread over `queues`, the first ones getting one more.
fn bindings_of(n: usize, queues: usize, total: usize) -> usize {
    total / queues + usize::from(n < total % queues)
}

/// Binding `j` of queue `n`.
fn binding_key(n: usize, j: usize) -> String {
    if j == 0 {
        format!("dev.{n}.cmd")
    } else {
        format!("dev.{n}.f{j}.*.x")
    }
}

/// A routing key matching binding `j` of queue `n`, and only it.
fn routing_key(n: usize, j: usize) -> String {
    if j == 0 {
        format!("dev.{n}.cmd")
    } else {
        format!("dev.{n}.f{j}.a.x")
    }
}

/// The queue the `i`-th published message goes to: a stride coprime with `queues`, so
/// consecutive messages hit queues far apart (no cache-friendly order).
fn scattered(i: usize, queues: usize) -> usize {
    let mut stride = 7919 % queues.max(1);
    while stride == 0 || gcd(stride, queues) != 1 {
        stride += 1;
    }
    (i.wrapping_mul(stride)) % queues.max(1)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn anon(pid: Option<u32>) -> Option<u64> {
    pid.and_then(|p| status_kib(p, "RssAnon"))
}

fn cpu_s(pid: Option<u32>) -> Option<f64> {
    pid.and_then(e2e::proc_sample).map(|s| s.cpu.as_secs_f64())
}

/// MQTT's spelling of a binding key (`.` ⇄ `/`, `*` ⇄ `+`).
fn mqtt_filter(key: &str) -> String {
    key.split('.')
        .map(|w| if w == "*" { "+" } else { w })
        .collect::<Vec<_>>()
        .join("/")
}

/// One worker of the create phase: sessions `next..` until all are done or the deadline
/// passes.
async fn creator(
    a: Arc<BindingsArgs>,
    port: u16,
    next: Arc<AtomicUsize>,
    made: Arc<AtomicUsize>,
    deadline: Instant,
) -> Result<(), String> {
    loop {
        if Instant::now() >= deadline {
            return Err("create: cut short by --time-limit".into());
        }
        let n = next.fetch_add(1, Ordering::Relaxed);
        if n >= a.queues {
            return Ok(());
        }
        let filters: Vec<String> = (0..bindings_of(n, a.queues, a.bindings))
            .map(|j| mqtt_filter(&binding_key(n, j)))
            .collect();
        subscribe_session(port, SOURCES, n, &filters).await?;
        made.fetch_add(filters.len(), Ordering::Relaxed);
    }
}

async fn create_phase(
    a: &Arc<BindingsArgs>,
    mqtt_port: u16,
    pid: Option<u32>,
) -> (Value, Vec<String>) {
    let next = Arc::new(AtomicUsize::new(0));
    let made = Arc::new(AtomicUsize::new(0));
    let cpu0 = cpu_s(pid);
    let t0 = Instant::now();
    let deadline = t0 + a.time_limit;
    let workers: Vec<_> = (0..a.parallel)
        .map(|_| {
            tokio::spawn(creator(
                a.clone(),
                mqtt_port,
                next.clone(),
                made.clone(),
                deadline,
            ))
        })
        .collect();
    let progress = {
        let (made, quiet) = (made.clone(), a.quiet);
        tokio::spawn(async move {
            let mut last = 0usize;
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                let n = made.load(Ordering::Relaxed);
                if !quiet {
                    eprintln!(
                        "[{:>5.0}s] create: {n} bindings ({:.0}/s over the last 10 s)",
                        t0.elapsed().as_secs_f64(),
                        (n - last) as f64 / 10.0
                    );
                }
                last = n;
            }
        })
    };
    let mut errors = Vec::new();
    for w in workers {
        match w.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(format!("create: worker panicked: {e}")),
        }
    }
    progress.abort();
    let secs = t0.elapsed().as_secs_f64();
    let made = made.load(Ordering::Relaxed);
    let cpu = match (cpu0, cpu_s(pid)) {
        (Some(x), Some(y)) => Some(y - x),
        _ => None,
    };
    (
        json!({
            "bindings": made,
            "seconds": round(secs, 3),
            "bindings_per_s": round(made as f64 / secs.max(1e-9), 0),
            "broker_cpu_s": cpu.map(|c| round(c, 3)),
            "broker_cpu_us_per_binding": cpu.filter(|_| made > 0).map(|c| round(c * 1e6 / made as f64, 1)),
        }),
        errors,
    )
}

/// Polls (bounded) until the broker answers a passive declare of `queue` on `port`.
async fn wait_ready(port: u16, queue: &str, deadline: Instant) -> Result<(), String> {
    let mut last = String::new();
    while Instant::now() < deadline {
        let attempt = async {
            let mut c = Conn::connect("127.0.0.1", port, "guest", "guest", "/").await?;
            c.push_declare(queue, true, true);
            c.send().await?;
            match c.next_method(STEP).await? {
                (Q_DECLARE_OK, _) => {
                    c.close().await;
                    Ok(())
                }
                (m, _) => Err(format!("unexpected method {m:?}")),
            }
        };
        match attempt.await {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Err(format!(
        "not ready within the start limit (last error: {last})"
    ))
}

async fn restart_phase(m: &mut Managed, a: &BindingsArgs) -> (Value, Vec<String>) {
    let (stop_s, clean) = tokio::task::block_in_place(|| m.stop());
    let t0 = Instant::now();
    let listen = tokio::task::block_in_place(|| m.start());
    let listen_s = match listen {
        Ok(s) => s,
        Err(e) => return (json!({"error": e.clone()}), vec![format!("restart: {e}")]),
    };
    // `start` spawned the broker just after t0: ready is measured from t0 (an upper bound
    // by the few microseconds between the two)
    let ready = wait_ready(m.amqp_port, &queue_name(a.queues - 1), t0 + a.time_limit).await;
    let ready_s = t0.elapsed().as_secs_f64();
    // CPU the broker used to get ready: less noisy than seconds on a shared machine
    let cpu_ready = cpu_s(m.pid());
    let anon_ready = anon(m.pid());
    // what the allocator and the broker's start-up threads settle to
    tokio::time::sleep(Duration::from_secs(2)).await;
    let anon_settled = anon(m.pid());
    let mut errors = Vec::new();
    if let Err(e) = &ready {
        errors.push(format!("restart: {e}"));
    }
    (
        json!({
            "stop_s": round(stop_s, 3),
            "stopped_by_sigterm": clean,
            "listen_s": round(listen_s, 3),
            "ready_s": ready.is_ok().then(|| round(ready_s, 3)),
            "broker_cpu_s_at_ready": cpu_ready.map(|c| round(c, 3)),
            "rss_anon_kib_ready": anon_ready,
            "rss_anon_kib_after_2s": anon_settled,
            "rss_kib_after_2s": m.pid().and_then(|p| status_kib(p, "VmRSS")),
        }),
        errors,
    )
}

async fn route_phase(a: &BindingsArgs, port: u16, pid: Option<u32>) -> (Value, Vec<String>) {
    let cpu0 = cpu_s(pid);
    let t0 = Instant::now();
    let deadline = t0 + a.time_limit;
    let (mut sent, mut confirmed, mut returned, mut nacked) = (0usize, 0usize, 0usize, 0usize);
    let res: Result<(), String> = async {
        let mut c = Conn::connect("127.0.0.1", port, "guest", "guest", "/").await?;
        c.confirm_select().await?;
        while confirmed < a.publish {
            if Instant::now() >= deadline {
                return Err("route: cut short by --time-limit".into());
            }
            while sent < a.publish && sent - confirmed < a.window {
                let n = scattered(sent, a.queues);
                let j = sent % bindings_of(n, a.queues, a.bindings).max(1);
                c.push_publish(EXCHANGE, &routing_key(n, j), true, BODY);
                sent += 1;
                if c.pending() >= FLUSH_AT {
                    c.send().await?;
                }
            }
            c.send().await?;
            // confirms are per publish in order; `multiple` settles everything up to a tag
            match c.next_method(STEP).await? {
                (mid @ (B_ACK | B_NACK), args) if args.len() >= 9 => {
                    let mut tag = [0u8; 8];
                    tag.copy_from_slice(&args[..8]);
                    let tag = u64::from_be_bytes(tag) as usize;
                    let multiple = args[8] & 1 != 0;
                    // Triad confirms in publish order: a single ack of `tag` also means
                    // every earlier tag was settled
                    let upto = if multiple {
                        tag
                    } else {
                        tag.max(confirmed + 1)
                    };
                    if mid == B_NACK {
                        nacked += upto.saturating_sub(confirmed);
                    }
                    confirmed = confirmed.max(upto);
                }
                (B_RETURN, _) => returned += 1,
                _ => {}
            }
        }
        c.close().await;
        Ok(())
    }
    .await;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = match (cpu0, cpu_s(pid)) {
        (Some(x), Some(y)) => Some(y - x),
        _ => None,
    };
    let mut errors = Vec::new();
    if let Err(e) = res {
        errors.push(e);
    }
    if returned > 0 {
        errors.push(format!(
            "route: {returned} message(s) returned unroutable (bindings lost?)"
        ));
    }
    if nacked > 0 {
        errors.push(format!("route: {nacked} message(s) nacked"));
    }
    (
        json!({
            "messages": confirmed,
            "seconds": round(secs, 3),
            "msgs_per_s": round(confirmed as f64 / secs.max(1e-9), 0),
            "broker_cpu_s": cpu.map(|c| round(c, 3)),
            "broker_cpu_us_per_msg": cpu.filter(|_| confirmed > 0).map(|c| round(c * 1e6 / confirmed as f64, 2)),
            "returned": returned,
        }),
        errors,
    )
}

pub fn run(a: &BindingsArgs) -> Result<Value, String> {
    e2e::runtime(a.threads)?.block_on(run_async(Arc::new(a.clone())))
}

async fn run_async(a: Arc<BindingsArgs>) -> Result<Value, String> {
    let load = loadavg();
    let scratch = Scratch::create(&a.dir, "bench-bindings", a.allow_tmpfs, a.keep)?;
    let mut m = Managed::new(Kind::Triad, &a.triad, &scratch.path)?;
    let first_start = tokio::task::block_in_place(|| m.start())?;
    let pid = m.pid();
    let anon0 = anon(pid);
    if !a.quiet {
        eprintln!(
            "bindings: triad pid {pid:?}, AMQP port {}, data dir {}: {} queues, {} bindings",
            m.amqp_port,
            m.data.display(),
            a.queues,
            a.bindings
        );
    }
    let mut errors = Vec::new();
    let (create, e) = create_phase(&a, m.port, pid).await;
    errors.extend(e);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let anon_created = anon(pid);
    let disk_created = crate::fleet::du(&m.data);
    let (restart, e) = if errors.is_empty() {
        restart_phase(&mut m, &a).await
    } else {
        (
            json!({"note": "skipped: the create phase failed"}),
            Vec::new(),
        )
    };
    errors.extend(e);
    let pid = m.pid();
    let (route, e) = if errors.is_empty() && a.publish > 0 {
        route_phase(&a, m.amqp_port, pid).await
    } else {
        (json!({"note": "skipped"}), Vec::new())
    };
    errors.extend(e);
    let anon_routed = anon(pid);
    let made = create.get("bindings").and_then(Value::as_u64).unwrap_or(0);
    let per_binding = |x: Option<u64>| match (anon0, x) {
        (Some(b), Some(x)) if made > 0 => {
            Some(round((x as f64 - b as f64) * 1024.0 / made as f64, 0))
        }
        _ => None,
    };
    let anon_restart = restart.get("rss_anon_kib_after_2s").and_then(Value::as_u64);
    let v = json!({
        "bench": "bindings",
        "queues": a.queues,
        "bindings_requested": a.bindings,
        "parallel": a.parallel,
        "window": a.window,
        "first_start_s": round(first_start, 3),
        "rss_anon_kib_start": anon0,
        "create": create,
        "rss_anon_kib_created": anon_created,
        "disk_bytes_created": disk_created,
        "restart": restart,
        "route": route,
        "rss_anon_kib_after_route": anon_routed,
        // RssAnon above the empty broker's, per binding (queues included in the cost)
        "rss_anon_bytes_per_binding_created": per_binding(anon_created),
        "rss_anon_bytes_per_binding_restarted": per_binding(anon_restart),
        "errors": errors,
        "loadavg_at_start": load,
    });
    drop(m); // stops the broker
    drop(scratch);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_are_spread_and_counted_exactly() {
        for (q, b) in [(10, 100), (7, 100), (100, 7), (1, 1)] {
            let total: usize = (0..q).map(|n| bindings_of(n, q, b)).sum();
            assert_eq!(total, b, "{q} queues, {b} bindings");
        }
    }

    #[test]
    fn keys_match_only_their_binding() {
        assert_eq!(binding_key(3, 0), "dev.3.cmd");
        assert_eq!(binding_key(3, 2), "dev.3.f2.*.x");
        assert_eq!(routing_key(3, 2), "dev.3.f2.a.x");
    }

    #[test]
    fn scattered_visits_every_queue_once() {
        for q in [1, 2, 7919, 10_000, 15_838] {
            let mut seen = vec![false; q];
            for i in 0..q {
                let n = scattered(i, q);
                assert!(!seen[n], "{q}: {n} twice");
                seen[n] = true;
            }
        }
    }
}
