//! The management HTTP API under `/api`, in RabbitMQ's URL and JSON shapes, so that
//! `rabbitmqadmin` and scripts written against RabbitMQ's API work for what Triad has.
//!
//! - **Auth**: HTTP basic auth against the broker's users ([`triad_core::Broker::authenticate`]:
//!   the same password check, failed-login throttling and loopback rule
//!   (`auth.loopback_users`) as the protocols). A user needs one of the tags
//!   `management`, `policymaker`, `monitoring` or `administrator`; as in RabbitMQ,
//!   `management` users see and change only vhosts they have permissions in (and need
//!   the configure / write / read permission for each change), `monitoring` users see
//!   every vhost and connection, and only `administrator`s manage users, vhosts,
//!   permissions and definitions. Refusals are RabbitMQ's: `401` with
//!   `{"error":"not_authorised","reason":...}` (`WWW-Authenticate` when the
//!   credentials are missing or wrong).
//! - **Errors**: `400 {"error":"bad_request","reason":...}` for invalid input (what
//!   `rabbitmqadmin` prints), `404 {"error":"Object Not Found"}`, `405` for a method a
//!   path does not take, `413` for a body over `http.max_body_size`, `501` for what Triad
//!   does not implement (named in the reason).
//! - **Listings** ([`list`]): `columns`, `sort=name` (the only order; another `sort` is
//!   a 400), `sort_reverse`, `name` / `use_regex`, `page` / `page_size` (at most 500),
//!   streamed.
//! - Handlers run on a blocking thread: changes wait for the metadata journal's fsync.
//!
//! Modules: [`channels`] (channel listings), [`cluster`] (`/api/cluster`, replication
//! metrics), [`json`] (values and properties as JSON), [`list`] (listings), [`read`]
//! (GET handlers), [`write`] (changes), [`defs`] (definitions export and import),
//! [`policies`] (policies), [`user_limits`] (per-user limits), [`metrics`] (Prometheus
//! `/metrics`), [`messages`] (message queries from the store), [`streams`] (stored stream
//! consumer offsets), [`ui`] (the web dashboard's static files).

pub mod channels;
pub mod cluster;
pub mod defs;
pub mod json;
pub mod list;
pub mod messages;
pub mod metrics;
pub mod policies;
pub mod read;
pub mod streams;
pub mod ui;
pub mod user_limits;
pub mod write;

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use base64::Engine;
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, AUTHORIZATION, WWW_AUTHENTICATE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::Value;
use triad_core::{Broker, CoreError, User, Vhost, VhostAccess};

use crate::http::{error_response, json_response, read_body, Body, BodyError};
use crate::listener::ConnContext;

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// RabbitMQ's `error` field.
    pub error: Cow<'static, str>,
    /// RabbitMQ's `reason` field.
    pub reason: String,
}

impl ApiError {
    /// 400 with `reason` (what `rabbitmqadmin` prints).
    pub fn bad_request(reason: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            error: "bad_request".into(),
            reason: reason.into(),
        }
    }

    /// 404, RabbitMQ's body.
    pub fn not_found() -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            error: "Object Not Found".into(),
            reason: "Not Found".into(),
        }
    }

    /// 401 for an authenticated user who may not do this.
    pub fn not_authorised(reason: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            error: "not_authorised".into(),
            reason: reason.into(),
        }
    }

    /// 501 naming what Triad does not implement.
    pub fn not_implemented(reason: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_IMPLEMENTED,
            error: "not_implemented".into(),
            reason: reason.into(),
        }
    }

    /// 405.
    pub fn method_not_allowed() -> ApiError {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            error: "method_not_allowed".into(),
            reason: "Method Not Allowed".into(),
        }
    }

    /// The response.
    pub fn response(&self) -> Response<Body> {
        error_response(self.status, &self.error, &self.reason)
    }
}

impl From<CoreError> for ApiError {
    fn from(e: CoreError) -> ApiError {
        match e {
            CoreError::NotFound { .. } => ApiError::not_found(),
            CoreError::AccessRefused(r) | CoreError::NotAllowed(r) => {
                tracing::debug!(reason = %r, "management API request refused");
                ApiError::not_authorised(r)
            }
            CoreError::Internal(r) => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                error: "internal_error".into(),
                reason: r,
            },
            other => ApiError::bad_request(other.to_string()),
        }
    }
}

/// Shorthand for handler results.
pub type ApiResult = Result<Response<Body>, ApiError>;

/// `200` with a JSON value.
pub fn ok_json(v: &Value) -> ApiResult {
    Ok(json_response(StatusCode::OK, v.to_string()))
}

/// `201 Created` or `204 No Content`, with an empty body.
pub fn no_content(created: bool) -> ApiResult {
    let mut r = json_response(StatusCode::NO_CONTENT, Bytes::new());
    if created {
        *r.status_mut() = StatusCode::CREATED;
    }
    Ok(r)
}

/// This node's name, RabbitMQ style: `triad@<host name>`.
pub fn node_name() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into());
        format!("triad@{host}")
    })
}

/// One request being answered, by an authenticated management user.
#[derive(Clone)]
pub struct Api {
    pub ctx: ConnContext,
    pub user: User,
    pub peer: SocketAddr,
    /// Query parameters, decoded.
    pub params: Vec<(String, String)>,
}

const MANAGEMENT_TAGS: [&str; 4] = ["management", "policymaker", "monitoring", "administrator"];

impl Api {
    pub fn broker(&self) -> &Arc<Broker> {
        &self.ctx.broker
    }

    fn has_tag(&self, tag: &str) -> bool {
        self.user.tags.iter().any(|t| t == tag)
    }

    pub fn is_admin(&self) -> bool {
        self.has_tag("administrator")
    }

    /// Sees every vhost and connection.
    pub fn is_monitor(&self) -> bool {
        self.is_admin() || self.has_tag("monitoring")
    }

    pub fn require_admin(&self) -> Result<(), ApiError> {
        if self.is_admin() {
            Ok(())
        } else {
            Err(ApiError::not_authorised("Not administrator user"))
        }
    }

    pub fn require_monitor(&self) -> Result<(), ApiError> {
        if self.is_monitor() {
            Ok(())
        } else {
            Err(ApiError::not_authorised("Not monitor user"))
        }
    }

    /// A query parameter.
    pub fn param(&self, k: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the user may see `vhost`.
    pub fn can_see(&self, vhost: &str) -> bool {
        self.is_monitor()
            || self
                .broker()
                .auth()
                .access(&self.user.name, vhost)
                .is_some()
    }

    /// The vhosts the user may see, sorted.
    pub fn visible_vhosts(&self) -> Vec<String> {
        self.broker()
            .vhost_names()
            .into_iter()
            .filter(|v| self.can_see(v))
            .collect()
    }

    /// A vhost to read from: 404 when it does not exist, 401 when not visible.
    pub fn vhost_read(&self, name: &str) -> Result<Arc<Vhost>, ApiError> {
        let vh = self
            .broker()
            .vhost(name)
            .map_err(|_| ApiError::not_found())?;
        if !self.can_see(name) {
            return Err(ApiError::not_authorised(
                "User not authorised to access virtual host",
            ));
        }
        Ok(vh)
    }

    /// A vhost to change, with the user's rights there (administrators too need
    /// permissions in a vhost to change what is in it, as in RabbitMQ).
    pub fn vhost_write(&self, name: &str) -> Result<(Arc<Vhost>, Arc<VhostAccess>), ApiError> {
        let vh = self
            .broker()
            .vhost(name)
            .map_err(|_| ApiError::not_found())?;
        let access = self
            .broker()
            .auth()
            .access(&self.user.name, name)
            .ok_or_else(|| {
                ApiError::not_authorised("User not authorised to access virtual host")
            })?;
        Ok((vh, access))
    }

    /// Routes a request (on a blocking thread).
    pub fn route(&self, method: &Method, path: &[&str], body: &Bytes) -> ApiResult {
        let json_body = || -> Result<Value, ApiError> {
            if body.is_empty() {
                return Ok(Value::Object(Default::default()));
            }
            serde_json::from_slice(body)
                .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
        };
        if *method == Method::PUT || *method == Method::POST {
            // refused before the body is parsed
            write::authorize(self, method, path)?;
        }
        match *method {
            Method::GET | Method::HEAD => read::get(self, path),
            Method::PUT => write::put(self, path, &json_body()?),
            Method::DELETE => write::delete(self, path),
            Method::POST => write::post(self, path, &json_body()?),
            _ => Err(ApiError::method_not_allowed()),
        }
    }
}

/// Whether the request comes from a script that handles 401 itself (the dashboard sends
/// `X-Requested-With: XMLHttpRequest`): then no `WWW-Authenticate` is sent, so a browser
/// does not put up its own login dialog.
fn from_script<B>(req: &Request<B>) -> bool {
    req.headers()
        .get("x-requested-with")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"XMLHttpRequest"))
}

fn unauthorized(reason: &str, challenge: bool) -> Response<Body> {
    let mut r = error_response(StatusCode::UNAUTHORIZED, "not_authorized", reason);
    if !challenge {
        return r;
    }
    r.headers_mut().insert(
        WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"RabbitMQ Management\""),
    );
    r
}

/// Basic-auth credentials of a request.
fn credentials<B>(req: &Request<B>) -> Option<(String, String)> {
    let h = req.headers().get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, b64) = h.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (u, p) = text.split_once(':')?;
    Some((u.to_owned(), p.to_owned()))
}

/// Splits `/api/a/b%2Fc` into decoded segments `["a", "b/c"]`.
pub fn segments(path: &str) -> Option<Vec<String>> {
    let rest = path.strip_prefix("/api")?;
    let rest = rest.strip_prefix('/').unwrap_or(rest);
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() {
        return Some(Vec::new());
    }
    rest.split('/')
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .ok()
                .map(|c| c.into_owned())
        })
        .collect()
}

/// Decoded query parameters (`+` is a space, as in forms).
pub fn query_params(q: Option<&str>) -> Vec<(String, String)> {
    q.map(|q| {
        form_urlencoded::parse(q.as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect()
    })
    .unwrap_or_default()
}

/// Answers one `/api` request.
pub async fn handle(req: Request<Incoming>, ctx: &ConnContext, peer: SocketAddr) -> Response<Body> {
    let Some(segs) = segments(req.uri().path()) else {
        return ApiError::bad_request("path is not valid UTF-8 after percent-decoding").response();
    };
    let params = query_params(req.uri().query());
    let challenge = !from_script(&req);
    let Some((name, pass)) = credentials(&req) else {
        let mut r = json_response(StatusCode::UNAUTHORIZED, Bytes::new());
        r.headers_mut().insert(
            WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"RabbitMQ Management\""),
        );
        return r;
    };
    let broker = Arc::clone(&ctx.broker);
    // The protocols' login check: the loopback rule and the failed-login throttle
    // (a refusal is counted, and answered after its hold).
    let login_peer = triad_core::link::Peer {
        addr: peer.ip(),
        conn: broker.next_connection_id(),
        failed_login_delay: ctx.config.auth.failed_login_delay.get(),
    };
    let credentials = triad_core::link::Credentials::Password {
        user: &name,
        password: &pass,
    };
    let user = match broker.check_credentials(credentials, login_peer) {
        Ok(auth) => auth.user().clone(),
        Err(refused) => {
            let e = refused.reason;
            tracing::info!(%peer, user = %name, error = %e, "management API login refused");
            tokio::time::sleep(refused.hold).await;
            let reason = match e {
                CoreError::NotAllowed(_) => "User can only log in via localhost",
                _ => "Login failed",
            };
            return unauthorized(reason, challenge);
        }
    };
    if !user
        .tags
        .iter()
        .any(|t| MANAGEMENT_TAGS.contains(&t.as_str()))
    {
        return ApiError::not_authorised("Not management user").response();
    }
    let method = req.method().clone();
    let max = usize::try_from(ctx.config.http.max_body_size.bytes()).unwrap_or(usize::MAX);
    let body = if method == Method::GET || method == Method::HEAD || method == Method::DELETE {
        Bytes::new()
    } else {
        match read_body(req, max).await {
            Ok(b) => b,
            Err(BodyError::TooLarge) => {
                return error_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    &format!("request body larger than http.max_body_size ({max} bytes)"),
                )
            }
            Err(BodyError::Io) => {
                return ApiError::bad_request("request body could not be read").response()
            }
        }
    };
    let api = Api {
        ctx: ctx.clone(),
        user,
        peer,
        params,
    };
    let answer = tokio::task::spawn_blocking(move || {
        let path: Vec<&str> = segs.iter().map(String::as_str).collect();
        let r = api.route(&method, &path, &body);
        if let Err(e) = &r {
            tracing::debug!(peer = %api.peer, user = %api.user.name, %method, path = ?path, status = e.status.as_u16(), reason = %e.reason, "management API error");
        }
        r
    })
    .await;
    match answer {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => e.response(),
        Err(_) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "the request's handler failed",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_segments_and_queries() {
        assert_eq!(segments("/api"), Some(vec![]));
        assert_eq!(segments("/api/"), Some(vec![]));
        assert_eq!(
            segments("/api/queues/%2F/a%20b"),
            Some(vec!["queues".into(), "/".into(), "a b".into()])
        );
        assert_eq!(
            segments("/api/bindings/%2F/e/x/q/y/~"),
            Some(
                ["bindings", "/", "e", "x", "q", "y", "~"]
                    .map(String::from)
                    .to_vec()
            )
        );
        assert_eq!(segments("/api/q/%ff"), None);
        assert_eq!(
            query_params(Some("columns=name,messages&name=a+b&x=%2F")),
            vec![
                ("columns".to_string(), "name,messages".to_string()),
                ("name".to_string(), "a b".to_string()),
                ("x".to_string(), "/".to_string())
            ]
        );
    }

    #[test]
    fn reads_basic_credentials() {
        let req = Request::builder()
            .header(AUTHORIZATION, "Basic Z3Vlc3Q6Z3Vlc3Q6eA==")
            .body(())
            .expect("request");
        assert_eq!(credentials(&req), Some(("guest".into(), "guest:x".into())));
        let req = Request::builder()
            .header(AUTHORIZATION, "Bearer abc")
            .body(())
            .expect("request");
        assert_eq!(credentials(&req), None);
    }

    #[test]
    fn core_errors_map_to_rabbitmq_statuses() {
        let e: ApiError = CoreError::queue_not_found("q").into();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        let e: ApiError = CoreError::PreconditionFailed("inequivalent arg".into()).into();
        assert_eq!(
            (e.status, e.error.as_ref()),
            (StatusCode::BAD_REQUEST, "bad_request")
        );
        let e: ApiError = CoreError::AccessRefused("no".into()).into();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        let e: ApiError = CoreError::Internal("disk".into()).into();
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
