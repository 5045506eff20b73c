//! A `triad` process the [`super::TestBroker`] does not fit: a cluster node (it may be a
//! follower, with no client listener, or change role and re-execute itself) on a data
//! directory and config the test owns. Killed on drop; its output is printed when the
//! test fails.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{parse_listening, triad_command};

pub struct Proc {
    pub name: String,
    pub data_dir: PathBuf,
    config: PathBuf,
    extra: Vec<String>,
    child: Option<Child>,
    log: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Proc {
    pub fn start(name: &str, data_dir: &Path, config: &Path, extra: &[&str]) -> Proc {
        let mut p = Proc {
            name: name.to_owned(),
            data_dir: data_dir.to_owned(),
            config: config.to_owned(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
            log: Arc::new(Mutex::new(String::new())),
            readers: Vec::new(),
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let mut child = triad_command()
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--config")
            .arg(&self.config)
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn triad");
        let out: [Box<dyn std::io::Read + Send>; 2] = [
            Box::new(child.stdout.take().expect("stdout")),
            Box::new(child.stderr.take().expect("stderr")),
        ];
        for o in out {
            let log = self.log.clone();
            self.readers.push(std::thread::spawn(move || {
                for line in BufReader::new(o).lines() {
                    let Ok(line) = line else { break };
                    let mut l = log.lock().expect("not poisoned");
                    l.push_str(&line);
                    l.push('\n');
                }
            }));
        }
        self.child = Some(child);
    }

    /// Starts it again (after [`Proc::kill9`]) on the same directory and config; the log
    /// goes on in the same buffer, after a marker line.
    pub fn restart(&mut self) {
        self.kill9();
        self.log
            .lock()
            .expect("not poisoned")
            .push_str("----- restarted -----\n");
        self.spawn();
    }

    pub fn log(&self) -> String {
        self.log.lock().expect("not poisoned").clone()
    }

    /// The log since the last restart.
    pub fn current_log(&self) -> String {
        let l = self.log();
        match l.rfind("----- restarted -----\n") {
            Some(i) => l[i..].to_owned(),
            None => l,
        }
    }

    /// How many times `needle` appears in the log since the last restart.
    pub fn count(&self, needle: &str) -> usize {
        self.current_log().matches(needle).count()
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Waits (bounded) for `needle` to appear `n` times since the last restart.
    pub fn wait_for_count(&mut self, needle: &str, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.count(needle) < n {
            if let Some(c) = self.child.as_mut() {
                if let Some(status) = c.try_wait().expect("try_wait") {
                    panic!("{} exited ({status}) before logging {needle:?}", self.name);
                }
            }
            assert!(
                Instant::now() < deadline,
                "{} did not log {needle:?} {n} time(s) within {timeout:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) {
        self.wait_for_count(needle, 1, timeout);
    }

    /// The address of the last `listening proto=<proto>` line since the last restart.
    pub fn addr(&self, proto: &str) -> SocketAddr {
        self.current_log()
            .lines()
            .filter_map(parse_listening)
            .filter(|(p, _)| p == proto)
            .map(|(_, a)| a)
            .next_back()
            .unwrap_or_else(|| panic!("{} has no {proto} listener", self.name))
    }

    /// The address a follower forwards `proto` clients on (its last `forwarding
    /// proto=<proto>` line since the last restart), if it logged one.
    pub fn forward_addr(&self, proto: &str) -> Option<SocketAddr> {
        self.current_log()
            .lines()
            .filter_map(|l| parse_listening(&l.replace("forwarding proto=", "listening proto=")))
            .filter(|(p, _)| p == proto)
            .map(|(_, a)| a)
            .next_back()
    }

    /// Sends `signal` (`-STOP`, `-CONT`, ...) to the running process.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let ok = std::process::Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {signal} {}", self.name);
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
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
