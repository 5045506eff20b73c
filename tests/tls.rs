//! The TLS listeners (`amqps`, `stomps`, `mqtts`, `https`) of the real broker: TLS 1.2
//! and 1.3 handshakes and each protocol over them, TLS 1.1 refused, client-certificate
//! verification, bad PEM files at startup, and the plain listeners alongside.
//!
//! Every certificate and key is generated at run time with rcgen into a temporary
//! directory: no private key is committed.

mod common;

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::certs::new_ca;
use common::{ephemeral_listen_args, run_to_exit, triad_command, TestBroker};
use rcgen::{
    CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::version::{TLS12, TLS13};
use rustls::{ClientConfig, RootCertStore, SupportedProtocolVersion};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

const IO_TIMEOUT: Duration = Duration::from_secs(10);
const STOMP_CONNECT: &[u8] = b"CONNECT\naccept-version:1.2\nhost:localhost\n\n\x00";
/// MQTT 3.1.1 CONNECT: clean session, keep-alive 60 s, client id "t".
const MQTT_CONNECT: [u8; 15] = [
    0x10, 13, 0, 4, b'M', b'Q', b'T', b'T', 4, 2, 0, 60, 0, 1, b't',
];
const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

/// A client's certificate chain and key.
struct Identity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    fn clone_key(&self) -> Identity {
        Identity {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

/// A test CA, a server certificate for `localhost` / 127.0.0.1 and client
/// certificates, all generated now and written (PEM) to a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
    ca: CertificateDer<'static>,
    ca_file: PathBuf,
    cert_file: PathBuf,
    key_file: PathBuf,
    /// Signed by the test CA.
    client: Identity,
    /// Signed by another CA the broker does not trust.
    stranger: Identity,
}

/// A leaf certificate signed by `ca`: (PEM certificate, key pair, DER certificate).
fn leaf(
    ca: &CertifiedIssuer<'static, KeyPair>,
    cn: &str,
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, KeyPair, CertificateDer<'static>) {
    let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
    let mut p = CertificateParams::new(sans).expect("leaf params");
    p.distinguished_name.push(DnType::CommonName, cn);
    p.extended_key_usages = vec![usage];
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate().expect("leaf key");
    let cert = p.signed_by(&key, ca).expect("sign leaf");
    (cert.pem(), key, cert.der().clone())
}

fn identity(key: &KeyPair, cert: CertificateDer<'static>) -> Identity {
    Identity {
        chain: vec![cert],
        key: PrivateKeyDer::try_from(key.serialize_der()).expect("client key"),
    }
}

impl Pki {
    fn generate() -> Pki {
        let dir = tempfile::Builder::new()
            .prefix("triad-tls-")
            .tempdir()
            .expect("temp dir");
        let ca = new_ca("Triad test CA");
        let (server_pem, server_key, _) = leaf(
            &ca,
            "localhost",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (_, client_key, client_der) = leaf(
            &ca,
            "triad-client",
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let other_ca = new_ca("Some other CA");
        let (_, stranger_key, stranger_der) = leaf(
            &other_ca,
            "stranger",
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).expect("write PEM");
            path
        };
        Pki {
            ca: ca.der().clone(),
            ca_file: write("ca.pem", &ca.pem()),
            cert_file: write("server.pem", &server_pem),
            key_file: write("server-key.pem", &server_key.serialize_pem()),
            client: identity(&client_key, client_der),
            stranger: identity(&stranger_key, stranger_der),
            dir,
        }
    }

    /// A client that trusts the test CA, speaks only `version`, and presents `identity`.
    fn connector(
        &self,
        version: &'static SupportedProtocolVersion,
        identity: Option<Identity>,
    ) -> TlsConnector {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).expect("trust the test CA");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[version])
            .expect("versions")
            .with_root_certificates(roots);
        let config = match identity {
            Some(id) => builder
                .with_client_auth_cert(id.chain, id.key)
                .expect("client cert"),
            None => builder.with_no_client_auth(),
        };
        TlsConnector::from(Arc::new(config))
    }
}

async fn connect(
    connector: &TlsConnector,
    addr: SocketAddr,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").expect("server name");
    tokio::time::timeout(IO_TIMEOUT, connector.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("TLS handshake timed out"))?
}

/// Sends `send` and reads exactly `want` bytes back.
async fn talk<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, send: &[u8], want: usize) -> Vec<u8> {
    s.write_all(send).await.expect("write");
    s.flush().await.expect("flush");
    let mut buf = vec![0u8; want];
    tokio::time::timeout(IO_TIMEOUT, s.read_exact(&mut buf))
        .await
        .expect("reply in time")
        .expect("reply");
    buf
}

/// Sends an HTTP request and reads until the server closes.
async fn http<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, request: &[u8]) -> String {
    s.write_all(request).await.expect("write");
    s.flush().await.expect("flush");
    let mut out = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        match tokio::time::timeout(IO_TIMEOUT, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&chunk[..n]),
            Err(_) => panic!("HTTP response not finished in time: {out:?}"),
        }
    }
    String::from_utf8(out).expect("UTF-8 response")
}

/// Each protocol over its TLS port, at `version`.
async fn speak_every_protocol(
    broker: &TestBroker,
    pki: &Pki,
    version: &'static SupportedProtocolVersion,
    identity: Option<&Identity>,
) {
    let want = version.version;
    let c = pki.connector(version, identity.map(Identity::clone_key));
    let check = |s: &TlsStream<TcpStream>, proto: &str| {
        assert_eq!(
            s.get_ref().1.protocol_version(),
            Some(want),
            "{proto} negotiated version"
        );
    };

    let mut s = connect(&c, broker.amqps_addr()).await.expect("amqps");
    check(&s, "amqps");
    // A wrong protocol header is answered with the one the server speaks.
    assert_eq!(
        talk(&mut s, b"AMQP\x00\x00\x08\x00", 8).await,
        b"AMQP\x00\x00\x09\x01"
    );

    let mut s = connect(&c, broker.stomps_addr()).await.expect("stomps");
    check(&s, "stomps");
    assert_eq!(talk(&mut s, STOMP_CONNECT, 10).await, b"CONNECTED\n");

    let mut s = connect(&c, broker.mqtts_addr()).await.expect("mqtts");
    check(&s, "mqtts");
    assert_eq!(talk(&mut s, &MQTT_CONNECT, 4).await, [0x20, 2, 0, 0]);

    let mut s = connect(&c, broker.https_addr()).await.expect("https");
    check(&s, "https");
    let resp = http(&mut s, HEALTH).await;
    assert!(resp.starts_with("HTTP/1.1 200 OK\r\n"), "{resp}");
    assert!(resp.ends_with("{\"status\":\"ok\"}"), "{resp}");
}

/// The plain listeners, unchanged beside the TLS ones.
async fn plain_listeners_work(broker: &TestBroker) {
    let mut s = TcpStream::connect(broker.amqp_addr()).await.expect("amqp");
    assert_eq!(
        talk(&mut s, b"AMQP\x00\x00\x08\x00", 8).await,
        b"AMQP\x00\x00\x09\x01"
    );
    let mut s = TcpStream::connect(broker.stomp_addr())
        .await
        .expect("stomp");
    assert_eq!(talk(&mut s, STOMP_CONNECT, 10).await, b"CONNECTED\n");
    let mut s = TcpStream::connect(broker.mqtt_addr()).await.expect("mqtt");
    assert_eq!(talk(&mut s, &MQTT_CONNECT, 4).await, [0x20, 2, 0, 0]);
    let mut s = TcpStream::connect(broker.http_addr()).await.expect("http");
    let resp = http(&mut s, HEALTH).await;
    assert!(resp.starts_with("HTTP/1.1 200 OK\r\n"), "{resp}");
}

/// Whether the broker refuses this client: the handshake fails, or (TLS 1.3, where the
/// client finishes before the server has checked its certificate) the first read
/// after a STOMP CONNECT ends in an alert or EOF instead of CONNECTED.
async fn refused(connector: &TlsConnector, addr: SocketAddr) -> bool {
    let Ok(mut s) = connect(connector, addr).await else {
        return true;
    };
    if s.write_all(STOMP_CONNECT).await.is_err() || s.flush().await.is_err() {
        return true;
    }
    let mut buf = [0u8; 10];
    match tokio::time::timeout(IO_TIMEOUT, s.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => true,
        Ok(Ok(_)) => false,
        Err(_) => panic!("neither refused nor answered within {IO_TIMEOUT:?}"),
    }
}

#[tokio::test]
async fn tls12_and_tls13_carry_every_protocol() {
    let pki = Pki::generate();
    let broker = TestBroker::start_with_tls("", &pki.cert_file, &pki.key_file, None);
    speak_every_protocol(&broker, &pki, &TLS13, None).await;
    speak_every_protocol(&broker, &pki, &TLS12, None).await;
    plain_listeners_work(&broker).await;
    // Distinct ports for all eight listeners.
    let mut ports: Vec<u16> = [
        "amqp", "stomp", "mqtt", "http", "amqps", "stomps", "mqtts", "https",
    ]
    .iter()
    .map(|p| broker.addr(p).port())
    .collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 8);
}

#[test]
fn default_config_binds_no_tls_listener() {
    let broker = TestBroker::start();
    let log = broker.log();
    for proto in ["amqps", "stomps", "mqtts", "https"] {
        assert!(!log.contains(&format!("proto={proto} ")), "{log}");
    }
    // Addresses alone (no certificate) do not start them either.
    let broker = TestBroker::start_with(
        Some(common::TEST_CONFIG),
        &common::tls_ephemeral_listen_args(),
    );
    assert!(!broker.log().contains("proto=amqps"), "{}", broker.log());
}

/// A hand-made TLS 1.1 ClientHello (rustls clients cannot speak 1.1 at all). Apart
/// from the version (and no `supported_versions` extension) it has all a TLS 1.2
/// server wants, so that the version is the only reason to refuse it.
fn tls11_client_hello() -> Vec<u8> {
    let mut body = vec![0x03, 0x02]; // client_version: TLS 1.1
    body.extend([0x42; 32]); // random
    body.push(0); // no session id
                  // TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA, TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA,
                  // TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_RSA_WITH_AES_128_CBC_SHA
    body.extend([0x00, 0x08, 0xc0, 0x09, 0xc0, 0x13, 0xc0, 0x2b, 0x00, 0x2f]);
    body.extend([0x01, 0x00]); // compression methods: null
    let extensions: [&[u8]; 3] = [
        // signature_algorithms: ecdsa_secp256r1_sha256, rsa_pss_rsae_sha256,
        // rsa_pkcs1_sha256
        &[
            0x00, 0x0d, 0x00, 0x08, 0x00, 0x06, 0x04, 0x03, 0x08, 0x04, 0x04, 0x01,
        ],
        // supported_groups: x25519, secp256r1
        &[0x00, 0x0a, 0x00, 0x06, 0x00, 0x04, 0x00, 0x1d, 0x00, 0x17],
        // ec_point_formats: uncompressed
        &[0x00, 0x0b, 0x00, 0x02, 0x01, 0x00],
    ];
    let ext: Vec<u8> = extensions.concat();
    body.extend(u16::try_from(ext.len()).expect("small").to_be_bytes());
    body.extend(ext);
    let len = u32::try_from(body.len()).expect("small");
    let mut handshake = vec![0x01]; // client_hello
    handshake.extend(&len.to_be_bytes()[1..]);
    handshake.extend(body);
    let len = u16::try_from(handshake.len()).expect("small");
    let mut record = vec![0x16, 0x03, 0x01]; // handshake record, TLS 1.0 record version
    record.extend(len.to_be_bytes());
    record.extend(handshake);
    record
}

#[tokio::test]
async fn tls11_client_hello_is_refused() {
    let pki = Pki::generate();
    let broker = TestBroker::start_with_tls("", &pki.cert_file, &pki.key_file, None);
    for addr in [
        broker.amqps_addr(),
        broker.stomps_addr(),
        broker.mqtts_addr(),
        broker.https_addr(),
    ] {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(&tls11_client_hello())
            .await
            .expect("send hello");
        let mut reply = Vec::new();
        let _ = tokio::time::timeout(IO_TIMEOUT, s.read_to_end(&mut reply))
            .await
            .expect("the server closes");
        // Either a bare close or an alert record; never a ServerHello (0x16).
        if let Some(&kind) = reply.first() {
            assert_eq!(kind, 0x15, "an alert record, not {reply:02x?}");
            // fatal protocol_version
            assert_eq!(reply.get(5..7), Some(&[2u8, 70][..]), "{reply:02x?}");
        }
    }
    // The broker is fine afterwards.
    speak_every_protocol(&broker, &pki, &TLS13, None).await;
    // Refused for its version, not for anything else in the hello (HTTPS closes are
    // logged at debug only).
    let log = broker.log();
    for proto in ["amqps", "stomps", "mqtts"] {
        assert!(
            log.lines().any(|l| l.contains(&format!("proto={proto} "))
                && l.contains("TLS handshake failed: peer is incompatible: Tls12NotOffered")),
            "{proto}: {log}"
        );
    }
}

#[tokio::test]
async fn client_certificates_are_verified() {
    let pki = Pki::generate();
    let strict = "[tls]\nverify_peer = true\nfail_if_no_peer_cert = true\n";
    let broker =
        TestBroker::start_with_tls(strict, &pki.cert_file, &pki.key_file, Some(&pki.ca_file));
    for version in [&TLS13, &TLS12] {
        let v = version.version;
        // The test CA's client certificate: every protocol works.
        speak_every_protocol(&broker, &pki, version, Some(&pki.client)).await;
        for addr in [broker.stomps_addr(), broker.amqps_addr()] {
            assert!(
                refused(&pki.connector(version, None), addr).await,
                "{v:?}: a client without a certificate is refused"
            );
            assert!(
                refused(
                    &pki.connector(version, Some(pki.stranger.clone_key())),
                    addr
                )
                .await,
                "{v:?}: a certificate from another CA is refused"
            );
        }
    }
    broker.wait_for_log("TLS handshake failed", Duration::from_secs(10));
    plain_listeners_work(&broker).await;

    // verify_peer alone: no certificate is fine, a bad one still is not.
    let lenient = "[tls]\nverify_peer = true\n";
    let broker =
        TestBroker::start_with_tls(lenient, &pki.cert_file, &pki.key_file, Some(&pki.ca_file));
    speak_every_protocol(&broker, &pki, &TLS13, None).await;
    speak_every_protocol(&broker, &pki, &TLS12, Some(&pki.client)).await;
    assert!(
        refused(
            &pki.connector(&TLS13, Some(pki.stranger.clone_key())),
            broker.stomps_addr()
        )
        .await
    );
}

/// Runs the broker with these TLS flags; it must exit 2 with one error line that
/// contains `needle`.
fn startup_refused(dir: &Path, tls_args: &[&Path; 2], extra: &[&str], needle: &str) {
    let mut cmd = triad_command();
    cmd.arg("--data-dir")
        .arg(dir.join("data"))
        .args(ephemeral_listen_args())
        .arg("--tls-cert")
        .arg(tls_args[0])
        .arg("--tls-key")
        .arg(tls_args[1])
        .args(extra);
    let out = run_to_exit(cmd, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("triad: error: "), "{stderr}");
    assert!(stderr.contains(needle), "{needle:?} in {stderr}");
    assert!(!dir.join("data").exists(), "no store is opened");
}

#[test]
fn bad_pem_files_stop_the_broker_at_startup() {
    let pki = Pki::generate();
    let d = pki.dir.path();
    let file = |name: &str, text: &str| {
        let p = d.join(name);
        let mut f = std::fs::File::create(&p).expect("create");
        f.write_all(text.as_bytes()).expect("write");
        p
    };
    let missing = d.join("no-such.pem");
    let garbage = file("garbage.pem", "this is not PEM\n");
    let broken = file(
        "broken.pem",
        "-----BEGIN CERTIFICATE-----\n!!!not base64!!!\n-----END CERTIFICATE-----\n",
    );
    let other_key = file(
        "other-key.pem",
        &KeyPair::generate().expect("key").serialize_pem(),
    );
    let (cert, key) = (pki.cert_file.as_path(), pki.key_file.as_path());

    let shown = |p: &Path| p.display().to_string();
    startup_refused(d, &[&missing, key], &[], &shown(&missing));
    startup_refused(d, &[cert, &missing], &[], &shown(&missing));
    startup_refused(d, &[&garbage, key], &[], &shown(&garbage));
    startup_refused(d, &[&broken, key], &[], &shown(&broken));
    // A certificate where the key should be: no key in it.
    startup_refused(d, &[cert, cert], &[], "no PEM PRIVATE KEY");
    startup_refused(d, &[cert, &other_key], &[], "does not match");
    let ca_missing = ["--tls-ca", missing.to_str().expect("UTF-8")];
    startup_refused(d, &[cert, key], &ca_missing, &shown(&missing));
    let ca_garbage = ["--tls-ca", garbage.to_str().expect("UTF-8")];
    startup_refused(d, &[cert, key], &ca_garbage, &shown(&garbage));
}

/// Interop with another TLS stack: Python's `ssl` (OpenSSL) against the HTTPS and
/// STOMP listeners. Skipped when there is no `python3`.
#[test]
fn python_ssl_client_interoperates() {
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("python3 not found; skipping");
        return;
    }
    let pki = Pki::generate();
    let broker = TestBroker::start_with_tls("", &pki.cert_file, &pki.key_file, None);
    let script = r#"
import socket, ssl, sys
ca, https_port, stomps_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for version in (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2):
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ctx.maximum_version = version
    with socket.create_connection(("127.0.0.1", https_port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            assert s.version() == version.name.replace("_", "."), s.version()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            data = b""
            while True:
                try:
                    chunk = s.recv(4096)
                except (ssl.SSLEOFError, ConnectionResetError):
                    break
                if not chunk:
                    break
                data += chunk
            assert data.startswith(b"HTTP/1.1 200 OK\r\n"), data
    with socket.create_connection(("127.0.0.1", stomps_port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"CONNECT\naccept-version:1.2\nhost:localhost\n\n\x00")
            data = b""
            while not data.startswith(b"CONNECTED\n") and len(data) < 10:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            assert data.startswith(b"CONNECTED\n"), data
    print("ok", version.name)
"#;
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&pki.ca_file)
        .arg(broker.https_addr().port().to_string())
        .arg(broker.stomps_addr().port().to_string())
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python3 failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("ok TLSv1_3") && stdout.contains("ok TLSv1_2"),
        "{stdout}"
    );
}

/// Reads one AMQP frame: (type, payload without the frame-end octet).
async fn amqp_frame<S: AsyncRead + Unpin>(s: &mut S) -> (u8, Vec<u8>) {
    let mut head = [0u8; 7];
    tokio::time::timeout(IO_TIMEOUT, s.read_exact(&mut head))
        .await
        .expect("frame in time")
        .expect("frame header");
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    assert!(size < 1 << 20, "frame size {size}");
    let mut payload = vec![0u8; size + 1];
    s.read_exact(&mut payload).await.expect("frame payload");
    payload.pop();
    (head[0], payload)
}

/// An AMQP method frame on channel 0.
fn amqp_method(payload: &[u8]) -> Vec<u8> {
    let mut f = vec![1, 0, 0];
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(0xCE);
    f
}

/// connection.start's mechanisms (the frame, searched as bytes), then SASL EXTERNAL
/// through connection.open of `/`: the class/method ids of the last answer.
async fn amqp_external<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> (bool, [u8; 4]) {
    s.write_all(b"AMQP\x00\x00\x09\x01").await.expect("header");
    let (_, start) = amqp_frame(s).await;
    assert_eq!(&start[..4], &[0, 10, 0, 10], "connection.start");
    let offers_external = start.windows(8).any(|w| w == b"EXTERNAL");
    if !offers_external {
        return (false, [0; 4]);
    }
    // start-ok: empty client properties, EXTERNAL, empty response, en_US
    let mut p = vec![0, 10, 0, 11, 0, 0, 0, 0, 8];
    p.extend_from_slice(b"EXTERNAL");
    p.extend_from_slice(&[0, 0, 0, 0, 5]);
    p.extend_from_slice(b"en_US");
    s.write_all(&amqp_method(&p)).await.expect("start-ok");
    let (_, answer) = amqp_frame(s).await;
    if answer[..4] != [0, 10, 0, 30] {
        return (true, [answer[0], answer[1], answer[2], answer[3]]);
    }
    // tune-ok (channel_max 0, frame_max 128 KiB, no heartbeat), then open "/"
    let tune_ok = [0, 10, 0, 31, 0, 0, 0, 2, 0, 0, 0, 0];
    s.write_all(&amqp_method(&tune_ok)).await.expect("tune-ok");
    s.write_all(&amqp_method(&[0, 10, 0, 40, 1, b'/', 0, 0]))
        .await
        .expect("open");
    let (_, answer) = amqp_frame(s).await;
    (true, [answer[0], answer[1], answer[2], answer[3]])
}

/// STOMP SUBSCRIBE to `/queue/cn-q` with a receipt: the answer's command line.
async fn stomp_subscribe<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> String {
    assert_eq!(talk(s, STOMP_CONNECT, 10).await, b"CONNECTED\n");
    // the rest of CONNECTED, up to its NUL
    let mut b = [1u8; 1];
    while b[0] != 0 {
        s.read_exact(&mut b).await.expect("CONNECTED");
    }
    let sub = b"SUBSCRIBE\nid:0\ndestination:/queue/cn-q\nreceipt:r\n\n\x00";
    let reply = talk(s, sub, 5).await;
    String::from_utf8_lossy(&reply).into_owned()
}

/// MQTT CONNECT without a user name with the one-letter client id `id`, then SUBSCRIBE
/// `a/b` at QoS 0: (CONNACK code, SUBACK code).
async fn mqtt_anonymous_subscribe<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    id: u8,
) -> (u8, u8) {
    let mut connect = MQTT_CONNECT;
    connect[14] = id;
    let connack = talk(s, &connect, 4).await;
    if connack[3] != 0 {
        return (connack[3], 0);
    }
    let sub = [0x82, 8, 0, 1, 0, 3, b'a', b'/', b'b', 0];
    let suback = talk(s, &sub, 5).await;
    assert_eq!(&suback[..4], &[0x90, 3, 0, 1]);
    (0, suback[4])
}

/// With a verified client certificate, AMQP offers SASL EXTERNAL and STOMP / MQTT
/// (`auth.ssl_cert_login`) log in as the certificate's CN. The default user is given
/// no rights here, so what works proves who logged in.
#[tokio::test]
async fn client_certificate_cn_logs_in() {
    let pki = Pki::generate();
    let hash = triad_core::PasswordHash::new("unused-password")
        .expect("hash")
        .to_base64();
    let toml = format!(
        r#"
[auth]
ssl_cert_login = true
failed_login_delay = "0s"

[tls]
verify_peer = true

[[users]]
name = "triad-client"
password_hash = "{hash}"

[[permissions]]
user = "triad-client"
vhost = "/"
configure = ".*"
write = ".*"
read = ".*"

[[permissions]]
user = "guest"
vhost = "/"
configure = ""
write = ""
read = ""
"#
    );
    let broker =
        TestBroker::start_with_tls(&toml, &pki.cert_file, &pki.key_file, Some(&pki.ca_file));
    let with_cert = pki.connector(&TLS13, Some(pki.client.clone_key()));
    let without = pki.connector(&TLS13, None);

    // AMQP: EXTERNAL offered and accepted, connection.open-ok (10, 41)
    let mut s = connect(&with_cert, broker.amqps_addr())
        .await
        .expect("amqps");
    assert_eq!(amqp_external(&mut s).await, (true, [0, 10, 0, 41]));
    // no certificate: no EXTERNAL
    let mut s = connect(&without, broker.amqps_addr()).await.expect("amqps");
    assert!(!amqp_external(&mut s).await.0);

    // STOMP: as the CN, /queue/ may be declared and consumed; as guest it may not
    let mut s = connect(&with_cert, broker.stomps_addr())
        .await
        .expect("stomps");
    assert_eq!(stomp_subscribe(&mut s).await, "RECEI");
    let mut s = connect(&without, broker.stomps_addr())
        .await
        .expect("stomps");
    assert_eq!(stomp_subscribe(&mut s).await, "ERROR");

    // MQTT: the CN's subscription is granted; guest's is refused (under another client
    // id: the CN's connection still holds `c`, and a session belongs to its user)
    let mut s = connect(&with_cert, broker.mqtts_addr())
        .await
        .expect("mqtts");
    assert_eq!(mqtt_anonymous_subscribe(&mut s, b'c').await, (0, 0));
    let mut s = connect(&without, broker.mqtts_addr()).await.expect("mqtts");
    assert_eq!(mqtt_anonymous_subscribe(&mut s, b'g').await, (0, 0x80));
}

/// EXTERNAL for a certificate whose CN is no user: 403 ACCESS_REFUSED
/// (connection.close, 10/50).
#[tokio::test]
async fn external_login_needs_an_existing_user() {
    let pki = Pki::generate();
    let broker = TestBroker::start_with_tls(
        "[tls]\nverify_peer = true\n[auth]\nfailed_login_delay = \"0s\"\n",
        &pki.cert_file,
        &pki.key_file,
        Some(&pki.ca_file),
    );
    let c = pki.connector(&TLS13, Some(pki.client.clone_key()));
    let mut s = connect(&c, broker.amqps_addr()).await.expect("amqps");
    assert_eq!(amqp_external(&mut s).await, (true, [0, 10, 0, 50]));
    // the log line comes through the harness's reader thread: poll for it
    broker.wait_for_log("AMQP login refused", Duration::from_secs(10));
}
