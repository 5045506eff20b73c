//! `triad-bench stomp`: a minimal STOMP 1.2 client (text frames written by hand, binary
//! bodies with content-length) driving producers and consumers on `/queue/<name>`
//! destinations: producer p sends to queue p % N, consumer c subscribes to queue c % N.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::args::{StompAck, StompArgs};
use crate::e2e::{self, Checker, Counters, Harness, Pacer};
use crate::wire::ReadBuf;

const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
const FLUSH_AT: usize = 64 << 10;

/// One parsed frame, borrowing the read buffer.
#[derive(Debug, PartialEq)]
pub struct Frame<'a> {
    pub command: &'a str,
    pub headers: Vec<(&'a str, &'a str)>,
    pub body: &'a [u8],
}

impl Frame<'_> {
    pub fn header(&self, name: &str) -> Option<&str> {
        // STOMP 1.2: the first occurrence of a repeated header wins
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| *v)
    }
}

/// Parses the frame at the front of `data`: `Ok(None)` if incomplete, else the frame and
/// the bytes it used (leading heart-beat EOLs included).
pub fn parse(data: &[u8]) -> Result<Option<(Frame<'_>, usize)>, String> {
    let mut i = 0;
    while i < data.len() && (data[i] == b'\n' || data[i] == b'\r') {
        i += 1;
    }
    let rest = &data[i..];
    let Some(hend) = rest
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|p| (p, p + 2))
        .or_else(|| {
            rest.windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|p| (p, p + 4))
        })
    else {
        if rest.len() > 1 << 20 {
            return Err("frame header over 1 MiB".into());
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&rest[..hend.0]).map_err(|_| "non-UTF-8 frame header")?;
    let mut lines = head.lines().map(|l| l.trim_end_matches('\r'));
    let command = lines.next().unwrap_or("");
    let headers: Vec<(&str, &str)> = lines.filter_map(|l| l.split_once(':')).collect();
    let start = hend.1;
    let (body_end, used) = match headers
        .iter()
        .find(|(k, _)| *k == "content-length")
        .map(|(_, v)| v.parse::<usize>())
    {
        Some(Ok(n)) => {
            if rest.len() < start + n + 1 {
                return Ok(None);
            }
            if rest[start + n] != 0 {
                return Err("no NUL after content-length bytes".into());
            }
            (start + n, start + n + 1)
        }
        Some(Err(_)) => return Err("bad content-length".into()),
        None => match rest[start..].iter().position(|&b| b == 0) {
            Some(p) => (start + p, start + p + 1),
            None => return Ok(None),
        },
    };
    Ok(Some((
        Frame {
            command,
            headers,
            body: &rest[start..body_end],
        },
        i + used,
    )))
}

struct Conn {
    r: ReadBuf,
    w: OwnedWriteHalf,
    out: Vec<u8>,
}

impl Conn {
    async fn open(a: &StompArgs) -> Result<Conn, String> {
        let l = &a.load;
        let s = tokio::time::timeout(SETUP_TIMEOUT, TcpStream::connect((l.host.as_str(), l.port)))
            .await
            .map_err(|_| format!("connect {}:{}: timed out", l.host, l.port))?
            .map_err(|e| format!("connect {}:{}: {e}", l.host, l.port))?;
        let _ = s.set_nodelay(true);
        let (rd, w) = s.into_split();
        let mut c = Conn {
            r: ReadBuf::new(rd),
            w,
            out: Vec::with_capacity(FLUSH_AT * 2),
        };
        c.out.extend_from_slice(
            format!(
                "CONNECT\naccept-version:1.2\nhost:{}\nlogin:{}\npasscode:{}\nheart-beat:0,0\n\n\0",
                a.vhost, l.user, l.pass
            )
            .as_bytes(),
        );
        c.flush().await?;
        c.expect("CONNECTED", None).await?;
        Ok(c)
    }

    async fn flush(&mut self) -> Result<(), String> {
        write_out(&mut self.w, &mut self.out).await
    }

    /// Reads until a `command` frame (with `receipt-id: receipt` if given); ERROR fails.
    async fn expect(&mut self, command: &str, receipt: Option<&str>) -> Result<(), String> {
        loop {
            let found = match parse(self.r.data())? {
                Some((f, used)) => {
                    if f.command == "ERROR" {
                        return Err(error_text(&f));
                    }
                    let ok = f.command == command
                        && receipt.is_none_or(|r| f.header("receipt-id") == Some(r));
                    Some((ok, used))
                }
                None => None,
            };
            match found {
                Some((ok, used)) => {
                    self.r.consume(used);
                    if ok {
                        return Ok(());
                    }
                }
                None => self.r.fill_within(4096, SETUP_TIMEOUT).await?,
            }
        }
    }

    /// DISCONNECT with a receipt, then waits briefly for it.
    async fn close(mut self) {
        self.out.extend_from_slice(b"DISCONNECT\nreceipt:bye\n\n\0");
        if self.flush().await.is_ok() {
            let _ =
                tokio::time::timeout(Duration::from_secs(2), self.expect("RECEIPT", Some("bye")))
                    .await;
        }
    }
}

fn error_text(f: &Frame) -> String {
    format!(
        "ERROR from broker: {} {}",
        f.header("message").unwrap_or(""),
        String::from_utf8_lossy(&f.body[..f.body.len().min(200)]).trim()
    )
}

async fn write_out(w: &mut OwnedWriteHalf, out: &mut Vec<u8>) -> Result<(), String> {
    if !out.is_empty() {
        w.write_all(out).await.map_err(|e| format!("write: {e}"))?;
        out.clear();
    }
    Ok(())
}

fn destination(i: usize) -> String {
    format!("/queue/triad-bench-{}-{i}", std::process::id())
}

/// SEND frame: headers, body, NUL.
fn send_frame(
    out: &mut Vec<u8>,
    dest: &str,
    persistent: bool,
    receipt: Option<u64>,
    headers: &[String],
    body: &[u8],
) {
    use std::io::Write;
    let _ = write!(
        out,
        "SEND\ndestination:{dest}\ncontent-type:application/octet-stream\ncontent-length:{}\n",
        body.len()
    );
    if persistent {
        out.extend_from_slice(b"persistent:true\n");
    }
    if let Some(r) = receipt {
        let _ = writeln!(out, "receipt:{r}");
    }
    for h in headers {
        let _ = writeln!(out, "{h}");
    }
    out.push(b'\n');
    out.extend_from_slice(body);
    out.push(0);
}

/// The producer's read side: a RECEIPT frees a window slot; `bye` ends it; ERROR fails.
async fn receipt_reader(
    mut r: ReadBuf,
    window: Arc<Semaphore>,
    counters: Arc<Counters>,
    done: CancellationToken,
) -> (u64, Option<String>) {
    let mut receipts = 0u64;
    let res: Result<(), String> = async {
        loop {
            while let Some((f, used)) = parse(r.data())? {
                match f.command {
                    "RECEIPT" => {
                        if f.header("receipt-id") == Some("bye") {
                            return Ok(());
                        }
                        receipts += 1;
                        counters.confirmed.fetch_add(1, Ordering::Relaxed);
                        window.add_permits(1);
                    }
                    "ERROR" => return Err(error_text(&f)),
                    _ => {}
                }
                r.consume(used);
            }
            r.fill(4096).await?;
        }
    }
    .await;
    let err = res.err();
    if err.is_some() {
        window.close();
    }
    done.cancel();
    (receipts, err)
}

async fn producer(
    c: Conn,
    a: Arc<StompArgs>,
    id: u32,
    dest: String,
    quota: Option<u64>,
    deadline: Option<Instant>,
    counters: Arc<Counters>,
) -> e2e::ProducerResult {
    let Conn { r, mut w, mut out } = c;
    let window = Arc::new(Semaphore::new(if a.receipts {
        a.receipt_window
    } else {
        Semaphore::MAX_PERMITS
    }));
    let done = CancellationToken::new();
    let reader = tokio::spawn(receipt_reader(
        r,
        window.clone(),
        counters.clone(),
        done.clone(),
    ));
    let pacer = Pacer::new(a.load.rate.map(|r| r / a.load.producers as f64));
    let mut body = e2e::body_template(a.load.size);
    let mut sent = 0u64;
    let res: Result<(), String> = async {
        loop {
            if quota.is_some_and(|q| sent >= q)
                || deadline.is_some_and(|d| Instant::now() >= d)
                || done.is_cancelled()
            {
                break;
            }
            if let Some(d) = pacer.wait(sent) {
                write_out(&mut w, &mut out).await?;
                tokio::time::sleep(d).await;
            }
            if a.receipts {
                match window.try_acquire() {
                    Ok(p) => p.forget(),
                    Err(_) => {
                        write_out(&mut w, &mut out).await?;
                        match window.acquire().await {
                            Ok(p) => p.forget(),
                            Err(_) => break,
                        }
                    }
                }
            }
            e2e::stamp(&mut body, id, sent as u32, e2e::now_ns());
            send_frame(
                &mut out,
                &dest,
                a.persistent,
                a.receipts.then_some(sent),
                &a.header,
                &body,
            );
            sent += 1;
            counters.sent.fetch_add(1, Ordering::Relaxed);
            if out.len() >= FLUSH_AT {
                write_out(&mut w, &mut out).await?;
            }
        }
        write_out(&mut w, &mut out).await?;
        if a.receipts {
            let t = Instant::now() + a.load.drain_timeout.max(Duration::from_secs(10));
            while window.available_permits() < a.receipt_window
                && !done.is_cancelled()
                && Instant::now() < t
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        out.extend_from_slice(b"DISCONNECT\nreceipt:bye\n\n\0");
        write_out(&mut w, &mut out).await
    }
    .await;
    let (receipts, rerr) = match tokio::time::timeout(Duration::from_secs(5), reader).await {
        Ok(Ok(x)) => x,
        _ => (0, Some("no DISCONNECT receipt from the broker".into())),
    };
    let mut err = res.err().or(rerr);
    if a.receipts && err.is_none() && receipts < sent {
        err = Some(format!("{} SENDs never got a receipt", sent - receipts));
    }
    (sent, err)
}

async fn start_consumer(a: &StompArgs, dest: &str) -> Result<Conn, String> {
    let mut c = Conn::open(a).await?;
    let mut sub = format!(
        "SUBSCRIBE\nid:0\ndestination:{dest}\nack:{}\nreceipt:sub\n",
        a.ack.name()
    );
    if let Some(p) = a.prefetch {
        sub.push_str(&format!("prefetch-count:{p}\n"));
    }
    if let Some(s) = &a.selector {
        sub.push_str(&format!("selector:{s}\n"));
    }
    sub.push_str("\n\0");
    c.out.extend_from_slice(sub.as_bytes());
    c.flush().await?;
    c.expect("RECEIPT", Some("sub")).await?;
    Ok(c)
}

async fn consumer(
    mut c: Conn,
    a: Arc<StompArgs>,
    producers: usize,
    counters: Arc<Counters>,
    stop: CancellationToken,
) -> e2e::ConsumerResult {
    let mut chk = Checker::new(producers, a.load.size);
    let res: Result<(), String> = async {
        loop {
            let mut n = 0u64;
            let mut last_ack: Option<String> = None;
            while let Some((f, used)) = parse(c.r.data())? {
                match f.command {
                    "MESSAGE" => {
                        chk.check(f.body);
                        n += 1;
                        match a.ack {
                            StompAck::Auto => {}
                            StompAck::Client => last_ack = f.header("ack").map(String::from),
                            StompAck::ClientIndividual => {
                                let id = f.header("ack").ok_or("MESSAGE without ack header")?;
                                c.out
                                    .extend_from_slice(format!("ACK\nid:{id}\n\n\0").as_bytes());
                            }
                        }
                    }
                    "ERROR" => return Err(error_text(&f)),
                    _ => {}
                }
                c.r.consume(used);
            }
            if n > 0 {
                counters.received.fetch_add(n, Ordering::Relaxed);
            }
            if let Some(id) = last_ack {
                // client mode: cumulative
                c.out
                    .extend_from_slice(format!("ACK\nid:{id}\n\n\0").as_bytes());
            }
            c.flush().await?;
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                r = c.r.fill(a.load.size + 4096) => r?,
            }
        }
    }
    .await;
    let err = res.err();
    if err.is_none() {
        c.close().await;
    }
    (chk, err)
}

pub fn run(a: &StompArgs) -> Result<Value, String> {
    e2e::runtime(a.load.threads)?.block_on(run_async(Arc::new(a.clone())))
}

async fn run_async(a: Arc<StompArgs>) -> Result<Value, String> {
    let l = &a.load;
    let groups = a.queues;
    let dests: Vec<String> = (0..groups).map(destination).collect();
    let mut consumer_conns = Vec::new();
    for j in 0..l.consumers {
        consumer_conns.push(start_consumer(&a, &dests[j % groups]).await?);
    }
    let mut producer_conns = Vec::new();
    for _ in 0..l.producers {
        producer_conns.push(Conn::open(&a).await?);
    }
    let h = Harness::start(l)?;
    let consumers: Vec<_> = consumer_conns
        .into_iter()
        .map(|c| {
            tokio::spawn(consumer(
                c,
                a.clone(),
                l.producers,
                h.counters.clone(),
                h.stop.clone(),
            ))
        })
        .collect();
    let quotas = e2e::quotas(l.count, l.producers);
    let producers: Vec<_> = producer_conns
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            tokio::spawn(producer(
                c,
                a.clone(),
                i as u32,
                dests[i % groups].clone(),
                quotas[i],
                h.deadline(l),
                h.counters.clone(),
            ))
        })
        .collect();
    let feeds = move |g: usize, p: usize| p % groups == g;
    let fin = h
        .finish(l, producers, consumers, |sent| sent.iter().sum())
        .await;
    let group_of: Vec<usize> = (0..l.consumers).map(|j| j % groups).collect();
    let o = fin.outcome(&group_of, groups, feeds);
    Ok(e2e::result(
        "stomp",
        l,
        &o,
        json!({
            "variant": format!("{}+ack-{}{}{}",
                if a.persistent { "persistent" } else { "transient" },
                a.ack.name(),
                if a.receipts { "+receipts" } else { "" },
                if a.selector.is_some() { "+selector" } else { "" }),
            "selector": a.selector,
            "headers": a.header,
            "queues": groups,
            "persistent": a.persistent,
            "receipts": a.receipts,
            "receipt_window": a.receipts.then_some(a.receipt_window),
            "ack": a.ack.name(),
            "prefetch": a.prefetch,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_frames() {
        let mut out = Vec::new();
        send_frame(&mut out, "/queue/a", true, Some(7), &[], b"he\0llo");
        out.extend_from_slice(b"\n\nRECEIPT\r\nreceipt-id:7\r\n\r\n\0");
        let (f, used) = parse(&out).unwrap().unwrap();
        assert_eq!(f.command, "SEND");
        assert_eq!(f.header("destination"), Some("/queue/a"));
        assert_eq!(f.header("persistent"), Some("true"));
        assert_eq!(f.header("receipt"), Some("7"));
        assert_eq!(f.body, b"he\0llo");
        let (g, used2) = parse(&out[used..]).unwrap().unwrap();
        assert_eq!(g.command, "RECEIPT");
        assert_eq!(g.header("receipt-id"), Some("7"));
        assert!(g.body.is_empty());
        assert_eq!(used + used2, out.len());
        for cut in [1, 10, used - 1] {
            assert_eq!(parse(&out[..cut]).unwrap(), None, "{cut}");
        }
        assert!(parse(b"MESSAGE\ncontent-length:2\n\nabc\0").is_err());
    }
}
