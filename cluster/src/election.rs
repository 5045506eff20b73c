//! The leader election on etcd (issue 18, phase 2), over etcd's JSON gateway
//! (ARCHITECTURE.md, "Election on etcd": hyper's HTTP/1.1 client, no gRPC stack).
//!
//! A candidate takes a lease ([`Etcd::grant`], TTL = `cluster.lease_ttl`) and runs one
//! transaction on the election key `/triad/<group>/leader` ([`Etcd::campaign`]): if the
//! key does not exist (`create_revision == 0`) it is put, bound to the lease, with the
//! candidate's [`NodeInfo`]; otherwise the transaction reads it, and the candidate learns
//! who leads. The winner renews its lease every TTL/3 ([`Etcd::keepalive`]); when it
//! stops (crash, partition), etcd deletes the key with the lease and the next
//! transaction wins. The **epoch** of a term is the key's `create_revision`: etcd's
//! revision counter only grows, so a later term always has a larger epoch.
//!
//! Every call is one POST with a JSON body on a fresh connection (TLS with `https://`
//! endpoints and `[cluster.etcd_tls]`) to the first endpoint that answers (a small number of calls per TTL/3: no pooling needed), bounded by a
//! timeout; keys and values are base64, 64-bit integers arrive as strings.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

/// The largest answer read from etcd.
const MAX_ANSWER: usize = 1 << 20;

/// The election key of group `group`.
pub fn election_key(group: &str) -> String {
    format!("/triad/{group}/leader")
}

/// The prefix under which candidates state how much log they hold during an election.
pub fn candidates_prefix(group: &str) -> String {
    format!("/triad/{group}/candidates/")
}

/// What went wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint answered (connection refused, timeout): the last failure.
    #[error("no etcd endpoint answered (last: {endpoint}: {reason})")]
    Unreachable { endpoint: String, reason: String },
    /// etcd answered with an error.
    #[error("etcd answered {status} to {path}: {body}")]
    Status {
        path: &'static str,
        status: u16,
        body: String,
    },
    /// The answer is not what the API documents.
    #[error("unexpected answer from etcd to {path}: {what}")]
    Malformed { path: &'static str, what: String },
}

/// Who a node is, as the election key's value says (JSON: `{"node", "replication",
/// "clients": {"amqp": "host:port", ...}}`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeInfo {
    pub node: String,
    /// Its replication listener, as the other nodes reach it.
    pub replication: String,
    /// Its client listeners (protocol name, `host:port`), once the leader has bound them
    /// (empty before): where a client or a forwarding follower reaches the leader.
    pub clients: Vec<(String, String)>,
}

impl NodeInfo {
    pub fn to_json(&self) -> String {
        let clients: serde_json::Map<String, Value> = self
            .clients
            .iter()
            .map(|(p, a)| (p.clone(), Value::String(a.clone())))
            .collect();
        json!({ "node": self.node, "replication": self.replication, "clients": clients })
            .to_string()
    }

    pub fn from_json(s: &[u8]) -> Option<NodeInfo> {
        let v: Value = serde_json::from_slice(s).ok()?;
        let clients = match v.get("clients") {
            None => Vec::new(),
            Some(c) => c
                .as_object()?
                .iter()
                .map(|(p, a)| Some((p.clone(), a.as_str()?.to_owned())))
                .collect::<Option<Vec<_>>>()?,
        };
        Some(NodeInfo {
            node: v.get("node")?.as_str()?.to_owned(),
            replication: v.get("replication")?.as_str()?.to_owned(),
            clients,
        })
    }
}

/// The election key's holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The key's value (a [`NodeInfo`] for Triad's nodes).
    pub value: Vec<u8>,
    /// The term: the key's `create_revision`.
    pub epoch: u64,
    /// The holder's lease.
    pub lease: i64,
    /// The key's `mod_revision` as read: [`Etcd::watch`] from one past it sees any
    /// change since.
    pub revision: u64,
}

/// A campaign's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Campaign {
    /// This candidate leads, in term `epoch`.
    Won { epoch: u64 },
    /// Somebody else does.
    Lost(Holder),
}

/// A client of etcd's JSON gateway (v3 API).
#[derive(Debug)]
pub struct Etcd {
    /// `host:port` of each endpoint.
    endpoints: Vec<String>,
    timeout: Duration,
    /// The endpoint that answered last (tried first).
    preferred: AtomicUsize,
    /// TLS to every endpoint (`https://` URLs, `[cluster.etcd_tls]`); `None`: plain.
    tls: Option<Arc<rustls::ClientConfig>>,
}

fn b64(s: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn unb64(v: Option<&Value>) -> Option<Vec<u8>> {
    match v {
        None => Some(Vec::new()),
        Some(v) => base64::engine::general_purpose::STANDARD
            .decode(v.as_str()?)
            .ok(),
    }
}

/// A 64-bit integer as the gateway writes it (a string), or a JSON number; absent is 0
/// (proto3 leaves zero values out).
fn int(v: Option<&Value>) -> Option<i64> {
    match v {
        None => Some(0),
        Some(Value::String(s)) => s.parse().ok(),
        Some(Value::Number(n)) => n.as_i64(),
        Some(_) => None,
    }
}

impl Etcd {
    /// A client of `endpoints` (`http://host:port`, as `cluster.etcd` holds them); each
    /// call gives up after `timeout`.
    pub fn new(endpoints: &[String], timeout: Duration) -> Etcd {
        Etcd {
            endpoints: endpoints
                .iter()
                .map(|e| {
                    e.trim_start_matches("http://")
                        .trim_start_matches("https://")
                        .trim_end_matches('/')
                        .to_owned()
                })
                .collect(),
            timeout,
            preferred: AtomicUsize::new(0),
            tls: None,
        }
    }

    /// A client of `endpoints` (`https://host:port`) over TLS with `tls`
    /// ([`crate::tls::etcd_client_config`]): each endpoint's certificate is checked for
    /// its host.
    pub fn with_tls(
        endpoints: &[String],
        timeout: Duration,
        tls: Arc<rustls::ClientConfig>,
    ) -> Etcd {
        Etcd {
            tls: Some(tls),
            ..Etcd::new(endpoints, timeout)
        }
    }

    /// One call: POST `body` to `path` on the first endpoint that answers.
    async fn call(&self, path: &'static str, body: Value) -> Result<Value, EtcdError> {
        let body = Bytes::from(body.to_string());
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed);
        let mut last = EtcdError::Unreachable {
            endpoint: String::new(),
            reason: "no endpoint configured".into(),
        };
        for i in 0..n {
            let at = (first + i) % n;
            let Some(endpoint) = self.endpoints.get(at) else {
                continue;
            };
            let call = post(
                endpoint,
                path,
                body.clone(),
                self.tls.as_ref(),
                Answer::Whole,
            );
            let answer = tokio::time::timeout(self.timeout, call)
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.timeout)));
            match answer {
                Ok((status, bytes)) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    if !(200..300).contains(&status) {
                        return Err(EtcdError::Status {
                            path,
                            status,
                            body: String::from_utf8_lossy(&bytes).into_owned(),
                        });
                    }
                    return serde_json::from_slice(&bytes).map_err(|e| EtcdError::Malformed {
                        path,
                        what: e.to_string(),
                    });
                }
                Err(reason) => {
                    last = EtcdError::Unreachable {
                        endpoint: endpoint.clone(),
                        reason,
                    };
                }
            }
        }
        Err(last)
    }

    /// A new lease of `ttl` (whole seconds); returns its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let path = "/v3/lease/grant";
        let v = self
            .call(path, json!({ "TTL": ttl.as_secs().max(1) }))
            .await?;
        match int(v.get("ID")) {
            Some(id) if id != 0 => Ok(id),
            _ => Err(malformed(path, &v)),
        }
    }

    /// Renews `lease`; `Ok(None)` when etcd no longer has it (expired or revoked),
    /// otherwise the TTL it was renewed for.
    pub async fn keepalive(&self, lease: i64) -> Result<Option<Duration>, EtcdError> {
        let path = "/v3/lease/keepalive";
        let v = match self.call(path, json!({ "ID": lease.to_string() })).await {
            Ok(v) => v,
            Err(EtcdError::Status { body, .. }) if body.contains("lease not found") => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        // the gateway wraps a stream's messages in {"result": ...} (or {"error": ...})
        if let Some(e) = v.get("error") {
            if e.to_string().contains("lease not found") {
                return Ok(None);
            }
            return Err(malformed(path, &v));
        }
        let r = v.get("result").unwrap_or(&v);
        match int(r.get("TTL")) {
            Some(ttl) if ttl > 0 => Ok(Some(Duration::from_secs(ttl as u64))),
            Some(_) => Ok(None),
            None => Err(malformed(path, &v)),
        }
    }

    /// Ends `lease` now (its keys go with it).
    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        match self
            .call("/v3/lease/revoke", json!({ "ID": lease.to_string() }))
            .await
        {
            Ok(_) => Ok(()),
            Err(EtcdError::Status { body, .. }) if body.contains("lease not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// One campaign for `key`: put `value` bound to `lease` if nobody holds it, or learn
    /// who does.
    pub async fn campaign(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
    ) -> Result<Campaign, EtcdError> {
        let path = "/v3/kv/txn";
        let k = b64(key.as_bytes());
        let v = self
            .call(
                path,
                json!({
                    "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL",
                                  "create_revision": "0" }],
                    "success": [{ "request_put": { "key": k, "value": b64(value),
                                                   "lease": lease.to_string() } }],
                    "failure": [{ "request_range": { "key": k } }],
                }),
            )
            .await?;
        if v.get("succeeded").and_then(Value::as_bool) == Some(true) {
            // the put's revision is the key's create_revision
            let rev = v
                .get("header")
                .and_then(|h| int(h.get("revision")))
                .filter(|r| *r > 0)
                .ok_or_else(|| malformed(path, &v))?;
            return Ok(Campaign::Won { epoch: rev as u64 });
        }
        let kv = v
            .get("responses")
            .and_then(|r| r.get(0))
            .and_then(|r| r.get("response_range"))
            .and_then(|r| r.get("kvs"))
            .and_then(|k| k.get(0))
            .ok_or_else(|| malformed(path, &v))?;
        Ok(Campaign::Lost(holder(path, kv)?))
    }

    /// Replaces the value of `key` (keeping it bound to `lease`) only while it is still
    /// the key of term `epoch`; returns whether it was.
    pub async fn update_term(
        &self,
        key: &str,
        epoch: u64,
        value: &[u8],
        lease: i64,
    ) -> Result<bool, EtcdError> {
        let k = b64(key.as_bytes());
        let v = self
            .call(
                "/v3/kv/txn",
                json!({
                    "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL",
                                  "create_revision": epoch.to_string() }],
                    "success": [{ "request_put": { "key": k, "value": b64(value),
                                                   "lease": lease.to_string() } }],
                }),
            )
            .await?;
        Ok(v.get("succeeded").and_then(Value::as_bool) == Some(true))
    }

    /// Who holds `key` now (`None`: nobody; an election is due).
    pub async fn holder(&self, key: &str) -> Result<Option<Holder>, EtcdError> {
        let path = "/v3/kv/range";
        let v = self
            .call(path, json!({ "key": b64(key.as_bytes()) }))
            .await?;
        match v.get("kvs").and_then(|k| k.get(0)) {
            None => Ok(None),
            Some(kv) => Ok(Some(holder(path, kv)?)),
        }
    }

    /// Returns once `key` changes (put or deleted: its holder's lease ended) at or
    /// after revision `from`, through etcd's watch stream on the endpoint that answered
    /// last. Not bounded by the client's timeout: the caller races it against its own
    /// poll and drops it (closing the stream). An error (no endpoint, the stream ended)
    /// says nothing about the key: the caller polls as before.
    pub async fn watch(&self, key: &str, from: u64) -> Result<(), EtcdError> {
        let path = "/v3/watch";
        let body = json!({ "create_request": { "key": b64(key.as_bytes()),
                                               "start_revision": from.to_string() } });
        let at = self.preferred.load(Ordering::Relaxed);
        let endpoint = self
            .endpoints
            .get(at)
            .or_else(|| self.endpoints.first())
            .ok_or_else(|| EtcdError::Unreachable {
                endpoint: String::new(),
                reason: "no endpoint configured".into(),
            })?;
        let body = Bytes::from(body.to_string());
        match post(endpoint, path, body, self.tls.as_ref(), Answer::FirstEvent).await {
            Ok((status, _)) if (200..300).contains(&status) => Ok(()),
            Ok((status, bytes)) => Err(EtcdError::Status {
                path,
                status,
                body: String::from_utf8_lossy(&bytes).into_owned(),
            }),
            Err(reason) => Err(EtcdError::Unreachable {
                endpoint: endpoint.clone(),
                reason,
            }),
        }
    }

    /// Puts `key` = `value`, bound to `lease` (0: none).
    pub async fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), EtcdError> {
        let (key, value) = (b64(key.as_bytes()), b64(value));
        let body = if lease != 0 {
            json!({ "key": key, "value": value, "lease": lease.to_string() })
        } else {
            json!({ "key": key, "value": value })
        };
        self.call("/v3/kv/put", body).await.map(|_| ())
    }

    /// Every key under `prefix` with its value (at most `limit`).
    pub async fn range_prefix(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, EtcdError> {
        let path = "/v3/kv/range";
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last = last.saturating_add(1);
        }
        let v = self
            .call(
                path,
                json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&end),
                        "limit": limit.to_string() }),
            )
            .await?;
        let Some(kvs) = v.get("kvs").and_then(Value::as_array) else {
            return Ok(Vec::new());
        };
        kvs.iter()
            .map(|kv| {
                let k = unb64(kv.get("key")).ok_or_else(|| malformed(path, kv))?;
                let val = unb64(kv.get("value")).ok_or_else(|| malformed(path, kv))?;
                Ok((k, val))
            })
            .collect()
    }
}

fn holder(path: &'static str, kv: &Value) -> Result<Holder, EtcdError> {
    let epoch = int(kv.get("create_revision"))
        .filter(|r| *r > 0)
        .ok_or_else(|| malformed(path, kv))?;
    Ok(Holder {
        value: unb64(kv.get("value")).ok_or_else(|| malformed(path, kv))?,
        epoch: epoch as u64,
        lease: int(kv.get("lease")).unwrap_or(0),
        revision: int(kv.get("mod_revision")).unwrap_or(epoch) as u64,
    })
}

fn malformed(path: &'static str, v: &Value) -> EtcdError {
    let mut what = v.to_string();
    what.truncate(300);
    EtcdError::Malformed { path, what }
}

/// How much of an answer [`post`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// All of it (at most [`MAX_ANSWER`]).
    Whole,
    /// A watch stream (one JSON message per line) up to its first message with events.
    FirstEvent,
}

/// POSTs `body` to `http://endpoint/path` (`https://` with `tls`) on a fresh connection;
/// the status and the body, read as `answer` says.
async fn post(
    endpoint: &str,
    path: &str,
    body: Bytes,
    tls: Option<&Arc<rustls::ClientConfig>>,
    answer: Answer,
) -> Result<(u16, Bytes), String> {
    let addrs: Vec<SocketAddr> = endpoint
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve: {e}"))?
        .collect();
    let mut last = format!("{endpoint} resolves to nothing");
    let mut stream = None;
    for a in addrs {
        match tokio::net::TcpStream::connect(a).await {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e.to_string(),
        }
    }
    let stream = stream.ok_or(last)?;
    let _ = stream.set_nodelay(true);
    match tls {
        None => exchange(TokioIo::new(stream), endpoint, path, body, answer).await,
        Some(cfg) => {
            let name = crate::tls::server_name(endpoint).map_err(|e| e.to_string())?;
            let stream = tokio_rustls::TlsConnector::from(cfg.clone())
                .connect(name, stream)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            exchange(TokioIo::new(stream), endpoint, path, body, answer).await
        }
    }
}

/// One HTTP/1.1 POST on `io`, an open connection to `endpoint`.
async fn exchange<T>(
    io: TokioIo<T>,
    endpoint: &str,
    path: &str,
    body: Bytes,
    answer: Answer,
) -> Result<(u16, Bytes), String>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let req = Request::post(path)
        .header(hyper::header::HOST, endpoint)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let answer = async {
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let bytes = if answer == Answer::FirstEvent && (200..300).contains(&status) {
            first_event(resp.into_body()).await?
        } else {
            Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes()
        };
        Ok((status, bytes))
    }
    .await;
    drop(sender);
    conn.abort();
    answer
}

/// Reads a watch stream (etcd's gateway writes one JSON message per line) up to the
/// first message with events; returns that line. An `error` message, the stream's end,
/// or more than [`MAX_ANSWER`] bytes without a whole line are errors.
async fn first_event(mut body: hyper::body::Incoming) -> Result<Bytes, String> {
    let mut buf: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let Ok(v) = serde_json::from_slice::<Value>(&line) else {
                return Err("a watch message that is not JSON".into());
            };
            if let Some(e) = v.get("error") {
                return Err(format!("watch: {e}"));
            }
            let events = v.get("result").and_then(|r| r.get("events"));
            if events
                .and_then(Value::as_array)
                .is_some_and(|e| !e.is_empty())
            {
                return Ok(Bytes::from(line));
            }
        }
        if buf.len() > MAX_ANSWER {
            return Err("a watch message over the size limit".into());
        }
    }
    Err("the watch stream ended".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::EtcdServer;
    use std::time::Instant;

    fn etcd() -> Option<(EtcdServer, tempfile::TempDir)> {
        let dir = tempfile::tempdir().unwrap();
        let server = EtcdServer::start(dir.path())?;
        Some((server, dir))
    }

    const TTL: Duration = Duration::from_secs(2);

    #[tokio::test]
    async fn one_candidate_wins_the_others_learn_it_and_a_later_term_has_a_larger_epoch() {
        let Some((server, _dir)) = etcd() else { return };
        let c = Etcd::new(&[server.url()], Duration::from_secs(5));
        let key = election_key("t1");
        let a = NodeInfo {
            node: "a".into(),
            replication: "127.0.0.1:1".into(),
            clients: vec![],
        };
        let la = c.grant(TTL).await.unwrap();
        let lb = c.grant(TTL).await.unwrap();
        assert_ne!(la, lb);
        let Campaign::Won { epoch: e1 } =
            c.campaign(&key, a.to_json().as_bytes(), la).await.unwrap()
        else {
            panic!("the first candidate wins")
        };
        let lost = c.campaign(&key, b"b", lb).await.unwrap();
        let want = Holder {
            value: a.to_json().into_bytes(),
            epoch: e1,
            lease: la,
            revision: e1,
        };
        assert_eq!(lost, Campaign::Lost(want.clone()));
        assert_eq!(NodeInfo::from_json(&want.value), Some(a));
        assert_eq!(c.holder(&key).await.unwrap(), Some(want));
        // the same candidate again: still held (one term per key creation)
        assert!(matches!(
            c.campaign(&key, b"a", la).await.unwrap(),
            Campaign::Lost(_)
        ));
        // the winner steps down: the key goes with its lease; b wins a later term
        c.revoke(la).await.unwrap();
        assert_eq!(c.holder(&key).await.unwrap(), None);
        let Campaign::Won { epoch: e2 } = c.campaign(&key, b"b", lb).await.unwrap() else {
            panic!("b wins once the key is gone")
        };
        assert!(e2 > e1, "epochs grow: {e1} then {e2}");
        // the holder adds its client addresses: same term (create_revision), new value
        let with_clients = NodeInfo {
            node: "b".into(),
            replication: "127.0.0.1:2".into(),
            clients: vec![
                ("amqp".into(), "127.0.0.1:5672".into()),
                ("mqtt".into(), "[::1]:1883".into()),
            ],
        };
        assert!(c
            .update_term(&key, e2, with_clients.to_json().as_bytes(), lb)
            .await
            .unwrap());
        let h = c.holder(&key).await.unwrap().unwrap();
        assert_eq!((h.epoch, h.lease), (e2, lb));
        assert_eq!(NodeInfo::from_json(&h.value), Some(with_clients.clone()));
        // not the term any more: nothing written
        assert!(!c.update_term(&key, e1, b"stale", la).await.unwrap());
        assert_eq!(c.holder(&key).await.unwrap().unwrap().value, h.value);
        // a revoked lease cannot be renewed
        assert_eq!(c.keepalive(la).await.unwrap(), None);
        assert_eq!(c.keepalive(lb).await.unwrap(), Some(TTL));
        // candidates' statements under a prefix
        let p = candidates_prefix("t1");
        c.put(&format!("{p}a"), b"10", 0).await.unwrap();
        c.put(&format!("{p}b"), b"20", lb).await.unwrap();
        c.put("/triad/t1/candidates0", b"x", 0).await.unwrap();
        let got = c.range_prefix(&p, 10).await.unwrap();
        assert_eq!(
            got,
            vec![
                (format!("{p}a").into_bytes(), b"10".to_vec()),
                (format!("{p}b").into_bytes(), b"20".to_vec())
            ]
        );
    }

    #[tokio::test]
    async fn a_lease_not_renewed_expires_with_its_key_and_one_renewed_does_not() {
        let Some((server, _dir)) = etcd() else { return };
        let c = Etcd::new(&[server.url()], Duration::from_secs(5));
        let key = election_key("t2");
        let kept = c.grant(TTL).await.unwrap();
        let left = c.grant(TTL).await.unwrap();
        assert!(matches!(
            c.campaign(&key, b"left", left).await.unwrap(),
            Campaign::Won { .. }
        ));
        let k2 = election_key("t2-kept");
        assert!(matches!(
            c.campaign(&k2, b"kept", kept).await.unwrap(),
            Campaign::Won { .. }
        ));
        // renew one every TTL/3; the other expires (etcd checks expiry every 500 ms)
        let start = Instant::now();
        let deadline = start + TTL * 4;
        loop {
            assert_eq!(c.keepalive(kept).await.unwrap(), Some(TTL));
            if c.holder(&key).await.unwrap().is_none() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the unrenewed lease never expired"
            );
            tokio::time::sleep(TTL / 3).await;
        }
        assert!(start.elapsed() >= TTL - Duration::from_millis(100));
        assert_eq!(c.keepalive(left).await.unwrap(), None);
        assert!(
            c.holder(&k2).await.unwrap().is_some(),
            "the renewed key stays"
        );
    }

    /// A watch from one past the revision read returns when the key changes (here its
    /// lease is revoked and it goes), and at once when it changed since that revision.
    #[tokio::test]
    async fn a_watch_returns_when_the_key_changes_after_the_revision_read() {
        let Some((server, _dir)) = etcd() else { return };
        let c = Arc::new(Etcd::new(&[server.url()], Duration::from_secs(5)));
        let key = election_key("t3");
        let lease = c.grant(TTL).await.unwrap();
        assert!(matches!(
            c.campaign(&key, b"a", lease).await.unwrap(),
            Campaign::Won { .. }
        ));
        let h = c.holder(&key).await.unwrap().expect("held");
        let w = {
            let (c, key) = (c.clone(), key.clone());
            tokio::spawn(async move { c.watch(&key, h.revision + 1).await })
        };
        // a change of another key is not this key's
        c.put(&election_key("t3-other"), b"x", 0).await.unwrap();
        assert!(!w.is_finished(), "the watch returned for another key");
        c.revoke(lease).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), w)
            .await
            .expect("the watch saw the key go")
            .unwrap()
            .unwrap();
        // from a revision the change is past: at once
        tokio::time::timeout(Duration::from_secs(10), c.watch(&key, h.revision + 1))
            .await
            .expect("a past change is reported at once")
            .unwrap();
    }

    #[tokio::test]
    async fn an_endpoint_that_does_not_answer_is_skipped_and_none_answering_is_an_error() {
        let Some((server, _dir)) = etcd() else { return };
        // a port nobody listens on: bound, then closed
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let c = Etcd::new(&[dead.clone(), server.url()], Duration::from_secs(5));
        let lease = c.grant(TTL).await.unwrap();
        assert_eq!(c.keepalive(lease).await.unwrap(), Some(TTL));
        let none = Etcd::new(&[dead], Duration::from_secs(5));
        let err = none.grant(TTL).await.unwrap_err();
        assert!(matches!(err, EtcdError::Unreachable { .. }), "{err}");
        // a stopped etcd (paused process): the call times out, it does not hang
        server.pause();
        let slow = Etcd::new(&[server.url()], Duration::from_millis(300));
        let t = Instant::now();
        let err = slow.keepalive(lease).await.unwrap_err();
        assert!(matches!(err, EtcdError::Unreachable { .. }), "{err}");
        assert!(t.elapsed() < Duration::from_secs(3));
        server.resume();
    }
}
