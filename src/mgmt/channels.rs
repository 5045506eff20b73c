//! `/api/channels`, `/api/channels/{name}`, `/api/connections/{name}/channels` and
//! `/api/vhosts/{vhost}/channels`, in RabbitMQ's shape.
//!
//! AMQP channels are registered by the connection's task as they open
//! ([`triad_core::conns::open_channel`]) with the figures listed here (mode, prefetch,
//! consumers, unacknowledged deliveries), kept up to date with relaxed stores. A STOMP
//! or MQTT connection is listed as one channel, number 1, as RabbitMQ's plugins show the
//! channel they open per connection; Triad keeps no per-channel figures for those, so
//! their entries carry only the names, user, vhost and state (no counts).
//!
//! A channel's name is its connection's name and ` (number)`, as RabbitMQ's.

use std::sync::Arc;

use serde_json::{json, Value};
use triad_core::conns::{ChannelMode, ChannelStats, ConnInfo};

use super::list::{respond, ListQuery};
use super::read::{visible_connection, visible_connections};
use super::{node_name, ok_json, Api, ApiError, ApiResult};

/// One channel of a listing: its connection and, for AMQP, its entry.
struct Item {
    name: String,
    conn: Arc<ConnInfo>,
    stats: Option<Arc<ChannelStats>>,
}

fn channel_name(conn: &ConnInfo, number: u16) -> String {
    format!("{} ({number})", conn.name())
}

/// The channels of `conn`: its AMQP channels, or one for a STOMP or MQTT connection.
fn channels_of(conn: &Arc<ConnInfo>, out: &mut Vec<Item>) {
    if conn.protocol == "amqp" {
        out.extend(conn.channels().into_iter().map(|s| Item {
            name: channel_name(conn, s.number()),
            conn: Arc::clone(conn),
            stats: Some(s),
        }));
    } else {
        out.push(Item {
            name: channel_name(conn, 1),
            conn: Arc::clone(conn),
            stats: None,
        });
    }
}

fn channel_json(item: &Item) -> Value {
    let c = &item.conn;
    let login = c.login();
    let mut v = json!({
        "name": item.name,
        "number": item.stats.as_ref().map_or(1, |s| s.number()),
        "node": node_name(),
        "state": "running",
        "user": login.as_ref().map(|l| l.user.clone()),
        "vhost": login.as_ref().and_then(|l| l.vhost.clone()),
        "connection_details": {
            "name": c.name(),
            "peer_host": c.peer.ip().to_string(),
            "peer_port": c.peer.port(),
        },
    });
    if let Some(s) = &item.stats {
        let mode = s.mode();
        let (prefetch, global) = s.prefetch();
        v["confirm"] = json!(mode == ChannelMode::Confirm);
        v["transactional"] = json!(mode == ChannelMode::Tx);
        v["prefetch_count"] = json!(prefetch);
        v["global_prefetch_count"] = json!(global);
        v["consumer_count"] = json!(s.consumers());
        v["messages_unacknowledged"] = json!(s.unacked());
    }
    v
}

fn list(api: &Api, conns: Vec<Arc<ConnInfo>>) -> ApiResult {
    let q = ListQuery::parse(&api.params)?;
    let mut items = Vec::new();
    for c in &conns {
        channels_of(c, &mut items);
    }
    items.sort_by(|a, b| a.name.cmp(&b.name));
    respond(q, items, |i| i.name.as_str(), |i| Some(channel_json(i)))
}

/// `GET /api/channels`.
pub fn all(api: &Api) -> ApiResult {
    list(api, visible_connections(api))
}

/// `GET /api/vhosts/{vhost}/channels`.
pub fn of_vhost(api: &Api, vhost: &str) -> ApiResult {
    api.vhost_read(vhost)?;
    let conns = visible_connections(api)
        .into_iter()
        .filter(|c| c.login().and_then(|l| l.vhost).as_deref() == Some(vhost))
        .collect();
    list(api, conns)
}

/// `GET /api/connections/{name}/channels`.
pub fn of_connection(api: &Api, conn: &str) -> ApiResult {
    let c = visible_connection(api, conn)?;
    list(api, vec![c])
}

/// `GET /api/channels/{name}`: the connection by the name's part before the last
/// ` (number)`, then the channel.
pub fn one(api: &Api, name: &str) -> ApiResult {
    let (conn, number) = name
        .strip_suffix(')')
        .and_then(|s| s.rsplit_once(" ("))
        .and_then(|(c, n)| Some((c, n.parse::<u16>().ok()?)))
        .ok_or_else(ApiError::not_found)?;
    let c = visible_connection(api, conn)?;
    let mut items = Vec::new();
    channels_of(&c, &mut items);
    let item = items
        .into_iter()
        .find(|i| i.stats.as_ref().map_or(1, |s| s.number()) == number)
        .ok_or_else(ApiError::not_found)?;
    ok_json(&channel_json(&item))
}
