//! Result lines (one JSON object per run) and the Markdown table made from them.

use hdrhistogram::Histogram;
use serde_json::{json, Value};

/// Latency histograms are recorded in nanoseconds, 1 ns .. 60 s, 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3)
        .unwrap_or_else(|_| Histogram::new(3).unwrap_or_else(|_| unreachable!()))
}

fn us(ns: f64) -> f64 {
    round(ns / 1000.0, 1)
}

pub fn round(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

/// `{"p50":..,"p99":..,"p999":..,"max":..,"mean":..}` in microseconds.
pub fn latency_json(h: &Histogram<u64>) -> Value {
    if h.is_empty() {
        return Value::Null;
    }
    json!({
        "p50": us(h.value_at_quantile(0.50) as f64),
        "p99": us(h.value_at_quantile(0.99) as f64),
        "p999": us(h.value_at_quantile(0.999) as f64),
        "max": us(h.max() as f64),
        "mean": us(h.mean()),
    })
}

/// The one-line form printed on stdout.
pub fn result_line(v: &Value) -> String {
    // serde_json's compact form has no newlines (strings escape theirs).
    v.to_string()
}

fn get_f(v: &Value, path: &[&str]) -> Option<f64> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p)?;
    }
    cur.as_f64()
}

fn get_s<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

pub fn fmt_size(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1024 && bytes.is_multiple_of(1024) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// Thousands-separated integer, or a few significant digits for small values.
pub fn fmt_num(x: Option<f64>) -> String {
    let Some(x) = x.filter(|x| x.is_finite()) else {
        return "–".into();
    };
    if x.abs().round() >= 1000.0 {
        let n = x.round() as i64;
        let s = n.unsigned_abs().to_string();
        let mut out = String::new();
        for (i, c) in s.chars().enumerate() {
            if i > 0 && (s.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        if n < 0 {
            out.insert(0, '-');
        }
        out
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// A count: thousands-separated, never with decimals.
pub fn fmt_int(x: Option<f64>) -> String {
    match x.filter(|x| x.is_finite()) {
        Some(x) if x.abs() < 1000.0 => format!("{x:.0}"),
        other => fmt_num(other),
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        Some(r) if r >= 10.0 => format!("{r:.0}×"),
        Some(r) => format!("{r:.2}×"),
        None => "–".into(),
    }
}

/// Summary of a broker benchmark (`amqp`, `stomp`, `mqtt`, `*-idle`).
fn human_e2e(v: &Value) -> String {
    let n = |k: &str| fmt_num(get_f(v, &[k]));
    let int = |k: &str| fmt_int(get_f(v, &[k]));
    if get_s(v, "bench").ends_with("-idle") {
        return format!(
            "{}{} {}: {} of {} connected in {} s ({} failed, {} alive at the end)\n  broker RSS KiB: before {} connected {} after {}; per connection {} KiB ({} KiB anonymous)",
            get_s(v, "bench"),
            if v.get("tls").and_then(Value::as_bool) == Some(true) { " tls" } else { "" },
            get_s(v, "target"),
            int("connected"),
            int("connections"),
            n("connect_s"),
            int("failed"),
            int("alive_at_end"),
            fmt_num(get_f(v, &["broker", "rss_kib_before"])),
            fmt_num(get_f(v, &["broker", "rss_kib_connected"])),
            fmt_num(get_f(v, &["broker", "rss_kib_after"])),
            fmt_num(get_f(v, &["broker", "rss_kib_per_conn"])),
            fmt_num(get_f(v, &["broker", "rss_anon_kib_per_conn"])),
        );
    }
    let mut s = format!(
        "{} {} {} size={} producers={} consumers={}\n  sent {} received {} (expected {}) in {:.2} s: {} msgs/s, {} MB/s (publishing {} msgs/s)\n  lost {} duplicated {} out-of-order {} unexpected {} corrupt {}{}",
        get_s(v, "bench"),
        get_s(v, "variant"),
        get_s(v, "target"),
        fmt_size(get_f(v, &["size"]).unwrap_or(0.0) as u64),
        int("producers"),
        int("consumers"),
        int("sent"),
        int("received"),
        int("expected"),
        get_f(v, &["seconds"]).unwrap_or(0.0),
        n("msgs_per_s"),
        n("mb_per_s"),
        n("send_per_s"),
        int("lost"),
        int("duplicated"),
        int("out_of_order"),
        int("unexpected"),
        int("corrupt"),
        if v.get("drained").and_then(Value::as_bool) == Some(false) {
            " (gave up waiting: not drained)"
        } else {
            ""
        },
    );
    if v.get("lat_us").is_some_and(|l| !l.is_null()) {
        s.push_str(&format!(
            "\n  latency µs (send → receive): p50 {} p99 {} p99.9 {} max {}",
            fmt_num(get_f(v, &["lat_us", "p50"])),
            fmt_num(get_f(v, &["lat_us", "p99"])),
            fmt_num(get_f(v, &["lat_us", "p999"])),
            fmt_num(get_f(v, &["lat_us", "max"])),
        ));
    }
    if v.get("confirm_lat_us").is_some_and(|l| !l.is_null()) {
        s.push_str(&format!(
            "\n  confirm latency µs (publish → ack): p50 {} p99 {} p99.9 {} max {}",
            fmt_num(get_f(v, &["confirm_lat_us", "p50"])),
            fmt_num(get_f(v, &["confirm_lat_us", "p99"])),
            fmt_num(get_f(v, &["confirm_lat_us", "p999"])),
            fmt_num(get_f(v, &["confirm_lat_us", "max"])),
        ));
    }
    if let Some(b) = v.get("broker").filter(|b| !b.is_null()) {
        s.push_str(&format!(
            "\n  broker pid {}: CPU {} s, {} µs/msg; RSS KiB before {} peak {} after {}",
            b.get("pids")
                .and_then(Value::as_array)
                .map(|p| p
                    .iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join("+"))
                .unwrap_or_default(),
            fmt_num(get_f(b, &["cpu_s"])),
            fmt_num(get_f(b, &["cpu_us_per_msg"])),
            fmt_num(get_f(b, &["rss_kib_before"])),
            fmt_num(get_f(b, &["rss_kib_peak"])),
            fmt_num(get_f(b, &["rss_kib_after"])),
        ));
    }
    s.push_str(&format!(
        "\n  client CPU µs/msg: {}",
        n("client_cpu_us_per_msg")
    ));
    s
}

/// Summary of a `fleet` result.
fn human_fleet(v: &Value) -> String {
    let f = |p: &[&str]| fmt_num(get_f(v, p));
    let kib = |p: &[&str]| fmt_num(get_f(v, p).map(|b| b / 1024.0));
    format!(
        "fleet {} {}: {} of {} sessions in {} s, {} sessions/s (first block {}/s, last {}/s, \
         last/first time {}); broker CPU {} µs/session\n  disk per session: idle {} KiB, with \
         1 queued message {} KiB, after stop {} KiB; RssAnon per disconnected session {} KiB\n  \
         publish: {} msgs/s, broker CPU {} µs/msg\n  \
         idle: {} connected, RssAnon {} KiB/conn (VmRSS {} KiB/conn), {} got their message\n  \
         restart: stop {} s, listening after {} s, CONNACK session-present after {} s; RSS after \
         {} KiB (RssAnon {} KiB)",
        get_s(v, "broker_name"),
        get_s(v, "target"),
        f(&["sessions"]),
        f(&["sessions_requested"]),
        f(&["create", "seconds"]),
        f(&["create", "sessions_per_s"]),
        f(&["create", "first_block_per_s"]),
        f(&["create", "last_block_per_s"]),
        f(&["create", "last_over_first_time"]),
        f(&["create", "broker_cpu_us_per_session"]),
        kib(&["disk", "bytes_per_session_idle"]),
        kib(&["disk", "bytes_per_session_with_message"]),
        kib(&["disk", "bytes_per_session_after_stop"]),
        f(&["rss_anon_kib_per_session"]),
        f(&["publish", "msgs_per_s"]),
        f(&["publish", "broker_cpu_us_per_msg"]),
        f(&["idle", "connected"]),
        f(&["idle", "rss_anon_kib_per_conn"]),
        f(&["idle", "rss_kib_per_conn"]),
        f(&["idle", "queued_delivered"]),
        f(&["restart", "stop_s"]),
        f(&["restart", "listen_s"]),
        f(&["restart", "ready_s"]),
        f(&["restart", "rss_kib_after"]),
        f(&["restart", "rss_anon_kib_after"]),
    )
}

fn human_bindings(v: &Value) -> String {
    let f = |p: &[&str]| fmt_num(get_f(v, p));
    let mib = |p: &[&str]| fmt_num(get_f(v, p).map(|k| k / 1024.0));
    format!(
        "bindings: {} queues, {} bindings in {} s ({}/s, broker CPU {} µs each); RssAnon \
         {} MiB at start, {} MiB after creating ({} B per binding)\n  restart: listening \
         after {} s, ready after {} s (broker CPU {} s), RssAnon {} MiB ({} B per binding)\n  \
         route: {} messages at {}/s, broker CPU {} µs per message",
        f(&["queues"]),
        f(&["create", "bindings"]),
        f(&["create", "seconds"]),
        f(&["create", "bindings_per_s"]),
        f(&["create", "broker_cpu_us_per_binding"]),
        mib(&["rss_anon_kib_start"]),
        mib(&["rss_anon_kib_created"]),
        f(&["rss_anon_bytes_per_binding_created"]),
        f(&["restart", "listen_s"]),
        f(&["restart", "ready_s"]),
        f(&["restart", "broker_cpu_s_at_ready"]),
        mib(&["restart", "rss_anon_kib_after_2s"]),
        f(&["rss_anon_bytes_per_binding_restarted"]),
        f(&["route", "messages"]),
        f(&["route", "msgs_per_s"]),
        f(&["route", "broker_cpu_us_per_msg"]),
    )
}

fn human_connect(v: &Value) -> String {
    let f = |p: &[&str]| fmt_num(get_f(v, p));
    let int = |p: &[&str]| fmt_int(get_f(v, p));
    let tls = if v.get("tls").and_then(Value::as_bool) == Some(true) {
        format!(
            " TLS {}{} ({} resumed)",
            get_s(v, "tls_version"),
            if v.get("resume").and_then(Value::as_bool) == Some(true) {
                " with resumption"
            } else {
                " full handshakes"
            },
            int(&["resumed"]),
        )
    } else {
        String::new()
    };
    format!(
        "connect {} {} {}{}{} parallel={}\n  {} connects in {} s: {}/s ({} failed, {} with \
         session present); connect to close µs p50 {} p99 {} max {}\n  broker CPU {} ms per \
         connect (user {}, system {}); client CPU {} ms per connect",
        get_s(v, "name"),
        get_s(v, "target"),
        get_s(v, "proto"),
        match v.get("session").and_then(Value::as_str) {
            Some(k) => format!(" {k}"),
            None => String::new(),
        },
        tls,
        int(&["parallel"]),
        int(&["connects"]),
        f(&["seconds"]),
        f(&["connects_per_s"]),
        int(&["failed"]),
        int(&["session_present"]),
        f(&["lat_us", "p50"]),
        f(&["lat_us", "p99"]),
        f(&["lat_us", "max"]),
        f(&["cpu_ms_per_connect"]),
        f(&["broker", "user_ms_per_connect"]),
        f(&["broker", "sys_ms_per_connect"]),
        f(&["client_cpu_ms_per_connect"]),
    )
}

/// Human-readable summary of one result (stdout without `--json`).
pub fn human(v: &Value) -> String {
    let mut s = String::new();
    let bench = get_s(v, "bench");
    if bench == "connect" {
        return human_connect(v);
    }
    if bench == "fleet" {
        return human_fleet(v);
    }
    if bench == "bindings" {
        return human_bindings(v);
    }
    if matches!(bench, "amqp" | "stomp" | "mqtt") || bench.ends_with("-idle") {
        return human_e2e(v);
    }
    let what = match bench {
        "store" => format!(
            "store {} size={} writers={} queues={}",
            get_s(v, "flush"),
            fmt_size(get_f(v, &["size"]).unwrap_or(0.0) as u64),
            get_f(v, &["writers"]).unwrap_or(0.0) as u64,
            get_f(v, &["queues"]).unwrap_or(0.0) as u64
        ),
        "dd" => "dd bs=1M oflag=direct conv=fdatasync".to_string(),
        _ => format!(
            "{bench} {} size={}",
            get_s(v, "variant"),
            fmt_size(get_f(v, &["size"]).unwrap_or(0.0) as u64)
        ),
    };
    s.push_str(&what);
    s.push_str(&format!(
        "\n  {} ops in {:.2} s: {} ops/s, {} MB/s",
        fmt_num(get_f(v, &["ops"])),
        get_f(v, &["seconds"]).unwrap_or(0.0),
        fmt_num(get_f(v, &["ops_per_s"])),
        fmt_num(get_f(v, &["mb_per_s"])),
    ));
    if v.get("lat_us").is_some_and(|l| !l.is_null()) {
        s.push_str(&format!(
            "\n  latency µs: p50 {} p99 {} p99.9 {} max {}",
            fmt_num(get_f(v, &["lat_us", "p50"])),
            fmt_num(get_f(v, &["lat_us", "p99"])),
            fmt_num(get_f(v, &["lat_us", "p999"])),
            fmt_num(get_f(v, &["lat_us", "max"])),
        ));
    }
    if let Some(c) = get_f(v, &["cpu_us_per_op"]) {
        s.push_str(&format!("\n  CPU µs/op: {}", fmt_num(Some(c))));
    }
    if let Some(f) = get_f(v, &["dev", "flushes"]) {
        s.push_str(&format!(
            "\n  disk: {} flushes, {} writes, {} MB written",
            fmt_num(Some(f)),
            fmt_num(get_f(v, &["dev", "writes"])),
            fmt_num(get_f(v, &["dev", "write_mb"])),
        ));
    }
    if let Some(r) = v.get("read").filter(|r| !r.is_null()) {
        s.push_str(&format!(
            "\n  read back: {} msgs/s, {} MB/s, verified {}",
            fmt_num(get_f(r, &["ops_per_s"])),
            fmt_num(get_f(r, &["mb_per_s"])),
            r.get("verified").and_then(Value::as_u64).unwrap_or(0)
        ));
    }
    s
}

/// Operations per device flush request (how many appends one group commit covered, as the
/// disk saw it).
fn ops_per_flush(v: &Value) -> Option<f64> {
    ratio(get_f(v, &["ops"]), get_f(v, &["dev", "flushes"]))
}

/// Device write requests per operation (device-wide counters: other I/O on the same disk
/// counts too).
fn writes_per_op(v: &Value) -> Option<f64> {
    ratio(get_f(v, &["dev", "writes"]), get_f(v, &["ops"]))
}

/// Markdown tables (baselines, store writes, store reads) from result lines; other lines
/// are ignored.
pub fn table(input: &str) -> String {
    let rows: Vec<Value> = input
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .filter(|v| v.is_object())
        .collect();
    let dd = rows
        .iter()
        .find(|v| get_s(v, "bench") == "dd")
        .and_then(|v| get_f(v, &["mb_per_s"]));
    let mut out = String::new();
    baseline_table(&mut out, &rows);
    store_table(&mut out, &rows, dd);
    out
}

/// The ops/s of the write+fdatasync loop `variant` at `size`, if measured.
fn loop_ops(rows: &[Value], variant: &str, size: Option<f64>) -> Option<f64> {
    rows.iter()
        .find(|v| {
            get_s(v, "bench") == "fsync-loop"
                && get_s(v, "variant") == variant
                && get_f(v, &["size"]) == size
        })
        .and_then(|v| get_f(v, &["ops_per_s"]))
}

/// The disk baselines: dd and the write+fdatasync loops.
fn baseline_table(out: &mut String, rows: &[Value]) {
    let base: Vec<&Value> = rows
        .iter()
        .filter(|v| matches!(get_s(v, "bench"), "dd" | "fsync-loop"))
        .collect();
    if !base.is_empty() {
        out.push_str("| baseline | size | ops/s | MB/s | p50 µs | p99 µs | p99.9 µs | CPU µs/op | ops/disk flush | disk writes/op |\n");
        out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for v in base {
            let name = match get_s(v, "bench") {
                "dd" => "dd bs=1M oflag=direct".to_string(),
                _ => format!("write+fdatasync, {}", get_s(v, "variant")),
            };
            out.push_str(&format!(
                "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                fmt_size(get_f(v, &["size"]).unwrap_or(0.0) as u64),
                fmt_num(get_f(v, &["ops_per_s"])),
                fmt_num(get_f(v, &["mb_per_s"])),
                fmt_num(get_f(v, &["lat_us", "p50"])),
                fmt_num(get_f(v, &["lat_us", "p99"])),
                fmt_num(get_f(v, &["lat_us", "p999"])),
                fmt_num(get_f(v, &["cpu_us_per_op"])),
                fmt_num(ops_per_flush(v)),
                fmt_num(writes_per_op(v)),
            ));
        }
        out.push('\n');
    }
}

/// The store runs, against the baselines (`dd`: dd's MB/s).
fn store_table(out: &mut String, rows: &[Value], dd: Option<f64>) {
    let store: Vec<&Value> = rows
        .iter()
        .filter(|v| get_s(v, "bench") == "store")
        .collect();
    if !store.is_empty() {
        out.push_str("| flush | size | writers | appends/s | MB/s | p50 µs | p99 µs | p99.9 µs | CPU µs/msg | msgs/disk flush | disk writes/msg | vs loop (overwrite) | vs loop (fallocated) | % of dd MB/s |\n");
        out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for v in &store {
            let size = get_f(v, &["size"]);
            let ops = get_f(v, &["ops_per_s"]);
            let pct = ratio(get_f(v, &["mb_per_s"]), dd).map(|r| r * 100.0);
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                get_s(v, "flush"),
                fmt_size(size.unwrap_or(0.0) as u64),
                get_f(v, &["writers"]).unwrap_or(0.0) as u64,
                fmt_num(ops),
                fmt_num(get_f(v, &["mb_per_s"])),
                fmt_num(get_f(v, &["lat_us", "p50"])),
                fmt_num(get_f(v, &["lat_us", "p99"])),
                fmt_num(get_f(v, &["lat_us", "p999"])),
                fmt_num(get_f(v, &["cpu_us_per_op"])),
                fmt_num(ops_per_flush(v)),
                fmt_num(writes_per_op(v)),
                fmt_ratio(ratio(ops, loop_ops(rows, "overwrite", size))),
                fmt_ratio(ratio(ops, loop_ops(rows, "fallocated", size))),
                pct.map(|p| format!("{p:.1} %"))
                    .unwrap_or_else(|| "–".into()),
            ));
        }
        out.push('\n');
        read_back_table(out, &store);
    }
}

/// The store runs that read back what they wrote.
fn read_back_table(out: &mut String, store: &[&Value]) {
    let reads: Vec<&&Value> = store
        .iter()
        .filter(|v| v.get("read").is_some_and(|r| !r.is_null()))
        .collect();
    if !reads.is_empty() {
        out.push_str(
            "| read back after | size | writers | msgs read | msgs/s | MB/s | verified |\n",
        );
        out.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
        for v in reads {
            let r = &v["read"];
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                get_s(v, "flush"),
                fmt_size(get_f(v, &["size"]).unwrap_or(0.0) as u64),
                get_f(v, &["writers"]).unwrap_or(0.0) as u64,
                fmt_num(get_f(r, &["ops"])),
                fmt_num(get_f(r, &["ops_per_s"])),
                fmt_num(get_f(r, &["mb_per_s"])),
                if r.get("ok").and_then(Value::as_bool) == Some(true) {
                    "yes"
                } else {
                    "NO"
                },
            ));
        }
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_and_line() {
        let mut h = new_histogram();
        for ns in 1..=1000u64 {
            h.record(ns * 1000).unwrap();
        }
        let l = latency_json(&h);
        assert!((l["p50"].as_f64().unwrap() - 500.0).abs() < 1.0);
        assert!((l["p99"].as_f64().unwrap() - 990.0).abs() < 2.0);
        assert!(latency_json(&new_histogram()).is_null());
        let v = json!({"bench": "store", "dir": "a\nb", "lat_us": l});
        let line = result_line(&v);
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<Value>(&line).unwrap(), v);
    }

    #[test]
    fn numbers() {
        assert_eq!(fmt_num(Some(1234567.4)), "1,234,567");
        assert_eq!(fmt_num(Some(999.6)), "1,000");
        assert_eq!(fmt_num(Some(123.4)), "123");
        assert_eq!(fmt_num(Some(12.34)), "12.3");
        assert_eq!(fmt_num(Some(1.234)), "1.23");
        assert_eq!(fmt_num(None), "–");
        assert_eq!(fmt_size(16), "16 B");
        assert_eq!(fmt_size(1024), "1 KiB");
        assert_eq!(fmt_size(65536), "64 KiB");
        assert_eq!(fmt_size(1 << 20), "1 MiB");
        assert_eq!(fmt_size(1000), "1000 B");
    }

    #[test]
    fn table_from_lines() {
        let input = [
            r#"{"bench":"dd","size":1048576,"ops":100,"ops_per_s":500,"mb_per_s":524.3}"#,
            r#"{"bench":"fsync-loop","variant":"overwrite","size":1024,"ops":1000,"ops_per_s":2000,"mb_per_s":2.0,"lat_us":{"p50":450,"p99":900,"p999":2000},"cpu_us_per_op":20,"dev":{"writes":2000,"flushes":1000}}"#,
            "not json",
            r#"{"bench":"store","flush":"sync","size":1024,"writers":8,"ops":8000,"ops_per_s":8000,"mb_per_s":8.2,"lat_us":{"p50":900,"p99":1800,"p999":3000},"cpu_us_per_op":15.5,"dev":{"writes":1000,"flushes":500},"read":{"ops":8000,"ops_per_s":1e6,"mb_per_s":1024,"ok":true}}"#,
        ]
        .join("\n");
        let t = table(&input);
        assert!(
            t.contains("| dd bs=1M oflag=direct | 1 MiB | 500 | 524 |"),
            "{t}"
        );
        assert!(t.contains("| write+fdatasync, overwrite | 1 KiB | 2,000 | 2.00 | 450 | 900 | 2,000 | 20.0 | 1.00 | 2.00 |"), "{t}");
        assert!(
            t.contains("| sync | 1 KiB | 8 | 8,000 | 8.20 | 900 | 1,800 | 3,000 | 15.5 | 16.0 | 0.12 | 4.00× | – | 1.6 % |"),
            "{t}"
        );
        assert!(
            t.contains("| sync | 1 KiB | 8 | 8,000 | 1,000,000 | 1,024 | yes |"),
            "{t}"
        );
        assert_eq!(table("garbage\n"), "");
    }

    #[test]
    fn human_e2e_lines() {
        let v: Value = serde_json::from_str(
            r#"{"bench":"amqp","variant":"transient","target":"127.0.0.1:5680","size":1024,"producers":1,"consumers":1,"sent":10,"received":9,"expected":10,"lost":1,"duplicated":0,"out_of_order":0,"unexpected":0,"corrupt":0,"drained":false,"seconds":1.0,"msgs_per_s":9,"mb_per_s":0.01,"send_per_s":10,"lat_us":{"p50":100,"p99":200,"p999":300,"max":400},"broker":{"pid":42,"cpu_s":0.5,"cpu_us_per_msg":55.5,"rss_kib_before":1,"rss_kib_peak":3,"rss_kib_after":2},"client_cpu_us_per_msg":3}"#,
        )
        .unwrap();
        let h = human(&v);
        assert!(h.contains("lost 1 duplicated 0"), "{h}");
        assert!(h.contains("not drained"), "{h}");
        assert!(h.contains("55.5 µs/msg"), "{h}");
        let i: Value = serde_json::from_str(
            r#"{"bench":"mqtt-idle","target":"t","connections":10,"connected":10,"connect_s":0.5,"failed":0,"alive_at_end":10,"broker":{"rss_kib_per_conn":1.5}}"#,
        )
        .unwrap();
        assert!(
            human(&i).contains("per connection 1.50 KiB"),
            "{}",
            human(&i)
        );
    }
}
