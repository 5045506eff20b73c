//! Replication test pieces (issue 18): a `triad` process the harness's `TestBroker` does
//! not fit (a follower), leader and follower configurations, the in-sync count read
//! from the leader's log, and [`FaultProxy`], a TCP proxy between nodes that passes,
//! delays, drops or blackholes the traffic.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{parse_listening, triad_command, TestBroker, TEST_CONFIG};

/// How long a cluster step may take.
pub const T: Duration = Duration::from_secs(30);

/// A `triad` process the harness's `TestBroker` does not fit: a follower (no client
/// listener) or a broker on a directory it did not make. Killed on drop; its output is
/// printed when the test fails.
pub struct Proc {
    name: String,
    child: Option<Child>,
    log: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Proc {
    pub fn start(name: &str, data_dir: &Path, config: &Path, extra: &[&str]) -> Proc {
        let mut child = triad_command()
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--config")
            .arg(config)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn triad");
        let log = Arc::new(Mutex::new(String::new()));
        let mut readers = Vec::new();
        let out: [Box<dyn std::io::Read + Send>; 2] = [
            Box::new(child.stdout.take().unwrap()),
            Box::new(child.stderr.take().unwrap()),
        ];
        for o in out {
            let log = log.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(o).lines() {
                    let Ok(line) = line else { break };
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            }));
        }
        Proc {
            name: name.to_owned(),
            child: Some(child),
            log,
            readers,
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn wait_for_log(&mut self, needle: &str) {
        let deadline = Instant::now() + T;
        while !self.log().contains(needle) {
            if let Some(c) = self.child.as_mut() {
                if let Some(status) = c.try_wait().unwrap() {
                    panic!("{} exited ({status}) before logging {needle:?}", self.name);
                }
            }
            assert!(
                Instant::now() < deadline,
                "{} did not log {needle:?} within {T:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The address of a `listening proto=<proto>` line.
    pub fn addr(&self, proto: &str) -> SocketAddr {
        self.log()
            .lines()
            .filter_map(parse_listening)
            .find(|(p, _)| p == proto)
            .map(|(_, a)| a)
            .unwrap_or_else(|| panic!("{} has no {proto} listener", self.name))
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!("----- {} -----\n{}-----", self.name, self.log());
        }
    }
}

pub fn leader_config(min_insync: u32) -> String {
    format!(
        "{TEST_CONFIG}\n[cluster]\nrole = \"leader\"\nnode_id = \"l\"\nlisten = \"127.0.0.1:0\"\n\
         [replication]\nmode = \"sync\"\nmin_insync = {min_insync}\nreplica_lag_max = \"16 MiB\"\n"
    )
}

/// A follower of `leader` in a fresh directory under `root`.
pub fn follower(root: &Path, name: &str, leader: SocketAddr) -> (Proc, PathBuf) {
    let config = root.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "{TEST_CONFIG}\n[cluster]\nrole = \"follower\"\nnode_id = \"{name}\"\nleader = \"{leader}\"\n"
        ),
    )
    .unwrap();
    let data = root.join(name);
    let mut p = Proc::start(name, &data, &config, &[]);
    p.wait_for_log("follower: connected to the leader");
    (p, data)
}

pub fn in_sync_count(leader: &TestBroker) -> usize {
    let log = leader.log();
    log.matches("joined the in-sync set").count() - log.matches("left the in-sync set").count()
}
