//! TLS for the `amqps`, `stomps`, `mqtts` and `https` listeners: rustls (ring provider),
//! through its unbuffered API ([`stream`]).
//!
//! - [`server_config`] reads `[tls]`'s PEM files and builds the [`ServerConfig`] every
//!   TLS listener shares: TLS 1.2 and 1.3 only, and, with `verify_peer`, client
//!   certificates verified against `ca_file` by [`WebPkiClientVerifier`] (required with
//!   `fail_if_no_peer_cert`, else optional); further chains chosen by SNI
//!   (`[[tls.certificates]]`, [`SniResolver`]); session resumption by cache
//!   (`session_cache_size`) and tickets (`session_tickets`, `tls13_tickets`). Any
//!   problem with a file is a [`TlsError`] naming it (the broker exits with 2 at
//!   startup).
//! - [`TlsConfigs`] holds the configuration in use and reloads it (SIGHUP, or a file
//!   changed): new handshakes get the new chain, connections keep theirs, a bad file
//!   keeps the old one. The session cache and ticket keys survive reloads.
//! - [`TlsHandler`] wraps a protocol's [`Service`] into the listener's [`Handler`]: the
//!   handshake runs inside the connection's task with a [`HANDSHAKE_TIMEOUT`] deadline
//!   (never in the accept loop), then the protocol is served over the TLS stream with
//!   the client certificate's subject CN in [`ConnContext::peer_cert_cn`].
//! - [`subject_cn`] reads that CN from a certificate's DER.
//! - [`stream`]: the TLS stream itself, over rustls' unbuffered API, holding no buffer
//!   while idle.

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures_util::future::Either;
use futures_util::FutureExt;
use rustls::crypto::CryptoProvider;
use rustls::server::{
    ClientHello, NoServerSessionStorage, ProducesTickets, ResolvesServerCert,
    ServerSessionMemoryCache, StoresServerSessions, WebPkiClientVerifier,
};
use rustls::sign::CertifiedKey;
use rustls::version::{TLS12, TLS13};
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpStream;
use tracing::debug;

use crate::config::TlsSection;
use crate::listener::{ConnContext, ConnResult, Handler, Service};

mod records;
pub mod stream;

pub use stream::TlsStream;

/// Deadline for the TLS handshake, from accept to a finished handshake (house style:
/// every pre-auth phase has one; the protocol's own handshake deadline follows).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the TLS settings were refused; one line, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read TLS {what} file {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("invalid TLS {what} file {path}: {reason}")]
    Invalid {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("TLS key file {key} does not match the certificate in {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("cannot use TLS certificate {cert} with key {key}: {reason}")]
    Certified {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error("cannot set up TLS: {0}")]
    Setup(String),
}

/// Builds the TLS listeners' configuration from `[tls]`, or `None` when no certificate
/// and key are configured (then no TLS listener is bound). Reads every file named.
pub fn server_config(tls: &TlsSection) -> Result<Option<Arc<ServerConfig>>, TlsError> {
    let resumption = Resumption::new(tls)?;
    build(tls, &resumption)
}

/// What a reload keeps: the session cache and the ticket keys, so that clients resume
/// across certificate reloads too.
struct Resumption {
    cache: Arc<dyn StoresServerSessions>,
    ticketer: Option<Arc<dyn ProducesTickets>>,
}

impl Resumption {
    fn new(tls: &TlsSection) -> Result<Resumption, TlsError> {
        let cache: Arc<dyn StoresServerSessions> = match tls.session_cache_size {
            0 => Arc::new(NoServerSessionStorage {}),
            n => ServerSessionMemoryCache::new(n),
        };
        let ticketer = if tls.session_tickets {
            Some(
                rustls::crypto::ring::Ticketer::new()
                    .map_err(|e| TlsError::Setup(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Resumption { cache, ticketer })
    }
}

fn build(tls: &TlsSection, resumption: &Resumption) -> Result<Option<Arc<ServerConfig>>, TlsError> {
    let (Some(cert_file), Some(key_file)) = (&tls.cert_file, &tls.key_file) else {
        return Ok(None);
    };
    let chain = load_certs("certificate", cert_file)?;
    let key = load_key(key_file)?;
    // Read even without verify_peer, so that a wrong path shows at startup.
    let cas = match &tls.ca_file {
        Some(path) => Some((path, load_certs("CA", path)?)),
        None => None,
    };

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&TLS13, &TLS12])
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    let builder = match cas {
        Some((path, cas)) if tls.verify_peer => {
            let verifier =
                client_verifier(path, cas, Arc::clone(&provider), tls.fail_if_no_peer_cert)?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let default = certified(cert_file, key_file, chain, key, &provider)?;
    let mut by_name = HashMap::new();
    for c in &tls.certificates {
        let chain = load_certs("certificate", &c.cert_file)?;
        let key = load_key(&c.key_file)?;
        let ck = certified(&c.cert_file, &c.key_file, chain, key, &provider)?;
        for name in &c.server_names {
            by_name.insert(name.to_ascii_lowercase(), Arc::clone(&ck));
        }
    }
    let mut config = builder.with_cert_resolver(Arc::new(SniResolver { by_name, default }));
    config.session_storage = Arc::clone(&resumption.cache);
    if let Some(t) = &resumption.ticketer {
        config.ticketer = Arc::clone(t);
    }
    config.send_tls13_tickets = tls.tls13_tickets;
    stream::prepare(&mut config);
    Ok(Some(Arc::new(config)))
}

/// The TLS configuration new handshakes use, replaced by [`TlsConfigs::reload`] (on
/// SIGHUP, and when [`TlsConfigs::files_changed`]). A connection keeps the configuration
/// it was accepted with; a reload that fails keeps the one in use.
pub struct TlsConfigs {
    section: TlsSection,
    resumption: Resumption,
    current: RwLock<Arc<ServerConfig>>,
    /// What the files looked like at the last (attempted) load.
    stamps: Mutex<Vec<Option<FileStamp>>>,
}

/// A file's identity and version, as far as `stat` tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    modified: Option<std::time::SystemTime>,
    len: u64,
    inode: u64,
}

impl TlsConfigs {
    /// Loads `[tls]`; `None` without a certificate and key.
    pub fn load(tls: &TlsSection) -> Result<Option<Arc<TlsConfigs>>, TlsError> {
        let resumption = Resumption::new(tls)?;
        let stamps = stamps(tls);
        let Some(config) = build(tls, &resumption)? else {
            return Ok(None);
        };
        Ok(Some(Arc::new(TlsConfigs {
            section: tls.clone(),
            resumption,
            current: RwLock::new(config),
            stamps: Mutex::new(stamps),
        })))
    }

    /// The configuration for a new handshake.
    pub fn current(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reads the files again; on success new handshakes use them, on failure the
    /// configuration in use stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        *self.stamps.lock().unwrap_or_else(|e| e.into_inner()) = stamps(&self.section);
        let config = build(&self.section, &self.resumption)?
            .ok_or_else(|| TlsError::Setup("no certificate and key configured".into()))?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = config;
        Ok(())
    }

    /// Whether a certificate, key or CA file changed since the last load.
    pub fn files_changed(&self) -> bool {
        *self.stamps.lock().unwrap_or_else(|e| e.into_inner()) != stamps(&self.section)
    }

    /// `tls.watch_interval`, `None` when off.
    pub fn watch_interval(&self) -> Option<Duration> {
        Some(self.section.watch_interval.get()).filter(|d| !d.is_zero())
    }
}

fn stamps(tls: &TlsSection) -> Vec<Option<FileStamp>> {
    use std::os::unix::fs::MetadataExt;
    let extra = tls
        .certificates
        .iter()
        .flat_map(|c| [Some(&c.cert_file), Some(&c.key_file)]);
    [&tls.cert_file, &tls.key_file, &tls.ca_file]
        .into_iter()
        .map(Option::as_ref)
        .chain(extra)
        .map(|path| {
            let m = std::fs::metadata(path?).ok()?;
            Some(FileStamp {
                modified: m.modified().ok(),
                len: m.len(),
                inode: m.ino(),
            })
        })
        .collect()
}

/// A chain and its key, checked to match.
fn certified(
    cert_file: &Path,
    key_file: &Path,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    provider: &CryptoProvider,
) -> Result<Arc<CertifiedKey>, TlsError> {
    CertifiedKey::from_der(chain, key, provider)
        .map(Arc::new)
        .map_err(|e| match e {
            rustls::Error::InconsistentKeys(_) => TlsError::KeyMismatch {
                cert: cert_file.to_owned(),
                key: key_file.to_owned(),
            },
            e => TlsError::Certified {
                cert: cert_file.to_owned(),
                key: key_file.to_owned(),
                reason: e.to_string(),
            },
        })
}

/// Picks the chain by the name the client asked for (SNI): an exact
/// `[[tls.certificates]]` name, then `*.` + the name without its first label, else
/// the default chain (`cert_file`), also for clients that send no name.
#[derive(Debug)]
struct SniResolver {
    by_name: HashMap<String, Arc<CertifiedKey>>,
    default: Arc<CertifiedKey>,
}

impl SniResolver {
    fn pick(&self, name: Option<&str>) -> Arc<CertifiedKey> {
        let found = name.and_then(|n| {
            let n = n.to_ascii_lowercase();
            self.by_name.get(&n).or_else(|| {
                let (_, parent) = n.split_once('.')?;
                self.by_name.get(&format!("*.{parent}"))
            })
        });
        Arc::clone(found.unwrap_or(&self.default))
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.pick(hello.server_name()))
    }
}

fn client_verifier(
    path: &Path,
    cas: Vec<CertificateDer<'static>>,
    provider: Arc<CryptoProvider>,
    required: bool,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let invalid = |reason: String| TlsError::Invalid {
        what: "CA",
        path: path.to_owned(),
        reason,
    };
    let mut roots = RootCertStore::empty();
    for (i, ca) in cas.into_iter().enumerate() {
        roots
            .add(ca)
            .map_err(|e| invalid(format!("certificate {}: {e}", i + 1)))?;
    }
    let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
    let builder = if required {
        builder
    } else {
        builder.allow_unauthenticated()
    };
    builder.build().map_err(|e| invalid(e.to_string()))
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Every `CERTIFICATE` section of a PEM file; at least one.
fn load_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let invalid = |reason: String| TlsError::Invalid {
        what,
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(e.to_string()))?;
    if certs.is_empty() {
        return Err(invalid("no PEM CERTIFICATE section found".into()));
    }
    Ok(certs)
}

/// The first private key (PKCS#8, PKCS#1 or SEC1) of a PEM file.
fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read("key", path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Invalid {
        what: "key",
        path: path.to_owned(),
        reason: match e {
            rustls_pki_types::pem::Error::NoItemsFound => {
                "no PEM PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY section found".into()
            }
            e => e.to_string(),
        },
    })
}

/// A protocol's [`Service`] behind a TLS handshake: the [`Handler`] of a TLS listener.
pub struct TlsHandler<T> {
    configs: Arc<TlsConfigs>,
    service: T,
}

impl<T: Service> TlsHandler<T> {
    pub fn new(configs: Arc<TlsConfigs>, service: T) -> TlsHandler<T> {
        TlsHandler { configs, service }
    }
}

impl<T: Service> Handler for TlsHandler<T> {
    fn serve(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        mut ctx: ConnContext,
    ) -> impl Future<Output = ConnResult> + Send + 'static + use<T> {
        let config = self.configs.current();
        let service = self.service.clone();
        // Boxed (the handshake and the stream after it): a connection's task is sized
        // for its largest state, and rustls' connection state (1.2 KiB) and the
        // handshake's temporaries would otherwise widen it several times over for as
        // long as the connection lives. `then`, not an async block: it holds either the
        // handshake (with what the service needs next) or the service's future, and an
        // async block would keep its captures beside the service's future.
        let shutdown = ctx.shutdown.clone();
        let handshake = Box::pin(async move { handshake(config, stream, &shutdown).await });
        handshake.then(move |r| match r {
            Ok((tls, established)) => {
                ctx.peer_cert_cn = established.peer_cert.as_deref().and_then(subject_cn);
                if let (Some(conn), Some(cn)) = (&ctx.conn, &ctx.peer_cert_cn) {
                    conn.set_peer_cert_cn(cn);
                }
                debug!(
                    version = ?established.version,
                    suite = ?established.suite,
                    peer_cert_cn = ?ctx.peer_cert_cn,
                    "TLS established"
                );
                Either::Left(service.serve(tls, peer, ctx))
            }
            Err(end) => Either::Right(std::future::ready(end)),
        })
    }
}

/// The TLS handshake under [`HANDSHAKE_TIMEOUT`]; `Err` is how the connection ends.
async fn handshake(
    config: Arc<ServerConfig>,
    stream: TcpStream,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<(Box<TlsStream<TcpStream>>, stream::Established), ConnResult> {
    tokio::select! {
        () = shutdown.cancelled() => {
            Err(Ok(Cow::Borrowed("shutdown during the TLS handshake")))
        }
        r = tokio::time::timeout(HANDSHAKE_TIMEOUT, TlsStream::accept(stream, config)) => match r {
            Err(_elapsed) => Err(Ok(Cow::Borrowed("TLS handshake timeout"))),
            Ok(Err(e)) => Err(Err(format!("TLS handshake failed: {e}").into())),
            Ok(Ok((tls, established))) => Ok((Box::new(tls), established)),
        },
    }
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;
/// `[0] EXPLICIT Version` of a v2/v3 `TBSCertificate`.
const VERSION: u8 = 0xa0;
/// id-at-commonName, 2.5.4.3.
const OID_CN: [u8; 3] = [0x55, 0x04, 0x03];

/// The first common name (2.5.4.3) in an X.509 certificate's subject, if any and if it
/// is a string type we read (UTF8String, PrintableString, IA5String, TeletexString as
/// Latin-1, BMPString). `None` for anything malformed; never panics.
pub fn subject_cn(cert_der: &[u8]) -> Option<String> {
    let (SEQUENCE, cert, _) = tlv(cert_der)? else {
        return None;
    };
    let (SEQUENCE, mut tbs, _) = tlv(cert)? else {
        return None;
    };
    let (tag, _, after) = tlv(tbs)?;
    if tag == VERSION {
        tbs = after;
    }
    // serialNumber, signature, issuer, validity
    for _ in 0..4 {
        tbs = tlv(tbs)?.2;
    }
    let (SEQUENCE, mut name, _) = tlv(tbs)? else {
        return None;
    };
    // Name ::= SEQUENCE OF RelativeDistinguishedName (SET OF AttributeTypeAndValue)
    while !name.is_empty() {
        let (SET, mut rdn, rest) = tlv(name)? else {
            return None;
        };
        name = rest;
        while !rdn.is_empty() {
            let (SEQUENCE, atv, rest) = tlv(rdn)? else {
                return None;
            };
            rdn = rest;
            let (OID, oid, value) = tlv(atv)? else {
                return None;
            };
            if oid == OID_CN {
                let (tag, value, _) = tlv(value)?;
                return directory_string(tag, value);
            }
        }
    }
    None
}

/// One DER tag-length-value: (tag, value, what follows). Single-byte tags only (all
/// an X.509 name needs); lengths up to 4 bytes.
fn tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let (bytes, rest) = rest.split_at_checked(n)?;
        let len = bytes.iter().try_fold(0usize, |acc, &b| {
            acc.checked_mul(256)?.checked_add(b.into())
        })?;
        (len, rest)
    };
    let (value, rest) = rest.split_at_checked(len)?;
    Some((tag, value, rest))
}

fn directory_string(tag: u8, value: &[u8]) -> Option<String> {
    match tag {
        // UTF8String
        0x0c => String::from_utf8(value.to_vec()).ok(),
        // PrintableString, IA5String
        0x13 | 0x16 => value
            .is_ascii()
            .then(|| String::from_utf8_lossy(value).into_owned()),
        // TeletexString: in practice Latin-1
        0x14 => Some(value.iter().map(|&b| char::from(b)).collect()),
        // BMPString: UCS-2 big-endian
        0x1e => {
            let units: Vec<u16> = value
                .chunks(2)
                .map(|c| match c {
                    [hi, lo] => Some(u16::from_be_bytes([*hi, *lo])),
                    _ => None,
                })
                .collect::<Option<_>>()?;
            String::from_utf16(&units).ok()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DistinguishedName, DnType, DnValue, KeyPair};

    fn cert_with(dn: DistinguishedName) -> Vec<u8> {
        let mut params = CertificateParams::new(vec!["localhost".into()]).expect("params");
        params.distinguished_name = dn;
        let key = KeyPair::generate().expect("key");
        params.self_signed(&key).expect("cert").der().to_vec()
    }

    #[test]
    fn subject_cn_reads_the_common_name() {
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CountryName, "SE");
        dn.push(DnType::OrganizationName, "Triad");
        dn.push(DnType::CommonName, "client-1");
        assert_eq!(subject_cn(&cert_with(dn)).as_deref(), Some("client-1"));

        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            DnValue::PrintableString("printable".try_into().expect("printable")),
        );
        assert_eq!(subject_cn(&cert_with(dn)).as_deref(), Some("printable"));

        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, DnValue::Utf8String("Grüße ✓".into()));
        assert_eq!(subject_cn(&cert_with(dn)).as_deref(), Some("Grüße ✓"));

        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "no cn here");
        assert_eq!(subject_cn(&cert_with(dn)), None);
    }

    #[test]
    fn subject_cn_survives_garbage() {
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "x");
        let der = cert_with(dn);
        // Every truncation and a flipped byte at every position: no panic.
        for n in 0..der.len() {
            let _ = subject_cn(&der[..n]);
            let mut bad = der.clone();
            bad[n] ^= 0xff;
            let _ = subject_cn(&bad);
        }
        assert_eq!(subject_cn(&[]), None);
        assert_eq!(subject_cn(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(subject_cn(&[0x30, 0x85, 1, 1, 1, 1, 1]), None);
    }

    #[test]
    fn directory_strings() {
        assert_eq!(directory_string(0x14, b"caf\xe9").as_deref(), Some("café"));
        assert_eq!(
            directory_string(0x1e, &[0, b'h', 0, b'i']).as_deref(),
            Some("hi")
        );
        assert_eq!(directory_string(0x1e, &[0, b'h', 0]), None);
        assert_eq!(directory_string(0x13, b"\xff"), None);
        assert_eq!(directory_string(0x04, b"octets"), None);
    }
}
