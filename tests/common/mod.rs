//! Whole-broker test harness: runs the real `triad` binary (after iggy's `TestServer`).
//!
//! [`TestBroker::start`] runs `triad` with a fresh temporary data directory, every
//! listener on `127.0.0.1:0` and a small-segment config, then reads its stderr for the
//! `listening proto=<name> addr=<ip:port>` lines and the `broker ready` line (see the
//! output contract in `src/main.rs`) to learn the ports. The broker's whole output is
//! kept and printed if the test panics. Dropping a `TestBroker` kills the process.
//!
//! [`TestBroker::start_with_tls`] adds the TLS listeners (`amqps`, `stomps`, `mqtts`,
//! `https`, also on ephemeral ports); only then does the starter expect their
//! `listening` lines.
//!
//! Set `TRIAD_TEST_LOG` to change the broker's `RUST_LOG` (it must keep `info` for the
//! `triad` target, or the ports cannot be read), e.g. `TRIAD_TEST_LOG=info,triad=debug`.

#![allow(dead_code)] // Each test file uses a different part of the harness.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use triad_core::testing::eventually_blocking;

/// How long a broker may take to announce readiness (debug builds, busy CI machines).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a broker may take to exit after SIGTERM (its own grace period is 5 s).
pub const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// The config every test broker gets unless the test gives its own: small commitlog
/// segments, so that each broker does not preallocate 1 GiB.
pub const TEST_CONFIG: &str = r#"
[store]
segment_size = "4 MiB"

[limits]
max_message_size = "1 MiB"
"#;

/// A `Command` for the `triad` binary under test, with `RUST_LOG` set.
pub fn triad_command() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_triad"));
    let log = std::env::var("TRIAD_TEST_LOG").unwrap_or_else(|_| "info".to_owned());
    cmd.env("RUST_LOG", log);
    cmd
}

/// Runs `cmd` to completion, capturing its output; kills it and panics after `timeout`.
pub fn run_to_exit(mut cmd: Command, timeout: Duration) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn triad");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(out) => out.expect("wait for triad"),
        Err(_) => {
            send_signal(pid, libc::SIGKILL);
            panic!("triad (pid {pid}) did not exit within {timeout:?}");
        }
    }
}

/// Every listener on an ephemeral loopback port.
pub fn ephemeral_listen_args() -> [&'static str; 8] {
    [
        "--amqp-listen",
        "127.0.0.1:0",
        "--stomp-listen",
        "127.0.0.1:0",
        "--mqtt-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ]
}

/// Every TLS listener on an ephemeral loopback port (they are bound only with a
/// certificate: `--tls-cert` and `--tls-key`).
pub fn tls_ephemeral_listen_args() -> [&'static str; 8] {
    [
        "--amqps-listen",
        "127.0.0.1:0",
        "--stomps-listen",
        "127.0.0.1:0",
        "--mqtts-listen",
        "127.0.0.1:0",
        "--https-listen",
        "127.0.0.1:0",
    ]
}

fn send_signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits in pid_t");
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Sends one raw HTTP request and returns the whole response (the server closes after
/// one response).
pub fn http_request(addr: SocketAddr, request: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the HTTP listener");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("set timeout");
    s.write_all(request.as_bytes()).expect("send request");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read response");
    String::from_utf8(out).expect("UTF-8 response")
}

/// `GET path`: (status code, body).
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let resp = http_request(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"),
    );
    let status = resp
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {resp:?}"));
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

pub struct TestBroker {
    child: Option<Child>,
    readers: Vec<JoinHandle<()>>,
    /// Everything the broker printed, over all its runs.
    log: Arc<Mutex<String>>,
    addrs: HashMap<String, SocketAddr>,
    config: Option<PathBuf>,
    data_dir: PathBuf,
    extra_args: Vec<String>,
    // Last, so that the directory outlives the process.
    _tmp: tempfile::TempDir,
}

impl TestBroker {
    /// Starts a broker with [`TEST_CONFIG`].
    pub fn start() -> TestBroker {
        TestBroker::start_with_config(TEST_CONFIG)
    }

    /// Starts a broker with this config file content (used as the whole file; the data
    /// directory and listeners still come from flags).
    pub fn start_with_config(toml: &str) -> TestBroker {
        TestBroker::start_with(Some(toml), &[])
    }

    /// Starts a broker with an optional config file content and extra flags.
    pub fn start_with(toml: Option<&str>, extra_args: &[&str]) -> TestBroker {
        let tmp = tempfile::Builder::new()
            .prefix("triad-test-")
            .tempdir()
            .expect("temp dir");
        let config = toml.map(|t| {
            let path = tmp.path().join("triad.toml");
            std::fs::write(&path, t).expect("write config");
            path
        });
        let mut broker = TestBroker {
            child: None,
            readers: Vec::new(),
            log: Arc::new(Mutex::new(String::new())),
            addrs: HashMap::new(),
            config,
            data_dir: tmp.path().join("data"),
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            _tmp: tmp,
        };
        broker.launch();
        broker
    }

    /// Starts a broker with TLS: [`TEST_CONFIG`] plus `extra_toml` (e.g. a `[tls]` section
    /// with `verify_peer`), the certificate chain and key as `--tls-cert` / `--tls-key`,
    /// `ca` as `--tls-ca`, and every TLS listener on an ephemeral port.
    pub fn start_with_tls(
        extra_toml: &str,
        cert: &Path,
        key: &Path,
        ca: Option<&Path>,
    ) -> TestBroker {
        let toml = format!("{TEST_CONFIG}\n{extra_toml}");
        let mut args: Vec<String> = tls_ephemeral_listen_args()
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut flag = |name: &str, path: &Path| {
            args.push(name.to_owned());
            args.push(path.to_str().expect("UTF-8 path").to_owned());
        };
        flag("--tls-cert", cert);
        flag("--tls-key", key);
        if let Some(ca) = ca {
            flag("--tls-ca", ca);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        TestBroker::start_with(Some(&toml), &args)
    }

    /// Whether this broker was started with a TLS certificate on the command line.
    pub fn has_tls(&self) -> bool {
        self.extra_args.iter().any(|a| a == "--tls-cert")
    }

    /// A `Command` that would start another broker like this one (same data dir and
    /// config, ephemeral ports), e.g. to check the data-dir lock.
    pub fn command(&self) -> Command {
        let mut cmd = triad_command();
        cmd.arg("--data-dir").arg(&self.data_dir);
        if let Some(c) = &self.config {
            cmd.arg("--config").arg(c);
        }
        // a listener the extra flags name (e.g. `--mqtt-listen [::]:0`) is theirs
        for pair in ephemeral_listen_args().chunks(2) {
            if let [flag, addr] = pair {
                if !self.extra_args.iter().any(|a| a == flag) {
                    cmd.args([flag, addr]);
                }
            }
        }
        cmd.args(&self.extra_args);
        cmd
    }

    fn launch(&mut self) {
        assert!(self.child.is_none(), "broker already running");
        let mut child = self
            .command()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn triad");
        self.append_log(&format!("--- triad started, pid {} ---\n", child.id()));
        let (tx, rx) = mpsc::channel::<String>();
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        self.readers.push(self.spawn_reader(stdout, tx.clone()));
        self.readers.push(self.spawn_reader(stderr, tx));
        self.child = Some(child);

        self.addrs.clear();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some((proto, addr)) = parse_listening(&line) {
                        self.addrs.insert(proto, addr);
                    }
                    if line.contains("broker ready") {
                        break;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("triad did not become ready within {START_TIMEOUT:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.as_mut().and_then(|c| c.wait().ok());
                    panic!("triad exited before becoming ready: {status:?}");
                }
            }
        }
        for proto in ["amqp", "stomp", "mqtt", "http"] {
            assert!(
                self.addrs.contains_key(proto),
                "no `listening proto={proto}` line before `broker ready`"
            );
        }
        if self.has_tls() {
            for proto in ["amqps", "stomps", "mqtts", "https"] {
                assert!(
                    self.addrs.contains_key(proto),
                    "no `listening proto={proto}` line before `broker ready`"
                );
            }
        }
    }

    fn spawn_reader(
        &self,
        out: impl Read + Send + 'static,
        tx: mpsc::Sender<String>,
    ) -> JoinHandle<()> {
        let log = Arc::clone(&self.log);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                {
                    let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
                    log.push_str(&line);
                    log.push('\n');
                }
                // The starter stops listening once the broker is ready.
                let _ = tx.send(line);
            }
        })
    }

    fn append_log(&self, s: &str) {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_str(s);
    }

    /// Waits for the reader threads, so that the log holds all the process printed.
    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    pub fn addr(&self, proto: &str) -> SocketAddr {
        *self
            .addrs
            .get(proto)
            .unwrap_or_else(|| panic!("no {proto} listener"))
    }
    pub fn amqp_addr(&self) -> SocketAddr {
        self.addr("amqp")
    }
    pub fn stomp_addr(&self) -> SocketAddr {
        self.addr("stomp")
    }
    pub fn mqtt_addr(&self) -> SocketAddr {
        self.addr("mqtt")
    }
    pub fn http_addr(&self) -> SocketAddr {
        self.addr("http")
    }
    pub fn amqps_addr(&self) -> SocketAddr {
        self.addr("amqps")
    }
    pub fn stomps_addr(&self) -> SocketAddr {
        self.addr("stomps")
    }
    pub fn mqtts_addr(&self) -> SocketAddr {
        self.addr("mqtts")
    }
    pub fn https_addr(&self) -> SocketAddr {
        self.addr("https")
    }
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("broker running").id()
    }

    /// Everything the broker printed so far, over all its runs.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until the log contains `needle`; panics after `timeout`.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) {
        eventually_blocking(&format!("{needle:?} in the broker log"), timeout, || {
            self.log().contains(needle)
        });
    }

    /// `kill -9`: no shutdown at all, as a crash or power cut (minus the page cache).
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("broker running");
        child.kill().expect("SIGKILL");
        let status = child.wait().expect("wait");
        self.join_readers();
        self.append_log(&format!("--- triad killed with SIGKILL: {status} ---\n"));
    }

    /// SIGTERM, then waits for the exit; returns its status.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("broker running");
        send_signal(child.id(), libc::SIGTERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("triad did not exit within {STOP_TIMEOUT:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        self.join_readers();
        self.append_log(&format!("--- triad exited after SIGTERM: {status} ---\n"));
        status
    }

    /// Starts the broker again on the same data dir and config (after `kill9` or
    /// `terminate`); the ports change.
    pub fn restart(&mut self) {
        if self.child.is_some() {
            assert!(self.terminate().success(), "clean stop before restart");
        }
        self.launch();
    }

    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().expect("try_wait").is_none(),
            None => false,
        }
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.join_readers();
        if std::thread::panicking() {
            eprintln!(
                "----- triad log ({}) -----\n{}----- end of triad log -----",
                self.data_dir.display(),
                self.log()
            );
        }
    }
}

/// `... listening proto=amqp addr=127.0.0.1:40123` -> ("amqp", 127.0.0.1:40123).
pub fn parse_listening(line: &str) -> Option<(String, SocketAddr)> {
    let (_, rest) = line.split_once("listening proto=")?;
    let mut words = rest.split_whitespace();
    let proto = words.next()?.to_owned();
    let addr = words.find_map(|w| w.strip_prefix("addr="))?.parse().ok()?;
    Some((proto, addr))
}

/// lapin helpers: connect, declare a durable queue, drain a queue (see `amqp.rs`).
pub mod amqp;
/// rcgen certificates: a CA and node certificates (see `certs.rs`).
pub mod certs;
/// Replication: follower processes, cluster configs, a fault-injecting TCP proxy (see
/// `cluster.rs`).
pub mod cluster;
/// A `triad` process a cluster test drives (follower, role changes, restarts).
pub mod proc;
/// Raw STOMP and MQTT clients, a seeded RNG and an RSS reader (see `raw.rs`).
pub mod raw;
