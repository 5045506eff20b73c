//! Prometheus metrics in the text exposition format (0.0.4), named as
//! `rabbitmq_prometheus` names them where RabbitMQ has a counterpart, so that
//! RabbitMQ's Grafana dashboards show Triad:
//!
//! - `GET /metrics`: aggregated, as RabbitMQ's default endpoint: queue gauges are summed
//!   over every queue (one series each, whatever the number of queues).
//! - `GET /metrics/per-object`: the queue gauges once per queue, labelled `vhost` and
//!   `queue`, streamed one queue at a time.
//!
//! Like RabbitMQ's Prometheus endpoint, these need no login (they carry counts and,
//! per object, queue names; put the HTTP listener where only the scraper reaches it if
//! that matters). Triad's own metrics are prefixed `triad_`; on a replication leader,
//! `triad_replication_*` give each replica's lag and the in-sync count
//! ([`super::cluster`]).
//!
//! Counters are read when scraped: queue counters under each queue's lock for a moment,
//! the publish counter summed over its shards, the store's flush histograms (relaxed
//! atomic adds once per flush, by the flusher) and compaction counters (by the
//! retention pass), the commitlog's append count (a plain integer under the writer lock
//! the append holds anyway); nothing else is added to a message path.

use std::fmt::Write as _;
use std::sync::Arc;

use bytes::Bytes;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use triad_core::conns::ConnInfo;
use triad_core::Broker;

use crate::http::Body;

const CONTENT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value, escaped as the format wants (`\\`, `\"`, `\n`).
pub(super) fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

pub(super) fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

pub(super) fn one(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    labels: &str,
    v: impl std::fmt::Display,
) {
    head(out, name, kind, help);
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {v}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {v}");
    }
}

/// A histogram family; the recorded values are divided by `divisor` (1e6: µs to
/// seconds).
fn histogram(
    out: &mut String,
    name: &str,
    help: &str,
    h: &triad_store::flush::HistogramSnapshot,
    divisor: f64,
) {
    head(out, name, "histogram", help);
    for (le, n) in &h.buckets {
        let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {n}", *le as f64 / divisor);
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum {}", h.sum as f64 / divisor);
    let _ = writeln!(out, "{name}_count {}", h.count);
}

/// The per-queue gauges: (name, help, value from stats).
type QueueGauge = (
    &'static str,
    &'static str,
    fn(&triad_core::queue::QueueStats) -> u64,
);

const QUEUE_GAUGES: [QueueGauge; 5] = [
    (
        "rabbitmq_queue_messages_ready",
        "Messages ready to be delivered to consumers",
        |s| s.ready,
    ),
    (
        "rabbitmq_queue_messages_unacked",
        "Messages delivered to consumers but not yet acknowledged",
        |s| s.unacked,
    ),
    (
        "rabbitmq_queue_messages",
        "Sum of ready and unacknowledged messages - total queue depth",
        |s| s.ready + s.unacked,
    ),
    ("rabbitmq_queue_consumers", "Consumers on a queue", |s| {
        u64::from(s.consumers)
    }),
    (
        "rabbitmq_queue_messages_ready_bytes",
        "Size in bytes of ready messages (bodies)",
        |s| s.ready_bytes,
    ),
];

fn identity(out: &mut String, endpoint: &str) {
    let node = esc(super::node_name());
    one(
        out,
        "rabbitmq_identity_info",
        "untyped",
        "RabbitMQ node & cluster identity info",
        &format!(
            "rabbitmq_node=\"{node}\",rabbitmq_cluster=\"{node}\",rabbitmq_endpoint=\"{endpoint}\""
        ),
        1,
    );
    one(
        out,
        "rabbitmq_build_info",
        "untyped",
        "RabbitMQ & Erlang/OTP version info",
        &format!(
            "product_name=\"Triad\",product_version=\"{}\"",
            env!("CARGO_PKG_VERSION")
        ),
        1,
    );
}

/// The aggregated metrics.
pub fn aggregated(broker: &Broker) -> String {
    let mut out = String::with_capacity(8192);
    identity(&mut out, "default");
    let conns = totals(&mut out, broker);
    alarms(&mut out, broker);
    // Triad's own
    connections_by_protocol(&mut out, &conns);
    store_metrics(&mut out, broker);
    out
}

/// RabbitMQ's broker-wide gauges and message counters (one pass over each vhost's
/// queues); returns the connections it counted.
fn totals(out: &mut String, broker: &Broker) -> Vec<Arc<ConnInfo>> {
    let (mut queues, mut consumers) = (0u64, 0u64);
    let mut sums = [0u64; QUEUE_GAUGES.len()];
    let mut values = [0u64; 8];
    for v in broker.vhost_names() {
        let Ok(vh) = broker.vhost(&v) else { continue };
        // one pass over the vhost's queues
        let t = vh.totals();
        queues += t.queues;
        consumers += t.consumers;
        let gauges = [
            t.ready,
            t.unacked,
            t.ready.wrapping_add(t.unacked),
            t.consumers,
            t.ready_bytes,
        ];
        for (sum, g) in sums.iter_mut().zip(gauges) {
            *sum = sum.wrapping_add(g);
        }
        for (a, b) in values.iter_mut().zip(t.values) {
            *a = a.wrapping_add(b);
        }
    }
    let conns = broker.connections().list();
    one(
        out,
        "rabbitmq_connections",
        "gauge",
        "Connections currently open",
        "",
        conns.len(),
    );
    one(
        out,
        "rabbitmq_queues",
        "gauge",
        "Queues available",
        "",
        queues,
    );
    one(
        out,
        "rabbitmq_consumers",
        "gauge",
        "Consumers currently connected",
        "",
        consumers,
    );
    for (sum, (name, help, _)) in sums.iter().zip(QUEUE_GAUGES.iter()) {
        one(out, name, "gauge", help, "", sum);
    }
    // [publish, deliver, deliver_no_ack, get, get_no_ack, redeliver, ack, deliver_get]
    let [publish, deliver, deliver_no_ack, get, get_no_ack, redeliver, ack, deliver_get] = values;
    let counters: [(&str, &str, u64); 8] = [
        ("rabbitmq_global_messages_received_total", "Total number of messages received from publishers", publish),
        ("rabbitmq_global_messages_delivered_total", "Total number of messages delivered to consumers", deliver_get),
        ("rabbitmq_global_messages_delivered_consume_manual_ack_total", "Total number of messages delivered to consumers using basic.consume with manual acknowledgment", deliver),
        ("rabbitmq_global_messages_delivered_consume_auto_ack_total", "Total number of messages delivered to consumers using basic.consume with automatic acknowledgment", deliver_no_ack),
        ("rabbitmq_global_messages_delivered_get_manual_ack_total", "Total number of messages delivered to consumers using basic.get with manual acknowledgment", get),
        ("rabbitmq_global_messages_delivered_get_auto_ack_total", "Total number of messages delivered to consumers using basic.get with automatic acknowledgment", get_no_ack),
        ("rabbitmq_global_messages_redelivered_total", "Total number of messages redelivered to consumers", redeliver),
        ("rabbitmq_global_messages_acknowledged_total", "Total number of messages acknowledged by consumers", ack),
    ];
    for (name, help, v) in counters {
        one(out, name, "counter", help, "", v);
    }
    conns
}

/// RabbitMQ's resource alarm gauges.
fn alarms(out: &mut String, broker: &Broker) {
    let alarms = broker.current_alarms();
    one(
        out,
        "rabbitmq_alarms_memory_used_watermark",
        "gauge",
        "is 1 if VM memory watermark alarm is in effect",
        "",
        u8::from(alarms.memory),
    );
    one(
        out,
        "rabbitmq_alarms_free_disk_space_watermark",
        "gauge",
        "is 1 if free disk space watermark alarm is in effect",
        "",
        u8::from(alarms.disk),
    );
}

/// `triad_connections`, by protocol.
fn connections_by_protocol(out: &mut String, conns: &[Arc<ConnInfo>]) {
    head(
        out,
        "triad_connections",
        "gauge",
        "Connections currently open, by protocol",
    );
    let mut by_proto: Vec<(&str, usize)> = Vec::new();
    for c in conns {
        match by_proto.iter_mut().find(|(p, _)| *p == c.protocol) {
            Some((_, n)) => *n += 1,
            None => by_proto.push((c.protocol, 1)),
        }
    }
    by_proto.sort_unstable();
    for (p, n) in by_proto {
        let _ = writeln!(out, "triad_connections{{protocol=\"{}\"}} {n}", esc(p));
    }
}

/// The store's gauges, counters and histograms.
fn store_metrics(out: &mut String, broker: &Broker) {
    let st = broker.store().stats();
    one(
        out,
        "triad_store_commitlog_bytes",
        "gauge",
        "Bytes of commitlog between the oldest kept offset and the end",
        "",
        st.commitlog_end.saturating_sub(st.commitlog_min),
    );
    one(
        out,
        "triad_store_appended_bytes",
        "gauge",
        "Commitlog end offset: bytes appended over the store's life",
        "",
        st.commitlog_end,
    );
    one(
        out,
        "triad_store_unflushed_bytes",
        "gauge",
        "Bytes appended but not yet flushed to disk",
        "",
        st.commitlog_end.saturating_sub(st.flushed),
    );
    one(
        out,
        "triad_store_segments",
        "gauge",
        "Commitlog segment files",
        "",
        st.segments,
    );
    one(
        out,
        "triad_store_segment_bytes",
        "gauge",
        "Bytes of commitlog segment files on disk (each preallocated whole)",
        "",
        st.segment_bytes,
    );
    one(
        out,
        "triad_store_appends_total",
        "counter",
        "Records appended to the commitlog since the broker started",
        "",
        st.appends,
    );
    retention_metrics(out, &st);
    let fs = broker.store().flush_stats();
    histogram(
        out,
        "triad_store_fsync_seconds",
        "Duration of each group commit's commitlog flush (msync), by the flusher thread",
        &fs.sync_us.snapshot(),
        1e6,
    );
    histogram(
        out,
        "triad_store_group_commit_bytes",
        "Bytes each group commit made durable (its batch)",
        &fs.batch_bytes.snapshot(),
        1.0,
    );
    one(
        out,
        "triad_store_failed",
        "gauge",
        "is 1 if the store has failed (disk full)",
        "",
        u8::from(broker.store().disk_full()),
    );
}

/// The per-object metrics, streamed.
/// The retention pass's counters: compaction, deletion, and appends' waits for it.
fn retention_metrics(out: &mut String, st: &triad_store::store::StoreStats) {
    let counters: [(&str, &str, u64); 5] = [
        (
            "triad_store_compactions_total",
            "Commitlog segments compacted (live records copied forward, segment deleted)",
            st.compactions,
        ),
        (
            "triad_store_compaction_reclaimed_bytes_total",
            "Bytes compactions gave back: segment size less the bytes copied forward",
            st.compacted_bytes_reclaimed,
        ),
        (
            "triad_store_segments_deleted_total",
            "Commitlog segments deleted (no queue needed them, or compacted)",
            st.segments_deleted,
        ),
        (
            "triad_store_pass_waits_total",
            "Appends that waited for the retention pass after a seal before filling the \
             writer's segment (the disk bound)",
            st.pass_waits,
        ),
        (
            "triad_store_pass_wait_timeouts_total",
            "Of those, waits that ended at their 2 s limit instead of at the pass",
            st.pass_wait_timeouts,
        ),
    ];
    for (name, help, value) in counters {
        one(out, name, "counter", help, "", value);
    }
}

fn per_object(broker: std::sync::Arc<Broker>) -> Response<Body> {
    super::list::stream(move |out| {
        let mut s = String::new();
        identity(&mut s, "per-object");
        out.put(s.as_bytes());
        let mut vhosts = Vec::new();
        for v in broker.vhost_names() {
            if let Ok(vh) = broker.vhost(&v) {
                let mut names = vh.queue_names();
                names.retain(|n| !triad_core::reserved::is_reserved_queue(n));
                names.sort_unstable();
                vhosts.push((vh, names));
            }
        }
        // one family at a time (the format wants a family's samples together)
        for (name, help, f) in QUEUE_GAUGES.iter() {
            let mut s = String::new();
            head(&mut s, name, "gauge", help);
            out.put(s.as_bytes());
            for (vh, names) in &vhosts {
                let vl = esc(vh.name());
                for n in names {
                    if out.gone() {
                        return;
                    }
                    if let Some(q) = vh.queue(n) {
                        let line = format!(
                            "{name}{{vhost=\"{vl}\",queue=\"{}\"}} {}\n",
                            esc(n),
                            f(&q.stats())
                        );
                        out.put(line.as_bytes());
                    }
                }
            }
        }
    })
}

fn text(body: String) -> Response<Body> {
    let mut r = crate::http::json_response(StatusCode::OK, Bytes::from(body));
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(CONTENT));
    r
}

/// Answers `/metrics` and `/metrics/per-object` (`None`: not a metrics path).
pub async fn handle(
    path: &str,
    method: &hyper::Method,
    ctx: &crate::listener::ConnContext,
) -> Option<Response<Body>> {
    let broker = &ctx.broker;
    let detailed = match path {
        "/metrics" => false,
        "/metrics/per-object" => true,
        _ => return None,
    };
    if method != hyper::Method::GET {
        return Some(super::ApiError::method_not_allowed().response());
    }
    let broker = std::sync::Arc::clone(broker);
    if detailed {
        let mut r = per_object(broker);
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(CONTENT));
        return Some(r);
    }
    let mqtt = std::sync::Arc::clone(&ctx.mqtt);
    let ctx = ctx.clone();
    let body = tokio::task::spawn_blocking(move || {
        let mut out = aggregated(&broker);
        let (retained, sessions) = mqtt.totals();
        one(
            &mut out,
            "triad_mqtt_retained_messages",
            "gauge",
            "MQTT retained messages, over the vhosts MQTT clients have used since the start",
            "",
            retained,
        );
        one(
            &mut out,
            "triad_mqtt_persistent_sessions",
            "gauge",
            "MQTT persistent sessions (clean session 0), connected or not, over the vhosts MQTT clients have used since the start",
            "",
            sessions,
        );
        super::cluster::metrics(&mut out, &ctx);
        out
    })
    .await;
    Some(match body {
        Ok(b) => text(b),
        Err(_) => crate::http::error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "metrics could not be gathered",
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_in_the_exposition_format() {
        let h = triad_store::flush::Histogram::new([100, 1000]);
        h.record(50);
        h.record(5000);
        let mut out = String::new();
        histogram(&mut out, "x_seconds", "help", &h.snapshot(), 1e6);
        assert_eq!(
            out,
            "# HELP x_seconds help\n# TYPE x_seconds histogram\n\
             x_seconds_bucket{le=\"0.0001\"} 1\nx_seconds_bucket{le=\"0.001\"} 1\n\
             x_seconds_bucket{le=\"+Inf\"} 2\nx_seconds_sum 0.00505\nx_seconds_count 2\n"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(esc("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
