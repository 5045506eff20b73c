//! Listings: RabbitMQ's query parameters (`columns`, `sort=name`, `sort_reverse`,
//! `name` + `use_regex`, `page` + `page_size`) and a body streamed in chunks, so that a
//! listing of 100,000 queues never holds more than one item's JSON and the sorted names.

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde_json::Value;

use super::json::pick;
use super::ApiError;
use crate::http::{Body, ChannelBody};

/// RabbitMQ's largest `page_size`.
pub const MAX_PAGE_SIZE: usize = 500;
/// Bytes gathered before a chunk is sent.
const CHUNK: usize = 64 << 10;
/// Chunks in flight between the producer and the connection.
const CHUNKS_IN_FLIGHT: usize = 4;

/// How items are filtered.
#[derive(Debug, Clone)]
pub enum NameFilter {
    /// Names containing the string.
    Contains(String),
    /// Names matching the regex.
    Regex(triad_core::Pattern),
}

/// The listing parameters of a request.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    /// `columns=a,b.c`: keep only these (dotted paths into nested objects).
    pub columns: Option<Vec<Vec<String>>>,
    /// `sort_reverse=true`.
    pub reverse: bool,
    /// `name=...` (with `use_regex=true`, a regex).
    pub name: Option<NameFilter>,
    /// `page` and `page_size`: a paginated answer.
    pub page: Option<(usize, usize)>,
}

impl ListQuery {
    /// Reads the listing parameters; any other parameter is left to the handler.
    pub fn parse(params: &[(String, String)]) -> Result<ListQuery, ApiError> {
        let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let mut q = ListQuery::default();
        if let Some(c) = get("columns") {
            q.columns = Some(
                c.split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.split('.').map(str::to_owned).collect())
                    .collect(),
            );
        }
        match get("sort") {
            None | Some("") | Some("name") => {}
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "sort={other} is not supported: listings are sorted by name"
                )))
            }
        }
        q.reverse = get("sort_reverse") == Some("true");
        if let Some(n) = get("name").filter(|n| !n.is_empty()) {
            q.name =
                Some(if get("use_regex") == Some("true") {
                    NameFilter::Regex(triad_core::Pattern::new(n).map_err(|e| {
                        ApiError::bad_request(format!("invalid regex: {}", e.reason))
                    })?)
                } else {
                    NameFilter::Contains(n.to_owned())
                });
        }
        let num = |k: &str| -> Result<Option<usize>, ApiError> {
            get(k)
                .map(|v| {
                    v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| {
                        ApiError::bad_request(format!("{k} must be a positive integer"))
                    })
                })
                .transpose()
        };
        let page = num("page")?;
        let size = num("page_size")?;
        if let Some(s) = size {
            if s > MAX_PAGE_SIZE {
                return Err(ApiError::bad_request(format!(
                    "page_size must be at most {MAX_PAGE_SIZE}"
                )));
            }
        }
        if page.is_some() || size.is_some() {
            q.page = Some((page.unwrap_or(1), size.unwrap_or(100)));
        }
        Ok(q)
    }

    fn matches(&self, name: &str) -> bool {
        match &self.name {
            None => true,
            Some(NameFilter::Contains(s)) => name.contains(s.as_str()),
            Some(NameFilter::Regex(p)) => p.is_match(name),
        }
    }
}

/// Lists `keys` (sorted by name by the caller): filtered by name, paged, each rendered
/// by `render` (`None`: it went away meanwhile) on a blocking thread, streamed.
pub fn respond<K, N, R>(
    q: ListQuery,
    mut keys: Vec<K>,
    name: N,
    render: R,
) -> Result<Response<Body>, ApiError>
where
    K: Send + 'static,
    N: Fn(&K) -> &str,
    R: Fn(&K) -> Option<Value> + Send + 'static,
{
    let total = keys.len();
    keys.retain(|k| q.matches(name(k)));
    if q.reverse {
        keys.reverse();
    }
    let filtered = keys.len();
    let mut header = None;
    if let Some((page, size)) = q.page {
        let page_count = filtered.div_ceil(size);
        if page > page_count.max(1) {
            return Err(ApiError::bad_request(format!(
                "page out of range: page {page} of {page_count}"
            )));
        }
        let start = (page - 1) * size;
        keys = keys.into_iter().skip(start).take(size).collect();
        header = Some(format!(
            r#"{{"filtered_count":{filtered},"item_count":{},"page":{page},"page_count":{page_count},"page_size":{size},"total_count":{total},"items":"#,
            keys.len()
        ));
    }
    let columns = q.columns;
    Ok(stream(move |out| {
        let paged = header.is_some();
        if let Some(h) = header {
            out.put(h.as_bytes());
        }
        out.put(b"[");
        let mut first = true;
        for k in &keys {
            let Some(mut v) = render(k) else {
                continue;
            };
            if let Some(cols) = &columns {
                v = pick(v, cols);
            }
            if !first {
                out.put(b",");
            }
            first = false;
            if !out.value(&v) {
                return; // the client went away
            }
        }
        out.put(b"]");
        if paged {
            out.put(b"}");
        }
    }))
}

/// A JSON body written in chunks by a producer on a blocking thread.
pub struct Chunks {
    buf: BytesMut,
    tx: tokio::sync::mpsc::Sender<Bytes>,
    gone: bool,
}

impl Chunks {
    /// Appends raw bytes (sent once a chunk is full).
    pub fn put(&mut self, b: &[u8]) {
        self.buf.put_slice(b);
        self.flush_if_full();
    }

    /// Appends a value as JSON; `false` once the client went away.
    pub fn value(&mut self, v: &Value) -> bool {
        let mut w = (&mut self.buf).writer();
        if serde_json::to_writer(&mut w, v).is_err() {
            self.gone = true;
        }
        self.flush_if_full();
        !self.gone
    }

    /// Whether the client went away (the producer may stop).
    pub fn gone(&self) -> bool {
        self.gone
    }

    fn flush_if_full(&mut self) {
        if self.buf.len() >= CHUNK && !self.gone {
            self.gone = self.tx.blocking_send(self.buf.split().freeze()).is_err();
        }
    }
}

/// A `200` JSON response whose body `produce` writes on a blocking thread, sent as it
/// is written (at most [`CHUNKS_IN_FLIGHT`] chunks of 64 KiB wait for the client).
pub fn stream(produce: impl FnOnce(&mut Chunks) + Send + 'static) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(CHUNKS_IN_FLIGHT);
    tokio::task::spawn_blocking(move || {
        let mut out = Chunks {
            buf: BytesMut::with_capacity(CHUNK + 4096),
            tx,
            gone: false,
        };
        produce(&mut out);
        if !out.gone {
            let rest = out.buf.split().freeze();
            let _ = out.tx.blocking_send(rest);
        }
    });
    let mut r = Response::new(ChannelBody(rx).boxed());
    *r.status_mut() = StatusCode::OK;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params(s: &[(&str, &str)]) -> Vec<(String, String)> {
        s.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    async fn body(r: Response<Body>) -> Value {
        let b = r.into_body().collect().await.expect("body").to_bytes();
        serde_json::from_slice(&b).expect("json")
    }

    #[tokio::test]
    async fn pages_filters_and_streams_large_listings() {
        let names: Vec<String> = (0..10_000).map(|i| format!("q{i:05}")).collect();
        let q = ListQuery::parse(&params(&[
            ("page", "3"),
            ("page_size", "500"),
            ("columns", "name"),
        ]))
        .expect("query");
        let r = respond(
            q,
            names.clone(),
            |s| s.as_str(),
            |s| Some(json!({"name": s, "x": 1})),
        )
        .expect("listing");
        let v = body(r).await;
        assert_eq!(v["total_count"], 10_000);
        assert_eq!(v["page_count"], 20);
        assert_eq!(v["item_count"], 500);
        assert_eq!(v["items"][0], json!({"name": "q01000"}));
        let all = respond(
            ListQuery::default(),
            names.clone(),
            |s| s.as_str(),
            |s| Some(json!({"name": s})),
        )
        .expect("listing");
        assert_eq!(body(all).await.as_array().map(Vec::len), Some(10_000));
        let q = ListQuery::parse(&params(&[
            ("name", "^q0000[12]$"),
            ("use_regex", "true"),
            ("sort_reverse", "true"),
        ]))
        .expect("query");
        let r = respond(q, names.clone(), |s| s.as_str(), |s| Some(json!(s))).expect("listing");
        assert_eq!(body(r).await, json!(["q00002", "q00001"]));
        let q = ListQuery::parse(&params(&[("page", "99"), ("page_size", "500")])).expect("query");
        assert!(respond(q, names, |s| s.as_str(), |s| Some(json!(s))).is_err());
        assert!(ListQuery::parse(&params(&[("page_size", "501")])).is_err());
        assert!(ListQuery::parse(&params(&[("sort", "messages")])).is_err());
        assert!(ListQuery::parse(&params(&[("page", "x")])).is_err());
    }
}
