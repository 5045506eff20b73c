//! GET handlers: overview, nodes, vhosts, queues, exchanges, bindings, connections,
//! consumers, users, permissions, policies, health checks.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{json, Value};
use triad_core::conns::ConnInfo;
use triad_core::routing::Binding;
use triad_core::{Destination, ExchangeDef, Queue, Vhost};

use super::json::table_json;
use super::list::{respond, ListQuery};
use super::{node_name, ok_json, Api, ApiError, ApiResult};

/// RabbitMQ's `message_stats`: each counter and its `*_details.rate` (per second).
pub fn message_stats_json(values: &[u64; 8], rates: &[f64; 8]) -> Value {
    let mut m = serde_json::Map::new();
    for ((name, v), r) in triad_core::queue::RATE_NAMES.iter().zip(values).zip(rates) {
        m.insert((*name).to_owned(), json!(v));
        m.insert(format!("{name}_details"), json!({"rate": r}));
    }
    Value::Object(m)
}

/// A queue, RabbitMQ's fields for what Triad has.
pub fn queue_json(vhost: &str, q: &Queue) -> Value {
    let (s, rates) = q.stats_with_rates();
    let policy = q.policy();
    json!({
        "name": q.name(),
        "vhost": vhost,
        "durable": q.durable(),
        "auto_delete": q.auto_delete(),
        "exclusive": q.exclusive_owner().is_some(),
        "arguments": table_json(q.arguments()),
        "node": node_name(),
        "type": if q.is_stream() { "stream" } else { "classic" },
        "state": if s.flow { "flow" } else { "running" },
        "policy": policy.as_ref().map(|p| p.name.as_str()),
        "operator_policy": null,
        "effective_policy_definition": policy.as_ref().map_or_else(|| json!({}), |p| p.definition.to_json()),
        "consumers": s.consumers,
        "messages": s.ready + s.unacked,
        "messages_ready": s.ready,
        "messages_unacknowledged": s.unacked,
        "message_bytes_ready": s.ready_bytes,
        // `publish`: messages ever routed to the queue since it was created; the
        // others since the broker started
        "message_stats": message_stats_json(&s.values(), &rates),
    })
}

/// An exchange (the default one is listed with the name `""`, as RabbitMQ does), with
/// its `message_stats` from `stats` (a reading of its vhost's
/// [`triad_core::exchange_stats::ExchangeStats`]): `publish_in`, the messages
/// published to it, and `publish_out`, the queue entries it routed them to, each with
/// its `*_details.rate`, as RabbitMQ 3.x (0 for an exchange nobody published to since
/// it was declared or the broker started).
pub fn exchange_json(
    vhost: &str,
    x: &ExchangeDef,
    stats: &HashMap<Box<str>, triad_core::exchange_stats::WithRates>,
) -> Value {
    let s = stats.get(x.name.as_str()).copied().unwrap_or_default();
    json!({
        "name": x.name,
        "vhost": vhost,
        "type": x.kind.as_str(),
        "durable": x.durable,
        "auto_delete": x.auto_delete,
        "internal": x.internal,
        "arguments": table_json(&x.arguments),
        "message_stats": {
            "publish_in": s.counts.publish_in,
            "publish_in_details": {"rate": s.rates[0]},
            "publish_out": s.counts.publish_out,
            "publish_out_details": {"rate": s.rates[1]},
        },
    })
}

/// RabbitMQ's `properties_key`: the routing key (`~` when empty) when there are no
/// arguments, else the key, `~` and a hash of the arguments. Opaque: it names one
/// binding of a source and destination in URLs.
pub fn properties_key(b: &Binding) -> String {
    let key = if b.routing_key.is_empty() {
        "~".to_owned()
    } else {
        b.routing_key.clone()
    };
    if b.arguments.is_empty() {
        return key;
    }
    // FNV-1a over the arguments' JSON form: stable across restarts and versions
    let text = table_json(&b.arguments).to_string();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let base = if b.routing_key.is_empty() {
        ""
    } else {
        &b.routing_key
    };
    format!("{base}~{h:016x}")
}

pub fn binding_json(vhost: &str, b: &Binding) -> Value {
    let (dtype, dest) = match &b.destination {
        Destination::Queue(q) => ("queue", &**q),
        Destination::Exchange(x) => ("exchange", &**x),
    };
    json!({
        "source": b.source,
        "vhost": vhost,
        "destination": dest,
        "destination_type": dtype,
        "routing_key": b.routing_key,
        "arguments": table_json(&b.arguments),
        "properties_key": properties_key(b),
    })
}

/// Every binding of a vhost: the default exchange's implicit one per queue first (as
/// RabbitMQ lists them), then the declared ones.
pub fn vhost_bindings(vh: &Vhost) -> Vec<Binding> {
    let mut names = queue_names(vh);
    names.sort_unstable();
    let mut out: Vec<Binding> = names
        .into_iter()
        .map(|q| Binding {
            source: String::new(),
            destination: Destination::queue(q.as_str()),
            routing_key: q,
            arguments: Default::default(),
        })
        .collect();
    let mut declared: Vec<Binding> = vh
        .bindings()
        .into_iter()
        .filter(|b| !b.source.is_empty())
        .collect();
    declared.sort_by(|a, b| {
        (&a.source, a.destination.name(), &a.routing_key).cmp(&(
            &b.source,
            b.destination.name(),
            &b.routing_key,
        ))
    });
    out.extend(declared);
    out
}

fn protocol_name(c: &ConnInfo) -> &'static str {
    match (c.protocol, c.websocket) {
        ("amqp", _) => "AMQP 0-9-1",
        ("stomp", false) => "STOMP 1.2",
        ("stomp", true) => "Web STOMP",
        ("mqtt", false) => "MQTT 3.1.1",
        ("mqtt", true) => "Web MQTT",
        (other, _) => other,
    }
}

pub fn connection_json(c: &ConnInfo) -> Value {
    let login = c.login();
    let (io, rates) = c.io_with_rates();
    let mut v = json!({
        "name": c.name(),
        "node": node_name(),
        "type": "network",
        "state": "running",
        "protocol": protocol_name(c),
        "user": login.as_ref().map(|l| l.user.clone()),
        "vhost": login.as_ref().and_then(|l| l.vhost.clone()),
        "peer_host": c.peer.ip().to_string(),
        "peer_port": c.peer.port(),
        "ssl": c.tls,
        "connected_at": c.connected_at,
        // AMQP: its open channels; STOMP and MQTT: one, as RabbitMQ's plugins
        "channels": if c.protocol == "amqp" { c.channel_count() } else { 1 },
        // bytes and read / write calls on the connection's stream (inside TLS records
        // and WebSocket frames), with RabbitMQ's rates of the byte counts
        "recv_oct": io.recv_oct,
        "recv_oct_details": {"rate": rates[0]},
        "recv_cnt": io.recv_cnt,
        "send_oct": io.send_oct,
        "send_oct_details": {"rate": rates[1]},
        "send_cnt": io.send_cnt,
    });
    if let Some(cn) = c.peer_cert_cn() {
        v["peer_cert_subject"] = json!(format!("CN={cn}"));
    }
    v
}

fn vhost_json(api: &Api, name: &str) -> Value {
    let (mut ready, mut unacked) = (0u64, 0u64);
    let mut stats = Value::Null;
    if let Ok(vh) = api.broker().vhost(name) {
        // one pass over the queues
        let t = vh.totals();
        (ready, unacked) = (t.ready, t.unacked);
        stats = message_stats_json(&t.values, &t.rates);
    }
    json!({
        "message_stats": stats,
        "name": name,
        "description": "",
        "tags": [],
        "metadata": {"description": "", "tags": []},
        "default_queue_type": "classic",
        "tracing": false,
        "messages": ready + unacked,
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
        "cluster_state": { node_name(): "running" },
    })
}

/// A user as RabbitMQ lists it, with its limits (`limits`: [`super::user_limits::export`]).
fn user_json(
    u: &triad_core::auth::UserEntry,
    limits: &std::collections::HashMap<String, Value>,
) -> Value {
    json!({
        "name": u.name,
        "password_hash": u.password_hash,
        "hashing_algorithm": "rabbit_password_hashing_sha256",
        "tags": u.tags,
        "limits": limits.get(&u.name).cloned().unwrap_or_else(|| json!({})),
    })
}

fn perm_json(p: &triad_core::auth::PermissionEntry) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

fn topic_json(t: &triad_core::auth::TopicPermissionEntry) -> Value {
    json!({"user": t.user, "vhost": t.vhost, "exchange": t.exchange, "write": t.write, "read": t.read})
}

/// A vhost's queues, sorted, without the broker's own (reserved names: its MQTT
/// state), which no client can address.
pub fn queue_names(vh: &Vhost) -> Vec<String> {
    let mut names = vh.queue_names();
    names.retain(|n| !triad_core::reserved::is_reserved_queue(n));
    names.sort_unstable();
    names
}

/// Queues of the listed vhosts as (vhost, name) keys, sorted.
fn queue_keys(api: &Api, vhosts: &[String]) -> Vec<(Arc<Vhost>, String)> {
    let mut keys = Vec::new();
    for v in vhosts {
        if let Ok(vh) = api.broker().vhost(v) {
            let names = queue_names(&vh);
            keys.extend(names.into_iter().map(|n| (Arc::clone(&vh), n)));
        }
    }
    keys
}

fn list_queues(api: &Api, vhosts: Vec<String>) -> ApiResult {
    let q = ListQuery::parse(&api.params)?;
    let keys = queue_keys(api, &vhosts);
    respond(
        q,
        keys,
        |(_, n)| n.as_str(),
        |(vh, n)| vh.queue(n).map(|q| queue_json(vh.name(), &q)),
    )
}

fn list_exchanges(api: &Api, vhosts: Vec<String>) -> ApiResult {
    let q = ListQuery::parse(&api.params)?;
    let mut items = Vec::new();
    // one reading of each vhost's counters per listing
    let mut stats = HashMap::new();
    for v in vhosts {
        if let Ok(vh) = api.broker().vhost(&v) {
            let mut xs = vh.exchanges();
            xs.sort_by(|a, b| a.name.cmp(&b.name));
            items.extend(xs.into_iter().map(|x| (v.clone(), x)));
            let names: Vec<&str> = items
                .iter()
                .filter(|(iv, _)| *iv == v)
                .map(|(_, x)| x.name.as_str())
                .collect();
            let read = vh.exchange_stats().read(names);
            stats.insert(v, read);
        }
    }
    let none = HashMap::new();
    respond(
        q,
        items,
        |(_, x)| x.name.as_str(),
        move |(v, x)| Some(exchange_json(v, x, stats.get(v).unwrap_or(&none))),
    )
}

fn list_bindings(api: &Api, vhost: &str, filter: impl Fn(&Binding) -> bool) -> ApiResult {
    let q = ListQuery::parse(&api.params)?;
    let vh = api.vhost_read(vhost)?;
    let items: Vec<Binding> = vhost_bindings(&vh)
        .into_iter()
        .filter(|b| filter(b))
        .collect();
    let v = vhost.to_owned();
    respond(
        q,
        items,
        |b| b.source.as_str(),
        move |b| Some(binding_json(&v, b)),
    )
}

fn list_all_bindings(api: &Api, vhosts: Vec<String>) -> ApiResult {
    let q = ListQuery::parse(&api.params)?;
    let mut items = Vec::new();
    for v in vhosts {
        if let Ok(vh) = api.broker().vhost(&v) {
            items.extend(vhost_bindings(&vh).into_iter().map(|b| (v.clone(), b)));
        }
    }
    respond(
        q,
        items,
        |(_, b)| b.source.as_str(),
        |(v, b)| Some(binding_json(v, b)),
    )
}

/// The connections the user may see (monitoring: all; others: their own).
pub fn visible_connections(api: &Api) -> Vec<Arc<ConnInfo>> {
    let all = api.broker().connections().list();
    if api.is_monitor() {
        return all;
    }
    all.into_iter()
        .filter(|c| c.login().is_some_and(|l| l.user == api.user.name))
        .collect()
}

/// A connection the user may see, by name: one lookup ([`triad_core::conns::Registry::by_name`]),
/// not a scan; 404 when it is not there or not the user's (unless monitoring).
pub fn visible_connection(api: &Api, name: &str) -> Result<Arc<ConnInfo>, ApiError> {
    let c = api
        .broker()
        .connections()
        .by_name(name)
        .ok_or_else(ApiError::not_found)?;
    if api.is_monitor() || c.login().is_some_and(|l| l.user == api.user.name) {
        Ok(c)
    } else {
        Err(ApiError::not_found())
    }
}

fn list_connections(api: &Api, vhost: Option<&str>) -> ApiResult {
    let q = ListQuery::parse(&api.params)?;
    let mut items: Vec<(String, Arc<ConnInfo>)> = visible_connections(api)
        .into_iter()
        .filter(|c| vhost.is_none_or(|v| c.login().and_then(|l| l.vhost).is_some_and(|cv| cv == v)))
        .map(|c| (c.name(), c))
        .collect();
    items.sort_by(|a, b| a.0.cmp(&b.0));
    respond(
        q,
        items,
        |(n, _)| n.as_str(),
        |(_, c)| Some(connection_json(c)),
    )
}

fn list_consumers(api: &Api, vhosts: Vec<String>) -> ApiResult {
    let q = ListQuery::parse(&api.params)?;
    // one map per listing: a lookup per consumer, not a scan of the connections
    let by_core_id: std::collections::HashMap<_, _> = api
        .broker()
        .connections()
        .list()
        .into_iter()
        .filter_map(|c| Some((c.core_id()?, c)))
        .collect();
    let mut items = Vec::new();
    for (vh, name) in queue_keys(api, &vhosts) {
        if let Some(queue) = vh.queue(&name) {
            for c in queue.consumers() {
                items.push((vh.name().to_owned(), name.clone(), c));
            }
        }
    }
    respond(
        q,
        items,
        |(_, _, c)| &*c.tag,
        move |(v, qn, c)| {
            let conn = by_core_id.get(&c.conn);
            let details = conn.as_ref().map_or(Value::Null, |conn| {
                let login = conn.login();
                json!({
                    "connection_name": conn.name(),
                    "name": conn.name(),
                    "node": node_name(),
                    "peer_host": conn.peer.ip().to_string(),
                    "peer_port": conn.peer.port(),
                    "user": login.map(|l| l.user),
                })
            });
            Some(json!({
                "consumer_tag": &*c.tag,
                "queue": {"name": qn, "vhost": v},
                "channel_details": details,
                "ack_required": !c.no_ack,
                "exclusive": c.exclusive,
                "prefetch_count": c.prefetch,
                "active": true,
                "activity_status": "up",
                "arguments": if c.priority != 0 { json!({"x-priority": c.priority}) } else { json!({}) },
            }))
        },
    )
}

fn overview(api: &Api) -> ApiResult {
    let vhosts = api.visible_vhosts();
    let (mut queues, mut exchanges, mut consumers) = (0u64, 0u64, 0u64);
    let (mut ready, mut unacked) = (0u64, 0u64);
    let (mut values, mut rates) = ([0u64; 8], [0f64; 8]);
    for v in &vhosts {
        if let Ok(vh) = api.broker().vhost(v) {
            // one pass over the vhost's queues
            let t = vh.totals();
            for (a, b) in values.iter_mut().zip(t.values) {
                *a = a.wrapping_add(b);
            }
            for (a, b) in rates.iter_mut().zip(t.rates) {
                *a += b;
            }
            exchanges += vh.exchanges().len() as u64;
            queues += t.queues;
            consumers += t.consumers;
            ready += t.ready;
            unacked += t.unacked;
        }
    }
    let connections = super::read::visible_connections(api).len();
    let listeners: Vec<Value> = api
        .ctx
        .http
        .listeners()
        .iter()
        .map(|(proto, addr)| {
            json!({"node": node_name(), "protocol": proto.as_str(), "ip_address": addr.ip().to_string(), "port": addr.port()})
        })
        .collect();
    ok_json(&json!({
        "management_version": env!("CARGO_PKG_VERSION"),
        "product_name": "Triad",
        "product_version": env!("CARGO_PKG_VERSION"),
        "rates_mode": "basic",
        // `publish`: messages clients published; the others summed over the queues
        "message_stats": message_stats_json(&values, &rates),
        "cluster_name": node_name(),
        "node": node_name(),
        "exchange_types": exchange_types(),
        "listeners": listeners,
        "object_totals": {
            "connections": connections,
            "queues": queues,
            "exchanges": exchanges,
            "consumers": consumers,
        },
        "queue_totals": {
            "messages": ready + unacked,
            "messages_ready": ready,
            "messages_unacknowledged": unacked,
        },
    }))
}

fn exchange_types() -> Value {
    ["direct", "fanout", "headers", "topic"]
        .iter()
        .map(|t| json!({"name": t, "enabled": true}))
        .collect()
}

fn node_json(api: &Api) -> Value {
    let alarms = api.broker().current_alarms();
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map(|pages| pages * 4096);
    json!({
        "name": node_name(),
        "type": "disc",
        "running": true,
        "os_pid": std::process::id().to_string(),
        "mem_used": rss,
        "mem_alarm": alarms.memory,
        "disk_free_alarm": alarms.disk,
        "disk_free_limit": api.ctx.config.limits.disk_free_limit.bytes(),
        "processors": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "exchange_types": exchange_types(),
    })
}

fn whoami(api: &Api) -> Value {
    json!({"name": api.user.name, "tags": api.user.tags})
}

/// `/api/health/checks/...`.
fn health(api: &Api, rest: &[&str]) -> ApiResult {
    let failed = |v: Value| {
        Ok(crate::http::json_response(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            v.to_string(),
        ))
    };
    match rest {
        ["alarms"] | ["local-alarms"] => {
            let a = api.broker().current_alarms();
            let mut alarms = Vec::new();
            if a.memory {
                alarms.push(json!({"node": node_name(), "resource": "memory"}));
            }
            if a.disk {
                alarms.push(json!({"node": node_name(), "resource": "disk"}));
            }
            if let Err(e) = api.broker().store().health() {
                return failed(json!({"status": "failed", "reason": format!("store failed: {e}")}));
            }
            if alarms.is_empty() {
                ok_json(&json!({"status": "ok"}))
            } else {
                failed(
                    json!({"status": "failed", "reason": "resource alarm(s) in effect", "alarms": alarms}),
                )
            }
        }
        ["port-listener", port] => {
            let port: u16 = port
                .parse()
                .map_err(|_| ApiError::bad_request(format!("invalid port '{port}'")))?;
            let ports: Vec<u16> = api
                .ctx
                .http
                .listeners()
                .iter()
                .map(|(_, a)| a.port())
                .collect();
            if ports.contains(&port) {
                ok_json(&json!({"status": "ok", "port": port}))
            } else {
                failed(
                    json!({"status": "failed", "reason": "No active listener", "missing": port, "ports": ports}),
                )
            }
        }
        _ => Err(ApiError::not_found()),
    }
}

fn find<T>(items: Vec<T>, pred: impl Fn(&T) -> bool) -> Result<T, ApiError> {
    items.into_iter().find(pred).ok_or_else(ApiError::not_found)
}

/// Every GET.
pub fn get(api: &Api, path: &[&str]) -> ApiResult {
    match path {
        ["overview"] => overview(api),
        ["whoami"] => ok_json(&whoami(api)),
        ["stream-offsets", v, q] => super::streams::list(api, v, q),
        ["extensions"] => ok_json(&json!([])),
        ["cluster"] => {
            api.require_monitor()?;
            ok_json(&super::cluster::json(&api.ctx))
        }
        ["nodes"] => {
            api.require_monitor()?;
            ok_json(&json!([node_json(api)]))
        }
        ["nodes", name] => {
            api.require_monitor()?;
            if *name != node_name() {
                return Err(ApiError::not_found());
            }
            ok_json(&node_json(api))
        }
        ["health", "checks", rest @ ..] => health(api, rest),
        ["vhosts", ..] => get_vhosts(api, path),
        ["channels"] => super::channels::all(api),
        ["channels", name] => super::channels::one(api, name),
        ["connections", name, "channels"] => super::channels::of_connection(api, name),
        ["queues" | "exchanges" | "bindings", ..] => get_topology(api, path),
        ["connections"] => list_connections(api, None),
        ["connections", name] => {
            let c = visible_connection(api, name)?;
            ok_json(&connection_json(&c))
        }
        ["consumers"] => list_consumers(api, api.visible_vhosts()),
        ["consumers", v] => {
            api.vhost_read(v)?;
            list_consumers(api, vec![(*v).to_owned()])
        }
        ["users" | "permissions" | "topic-permissions", ..] => get_access(api, path),
        ["messages", rest @ ..] => super::messages::get(api, rest),
        ["user-limits"] => super::user_limits::get(api, None),
        ["user-limits", u] => super::user_limits::get(api, Some(u)),
        ["policies"] => super::policies::get(api, None, None),
        ["policies", v] => super::policies::get(api, Some(v), None),
        ["policies", v, name] => super::policies::get(api, Some(v), Some(name)),
        ["definitions"] => {
            api.require_admin()?;
            Ok(super::defs::export(api, None))
        }
        ["definitions", v] => {
            api.require_admin()?;
            api.vhost_read(v)?;
            Ok(super::defs::export(api, Some(v)))
        }
        _ => Err(ApiError::not_found()),
    }
}

/// GET `/vhosts...`: vhosts, their permissions, connections and channels.
fn get_vhosts(api: &Api, path: &[&str]) -> ApiResult {
    let auth = api.broker().auth();
    match path {
        ["vhosts"] => {
            let q = ListQuery::parse(&api.params)?;
            let names = api.visible_vhosts();
            let me = Api {
                ctx: api.ctx.clone(),
                user: api.user.clone(),
                peer: api.peer,
                params: Vec::new(),
            };
            respond(q, names, |n| n.as_str(), move |n| Some(vhost_json(&me, n)))
        }
        ["vhosts", v] => {
            api.vhost_read(v)?;
            ok_json(&vhost_json(api, v))
        }
        ["vhosts", v, "permissions"] => {
            api.require_admin()?;
            api.vhost_read(v)?;
            let items: Vec<Value> = auth
                .permissions()
                .iter()
                .filter(|p| p.vhost == *v)
                .map(perm_json)
                .collect();
            ok_json(&json!(items))
        }
        ["vhosts", v, "topic-permissions"] => {
            api.require_admin()?;
            api.vhost_read(v)?;
            let items: Vec<Value> = auth
                .topic_permissions()
                .iter()
                .filter(|p| p.vhost == *v)
                .map(topic_json)
                .collect();
            ok_json(&json!(items))
        }
        ["vhosts", v, "connections"] => {
            api.vhost_read(v)?;
            list_connections(api, Some(v))
        }
        ["vhosts", v, "channels"] => super::channels::of_vhost(api, v),
        _ => Err(ApiError::not_found()),
    }
}

/// GET `/queues...`, `/exchanges...` and `/bindings...`.
fn get_topology(api: &Api, path: &[&str]) -> ApiResult {
    match path {
        ["queues"] => list_queues(api, api.visible_vhosts()),
        ["queues", v] => {
            api.vhost_read(v)?;
            list_queues(api, vec![(*v).to_owned()])
        }
        ["queues", v, q] => {
            let vh = api.vhost_read(v)?;
            let queue = vh
                .queue(q)
                .filter(|_| !triad_core::reserved::is_reserved_queue(q))
                .ok_or_else(ApiError::not_found)?;
            let mut j = queue_json(v, &queue);
            let consumers: Vec<Value> = queue
                .consumers()
                .iter()
                .map(|c| json!({"consumer_tag": &*c.tag, "ack_required": !c.no_ack, "exclusive": c.exclusive, "prefetch_count": c.prefetch}))
                .collect();
            j["consumer_details"] = json!(consumers);
            ok_json(&j)
        }
        ["queues", v, q, "bindings"] => {
            let vh = api.vhost_read(v)?;
            vh.queue(q).ok_or_else(ApiError::not_found)?;
            list_bindings(
                api,
                v,
                |b| matches!(&b.destination, Destination::Queue(d) if &**d == *q),
            )
        }
        ["exchanges"] => list_exchanges(api, api.visible_vhosts()),
        ["exchanges", v] => {
            api.vhost_read(v)?;
            list_exchanges(api, vec![(*v).to_owned()])
        }
        ["exchanges", v, x] => {
            let vh = api.vhost_read(v)?;
            let name = if *x == "amq.default" { "" } else { x };
            let def = find(vh.exchanges(), |d| d.name == name)?;
            ok_json(&exchange_json(v, &def, &vh.exchange_stats().read([name])))
        }
        ["exchanges", v, x, "bindings", dir @ ("source" | "destination")] => {
            let vh = api.vhost_read(v)?;
            let name = if *x == "amq.default" { "" } else { x };
            if !vh.has_exchange(name) {
                return Err(ApiError::not_found());
            }
            let source = *dir == "source";
            list_bindings(api, v, |b| {
                if source {
                    b.source == name
                } else {
                    matches!(&b.destination, Destination::Exchange(d) if &**d == name)
                }
            })
        }
        ["bindings"] => list_all_bindings(api, api.visible_vhosts()),
        ["bindings", v] => list_bindings(api, v, |_| true),
        ["bindings", v, "e", src, kind @ ("q" | "e"), dst] => {
            let vh = api.vhost_read(v)?;
            check_ends(&vh, src, kind, dst)?;
            list_bindings(api, v, |b| binding_between(b, src, kind, dst))
        }
        ["bindings", v, "e", src, kind @ ("q" | "e"), dst, props] => {
            let vh = api.vhost_read(v)?;
            let b = find(vhost_bindings(&vh), |b| {
                binding_between(b, src, kind, dst) && properties_key(b) == *props
            })?;
            ok_json(&binding_json(v, &b))
        }
        _ => Err(ApiError::not_found()),
    }
}

/// GET `/users...`, `/permissions...` and `/topic-permissions...`.
fn get_access(api: &Api, path: &[&str]) -> ApiResult {
    let auth = api.broker().auth();
    match path {
        ["users"] => {
            api.require_admin()?;
            let limits = super::user_limits::export(api);
            let q = ListQuery::parse(&api.params)?;
            let mut users = auth.users();
            users.sort_by(|a, b| a.name.cmp(&b.name));
            respond(
                q,
                users,
                |u| u.name.as_str(),
                move |u| Some(user_json(u, &limits)),
            )
        }
        ["users", "without-permissions"] => {
            api.require_admin()?;
            let perms = auth.permissions();
            let limits = super::user_limits::export(api);
            let items: Vec<Value> = auth
                .users()
                .iter()
                .filter(|u| !perms.iter().any(|p| p.user == u.name))
                .map(|u| user_json(u, &limits))
                .collect();
            ok_json(&json!(items))
        }
        ["users", u] => {
            api.require_admin()?;
            let limits = super::user_limits::export(api);
            ok_json(&user_json(&find(auth.users(), |x| x.name == *u)?, &limits))
        }
        ["users", u, "permissions"] => {
            api.require_admin()?;
            find(auth.users(), |x| x.name == *u)?;
            let items: Vec<Value> = auth
                .permissions()
                .iter()
                .filter(|p| p.user == *u)
                .map(perm_json)
                .collect();
            ok_json(&json!(items))
        }
        ["users", u, "topic-permissions"] => {
            api.require_admin()?;
            find(auth.users(), |x| x.name == *u)?;
            let items: Vec<Value> = auth
                .topic_permissions()
                .iter()
                .filter(|p| p.user == *u)
                .map(topic_json)
                .collect();
            ok_json(&json!(items))
        }
        ["permissions"] => {
            api.require_admin()?;
            // listed by user name (the `name` filter and the order), then vhost
            let q = ListQuery::parse(&api.params)?;
            let mut perms = auth.permissions();
            perms.sort_by(|a, b| (&a.user, &a.vhost).cmp(&(&b.user, &b.vhost)));
            respond(q, perms, |p| p.user.as_str(), |p| Some(perm_json(p)))
        }
        ["permissions", v, u] => {
            api.require_admin()?;
            ok_json(&perm_json(&find(auth.permissions(), |p| {
                p.vhost == *v && p.user == *u
            })?))
        }
        ["topic-permissions"] => {
            api.require_admin()?;
            let q = ListQuery::parse(&api.params)?;
            let mut perms = auth.topic_permissions();
            perms.sort_by(|a, b| {
                (&a.user, &a.vhost, &a.exchange).cmp(&(&b.user, &b.vhost, &b.exchange))
            });
            respond(q, perms, |p| p.user.as_str(), |p| Some(topic_json(p)))
        }
        ["topic-permissions", v, u] => {
            api.require_admin()?;
            let items: Vec<Value> = auth
                .topic_permissions()
                .iter()
                .filter(|p| p.vhost == *v && p.user == *u)
                .map(topic_json)
                .collect();
            if items.is_empty() {
                return Err(ApiError::not_found());
            }
            ok_json(&json!(items))
        }
        _ => Err(ApiError::not_found()),
    }
}

/// Whether a binding goes from exchange `src` to the queue (`q`) or exchange (`e`) `dst`.
pub fn binding_between(b: &Binding, src: &str, kind: &str, dst: &str) -> bool {
    let src = if src == "amq.default" { "" } else { src };
    b.source == src
        && match (&b.destination, kind) {
            (Destination::Queue(d), "q") | (Destination::Exchange(d), "e") => &**d == dst,
            _ => false,
        }
}

/// 404 unless both ends of a binding URL exist.
pub fn check_ends(vh: &Vhost, src: &str, kind: &str, dst: &str) -> Result<(), ApiError> {
    let src = if src == "amq.default" { "" } else { src };
    let dst_exists = match kind {
        "q" => vh.queue(dst).is_some(),
        _ => vh.has_exchange(dst),
    };
    if vh.has_exchange(src) && dst_exists {
        Ok(())
    } else {
        Err(ApiError::not_found())
    }
}
