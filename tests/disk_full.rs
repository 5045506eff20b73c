//! A store that runs out of disk space: commitlog segments are preallocated whole, so the
//! store can be out of room while the file system still has more free than
//! `disk_free_limit`. The broker then raises its disk alarm (publishers blocked, not
//! refused), keeps every receipted message, and carries on once space is freed.
//!
//! The data directory lives on a small tmpfs mounted in a private user + mount namespace
//! (`unshare -rm`, no privileges needed where unprivileged user namespaces are allowed);
//! a filler file on the same tmpfs is deleted through `/proc/PID/root` to free space.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{ephemeral_listen_args, parse_listening, triad_command};

const BODY: usize = 64 * 1024;

struct Broker {
    child: Child,
    log: Arc<Mutex<String>>,
    stomp: SocketAddr,
    mnt: PathBuf,
}

impl Broker {
    fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn wait_for_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "no `{needle}` in the log within {timeout:?}:\n{}",
            self.log()
        );
    }

    /// A path on the broker's tmpfs, seen from outside its mount namespace.
    fn inside(&self, p: &Path) -> PathBuf {
        let rel = p.strip_prefix("/").expect("absolute path");
        PathBuf::from(format!("/proc/{}/root", self.child.id())).join(rel)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(tmp: &Path) -> Broker {
    let mnt = tmp.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let config = tmp.join("triad.toml");
    std::fs::write(
        &config,
        "[store]\nsegment_size = \"1 MiB\"\n[limits]\ndisk_free_limit = \"16 KiB\"\nmax_message_size = \"512 KiB\"\n",
    )
    .expect("config");
    let bin = triad_command().get_program().to_owned();
    // 12 MiB of tmpfs: 3 MiB of filler, the first 1 MiB segment and a queue's 5.7 MiB
    // consume-queue file leave room for about two more segments.
    let script = r#"mount -t tmpfs -o size=12m tmpfs "$0" && dd if=/dev/zero of="$0/filler" bs=64k count=48 2>/dev/null && exec "$@""#;
    let mut child = Command::new("unshare")
        .args(["-rm", "sh", "-c", script])
        .arg(&mnt)
        .arg(bin)
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(mnt.join("data"))
        .args(ephemeral_listen_args())
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn unshare (util-linux)");
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel::<String>();
    for out in [
        Box::new(child.stdout.take().expect("stdout")) as Box<dyn Read + Send>,
        Box::new(child.stderr.take().expect("stderr")),
    ] {
        let log = Arc::clone(&log);
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                log.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_str(&format!("{line}\n"));
                let _ = tx.send(line);
            }
        });
    }
    drop(tx);
    let mut stomp = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some((proto, addr)) = parse_listening(&line) {
                    if proto == "stomp" {
                        stomp = Some(addr);
                    }
                }
                if line.contains("broker ready") {
                    break;
                }
            }
            Err(e) => {
                let status = child.try_wait();
                panic!(
                    "broker not ready ({e:?}, status {status:?}); user namespaces must be \
                     allowed for this test (`unshare -rm true`). Log:\n{}",
                    log.lock().unwrap_or_else(|e| e.into_inner())
                );
            }
        }
    }
    Broker {
        child,
        log,
        stomp: stomp.expect("stomp listener"),
        mnt,
    }
}

struct Stomp {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Stomp {
    fn connect(addr: SocketAddr) -> Stomp {
        let s = TcpStream::connect(addr).expect("connect");
        let mut c = Stomp { s, buf: Vec::new() };
        c.send_raw(b"CONNECT\naccept-version:1.2\nhost:/\nlogin:guest\npasscode:guest\n\n\0");
        let f = c.frame(Duration::from_secs(10)).expect("CONNECTED");
        assert!(f.starts_with("CONNECTED"), "{f}");
        c
    }

    fn send_raw(&mut self, b: &[u8]) {
        let _ = self.s.write_all(b);
    }

    fn send(&mut self, seq: u32) {
        let body = vec![b'a' + (seq % 26) as u8; BODY];
        let head = format!(
            "SEND\ndestination:/queue/full\npersistent:true\nreceipt:{seq}\ncontent-length:{BODY}\n\n"
        );
        let mut f = head.into_bytes();
        f.extend_from_slice(&body);
        f.push(0);
        self.send_raw(&f);
    }

    /// The next frame's command and headers (its body is skipped), or `None` on timeout
    /// or a closed connection.
    fn frame(&mut self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            // skip heart-beat EOLs
            while self.buf.first().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                self.buf.remove(0);
            }
            if let Some(end) = self.buf.iter().position(|b| *b == 0) {
                let f: Vec<u8> = self.buf.drain(..=end).collect();
                let text = String::from_utf8_lossy(&f);
                let head = text.split("\n\n").next().unwrap_or("").to_owned();
                // a MESSAGE body may hold no NUL of its own here (bodies are letters)
                return Some(head);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.s.set_read_timeout(Some(left)).ok()?;
            let mut chunk = [0u8; 65536];
            match self.s.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

#[test]
fn out_of_disk_space_raises_the_disk_alarm_and_loses_nothing_receipted() {
    let tmp = tempfile::Builder::new()
        .prefix("triad-diskfull-")
        .tempdir()
        .expect("temp dir");
    let broker = start(tmp.path());

    // a second publisher, which has published before the disk fills
    let mut late = Stomp::connect(broker.stomp);
    late.send(999);
    let f = late.frame(Duration::from_secs(10)).expect("receipt 999");
    assert!(f.starts_with("RECEIPT"), "{f}");

    // publish with a receipt each until the store runs out of room
    let mut publisher = Stomp::connect(broker.stomp);
    let mut receipted = 0u32;
    let mut refused = None;
    for seq in 0..200u32 {
        publisher.send(seq);
        match publisher.frame(Duration::from_secs(10)) {
            Some(f) if f.starts_with("RECEIPT") => receipted += 1,
            other => {
                refused = Some((seq, other));
                break;
            }
        }
    }
    let (failed_seq, answer) = refused.expect("12 MiB of tmpfs cannot hold 200 x 64 KiB");
    assert!(
        receipted >= 10,
        "only {receipted} receipts before the refusal"
    );
    assert!(
        answer.as_deref().is_none_or(|f| f.starts_with("ERROR")),
        "refused SEND {failed_seq} answered with {answer:?}"
    );
    broker.wait_for_log("out of disk space", Duration::from_secs(5));
    broker.wait_for_log("resource alarm raised", Duration::from_secs(5));

    // a publisher is now blocked, not refused: its SEND waits unread (as RabbitMQ, a
    // connection is blocked once it publishes; one that never did gets its first
    // publish read, which the full store refuses with an ERROR and no receipt)
    late.send(1000);
    assert_eq!(
        late.frame(Duration::from_secs(2)),
        None,
        "no receipt while the disk alarm is raised"
    );

    // free space: the alarm clears, the blocked SEND goes through
    std::fs::remove_file(broker.inside(&broker.mnt.join("filler"))).expect("remove filler");
    broker.wait_for_log(
        "enough disk space for a new segment again",
        Duration::from_secs(5),
    );
    let f = late
        .frame(Duration::from_secs(10))
        .expect("receipt once space is free");
    assert!(
        f.starts_with("RECEIPT") && f.contains("receipt-id:1000"),
        "{f}"
    );

    // every receipted message is there, and the late one
    let mut consumer = Stomp::connect(broker.stomp);
    consumer.send_raw(b"SUBSCRIBE\nid:0\ndestination:/queue/full\nack:auto\n\n\0");
    let mut got = 0u32;
    while let Some(f) = consumer.frame(Duration::from_secs(5)) {
        assert!(f.starts_with("MESSAGE"), "{f}");
        got += 1;
        if got == receipted + 2 {
            break;
        }
    }
    assert_eq!(
        got,
        receipted + 2,
        "messages drained: {receipted} receipted while filling, one before, one after"
    );
}
