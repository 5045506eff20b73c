//! For tests (this crate's and the broker's): a real etcd server on free loopback ports
//! in a directory the caller owns, killed on drop. [`EtcdServer::start`] returns `None`,
//! after printing why, only when the `etcd` binary is not installed (Debian:
//! `etcd-server`; `.ci/run` installs it, so CI never skips).

// A harness: an etcd that is installed but does not come up fails the test loudly.
#![allow(clippy::panic)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long etcd gets to report healthy.
const STARTUP: Duration = Duration::from_secs(30);

/// A running etcd; see the module docs.
pub struct EtcdServer {
    child: Child,
    client: SocketAddr,
    log: PathBuf,
    /// Serving its clients over TLS ([`EtcdServer::start_tls`]).
    tls: bool,
}

/// What [`EtcdServer::start_tls`] serves with: its certificate and key (for 127.0.0.1),
/// and, with `client_ca`, client certificates required that chain to it (etcd's
/// `--client-cert-auth`).
pub struct EtcdTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// The etcd binary: `$TRIAD_ETCD`, else `etcd` on the `PATH`, else `/usr/bin/etcd`.
fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TRIAD_ETCD") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .chain([PathBuf::from("/usr/bin/etcd")])
        .find(|p| p.is_file())
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdServer {
    /// Starts etcd with its data in `dir` (see the module docs). Panics if it is
    /// installed but does not come up.
    pub fn start(dir: &Path) -> Option<EtcdServer> {
        Self::start_with(dir, None)
    }

    /// [`EtcdServer::start`], serving clients over `https://` with `tls`.
    pub fn start_tls(dir: &Path, tls: &EtcdTls) -> Option<EtcdServer> {
        Self::start_with(dir, Some(tls))
    }

    fn start_with(dir: &Path, tls: Option<&EtcdTls>) -> Option<EtcdServer> {
        let Some(bin) = binary() else {
            eprintln!(
                "SKIPPED: no etcd binary (install Debian's etcd-server, or set TRIAD_ETCD); \
                 .ci/run installs it"
            );
            return None;
        };
        // a free port can be taken by somebody else before etcd binds it: a few tries
        let mut last = String::new();
        for attempt in 0..3 {
            match Self::try_start(&bin, dir, attempt, tls) {
                Ok(s) => return Some(s),
                Err(e) => last = e,
            }
        }
        panic!("etcd ({}) did not start: {last}", bin.display());
    }

    fn try_start(
        bin: &Path,
        dir: &Path,
        attempt: u32,
        tls: Option<&EtcdTls>,
    ) -> Result<EtcdServer, String> {
        let (cp, pp) = (
            free_port().map_err(|e| e.to_string())?,
            free_port().map_err(|e| e.to_string())?,
        );
        let data = dir.join(format!("etcd-{attempt}"));
        let log = dir.join(format!("etcd-{attempt}.log"));
        let out = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{cp}");
        let peer = format!("http://127.0.0.1:{pp}");
        let mut cmd = Command::new(bin);
        if let Some(t) = tls {
            cmd.arg(format!("--cert-file={}", t.cert.display()))
                .arg(format!("--key-file={}", t.key.display()));
            if let Some(ca) = &t.client_ca {
                cmd.arg("--client-cert-auth")
                    .arg(format!("--trusted-ca-file={}", ca.display()));
            }
        }
        let child = cmd
            .arg("--name=t")
            .arg(format!("--data-dir={}", data.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=t={peer}"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        let mut s = EtcdServer {
            child,
            client: SocketAddr::from(([127, 0, 0, 1], cp)),
            log,
            tls: tls.is_some(),
        };
        let deadline = Instant::now() + STARTUP;
        loop {
            if s.healthy() {
                return Ok(s);
            }
            if let Ok(Some(status)) = s.child.try_wait() {
                return Err(format!("etcd exited ({status}): {}", s.log_text()));
            }
            if Instant::now() > deadline {
                return Err(format!("not healthy within {STARTUP:?}: {}", s.log_text()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn healthy(&self) -> bool {
        if self.tls {
            // no TLS client here: etcd says when it serves
            return self.log_text().contains("ready to serve client requests");
        }
        let Ok(mut s) = TcpStream::connect_timeout(&self.client, Duration::from_millis(500)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: etcd\r\n\r\n")
            .is_err()
        {
            return false;
        }
        let mut answer = String::new();
        let _ = s.take(64 << 10).read_to_string(&mut answer);
        answer.contains("\"health\":\"true\"")
    }

    /// Its client URL, `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.client)
    }

    /// Its log (for a failing test's output).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the process (SIGSTOP): etcd neither answers nor forgets anything.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Continues a paused process (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(sig)
            .arg(self.child.id().to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} etcd failed");
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.resume_quietly();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl EtcdServer {
    fn resume_quietly(&self) {
        let _ = Command::new("kill")
            .arg("-CONT")
            .arg(self.child.id().to_string())
            .status();
    }
}
