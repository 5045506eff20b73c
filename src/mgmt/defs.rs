//! Definitions: `GET /api/definitions[/{vhost}]` exports users, vhosts, permissions,
//! topic permissions, policies, queues, exchanges and bindings in RabbitMQ's format;
//! `POST /api/definitions[/{vhost}]` imports such a file, password hashes included,
//! so that moving from RabbitMQ is one command.
//!
//! What an import does not take is refused before anything is changed (400 naming it):
//! operator policies, runtime parameters (shovels, federation), vhost limits, and
//! password hashes of another algorithm than SHA-256 (user limits are imported). RabbitMQ's own
//! `cluster_name` and `internal_cluster_id` global parameters, which every RabbitMQ
//! export carries, are skipped with a log line: a single Triad node has no cluster; so
//! are vhost descriptions and tags (RabbitMQ's default vhost always has one).

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value};
use triad_core::auth::{PermissionEntry, TopicPermissionEntry};
use triad_core::policy::Policy;
use triad_core::{
    Broker, ExchangeDef, ExchangeKind, FieldTable, PasswordHash, QueueDeclare, UserConfig, Vhost,
};

use super::json::{boolean, json_table, table_json, tags};
use super::list::Chunks;
use super::write::SHA256;
use super::{Api, ApiError};

/// Streams the definitions of the broker (or of one vhost, without users and vhosts)
/// section by section, one entity at a time: 100,000 queues cost one item's JSON.
pub fn export(api: &Api, only: Option<&str>) -> hyper::Response<crate::http::Body> {
    let api = api.clone();
    let only = only.map(str::to_owned);
    super::list::stream(move |out| write_export(&api, only.as_deref(), out))
}

/// Writes `"name":[items...]`, preceded by a comma.
fn section(out: &mut Chunks, name: &str, items: impl Iterator<Item = Value>) {
    out.put(format!(",\"{name}\":[").as_bytes());
    let mut first = true;
    for v in items {
        if out.gone() {
            return;
        }
        if !first {
            out.put(b",");
        }
        first = false;
        out.value(&v);
    }
    out.put(b"]");
}

fn write_export(api: &Api, only: Option<&str>, out: &mut Chunks) {
    let vhosts: Vec<String> = match only {
        Some(v) => vec![v.to_owned()],
        None => api.broker().vhost_names(),
    };
    out.put(
        format!(
            r#"{{"product_name":"Triad","product_version":"{}""#,
            env!("CARGO_PKG_VERSION")
        )
        .as_bytes(),
    );
    if only.is_none() {
        export_access(api, &vhosts, out);
        section(out, "global_parameters", std::iter::empty());
    }
    section(out, "parameters", std::iter::empty());
    let vhs: Vec<_> = vhosts
        .iter()
        .filter_map(|v| api.broker().vhost(v).ok())
        .collect();
    export_policies(&vhs, only, out);
    export_queues(&vhs, only, out);
    export_exchanges(&vhs, only, out);
    export_bindings(&vhs, only, out);
    out.put(b"}");
}

/// An exported entity of `vhost`: named with its vhost in a whole-broker export.
fn with_vhost(mut j: Value, vhost: &str, only: Option<&str>) -> Value {
    if only.is_none() {
        j["vhost"] = json!(vhost);
    }
    j
}

/// The whole-broker sections: users (with their limits), vhosts, permissions and topic
/// permissions.
fn export_access(api: &Api, vhosts: &[String], out: &mut Chunks) {
    let auth = api.broker().auth();
    let limits = super::user_limits::export(api);
    section(
        out,
        "users",
        auth.users().into_iter().map(|u| {
            let l = limits.get(&u.name).cloned().unwrap_or_else(|| json!({}));
            json!({"name": u.name, "password_hash": u.password_hash,
                "hashing_algorithm": SHA256, "tags": u.tags, "limits": l})
        }),
    );
    section(
        out,
        "vhosts",
        vhosts
            .iter()
            .map(|v| json!({"name": v, "limits": [], "metadata": {"description": "", "tags": []}})),
    );
    section(
        out,
        "permissions",
        auth.permissions().into_iter().map(|p| {
            json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
        }),
    );
    section(
        out,
        "topic_permissions",
        auth.topic_permissions().into_iter().map(|t| {
            json!({"user": t.user, "vhost": t.vhost, "exchange": t.exchange, "write": t.write, "read": t.read})
        }),
    );
}

/// The vhosts' policies, by name.
fn export_policies(vhs: &[Arc<Vhost>], only: Option<&str>, out: &mut Chunks) {
    section(
        out,
        "policies",
        vhs.iter().flat_map(|vh| {
            let mut ps = vh.policies();
            ps.sort_by(|a, b| a.name.cmp(&b.name));
            ps.into_iter().map(|p| {
                let mut j = p.to_json();
                if only.is_some() {
                    if let Some(m) = j.as_object_mut() {
                        m.remove("vhost");
                    }
                }
                j
            })
        }),
    );
}

/// The vhosts' queues other than exclusive ones.
fn export_queues(vhs: &[Arc<Vhost>], only: Option<&str>, out: &mut Chunks) {
    section(
        out,
        "queues",
        vhs.iter().flat_map(|vh| {
            super::read::queue_names(vh).into_iter().filter_map(move |n| {
                let q = vh.queue(&n)?;
                // as RabbitMQ: exclusive queues die with their connection
                if q.exclusive_owner().is_some() {
                    return None;
                }
                Some(with_vhost(
                    json!({"name": n, "durable": q.durable(), "auto_delete": q.auto_delete(), "arguments": table_json(q.arguments())}),
                    vh.name(),
                    only,
                ))
            })
        }),
    );
}

/// The vhosts' exchanges other than the default and `amq.` ones, by name.
fn export_exchanges(vhs: &[Arc<Vhost>], only: Option<&str>, out: &mut Chunks) {
    section(
        out,
        "exchanges",
        vhs.iter().flat_map(|vh| {
            let mut xs = vh.exchanges();
            xs.sort_by(|a, b| a.name.cmp(&b.name));
            xs.into_iter()
                .filter(|x| !x.name.is_empty() && !x.name.starts_with("amq."))
                .map(|x| {
                    with_vhost(
                        json!({"name": x.name, "type": x.kind.as_str(), "durable": x.durable,
                            "auto_delete": x.auto_delete, "internal": x.internal, "arguments": table_json(&x.arguments)}),
                        vh.name(),
                        only,
                    )
                })
                .collect::<Vec<_>>()
        }),
    );
}

/// The vhosts' bindings other than the default exchange's.
fn export_bindings(vhs: &[Arc<Vhost>], only: Option<&str>, out: &mut Chunks) {
    section(
        out,
        "bindings",
        vhs.iter().flat_map(|vh| {
            let mut bs = vh.bindings();
            bs.retain(|b| !b.source.is_empty());
            bs.into_iter().map(move |b| {
                let (dtype, dest) = match &b.destination {
                    triad_core::Destination::Queue(q) => ("queue", q.to_string()),
                    triad_core::Destination::Exchange(x) => ("exchange", x.to_string()),
                };
                with_vhost(
                    json!({"source": b.source, "destination": dest, "destination_type": dtype,
                        "routing_key": b.routing_key, "arguments": table_json(&b.arguments)}),
                    vh.name(),
                    only,
                )
            })
        }),
    );
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Defs {
    users: Vec<Value>,
    vhosts: Vec<Value>,
    permissions: Vec<Value>,
    topic_permissions: Vec<Value>,
    parameters: Vec<Value>,
    global_parameters: Vec<Value>,
    policies: Vec<Value>,
    operator_policies: Vec<Value>,
    queues: Vec<Value>,
    exchanges: Vec<Value>,
    bindings: Vec<Value>,
}

fn bad(e: impl Into<String>) -> ApiError {
    ApiError::bad_request(e)
}

fn s<'a>(v: &'a Value, k: &str, what: &str) -> Result<&'a str, ApiError> {
    v.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("{what}: '{k}' is missing or not a string")))
}

/// A user entry, checked.
fn user_entry(u: &Value) -> Result<UserConfig, ApiError> {
    let name = s(u, "name", "users")?;
    match u.get("hashing_algorithm").and_then(Value::as_str) {
        None | Some(SHA256) => {}
        Some(other) => {
            return Err(bad(format!(
                "user '{name}': hashing_algorithm '{other}' is not supported (Triad stores {SHA256} hashes)"
            )))
        }
    }
    let hash = match (
        u.get("password_hash").and_then(Value::as_str),
        u.get("password").and_then(Value::as_str),
    ) {
        (_, Some(p)) => PasswordHash::new(p).map_err(|e| bad(e.to_string()))?,
        (Some(h), None) if !h.is_empty() => {
            PasswordHash::parse(h).map_err(|e| bad(format!("user '{name}': password_hash: {e}")))?
        }
        _ => return Err(bad(format!("user '{name}': no password_hash"))),
    };
    let tags = tags(u.get("tags")).map_err(|e| bad(format!("user '{name}': {e}")))?;
    Ok(UserConfig {
        name: name.to_owned(),
        password_hash: hash,
        tags,
    })
}

/// Imports `body`; with `only`, every entity goes into that vhost.
pub fn import(api: &Api, only: Option<&str>, body: &Value) -> Result<(), ApiError> {
    let d: Defs = serde_json::from_value(body.clone())
        .map_err(|e| bad(format!("not a definitions file: {e}")))?;
    refuse_untaken(&d)?;
    let users = d
        .users
        .iter()
        .map(|u| {
            let e = user_entry(u)?;
            let limits = super::user_limits::parse(&e.name, u.get("limits"))?;
            Ok((e, limits))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let policies = d
        .policies
        .iter()
        .map(|p| {
            let vhost = vhost_of(only, p, "policies")?;
            let name = s(p, "name", "policies")?;
            super::policies::policy(&vhost, name, p)
                .map_err(|e| bad(format!("policy '{name}': {}", e.reason)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let broker = api.broker();
    import_access(broker, only, &d, users)?;
    import_topology(broker, only, &d, policies)?;
    tracing::info!(by = %api.user.name, vhost = ?only, "definitions imported");
    Ok(())
}

/// Refuses, before anything is changed, what an import does not take: operator
/// policies, runtime parameters, vhost limits, global parameters other than RabbitMQ's
/// cluster ones (skipped with a log line).
fn refuse_untaken(d: &Defs) -> Result<(), ApiError> {
    // refuse what is not taken before changing anything
    if !d.operator_policies.is_empty() {
        return Err(ApiError::not_implemented(
            "the definitions contain operator policies, which Triad does not implement; remove them (or make them policies) and import again",
        ));
    }
    if !d.parameters.is_empty() {
        return Err(ApiError::not_implemented(
            "the definitions contain runtime parameters (shovels, federation, ...), which Triad does not implement",
        ));
    }
    // limits: Triad has no per-vhost limits (user limits are imported below); a file
    // that sets any is refused, never half-imported
    let has_limits = |v: &Value| match v.get("limits") {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    };
    if let Some(e) = d.vhosts.iter().find(|e| has_limits(e)) {
        let name = e.get("name").and_then(Value::as_str).unwrap_or("");
        return Err(bad(format!(
            "vhost '{name}' has limits {}, which are not imported: Triad has no per-vhost limits (limits.max_queues_per_vhost in the configuration applies to every vhost); remove them and import again",
            e.get("limits").unwrap_or(&Value::Null)
        )));
    }
    for g in &d.global_parameters {
        match g.get("name").and_then(Value::as_str) {
            Some("cluster_name") | Some("internal_cluster_id") => {
                tracing::info!(parameter = ?g.get("name"), "definitions import: RabbitMQ cluster parameter skipped (a Triad node has no cluster)")
            }
            other => {
                return Err(ApiError::not_implemented(format!(
                    "global parameter {other:?} is not implemented"
                )))
            }
        }
    }
    Ok(())
}

/// The vhost an imported entity goes into: `only`, else its own `vhost`.
fn vhost_of(only: Option<&str>, v: &Value, what: &str) -> Result<String, ApiError> {
    match only {
        Some(o) => Ok(o.to_owned()),
        None => s(v, "vhost", what).map(str::to_owned),
    }
}

/// An entity's boolean `k` (`default` when absent).
fn flag(v: &Value, k: &str, default: bool) -> Result<bool, ApiError> {
    boolean(v.get(k), default).map_err(|e| bad(format!("{k}: {e}")))
}

/// An entity's `arguments` as a field table.
fn table(v: &Value) -> Result<FieldTable, ApiError> {
    json_table(v.get("arguments").unwrap_or(&Value::Null)).map_err(bad)
}

/// Imports the users (checked, with their limits), vhosts, permissions and topic
/// permissions.
fn import_access(
    broker: &Broker,
    only: Option<&str>,
    d: &Defs,
    users: Vec<(UserConfig, Vec<(&'static str, u32)>)>,
) -> Result<(), ApiError> {
    for (u, limits) in users {
        let name = u.name.clone();
        broker.auth().put_user(u)?;
        if !limits.is_empty() {
            let changes: Vec<(&str, Option<u32>)> =
                limits.iter().map(|(l, v)| (*l, Some(*v))).collect();
            broker.set_user_limits(&name, &changes)?;
        }
    }
    for v in &d.vhosts {
        let name = s(v, "name", "vhosts")?;
        broker.add_vhost(name)?;
        if v.get("metadata").is_some() || v.get("description").is_some() {
            tracing::info!(
                vhost = name,
                "definitions import: vhost description and tags are not stored"
            );
        }
    }
    for p in &d.permissions {
        let vhost = vhost_of(only, p, "permissions")?;
        if !broker.has_vhost(&vhost) {
            return Err(bad(format!("permissions: no vhost '{vhost}'")));
        }
        broker.auth().set_permission(PermissionEntry {
            user: s(p, "user", "permissions")?.to_owned(),
            vhost,
            configure: s(p, "configure", "permissions")?.to_owned(),
            write: s(p, "write", "permissions")?.to_owned(),
            read: s(p, "read", "permissions")?.to_owned(),
        })?;
    }
    for t in &d.topic_permissions {
        broker.auth().set_topic_permission(TopicPermissionEntry {
            user: s(t, "user", "topic_permissions")?.to_owned(),
            vhost: vhost_of(only, t, "topic_permissions")?,
            exchange: s(t, "exchange", "topic_permissions")?.to_owned(),
            write: s(t, "write", "topic_permissions")?.to_owned(),
            read: s(t, "read", "topic_permissions")?.to_owned(),
        })?;
    }
    Ok(())
}

/// Imports the policies (checked), exchanges, queues and bindings.
fn import_topology(
    broker: &Broker,
    only: Option<&str>,
    d: &Defs,
    policies: Vec<Policy>,
) -> Result<(), ApiError> {
    for p in policies {
        broker.vhost(&p.vhost)?.set_policy(p)?;
    }
    for x in &d.exchanges {
        let vh = broker.vhost(&vhost_of(only, x, "exchanges")?)?;
        let kind: ExchangeKind = s(x, "type", "exchanges")?.parse()?;
        let mut def = ExchangeDef::new(s(x, "name", "exchanges")?, kind);
        def.durable = flag(x, "durable", true)?;
        def.auto_delete = flag(x, "auto_delete", false)?;
        def.internal = flag(x, "internal", false)?;
        def.arguments = table(x)?;
        vh.declare_exchange(def, false)?;
    }
    for q in &d.queues {
        let vh = broker.vhost(&vhost_of(only, q, "queues")?)?;
        vh.declare_queue(QueueDeclare {
            name: s(q, "name", "queues")?.to_owned(),
            durable: flag(q, "durable", true)?,
            auto_delete: flag(q, "auto_delete", false)?,
            arguments: table(q)?,
            ..QueueDeclare::default()
        })?;
    }
    for b in &d.bindings {
        let vh = broker.vhost(&vhost_of(only, b, "bindings")?)?;
        let (src, dst) = (
            s(b, "source", "bindings")?,
            s(b, "destination", "bindings")?,
        );
        let key = b.get("routing_key").and_then(Value::as_str).unwrap_or("");
        let args = table(b)?;
        match s(b, "destination_type", "bindings")? {
            "queue" => vh.bind_queue(dst, src, key, &args, 0)?,
            "exchange" => vh.bind_exchange(dst, src, key, &args)?,
            other => return Err(bad(format!("bindings: unknown destination_type '{other}'"))),
        }
    }
    Ok(())
}
