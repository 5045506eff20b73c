//! The web dashboard: static files compiled into the binary (vanilla JS, no build step),
//! served at `/` (also `/ui/`) and `/ui/app.js`, `/ui/style.css`. The page logs in with
//! the management API's basic auth and renders what `/api` answers (overview with a
//! message-rate chart, queues with peek / purge / delete, connections with close,
//! exchanges, bindings, users, permissions, policies, a message query by id). Broker
//! data is always put in the page as text, and a `Content-Security-Policy` allows only
//! the dashboard's own scripts and styles.

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Response, StatusCode};

use crate::http::Body;

const INDEX: &str = include_str!("../ui/index.html");
const APP: &str = include_str!("../ui/app.js");
const STYLE: &str = include_str!("../ui/style.css");

/// The file at `path`, if it is one of the dashboard's.
pub fn file(path: &str, method: &Method) -> Option<Response<Body>> {
    let (body, kind) = match path {
        "/" | "/ui" | "/ui/" | "/ui/index.html" => (INDEX, "text/html; charset=utf-8"),
        "/ui/app.js" => (APP, "text/javascript; charset=utf-8"),
        "/ui/style.css" => (STYLE, "text/css; charset=utf-8"),
        _ => return None,
    };
    if method != Method::GET && method != Method::HEAD {
        return Some(super::ApiError::method_not_allowed().response());
    }
    let mut r = crate::http::json_response(
        StatusCode::OK,
        if method == Method::HEAD {
            Bytes::new()
        } else {
            Bytes::from_static(body.as_bytes())
        },
    );
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        HeaderName::from_static("content-security-policy"),
        HeaderValue::from_static("default-src 'self'; frame-ancestors 'none'"),
    );
    h.insert(
        HeaderName::from_static("x-content-type-options"),
        HeaderValue::from_static("nosniff"),
    );
    Some(r)
}
