//! TLS certificate reload without a restart (SIGHUP, and a file change with
//! `tls.watch_interval`), certificates chosen by SNI (`[[tls.certificates]]`), and
//! session resumption seen by Python's `ssl` (OpenSSL) over TLS 1.2 and 1.3, with the
//! session cache and with stateless tickets.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::TestBroker;
use rustls::pki_types::{CertificateDer, ServerName};
use triad_core::testing::eventually_blocking;

const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A self-signed certificate for `localhost` with its own key and this serial.
struct Cert {
    der: CertificateDer<'static>,
    pem: String,
    key_pem: String,
}

fn cert(serial: u64) -> Cert {
    cert_for(serial, &["localhost", "127.0.0.1"])
}

fn cert_for(serial: u64, names: &[&str]) -> Cert {
    let key = rcgen::KeyPair::generate().expect("key");
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut params = rcgen::CertificateParams::new(names).expect("params");
    params.serial_number = Some(rcgen::SerialNumber::from(serial));
    let c = params.self_signed(&key).expect("cert");
    Cert {
        der: c.der().clone(),
        pem: c.pem(),
        key_pem: key.serialize_pem(),
    }
}

/// Replaces a file the way cert-manager and certbot do: a new file renamed over it.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

fn install(c: &Cert, cert: &Path, key: &Path) {
    replace(key, &c.key_pem);
    replace(cert, &c.pem);
}

/// A client that accepts any of `certs` (all self-signed) and never resumes.
fn client_config(certs: &[&Cert]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs {
        roots.add(c.der.clone()).expect("root");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    // A full handshake each time: a resumed session would report the certificate of
    // the session it resumed.
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// An MQTT-over-TLS session (anonymous, loopback) and the certificate it was served.
fn mqtt_tls(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
) -> (Tls, CertificateDer<'static>) {
    mqtt_tls_to(addr, config, "localhost")
}

/// [`mqtt_tls`] asking for `server_name` (an IP address sends no SNI).
fn mqtt_tls_to(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
    server_name: &str,
) -> (Tls, CertificateDer<'static>) {
    let tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    let name = ServerName::try_from(server_name.to_owned()).expect("name");
    let conn = rustls::ClientConnection::new(Arc::clone(config), name).expect("client");
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    // A client id of its own: a second CONNECT with the same one would take over.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let id = format!(
        "reload-{}",
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    tls.write_all(&common::raw::mqtt_connect_packet(&id, true))
        .expect("CONNECT");
    let mut connack = [0u8; 4];
    tls.read_exact(&mut connack).expect("CONNACK");
    assert_eq!(connack, [0x20, 2, 0, 0]);
    let served = tls.conn.peer_certificates().expect("server certificate")[0].clone();
    (tls, served)
}

fn ping(tls: &mut Tls) {
    tls.write_all(&[0xc0, 0]).expect("PINGREQ");
    let mut resp = [0u8; 2];
    tls.read_exact(&mut resp).expect("PINGRESP");
    assert_eq!(resp, [0xd0, 0]);
}

fn sighup(broker: &TestBroker) {
    let pid = libc::pid_t::try_from(broker.pid()).expect("pid");
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
}

fn count(broker: &TestBroker, needle: &str) -> usize {
    broker.log().matches(needle).count()
}

fn wait_for_count(broker: &TestBroker, needle: &str, n: usize) {
    eventually_blocking(&format!("{n}x {needle:?} in the log"), IO_TIMEOUT, || {
        if count(broker, needle) >= n {
            Ok(())
        } else {
            Err(format!("the log:\n{}", broker.log()))
        }
    });
}

#[test]
fn sighup_reloads_the_certificate_and_keeps_connections() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let (a, b) = (cert(1), cert(2));
    install(&a, &cert_path, &key_path);
    // Only SIGHUP reloads here.
    let broker = TestBroker::start_with_tls(
        "[tls]\nwatch_interval = \"0s\"\n",
        &cert_path,
        &key_path,
        None,
    );
    let config = client_config(&[&a, &b]);
    let (mut old, served) = mqtt_tls(broker.mqtts_addr(), &config);
    assert_eq!(served, a.der);

    install(&b, &cert_path, &key_path);
    sighup(&broker);
    wait_for_count(&broker, "TLS certificate reloaded", 1);
    let (mut new, served) = mqtt_tls(broker.mqtts_addr(), &config);
    assert_eq!(served, b.der, "a new connection gets the new certificate");
    ping(&mut old);
    ping(&mut new);

    // A bad file: logged, and the certificate in use stays.
    replace(
        &cert_path,
        "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
    );
    sighup(&broker);
    wait_for_count(
        &broker,
        "TLS certificate reload failed; keeping the one in use",
        1,
    );
    let (_, served) = mqtt_tls(broker.mqtts_addr(), &config);
    assert_eq!(served, b.der);
    // A key that does not match the certificate: the same.
    install(&a, &cert_path, &key_path);
    replace(&key_path, &b.key_pem);
    sighup(&broker);
    wait_for_count(
        &broker,
        "TLS certificate reload failed; keeping the one in use",
        2,
    );
    let (_, served) = mqtt_tls(broker.mqtts_addr(), &config);
    assert_eq!(served, b.der);
    ping(&mut old);
    assert!(broker.log().contains("does not match the certificate"));
    assert_eq!(count(&broker, "TLS certificate reloaded"), 1);
    assert!(!broker.log().contains("shutdown requested"));
}

#[test]
fn sighup_without_tls_does_not_stop_the_broker() {
    let mut broker = TestBroker::start();
    sighup(&broker);
    broker.wait_for_log("SIGHUP: no TLS certificate to reload", IO_TIMEOUT);
    assert!(broker.is_running());
    let mut s = TcpStream::connect(broker.mqtt_addr()).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s.write_all(&common::raw::mqtt_connect_packet("after-hup", true))
        .expect("CONNECT");
    let mut connack = [0u8; 4];
    s.read_exact(&mut connack).expect("CONNACK");
    assert_eq!(connack, [0x20, 2, 0, 0]);
}

#[test]
fn a_changed_file_is_reloaded_without_a_signal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let (a, c) = (cert(1), cert(3));
    install(&a, &cert_path, &key_path);
    let broker = TestBroker::start_with_tls(
        "[tls]\nwatch_interval = \"100ms\"\n",
        &cert_path,
        &key_path,
        None,
    );
    let config = client_config(&[&a, &c]);
    let (mut old, served) = mqtt_tls(broker.mqtts_addr(), &config);
    assert_eq!(served, a.der);
    install(&c, &cert_path, &key_path);
    // Key and certificate are replaced one after the other: a check between the two
    // sees a mismatch and keeps the old chain; the next sees both.
    eventually_blocking("the new certificate served", IO_TIMEOUT, || {
        let (_, served) = mqtt_tls(broker.mqtts_addr(), &config);
        if served == c.der {
            Ok(())
        } else {
            Err(format!("not reloaded, the log:\n{}", broker.log()))
        }
    });
    assert!(broker.log().contains("trigger=\"files changed\""));
    ping(&mut old);
}

#[test]
fn sni_picks_the_certificate_by_server_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = |n: &str| dir.path().join(n);
    let default = cert_for(1, &["localhost", "127.0.0.1", "other.example"]);
    let a = cert_for(2, &["a.example", "alias.example"]);
    let b = cert_for(3, &["*.b.example"]);
    install(&default, &path("cert.pem"), &path("key.pem"));
    install(&a, &path("a.pem"), &path("a-key.pem"));
    install(&b, &path("b.pem"), &path("b-key.pem"));
    let toml = format!(
        "[[tls.certificates]]\ncert_file = {:?}\nkey_file = {:?}\nserver_names = [\"a.example\", \"ALIAS.example\"]\n\n\
         [[tls.certificates]]\ncert_file = {:?}\nkey_file = {:?}\nserver_names = [\"*.b.example\"]\n",
        path("a.pem"),
        path("a-key.pem"),
        path("b.pem"),
        path("b-key.pem"),
    );
    let broker = TestBroker::start_with_tls(&toml, &path("cert.pem"), &path("key.pem"), None);
    let config = client_config(&[&default, &a, &b]);
    let addr = broker.mqtts_addr();
    for (name, want) in [
        ("a.example", &a),
        ("Alias.Example", &a),
        ("x.b.example", &b),
        ("localhost", &default),
        ("other.example", &default),
        ("127.0.0.1", &default),
    ] {
        let (_, served) = mqtt_tls_to(addr, &config, name);
        assert_eq!(served, want.der, "{name}");
    }
    // Reloads cover the SNI chains too.
    let a2 = cert_for(4, &["a.example"]);
    install(&a2, &path("a.pem"), &path("a-key.pem"));
    sighup(&broker);
    wait_for_count(&broker, "TLS certificate reloaded", 1);
    let config = client_config(&[&a2]);
    let (_, served) = mqtt_tls_to(addr, &config, "a.example");
    assert_eq!(served, a2.der);
}

/// Python's `ssl` resumes a session: TLS 1.3 and 1.2, by the session cache (default)
/// and by stateless tickets.
#[test]
fn python_ssl_resumes_sessions() {
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("python3 not found; skipping");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let a = cert(7);
    install(&a, &cert_path, &key_path);
    let script = r#"
import socket, ssl, sys
ca, port = sys.argv[1], int(sys.argv[2])
CONNECT = bytes([0x10, 14, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 60, 0, 2]) + b"py"
for version in (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2):
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ctx.maximum_version = version
    session = None
    reused = []
    for attempt in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost", session=session) as s:
                s.sendall(CONNECT)
                connack = s.recv(4)
                assert connack == bytes([0x20, 2, 0, 0]), connack
                reused.append(s.session_reused)
                session = s.session
    print(version.name, reused)
"#;
    for toml in [
        "",
        "[tls]\nsession_tickets = true\nsession_cache_size = 0\n",
    ] {
        let broker = TestBroker::start_with_tls(toml, &cert_path, &key_path, None);
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&cert_path)
            .arg(broker.mqtts_addr().port().to_string())
            .output()
            .expect("run python3");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "python3 failed ({toml:?}):\n{stdout}\n{stderr}"
        );
        for version in ["TLSv1_3", "TLSv1_2"] {
            assert!(
                stdout.contains(&format!("{version} [False, True, True]")),
                "{toml:?}: {stdout}"
            );
        }
    }
    // Without a cache, tickets or TLS 1.3 tickets, nothing resumes.
    let broker = TestBroker::start_with_tls(
        "[tls]\nsession_cache_size = 0\ntls13_tickets = 0\n",
        &cert_path,
        &key_path,
        None,
    );
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&cert_path)
        .arg(broker.mqtts_addr().port().to_string())
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for version in ["TLSv1_3", "TLSv1_2"] {
        assert!(
            stdout.contains(&format!("{version} [False, False, False]")),
            "{stdout}"
        );
    }
}

/// A client-certificate CA and a client certificate it signed.
struct Ca {
    pem: String,
    client_chain: Vec<CertificateDer<'static>>,
    client_key_der: Vec<u8>,
}

fn ca_with_client(name: &str) -> Ca {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().expect("CA key")).expect("CA");
    let mut leaf = CertificateParams::new(Vec::<String>::new()).expect("leaf params");
    leaf.distinguished_name
        .push(DnType::CommonName, format!("client of {name}"));
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().expect("leaf key");
    let cert = leaf.signed_by(&key, &ca).expect("sign");
    Ca {
        pem: ca.pem(),
        client_chain: vec![cert.der().clone()],
        client_key_der: key.serialize_der(),
    }
}

/// A client trusting `server` and presenting `ca`'s client certificate; no resumption.
fn client_with_cert(server: &Cert, ca: &Ca) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(server.der.clone()).expect("root");
    let key = rustls::pki_types::PrivateKeyDer::try_from(ca.client_key_der.clone()).expect("key");
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_client_auth_cert(ca.client_chain.clone(), key)
    .expect("client cert");
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

/// Whether an MQTT-over-TLS CONNECT gets its CONNACK (a refused client certificate
/// shows as a TLS error once the handshake's last flight reaches the broker).
fn mqtt_accepted(addr: SocketAddr, config: &Arc<rustls::ClientConfig>, id: &str) -> Option<Tls> {
    let tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    let name = ServerName::try_from("localhost").expect("name");
    let conn = rustls::ClientConnection::new(Arc::clone(config), name).expect("client");
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    tls.write_all(&common::raw::mqtt_connect_packet(id, true))
        .ok()?;
    let mut connack = [0u8; 4];
    tls.read_exact(&mut connack).ok()?;
    (connack == [0x20, 2, 0, 0]).then_some(tls)
}

#[test]
fn sighup_reloads_the_client_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = |n: &str| dir.path().join(n);
    let server = cert(1);
    install(&server, &path("cert.pem"), &path("key.pem"));
    let (one, two) = (ca_with_client("CA one"), ca_with_client("CA two"));
    replace(&path("ca.pem"), &one.pem);
    let broker = TestBroker::start_with_tls(
        "[tls]\nwatch_interval = \"0s\"\nverify_peer = true\nfail_if_no_peer_cert = true\n",
        &path("cert.pem"),
        &path("key.pem"),
        Some(&path("ca.pem")),
    );
    let (by_one, by_two) = (
        client_with_cert(&server, &one),
        client_with_cert(&server, &two),
    );
    let addr = broker.mqtts_addr();
    let mut old = mqtt_accepted(addr, &by_one, "old").expect("CA one's client is accepted");
    assert!(
        mqtt_accepted(addr, &by_two, "two").is_none(),
        "CA two is not trusted yet"
    );

    replace(&path("ca.pem"), &two.pem);
    sighup(&broker);
    wait_for_count(&broker, "TLS certificate reloaded", 1);
    assert!(
        mqtt_accepted(addr, &by_two, "two").is_some(),
        "the new CA is trusted"
    );
    assert!(
        mqtt_accepted(addr, &by_one, "one").is_none(),
        "the old CA no longer is"
    );
    ping(&mut old);
    // A refused client certificate ends that connection only (it once panicked a worker).
    assert!(!broker.log().contains("panicked"), "{}", broker.log());
}
