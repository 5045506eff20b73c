//! TLS between nodes (`[cluster.tls]`): mutual TLS with rustls (ring provider), and
//! [`Link`], the blocking byte stream the leader and the follower speak the protocol
//! over, plain or TLS.
//!
//! - [`server_config`]: the leader's; its certificate chain and key, and every follower
//!   must present a certificate that chains to `ca_file` (refused in the handshake
//!   otherwise).
//! - [`client_config`]: the follower's; it verifies the leader's certificate against
//!   `ca_file` (and the leader's host name or IP address, from `cluster.leader`) and
//!   presents its own chain.
//! - [`Link`]: a `TcpStream`, or a `TcpStream` plus a rustls connection shared by the
//!   leader's two threads per follower (the sender writes, the ack reader reads). The
//!   connection's lock is held only for in-memory work (feeding received bytes,
//!   encrypting); socket reads happen outside it, and socket writes under a second lock
//!   taken first, so records reach the socket in the order they were sealed.
//!
//! - [`etcd_client_config`]: the election's client of etcd over `https://`
//!   (`[cluster.etcd_tls]`): etcd's certificate verified against its CA, a client
//!   certificate presented when etcd asks for one.
//!
//! The handshake runs on the connection's own thread with the socket's timeouts (the
//! leader's `HANDSHAKE`, the follower's silence bound).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::version::{TLS12, TLS13};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};

/// The three files `[cluster.tls]` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM chain, this node's certificate first (used as the leader's server
    /// certificate and as the follower's client certificate).
    pub cert: PathBuf,
    /// PEM private key of that certificate.
    pub key: PathBuf,
    /// PEM bundle of the CAs every node's certificate must chain to.
    pub ca: PathBuf,
}

/// Why the TLS files cannot be used; names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("cannot read cluster TLS {what} file {path}: {reason}")]
    File {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("cluster TLS: {0}")]
    Config(String),
}

fn file_err<'a>(what: &'static str, path: &'a Path) -> impl Fn(String) -> TlsSetupError + 'a {
    move |reason| TlsSetupError::File {
        what,
        path: path.to_path_buf(),
        reason,
    }
}

fn load(
    f: &TlsFiles,
) -> Result<
    (
        Vec<CertificateDer<'static>>,
        PrivateKeyDer<'static>,
        RootCertStore,
    ),
    TlsSetupError,
> {
    let (chain, key) = load_chain(&f.cert, &f.key)?;
    Ok((chain, key, load_roots(&f.ca)?))
}

/// A PEM certificate chain and its key.
fn load_chain(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsSetupError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| file_err("certificate", cert)(e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_err("certificate", cert)(e.to_string()))?;
    if chain.is_empty() {
        return Err(file_err("certificate", cert)("no certificate in it".into()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| file_err("key", key)(e.to_string()))?;
    Ok((chain, key))
}

/// A PEM bundle of CA certificates (at least one).
fn load_roots(ca: &Path) -> Result<RootCertStore, TlsSetupError> {
    let mut roots = RootCertStore::empty();
    let cas = CertificateDer::pem_file_iter(ca).map_err(|e| file_err("CA", ca)(e.to_string()))?;
    for c in cas {
        let c = c.map_err(|e| file_err("CA", ca)(e.to_string()))?;
        roots
            .add(c)
            .map_err(|e| file_err("CA", ca)(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(file_err("CA", ca)("no certificate in it".into()));
    }
    Ok(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The leader's: its chain, and client certificates required, verified against `ca`.
pub fn server_config(f: &TlsFiles) -> Result<Arc<ServerConfig>, TlsSetupError> {
    let (chain, key, roots) = load(f)?;
    let cfg = |e: rustls::Error| TlsSetupError::Config(e.to_string());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| TlsSetupError::Config(e.to_string()))?;
    let c = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&TLS13, &TLS12])
        .map_err(cfg)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(cfg)?;
    Ok(Arc::new(c))
}

/// The follower's: the leader verified against `ca`, its own chain presented.
pub fn client_config(f: &TlsFiles) -> Result<Arc<ClientConfig>, TlsSetupError> {
    let (chain, key, roots) = load(f)?;
    let cfg = |e: rustls::Error| TlsSetupError::Config(e.to_string());
    let c = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&TLS13, &TLS12])
        .map_err(cfg)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(cfg)?;
    Ok(Arc::new(c))
}

/// The files `[cluster.etcd_tls]` names: the CAs etcd's server certificate must chain
/// to, and this node's client certificate and key when etcd requires one (etcd's
/// `--client-cert-auth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTlsFiles {
    pub ca: PathBuf,
    /// (certificate chain, key), PEM.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// The election's TLS to etcd (`https://` endpoints): etcd's certificate verified
/// against `ca` for the endpoint's host, and the client certificate presented if given.
pub fn etcd_client_config(f: &EtcdTlsFiles) -> Result<Arc<ClientConfig>, TlsSetupError> {
    let roots = load_roots(&f.ca)?;
    let cfg = |e: rustls::Error| TlsSetupError::Config(e.to_string());
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&TLS13, &TLS12])
        .map_err(cfg)?
        .with_root_certificates(roots);
    let c = match &f.client {
        Some((cert, key)) => {
            let (chain, key) = load_chain(cert, key)?;
            builder.with_client_auth_cert(chain, key).map_err(cfg)?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(c))
}

/// The name a follower checks the leader's certificate for: the host of `host:port`
/// (a DNS name or an IP address, `[v6]` unbracketed).
pub fn server_name(addr: &str) -> Result<ServerName<'static>, TlsSetupError> {
    let host = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(addr);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_owned())
        .map_err(|e| TlsSetupError::Config(format!("leader address {addr:?}: {e}")))
}

struct TlsState {
    conn: rustls::Connection,
    /// Received from the socket, not fed to rustls yet.
    raw: Vec<u8>,
}

struct Shared {
    state: Mutex<TlsState>,
    /// Held across sealing and writing, so records go out in order.
    write: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// See the module docs.
pub struct Link {
    sock: TcpStream,
    tls: Option<Arc<Shared>>,
}

impl Link {
    pub fn plain(sock: TcpStream) -> Link {
        Link { sock, tls: None }
    }

    /// The leader's side: runs the handshake (the socket's timeouts apply).
    pub fn accept(mut sock: TcpStream, cfg: Arc<ServerConfig>) -> io::Result<Link> {
        let conn = ServerConnection::new(cfg).map_err(io::Error::other)?;
        Link::handshake(&mut sock, conn.into()).map(|conn| Link::with(sock, conn))
    }

    /// The follower's side: runs the handshake (the socket's timeouts apply).
    pub fn connect(
        mut sock: TcpStream,
        cfg: Arc<ClientConfig>,
        name: ServerName<'static>,
    ) -> io::Result<Link> {
        let conn = ClientConnection::new(cfg, name).map_err(io::Error::other)?;
        Link::handshake(&mut sock, conn.into()).map(|conn| Link::with(sock, conn))
    }

    fn handshake(
        sock: &mut TcpStream,
        mut conn: rustls::Connection,
    ) -> io::Result<rustls::Connection> {
        // bounded: each round moves bytes or fails (timeouts, EOF, a TLS alert)
        while conn.is_handshaking() {
            let (read, written) = conn.complete_io(sock)?;
            if read == 0 && written == 0 && conn.is_handshaking() {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "TLS handshake: the peer closed the connection",
                ));
            }
        }
        while conn.wants_write() {
            conn.write_tls(sock)?;
        }
        // frames are bounded (`codec::MAX_FRAME`): seal each whole
        conn.set_buffer_limit(None);
        Ok(conn)
    }

    fn with(sock: TcpStream, conn: rustls::Connection) -> Link {
        Link {
            sock,
            tls: Some(Arc::new(Shared {
                state: Mutex::new(TlsState {
                    conn,
                    raw: Vec::new(),
                }),
                write: Mutex::new(()),
            })),
        }
    }

    /// A second handle on the same connection (for a reader thread).
    pub fn try_clone(&self) -> io::Result<Link> {
        Ok(Link {
            sock: self.sock.try_clone()?,
            tls: self.tls.clone(),
        })
    }

    /// The socket (timeouts, shutdown).
    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(t) = &self.tls else {
            return self.sock.read(buf);
        };
        let mut chunk = [0u8; 16 << 10];
        loop {
            {
                let mut st = lock(&t.state);
                match st.conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if !st.raw.is_empty() {
                    // no plaintext waiting: feed what was received
                    let TlsState { conn, raw } = &mut *st;
                    let mut rd: &[u8] = raw;
                    let n = conn.read_tls(&mut rd)?;
                    raw.drain(..n);
                    conn.process_new_packets()
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    continue;
                }
            }
            let n = self.sock.read(&mut chunk)?;
            if n == 0 {
                return Ok(0);
            }
            lock(&t.state)
                .raw
                .extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let Some(t) = &self.tls else {
            return self.sock.write(buf);
        };
        let _order = lock(&t.write);
        let mut out = Vec::with_capacity(buf.len() + 256);
        {
            let mut st = lock(&t.state);
            st.conn.writer().write_all(buf)?;
            while st.conn.wants_write() {
                st.conn.write_tls(&mut out)?;
            }
        }
        self.sock.write_all(&out)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.sock.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leaders_name_is_the_host_of_its_address() {
        assert!(matches!(
            server_name("127.0.0.1:5680").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            server_name("[::1]:5680").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert_eq!(
            server_name("node-a.example:5680").unwrap(),
            ServerName::try_from("node-a.example").unwrap()
        );
        assert!(server_name("bad name:1").is_err());
    }

    #[test]
    fn a_missing_file_is_named() {
        let d = tempfile::tempdir().unwrap();
        let f = TlsFiles {
            cert: d.path().join("none.pem"),
            key: d.path().join("k.pem"),
            ca: d.path().join("ca.pem"),
        };
        let e = server_config(&f).unwrap_err().to_string();
        assert!(
            e.contains("certificate file") && e.contains("none.pem"),
            "{e}"
        );
        std::fs::write(&f.cert, "not PEM").unwrap();
        let e = client_config(&f).unwrap_err().to_string();
        assert!(e.contains("none.pem"), "{e}");
    }
}
