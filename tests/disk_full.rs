//! A store that runs out of disk space: commitlog segments are preallocated whole, so the
//! store can be out of room while the file system still has more free than
//! `disk_free_limit`. The broker then raises its disk alarm (publishers blocked, not
//! refused), keeps every receipted message, and carries on once space is freed.
//!
//! The data directory lives on a small tmpfs mounted in a private user + mount namespace
//! (`unshare -rm`, no privileges needed where unprivileged user namespaces are allowed);
//! a filler file on the same tmpfs is deleted through `/proc/PID/root` to free space.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::raw::StompClient;
use common::{ephemeral_listen_args, parse_listening, triad_command};
use triad_core::testing::eventually_blocking;

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
        eventually_blocking(&format!("`{needle}` in the log"), timeout, || {
            let log = self.log();
            if log.contains(needle) {
                Ok(())
            } else {
                Err(format!("the log:\n{log}"))
            }
        });
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

/// A SEND of a `BODY`-byte persistent message with receipt `seq`.
fn send(c: &mut StompClient, seq: u32) {
    let body = vec![b'a' + (seq % 26) as u8; BODY];
    let receipt = seq.to_string();
    // the broker may have closed a refused publisher; its answer (or none) is what counts
    let _ = c.send(
        "SEND",
        &[
            ("destination", "/queue/full"),
            ("persistent", "true"),
            ("receipt", &receipt),
        ],
        &body,
    );
}

/// The next frame's command and `receipt-id`, or `None` on timeout or a closed connection.
fn answer(c: &mut StompClient, timeout: Duration) -> Option<(String, Option<String>)> {
    c.stream.set_read_timeout(Some(timeout)).ok()?;
    let f = c.read_frame().ok()?;
    let id = f.header("receipt-id").map(str::to_owned);
    Some((f.command, id))
}

#[test]
fn out_of_disk_space_raises_the_disk_alarm_and_loses_nothing_receipted() {
    let tmp = tempfile::Builder::new()
        .prefix("triad-diskfull-")
        .tempdir()
        .expect("temp dir");
    let broker = start(tmp.path());
    let connect = |addr| StompClient::connect(addr, Duration::from_secs(10)).expect("CONNECTED");

    // a second publisher, which has published before the disk fills
    let mut late = connect(broker.stomp);
    send(&mut late, 999);
    let f = answer(&mut late, Duration::from_secs(10)).expect("receipt 999");
    assert_eq!(f.0, "RECEIPT", "{f:?}");

    // publish with a receipt each until the store runs out of room
    let mut publisher = connect(broker.stomp);
    let mut receipted = 0u32;
    let mut refused = None;
    for seq in 0..200u32 {
        send(&mut publisher, seq);
        match answer(&mut publisher, Duration::from_secs(10)) {
            Some((command, _)) if command == "RECEIPT" => receipted += 1,
            other => {
                refused = Some((seq, other));
                break;
            }
        }
    }
    let (failed_seq, refusal) = refused.expect("12 MiB of tmpfs cannot hold 200 x 64 KiB");
    assert!(
        receipted >= 10,
        "only {receipted} receipts before the refusal"
    );
    assert!(
        refusal
            .as_ref()
            .is_none_or(|(command, _)| command == "ERROR"),
        "refused SEND {failed_seq} answered with {refusal:?}"
    );
    broker.wait_for_log("out of disk space", Duration::from_secs(5));
    broker.wait_for_log("resource alarm raised", Duration::from_secs(5));

    // a publisher is now blocked, not refused: its SEND waits unread (as RabbitMQ, a
    // connection is blocked once it publishes; one that never did gets its first
    // publish read, which the full store refuses with an ERROR and no receipt)
    send(&mut late, 1000);
    assert_eq!(
        answer(&mut late, Duration::from_secs(2)),
        None,
        "no receipt while the disk alarm is raised"
    );

    // free space: the alarm clears, the blocked SEND goes through
    std::fs::remove_file(broker.inside(&broker.mnt.join("filler"))).expect("remove filler");
    broker.wait_for_log(
        "enough disk space for a new segment again",
        Duration::from_secs(5),
    );
    let f = answer(&mut late, Duration::from_secs(10)).expect("receipt once space is free");
    assert_eq!(f, ("RECEIPT".to_owned(), Some("1000".to_owned())));

    // every receipted message is there, and the late one
    let mut consumer = connect(broker.stomp);
    consumer
        .send(
            "SUBSCRIBE",
            &[("id", "0"), ("destination", "/queue/full"), ("ack", "auto")],
            b"",
        )
        .expect("subscribe");
    let mut got = 0u32;
    while let Some((command, _)) = answer(&mut consumer, Duration::from_secs(5)) {
        assert_eq!(command, "MESSAGE");
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
