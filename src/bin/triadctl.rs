//! `triadctl`: Triad's admin CLI, a thin client of the management HTTP API (plain HTTP/1.1
//! over a TCP socket, basic auth), in the spirit of `rabbitmqctl` and `mqadmin`.
//!
//! ```text
//! triadctl [--host H] [--port P] [--user U] [--password PW] [--vhost V] [--format table|json] COMMAND ARGS
//! ```
//!
//! Exit codes: 0 done; 1 the broker refused or failed (its reason printed); 2 a usage
//! error; 3 the broker could not be reached. Errors are one line on stderr.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::Duration;

use base64::Engine;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde_json::{json, Value};

const USAGE: &str = "usage: triadctl [--host H] [--port P] [--user U] [--password PW] [--vhost V] [--format table|json] COMMAND [ARGS]
commands:
  status                             cluster_status
  list_queues | list_exchanges | list_bindings | list_connections | list_consumers
  list_users | list_vhosts | list_permissions | list_policies
  add_user NAME PASSWORD [TAGS]      delete_user NAME      change_password NAME PASSWORD
  add_vhost NAME                     delete_vhost NAME
  set_permissions USER CONFIGURE WRITE READ   (in --vhost)
  set_policy NAME PATTERN DEFINITION-JSON [PRIORITY [APPLY-TO]]   clear_policy NAME
  purge_queue NAME                   delete_queue NAME
  close_connection NAME
  export_definitions [FILE]          import_definitions FILE
  query_msg --id ID | --queue Q --offset N | --queue Q --from MS [--to MS]
            | --topic T [--from MS] [--to MS]  (MQTT topic, in --vhost)  [--count N] [--full]";

enum Failure {
    Usage(String),
    Refused(String),
    Unreachable(String),
}

struct Client {
    host: String,
    port: u16,
    auth: String,
}

fn enc(s: &str) -> String {
    utf8_percent_encode(s, NON_ALPHANUMERIC).to_string()
}

/// The body of a chunked response.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, Failure> {
    let bad = || Failure::Unreachable("malformed chunked response".into());
    let mut out = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n").ok_or_else(bad)?;
        let size = std::str::from_utf8(rest.get(..line_end).ok_or_else(bad)?).map_err(|_| bad())?;
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| bad())?;
        if n == 0 {
            return Ok(out);
        }
        let start = line_end + 2;
        out.extend_from_slice(rest.get(start..start + n).ok_or_else(bad)?);
        rest = rest.get(start + n + 2..).ok_or_else(bad)?;
    }
}

impl Client {
    /// One request; the JSON answer (`Null` when empty) or the broker's reason.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, Failure> {
        let addr = format!("{}:{}", self.host, self.port);
        let mut s = TcpStream::connect(&addr)
            .map_err(|e| Failure::Unreachable(format!("cannot reach {addr}: {e}")))?;
        let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
        let body = body.map(Value::to_string).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Basic {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.host,
            self.auth,
            body.len()
        );
        let io = |e: std::io::Error| Failure::Unreachable(format!("{addr}: {e}"));
        s.write_all(req.as_bytes()).map_err(io)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).map_err(io)?;
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| Failure::Unreachable("no HTTP response".into()))?;
        let head =
            String::from_utf8_lossy(raw.get(..split).unwrap_or_default()).to_ascii_lowercase();
        let rest = raw.get(split + 4..).unwrap_or_default();
        let status: u16 = head
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| Failure::Unreachable("no HTTP status".into()))?;
        let body = if head.contains("transfer-encoding: chunked") {
            dechunk(rest)?
        } else {
            rest.to_vec()
        };
        let v: Value = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()))
        };
        if status >= 400 {
            let reason = v
                .get("reason")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .unwrap_or_else(|| format!("HTTP {status}"));
            return Err(Failure::Refused(format!("{reason} (HTTP {status})")));
        }
        Ok(v)
    }
}

/// Prints `rows` (objects) as a table of `cols`.
fn table(rows: &Value, cols: &[&str]) {
    let rows: Vec<&Value> = rows
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let cell = |r: &Value, c: &str| -> String {
        let v = c
            .split('.')
            .try_fold(r, |v, k| v.get(k))
            .unwrap_or(&Value::Null);
        match v {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        }
    };
    let widths: Vec<usize> = cols
        .iter()
        .map(|c| {
            rows.iter()
                .map(|r| cell(r, c).chars().count())
                .max()
                .unwrap_or(0)
                .max(c.len())
        })
        .collect();
    let line = |vals: Vec<String>| {
        let parts: Vec<String> = vals
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:<w$}"))
            .collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(cols.iter().map(|c| (*c).to_owned()).collect());
    for r in rows {
        line(cols.iter().map(|c| cell(r, c)).collect());
    }
}

/// `cluster_status`'s first lines: the group as a whole.
fn cluster_summary(s: &Value) {
    let f = |k: &str| match s.get(k) {
        Some(Value::String(v)) => v.clone(),
        Some(Value::Null) | None => "-".to_owned(),
        Some(v) => v.to_string(),
    };
    println!(
        "node {}  role {}  leader {}  epoch {}  mode {}",
        f("node"),
        f("role"),
        f("leader"),
        f("epoch"),
        f("mode")
    );
    println!(
        "in sync {} (min_insync {})  confirms {}  log end {}  replicated {}",
        f("in_sync_replicas"),
        f("min_insync"),
        match s.get("refusing").and_then(Value::as_str) {
            Some(why) => format!("refused: {why}"),
            None => "accepted".to_owned(),
        },
        f("log_end"),
        f("replicated_offset")
    );
}

/// The global options and the command line after them.
struct Options {
    client: Client,
    vhost: String,
    json_out: bool,
    rest: Vec<String>,
}

/// Parses the global options; `None`: `--help` was asked for (and printed).
fn parse_options(args: Vec<String>) -> Result<Option<Options>, Failure> {
    let mut host = "127.0.0.1".to_owned();
    let mut port = 15672u16;
    let (mut user, mut password) = ("guest".to_owned(), "guest".to_owned());
    let mut vhost = "/".to_owned();
    let mut json_out = false;
    let mut rest = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| {
            it.next()
                .ok_or_else(|| Failure::Usage(format!("{name} needs a value")))
        };
        match a.as_str() {
            "--host" => host = val("--host")?,
            "--port" => {
                port = val("--port")?
                    .parse()
                    .map_err(|_| Failure::Usage("--port must be a number".into()))?
            }
            "--user" => user = val("--user")?,
            "--password" => password = val("--password")?,
            "--vhost" => vhost = val("--vhost")?,
            "--format" => match val("--format")?.as_str() {
                "json" => json_out = true,
                "table" => json_out = false,
                other => {
                    return Err(Failure::Usage(format!(
                        "unknown format '{other}' (table, json)"
                    )))
                }
            },
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(None);
            }
            _ => rest.push(a),
        }
    }
    let client = Client {
        host,
        port,
        auth: base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")),
    };
    Ok(Some(Options {
        client,
        vhost,
        json_out,
        rest,
    }))
}

fn run(args: Vec<String>) -> Result<(), Failure> {
    let Some(o) = parse_options(args)? else {
        return Ok(());
    };
    let Some((cmd, args)) = o.rest.split_first() else {
        return Err(Failure::Usage("no command".into()));
    };
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ctl = Ctl {
        c: o.client,
        v: enc(&o.vhost),
        vhost: o.vhost,
        json_out: o.json_out,
        cmd: cmd.as_str(),
    };
    match cmd.as_str() {
        "status" => ctl.status(&args),
        "cluster_status" => ctl.cluster_status(&args),
        "query_msg" => ctl.query_msg(&args),
        "export_definitions" | "import_definitions" => ctl.definitions(&args),
        c if c.starts_with("list_") => ctl.list(&args),
        _ => ctl.change(&args),
    }
}

/// One command's run: the client, the vhost, the output format.
struct Ctl<'a> {
    c: Client,
    /// `--vhost`.
    vhost: String,
    /// `--vhost`, percent-encoded for a path.
    v: String,
    json_out: bool,
    cmd: &'a str,
}

impl Ctl<'_> {
    fn unknown(&self) -> Failure {
        Failure::Usage(format!("unknown command or wrong arguments: {}", self.cmd))
    }

    fn want(&self, args: &[&str], n: usize) -> Result<(), Failure> {
        if args.len() == n {
            Ok(())
        } else {
            Err(Failure::Usage(format!(
                "{} takes {n} argument(s), got {}",
                self.cmd,
                args.len()
            )))
        }
    }

    fn show(&self, val: Value, cols: &[&str]) {
        if self.json_out {
            println!("{}", serde_json::to_string_pretty(&val).unwrap_or_default());
        } else {
            table(&val, cols);
        }
    }

    fn done(&self, what: String) {
        if self.json_out {
            println!("{}", json!({"ok": true, "done": what}));
        } else {
            println!("{what}");
        }
    }

    fn status(&self, args: &[&str]) -> Result<(), Failure> {
        self.want(args, 0)?;
        let o = self.c.call("GET", "/api/overview", None)?;
        if self.json_out {
            println!("{}", serde_json::to_string_pretty(&o).unwrap_or_default());
        } else {
            table(
                &json!([o]),
                &[
                    "node",
                    "product_version",
                    "object_totals.connections",
                    "object_totals.queues",
                    "queue_totals.messages",
                    "message_stats.publish_details.rate",
                ],
            );
        }
        Ok(())
    }

    fn cluster_status(&self, args: &[&str]) -> Result<(), Failure> {
        self.want(args, 0)?;
        let s = self.c.call("GET", "/api/cluster", None)?;
        if self.json_out {
            println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
        } else {
            cluster_summary(&s);
            table(
                s.get("nodes").unwrap_or(&Value::Null),
                &[
                    "node",
                    "role",
                    "address",
                    "connected",
                    "in_sync",
                    "log_durable",
                    "journal_durable",
                    "lag_bytes",
                    "lag_seconds",
                ],
            );
        }
        Ok(())
    }

    /// The `list_*` commands.
    fn list(&self, args: &[&str]) -> Result<(), Failure> {
        let v = &self.v;
        let (path, cols): (String, &[&str]) = match self.cmd {
            "list_queues" => (
                format!("/api/queues/{v}"),
                &[
                    "name",
                    "messages",
                    "messages_ready",
                    "messages_unacknowledged",
                    "consumers",
                    "policy",
                ],
            ),
            "list_exchanges" => (
                format!("/api/exchanges/{v}"),
                &["name", "type", "durable", "auto_delete", "internal"],
            ),
            "list_bindings" => (
                format!("/api/bindings/{v}"),
                &["source", "destination", "destination_type", "routing_key"],
            ),
            "list_connections" => (
                "/api/connections".to_owned(),
                &["name", "protocol", "user", "vhost", "ssl"],
            ),
            "list_consumers" => (
                format!("/api/consumers/{v}"),
                &[
                    "queue.name",
                    "consumer_tag",
                    "ack_required",
                    "prefetch_count",
                ],
            ),
            "list_users" => ("/api/users".to_owned(), &["name", "tags"]),
            "list_vhosts" => ("/api/vhosts".to_owned(), &["name", "messages"]),
            "list_permissions" => (
                format!("/api/vhosts/{v}/permissions"),
                &["user", "configure", "write", "read"],
            ),
            "list_policies" => (
                format!("/api/policies/{v}"),
                &["name", "pattern", "apply-to", "priority", "definition"],
            ),
            _ => return Err(self.unknown()),
        };
        self.want(args, 0)?;
        self.show(self.c.call("GET", &path, None)?, cols);
        Ok(())
    }

    /// The commands that change something: users, vhosts, permissions, policies, queues,
    /// connections.
    fn change(&self, args: &[&str]) -> Result<(), Failure> {
        let (c, v, vhost) = (&self.c, &self.v, &self.vhost);
        match (self.cmd, args) {
            ("add_user", [name, pw, tags @ ..]) if tags.len() <= 1 => {
                c.call(
                    "PUT",
                    &format!("/api/users/{}", enc(name)),
                    Some(&json!({"password": pw, "tags": tags.first().copied().unwrap_or("")})),
                )?;
                self.done(format!("user {name} added"));
            }
            ("change_password", [name, pw]) => {
                let u = c.call("GET", &format!("/api/users/{}", enc(name)), None)?;
                c.call(
                    "PUT",
                    &format!("/api/users/{}", enc(name)),
                    Some(&json!({"password": pw, "tags": u.get("tags").cloned().unwrap_or(json!(""))})),
                )?;
                self.done(format!("password of {name} changed"));
            }
            ("delete_user", [name]) => {
                c.call("DELETE", &format!("/api/users/{}", enc(name)), None)?;
                self.done(format!("user {name} deleted"));
            }
            ("add_vhost", [name]) => {
                c.call(
                    "PUT",
                    &format!("/api/vhosts/{}", enc(name)),
                    Some(&json!({})),
                )?;
                self.done(format!("vhost {name} added"));
            }
            ("delete_vhost", [name]) => {
                c.call("DELETE", &format!("/api/vhosts/{}", enc(name)), None)?;
                self.done(format!("vhost {name} deleted"));
            }
            ("set_permissions", [u, conf, write, read]) => {
                c.call(
                    "PUT",
                    &format!("/api/permissions/{v}/{}", enc(u)),
                    Some(&json!({"configure": conf, "write": write, "read": read})),
                )?;
                self.done(format!("permissions of {u} in {vhost} set"));
            }
            ("set_policy", [name, pattern, def, more @ ..]) if more.len() <= 2 => {
                self.set_policy(name, pattern, def, more)?
            }
            ("clear_policy", [name]) => {
                c.call("DELETE", &format!("/api/policies/{v}/{}", enc(name)), None)?;
                self.done(format!("policy {name} cleared"));
            }
            ("purge_queue", [name]) => {
                c.call(
                    "DELETE",
                    &format!("/api/queues/{v}/{}/contents", enc(name)),
                    None,
                )?;
                self.done(format!("queue {name} purged"));
            }
            ("delete_queue", [name]) => {
                c.call("DELETE", &format!("/api/queues/{v}/{}", enc(name)), None)?;
                self.done(format!("queue {name} deleted"));
            }
            ("close_connection", [name]) => {
                c.call("DELETE", &format!("/api/connections/{}", enc(name)), None)?;
                self.done(format!("connection {name} closed"));
            }
            _ => return Err(self.unknown()),
        }
        Ok(())
    }

    /// `set_policy NAME PATTERN DEFINITION-JSON [PRIORITY [APPLY-TO]]`.
    fn set_policy(
        &self,
        name: &str,
        pattern: &str,
        def: &str,
        more: &[&str],
    ) -> Result<(), Failure> {
        let (v, vhost) = (&self.v, &self.vhost);
        let definition: Value = serde_json::from_str(def)
            .map_err(|e| Failure::Usage(format!("definition is not JSON: {e}")))?;
        let priority: i64 = match more.first() {
            Some(p) => p
                .parse()
                .map_err(|_| Failure::Usage("priority must be an integer".into()))?,
            None => 0,
        };
        let apply_to = more.get(1).copied().unwrap_or("all");
        self.c.call("PUT", &format!("/api/policies/{v}/{}", enc(name)), Some(&json!({"pattern": pattern, "definition": definition, "priority": priority, "apply-to": apply_to})))?;
        self.done(format!("policy {name} set in {vhost}"));
        Ok(())
    }

    /// `export_definitions [FILE]` and `import_definitions FILE`.
    fn definitions(&self, args: &[&str]) -> Result<(), Failure> {
        match (self.cmd, args) {
            ("export_definitions", files) if files.len() <= 1 => {
                let d = self.c.call("GET", "/api/definitions", None)?;
                let text = serde_json::to_string_pretty(&d).unwrap_or_default();
                match files.first() {
                    Some(f) => std::fs::write(f, text)
                        .map_err(|e| Failure::Usage(format!("cannot write {f}: {e}")))?,
                    None => println!("{text}"),
                }
            }
            ("import_definitions", [file]) => {
                let text = std::fs::read_to_string(file)
                    .map_err(|e| Failure::Usage(format!("cannot read {file}: {e}")))?;
                let d: Value = serde_json::from_str(&text)
                    .map_err(|e| Failure::Usage(format!("{file} is not JSON: {e}")))?;
                self.c.call("POST", "/api/definitions", Some(&d))?;
                self.done(format!("definitions imported from {file}"));
            }
            _ => return Err(self.unknown()),
        }
        Ok(())
    }

    /// `query_msg`: messages by id, queue offset, queue time or MQTT topic.
    fn query_msg(&self, opts: &[&str]) -> Result<(), Failure> {
        let v = &self.v;
        let q = query_options(opts)?;
        let get = |k: &str| q.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
        let mut params: Vec<String> = q
            .iter()
            .filter(|(n, _)| matches!(*n, "count" | "body" | "from" | "to"))
            .map(|(n, v)| format!("{n}={}", enc(v)))
            .collect();
        let by_topic = get("topic").is_some();
        let path = match (
            get("id"),
            get("queue"),
            get("offset"),
            get("from"),
            get("topic"),
        ) {
            (Some(id), None, None, None, None) => {
                format!("/api/messages/by-id/{}", enc(id))
            }
            (None, Some(queue), Some(off), None, None) => {
                format!("/api/messages/{v}/{}/offset/{}", enc(queue), enc(off))
            }
            (None, Some(queue), None, Some(_), None) => {
                format!("/api/messages/{v}/{}/time", enc(queue))
            }
            (None, None, None, _, Some(topic)) => {
                params.push(format!("topic={}", enc(topic)));
                format!("/api/messages/by-topic/{v}")
            }
            _ => return Err(Failure::Usage(
                "query_msg needs --id ID, --queue Q --offset N, --queue Q --from MS or --topic T"
                    .into(),
            )),
        };
        if get("to").is_some() && get("from").is_none() && !by_topic {
            return Err(Failure::Usage("--to needs --from".into()));
        }
        params.sort();
        let sep = if params.is_empty() { "" } else { "?" };
        let found = self
            .c
            .call("GET", &format!("{path}{sep}{}", params.join("&")), None)?;
        self.show(
            found,
            &[
                "commit_offset",
                "store_time",
                "payload_bytes",
                "routing_key",
                "properties.message_id",
                "payload",
            ],
        );
        Ok(())
    }
}

/// `query_msg`'s options as (name, value) pairs; `--full` is `body=full`.
fn query_options<'a>(opts: &[&'a str]) -> Result<Vec<(&'a str, &'a str)>, Failure> {
    let mut q: Vec<(&str, &str)> = Vec::new();
    let mut k = opts.iter();
    while let Some(o) = k.next() {
        let key = match *o {
            "--id" | "--queue" | "--offset" | "--from" | "--to" | "--count" | "--topic" => {
                o.trim_start_matches('-')
            }
            "--full" => {
                q.push(("body", "full"));
                continue;
            }
            other => {
                return Err(Failure::Usage(format!(
                    "query_msg: unknown option '{other}'"
                )))
            }
        };
        let val = k
            .next()
            .ok_or_else(|| Failure::Usage(format!("{o} needs a value")))?;
        q.push((key, val));
    }
    Ok(q)
}

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(m)) => {
            eprintln!("triadctl: {m} (triadctl --help for usage)");
            ExitCode::from(2)
        }
        Err(Failure::Refused(m)) => {
            eprintln!("triadctl: error: {m}");
            ExitCode::from(1)
        }
        Err(Failure::Unreachable(m)) => {
            eprintln!("triadctl: {m}");
            ExitCode::from(3)
        }
    }
}
