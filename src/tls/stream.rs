//! A server-side TLS stream over rustls' unbuffered API
//! ([`UnbufferedServerConnection`]), whose buffers are ours and are let go while the
//! connection waits.
//!
//! rustls' buffered `ServerConnection` (what `tokio-rustls` wraps) sizes its record
//! buffer to 4 KiB before every socket read and keeps it, so every idle TLS connection
//! held 4 KiB it was not using. Here:
//!
//! - a read from the socket lands in a buffer on the stack and is copied into
//!   `incoming` (a partial record stays there until the rest arrives);
//! - decrypted bytes wait in `plain` until the protocol reads them;
//! - records to send are encoded or encrypted into `outgoing` until the socket takes
//!   them.
//!
//! While data flows the three keep their capacity (no allocation per read or write);
//! when a read finds the socket empty, i.e. the connection waits, each one that holds
//! nothing is freed.
//!
//! [`TlsStream::accept`] runs the handshake with rustls. The connection then leaves
//! rustls: its records are sealed and opened by [`Records`] (see [`super::records`]),
//! which keeps the keys (for TLS 1.3 also the traffic secrets) and sequence numbers and
//! only expands the keys while the connection is busy, so an idle TLS connection holds
//! about 250 bytes of TLS state and no buffer (with rustls' record layer, about 3 KiB).
//! The stream is then [`AsyncRead`] and [`AsyncWrite`] like
//! `tokio_rustls::server::TlsStream`.

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use rustls::pki_types::CertificateDer;
use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, EncryptError, UnbufferedStatus};
use rustls::{CipherSuite, ProtocolVersion, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::records::{self, Captured, Records};

/// The largest TLS record on the wire (16 KiB of payload, 2 KiB of expansion, header): one
/// socket read is at most this much, on the stack.
const READ_CHUNK: usize = 16 * 1024 + 2048 + 5;
/// Plaintext encrypted per `poll_write`: the caller's data is taken in pieces of at most
/// this, so that `outgoing` stays bounded.
const WRITE_CHUNK: usize = 64 * 1024;
/// Past this many unsent TLS bytes, `poll_write` waits for the socket first.
const OUTGOING_HIGH: usize = 64 * 1024;

/// What carries the records. Our record state is inline on purpose: the stream is
/// boxed once per connection, and a second box would cost an allocation and its
/// malloc overhead for nothing.
#[allow(clippy::large_enum_variant)]
enum Engine {
    /// The handshake, and connections whose configuration was not [`prepare`]d.
    Rustls(Box<UnbufferedServerConnection>),
    /// TLS 1.2 and 1.3 after the handshake.
    Own(Records),
    /// Only while a connection leaves rustls.
    Moving,
}

/// What the handshake settled, for the caller's log and authentication.
pub struct Established {
    pub version: Option<ProtocolVersion>,
    pub suite: Option<CipherSuite>,
    /// The client's certificate (the first of its chain), if it sent one.
    pub peer_cert: Option<CertificateDer<'static>>,
}

/// Sets what [`TlsStream`] needs in a server configuration: secret extraction and the
/// [`records::CaptureSecrets`] key log (TLS 1.3's traffic secrets, for key updates), so
/// that connections leave rustls after the handshake. Without them a connection stays
/// with rustls.
pub fn prepare(config: &mut ServerConfig) {
    config.enable_secret_extraction = true;
    config.key_log = Arc::new(records::CaptureSecrets);
}

/// A TLS connection accepted by a server: its record protection and our three buffers.
pub struct TlsStream<IO> {
    io: IO,
    engine: Engine,
    /// TLS bytes read and not yet processed (a record not yet complete); freed, with the
    /// other two, while the connection waits.
    incoming: Vec<u8>,
    /// Decrypted bytes not yet read by the protocol, from `plain_pos` on.
    plain: Vec<u8>,
    plain_pos: usize,
    /// TLS bytes not yet written to the socket, from `out_pos` on.
    outgoing: Vec<u8>,
    out_pos: usize,
    /// The peer sent close_notify or closed the socket: reads return end of file.
    read_eof: bool,
    /// Our close_notify is in `outgoing` (or was sent).
    close_queued: bool,
}

fn invalid(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl<IO: AsyncRead + AsyncWrite + Unpin> TlsStream<IO> {
    /// Runs the server side of the handshake over `io`. No deadline here: the caller
    /// puts one around it.
    pub async fn accept(
        io: IO,
        config: Arc<ServerConfig>,
    ) -> io::Result<(TlsStream<IO>, Established)> {
        let prepared = config.enable_secret_extraction;
        let conn = UnbufferedServerConnection::new(config).map_err(invalid)?;
        let mut s = TlsStream {
            io,
            engine: Engine::Rustls(Box::new(conn)),
            incoming: Vec::new(),
            plain: Vec::new(),
            plain_pos: 0,
            outgoing: Vec::new(),
            out_pos: 0,
            read_eof: false,
            close_queued: false,
        };
        let mut secrets = Captured::default();
        loop {
            let processed = records::capture(&mut secrets, || s.process(None));
            // Whatever was produced (flights, or an alert after an error) goes out first.
            std::future::poll_fn(|cx| s.poll_flush_outgoing(cx)).await?;
            processed?;
            if let Engine::Rustls(conn) = &s.engine {
                if !conn.is_handshaking() {
                    let established = Established {
                        version: conn.protocol_version(),
                        suite: conn.negotiated_cipher_suite().map(|c| c.suite()),
                        peer_cert: conn
                            .peer_certificates()
                            .and_then(|chain| chain.first())
                            .map(|c| c.clone().into_owned()),
                    };
                    s.leave_rustls(prepared, secrets)?;
                    return Ok((s, established));
                }
            }
            if s.read_eof {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed during the TLS handshake",
                ));
            }
            std::future::poll_fn(|cx| s.poll_fill(cx)).await?;
        }
    }

    /// A connection whose handshake is done moves to [`Records`] when the
    /// configuration was [`prepare`]d (for TLS 1.3, when its secrets were captured);
    /// any other stays with rustls.
    fn leave_rustls(&mut self, prepared: bool, secrets: Captured) -> io::Result<()> {
        let Engine::Rustls(conn) = &self.engine else {
            return Ok(());
        };
        let version = conn.protocol_version();
        let ready = match version {
            Some(ProtocolVersion::TLSv1_3) => secrets.complete(),
            Some(ProtocolVersion::TLSv1_2) => prepared,
            _ => false,
        };
        if !ready {
            return Ok(());
        }
        let Engine::Rustls(conn) = std::mem::replace(&mut self.engine, Engine::Moving) else {
            return Ok(());
        };
        let (keys, _kernel) = (*conn)
            .dangerous_into_kernel_connection()
            .map_err(invalid)?;
        let records = if version == Some(ProtocolVersion::TLSv1_3) {
            Records::tls13(keys.rx, keys.tx, secrets)
                .ok_or_else(|| invalid("TLS 1.3 secrets do not match the connection's keys"))?
        } else {
            Records::tls12(keys.rx, keys.tx)
                .ok_or_else(|| invalid("TLS 1.2 cipher suite without own record layer"))?
        };
        self.engine = Engine::Own(records);
        Ok(())
    }

    /// Decrypts what has arrived into `plain` and, with `write`, encrypts it into
    /// `outgoing` and returns `true` (`false`: the connection can no longer send).
    /// Replies owed to the peer, and after an error its alert, are in `outgoing`.
    fn process(&mut self, write: Option<&[u8]>) -> io::Result<bool> {
        if self.plain_pos == self.plain.len() {
            self.plain.clear();
            self.plain_pos = 0;
        }
        let records = match &mut self.engine {
            Engine::Rustls(_) => return self.process_rustls(write),
            Engine::Own(records) => records,
            Engine::Moving => return Err(invalid("TLS connection in an unusable state")),
        };
        let read = records.read(&mut self.incoming, &mut self.plain, &mut self.outgoing)?;
        self.incoming.drain(..read.consumed);
        if read.closed {
            self.read_eof = true;
        }
        match write {
            Some(data) => records.write(data, &mut self.outgoing).map(|()| true),
            None => Ok(false),
        }
    }

    /// [`Self::process`] through rustls: runs it until it needs bytes from the peer,
    /// and with `write`, encrypts it as soon as application data may be sent.
    fn process_rustls(&mut self, write: Option<&[u8]>) -> io::Result<bool> {
        let Engine::Rustls(conn) = &mut self.engine else {
            return Err(invalid("TLS connection in an unusable state"));
        };
        let mut write = write;
        let mut written = false;
        loop {
            let UnbufferedStatus { discard, state } = conn.process_tls_records(&mut self.incoming);
            let mut discard = discard;
            let mut done = false;
            let mut error = None;
            match state {
                Err(e) => error = Some(invalid(e)),
                Ok(ConnectionState::ReadTraffic(mut r)) => {
                    while let Some(record) = r.next_record() {
                        match record {
                            Ok(record) => {
                                discard += record.discard;
                                self.plain.extend_from_slice(record.payload);
                            }
                            Err(e) => {
                                error = Some(invalid(e));
                                break;
                            }
                        }
                    }
                }
                Ok(ConnectionState::EncodeTlsData(mut e)) => {
                    if let Err(err) = encode_into(&mut self.outgoing, |out| e.encode(out)) {
                        error = Some(invalid(err));
                    }
                }
                // The bytes are in `outgoing`; rustls need not wait for the socket.
                Ok(ConnectionState::TransmitTlsData(t)) => t.done(),
                Ok(ConnectionState::WriteTraffic(mut w)) => {
                    if let Some(data) = write.take() {
                        match encrypt_into(&mut self.outgoing, |out| w.encrypt(data, out)) {
                            Ok(()) => written = true,
                            Err(e) => error = Some(invalid(e)),
                        }
                    } else {
                        done = true;
                    }
                }
                // Reported once; we may still write after it (a write in progress goes on).
                Ok(ConnectionState::PeerClosed) => {
                    self.read_eof = true;
                    done = write.is_none();
                }
                Ok(ConnectionState::Closed) => {
                    self.read_eof = true;
                    done = true;
                }
                Ok(ConnectionState::BlockedHandshake) => done = true,
                // Early data is never accepted (`max_early_data_size` is 0).
                Ok(ConnectionState::ReadEarlyData(_)) => {
                    error = Some(invalid("unexpected TLS early data"));
                }
                Ok(_) => error = Some(invalid("unexpected TLS connection state")),
            }
            self.incoming.drain(..discard.min(self.incoming.len()));
            if let Some(e) = error {
                queue_alerts(conn, &mut self.incoming, &mut self.outgoing);
                return Err(e);
            }
            if done {
                return Ok(written);
            }
        }
    }

    /// Reads once from the socket into `incoming`; end of file sets `read_eof`.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut stack = [MaybeUninit::<u8>::uninit(); READ_CHUNK];
        let mut rb = ReadBuf::uninit(&mut stack);
        ready!(Pin::new(&mut self.io).poll_read(cx, &mut rb))?;
        if rb.filled().is_empty() {
            self.read_eof = true;
        } else {
            self.incoming.extend_from_slice(rb.filled());
        }
        Poll::Ready(Ok(()))
    }

    /// Writes `outgoing` to the socket until it is all sent, then frees it.
    fn poll_flush_outgoing(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.out_pos < self.outgoing.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.outgoing[self.out_pos..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.out_pos += n;
        }
        self.outgoing.clear();
        self.out_pos = 0;
        Poll::Ready(Ok(()))
    }

    /// The connection waits for the peer: frees every buffer that holds nothing, and
    /// the expanded keys.
    fn release_idle(&mut self) {
        if let Engine::Own(records) = &mut self.engine {
            records.release();
        }
        if self.incoming.is_empty() {
            self.incoming = Vec::new();
        }
        if self.plain_pos == self.plain.len() {
            self.plain = Vec::new();
            self.plain_pos = 0;
        }
        if self.out_pos == self.outgoing.len() {
            self.outgoing = Vec::new();
            self.out_pos = 0;
        }
    }

    fn pending_out(&self) -> usize {
        self.outgoing.len() - self.out_pos
    }
}

/// After an error rustls has queued its alert: encode it into `outgoing` (bounded;
/// best effort, the connection is ending). rustls is given the same `incoming` buffer
/// as before: it may still hold ranges into it (handshake messages after the one that
/// failed), and an empty buffer in its place made it panic (a client certificate
/// refused with the client's Finished in the same read).
fn queue_alerts(
    conn: &mut UnbufferedServerConnection,
    incoming: &mut Vec<u8>,
    outgoing: &mut Vec<u8>,
) {
    for _ in 0..4 {
        let UnbufferedStatus { discard, state } = conn.process_tls_records(incoming);
        let go_on = match state {
            Ok(ConnectionState::EncodeTlsData(mut e)) => {
                encode_into(outgoing, |out| e.encode(out)).is_ok()
            }
            Ok(ConnectionState::TransmitTlsData(t)) => {
                t.done();
                true
            }
            _ => false,
        };
        incoming.drain(..discard.min(incoming.len()));
        if !go_on {
            return;
        }
    }
}

/// Runs `encode` on the spare end of `out`, growing it to the size rustls asks for.
fn encode_into(
    out: &mut Vec<u8>,
    mut encode: impl FnMut(&mut [u8]) -> Result<usize, EncodeError>,
) -> Result<(), EncodeError> {
    let start = out.len();
    let need = match encode(&mut []) {
        Ok(n) => n,
        Err(EncodeError::InsufficientSize(s)) => s.required_size,
        Err(e) => return Err(e),
    };
    out.resize(start + need, 0);
    let n = encode(&mut out[start..])?;
    out.truncate(start + n);
    Ok(())
}

/// [`encode_into`] for application data and close_notify.
fn encrypt_into(
    out: &mut Vec<u8>,
    mut encrypt: impl FnMut(&mut [u8]) -> Result<usize, EncryptError>,
) -> Result<(), EncryptError> {
    let start = out.len();
    let need = match encrypt(&mut []) {
        Ok(n) => n,
        Err(EncryptError::InsufficientSize(s)) => s.required_size,
        Err(e) => return Err(e),
    };
    out.resize(start + need, 0);
    let n = encrypt(&mut out[start..])?;
    out.truncate(start + n);
    Ok(())
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsStream<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.plain_pos < this.plain.len() {
                let n = buf.remaining().min(this.plain.len() - this.plain_pos);
                buf.put_slice(&this.plain[this.plain_pos..this.plain_pos + n]);
                this.plain_pos += n;
                if this.plain_pos == this.plain.len() {
                    this.plain.clear();
                    this.plain_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.read_eof {
                return Poll::Ready(Ok(()));
            }
            // Replies rustls owes the peer (key updates, alerts) go out before we wait.
            if let Poll::Ready(Err(e)) = this.poll_flush_outgoing(cx) {
                return Poll::Ready(Err(e));
            }
            match this.poll_fill(cx) {
                Poll::Pending => {
                    this.release_idle();
                    return Poll::Pending;
                }
                Poll::Ready(r) => r?,
            }
            if let Err(e) = this.process(None) {
                // The alert, if the socket takes it now.
                let _ = this.poll_flush_outgoing(cx);
                return Poll::Ready(Err(e));
            }
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsStream<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.pending_out() >= OUTGOING_HIGH {
            ready!(this.poll_flush_outgoing(cx))?;
        }
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if this.close_queued {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let n = data.len().min(WRITE_CHUNK);
        match this.process(Some(&data[..n])) {
            Ok(true) => {}
            Ok(false) => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            Err(e) => {
                let _ = this.poll_flush_outgoing(cx);
                return Poll::Ready(Err(e));
            }
        }
        // Start sending now; what the socket does not take waits for the next write or
        // flush.
        if let Poll::Ready(Err(e)) = this.poll_flush_outgoing(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_flush_outgoing(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.close_queued {
            this.close_queued = true;
            // Flush whatever is still owed first, then close_notify.
            if this.process(None).is_ok() {
                match &mut this.engine {
                    Engine::Rustls(conn) => {
                        let UnbufferedStatus { discard, state } =
                            conn.process_tls_records(&mut this.incoming);
                        if let Ok(ConnectionState::WriteTraffic(mut w)) = state {
                            let _ =
                                encrypt_into(&mut this.outgoing, |out| w.queue_close_notify(out));
                        }
                        this.incoming.drain(..discard.min(this.incoming.len()));
                    }
                    Engine::Own(records) => {
                        let _ = records.close_notify(&mut this.outgoing);
                    }
                    Engine::Moving => {}
                }
            }
        }
        ready!(this.poll_flush_outgoing(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn configs(
        versions: &[&'static rustls::SupportedProtocolVersion],
        prepared: bool,
    ) -> (Arc<ServerConfig>, Arc<rustls::ClientConfig>) {
        configs_with(versions, prepared, None)
    }

    /// With `suite`, the client offers only that cipher suite.
    fn configs_with(
        versions: &[&'static rustls::SupportedProtocolVersion],
        prepared: bool,
        suite: Option<rustls::SupportedCipherSuite>,
    ) -> (Arc<ServerConfig>, Arc<rustls::ClientConfig>) {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(versions)
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .expect("server config");
        if prepared {
            prepare(&mut server);
        }
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone()).expect("root");
        let mut client_provider = (*provider).clone();
        if let Some(suite) = suite {
            client_provider.cipher_suites = vec![suite];
        }
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(client_provider))
            .with_protocol_versions(versions)
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        (Arc::new(server), Arc::new(client))
    }

    async fn pair(
        versions: &[&'static rustls::SupportedProtocolVersion],
        prepared: bool,
    ) -> (
        TlsStream<tokio::io::DuplexStream>,
        tokio_rustls::client::TlsStream<tokio::io::DuplexStream>,
    ) {
        let (server, client) = configs(versions, prepared);
        // Small pipe: records cross it in pieces, writes wait for the reader.
        let (a, b) = tokio::io::duplex(1000);
        let connector = tokio_rustls::TlsConnector::from(client);
        let name = ServerName::try_from("localhost").expect("name");
        let (s, c) = tokio::join!(TlsStream::accept(a, server), connector.connect(name, b));
        (s.expect("server handshake").0, c.expect("client handshake"))
    }

    #[tokio::test]
    async fn carries_data_both_ways_and_frees_its_buffers() {
        for (versions, prepared, own_records) in [
            (&[&rustls::version::TLS13][..], true, true),
            (&[&rustls::version::TLS13][..], false, false),
            (&[&rustls::version::TLS12][..], true, true),
            (&[&rustls::version::TLS12][..], false, false),
        ] {
            let (mut s, mut c) = pair(versions, prepared).await;
            assert_eq!(matches!(s.engine, Engine::Own(_)), own_records);
            let big: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
            let (w, r) = tokio::join!(
                async {
                    c.write_all(&big).await.expect("client write");
                    c.flush().await.expect("flush");
                },
                async {
                    let mut got = vec![0u8; big.len()];
                    s.read_exact(&mut got).await.expect("server read");
                    got
                }
            );
            let ((), got) = (w, r);
            assert_eq!(got, big);
            let (w, r) = tokio::join!(
                async {
                    s.write_all(&big).await.expect("server write");
                    s.flush().await.expect("flush");
                },
                async {
                    let mut got = vec![0u8; big.len()];
                    c.read_exact(&mut got).await.expect("client read");
                    got
                }
            );
            let ((), got) = (w, r);
            assert_eq!(got, big);
            // the server then waits for the client: a read that finds nothing
            let mut one = [0u8; 1];
            let waiting = std::future::poll_fn(|cx| {
                let mut rb = ReadBuf::new(&mut one);
                Poll::Ready(Pin::new(&mut s).poll_read(cx, &mut rb).is_pending())
            })
            .await;
            assert!(waiting);
            assert_eq!(s.incoming.capacity(), 0);
            assert_eq!(s.plain.capacity(), 0);
            assert_eq!(s.outgoing.capacity(), 0);
            if let Engine::Own(records) = &s.engine {
                assert!(
                    !records.keys_expanded(),
                    "idle: the expanded keys are dropped"
                );
            }
            // close_notify both ways: the client sees EOF, and the server too.
            s.shutdown().await.expect("shutdown");
            let mut rest = Vec::new();
            c.read_to_end(&mut rest).await.expect("client eof");
            assert!(rest.is_empty());
            c.shutdown().await.expect("client shutdown");
            let mut rest = Vec::new();
            s.read_to_end(&mut rest).await.expect("server eof");
            assert!(rest.is_empty());
        }
    }

    #[tokio::test]
    async fn writes_after_the_peer_closed_its_side() {
        let (mut s, mut c) = pair(&[&rustls::version::TLS13], true).await;
        c.write_all(b"last words").await.expect("client write");
        c.shutdown().await.expect("client close_notify");
        let mut got = Vec::new();
        s.read_to_end(&mut got)
            .await
            .expect("server reads to close_notify");
        assert_eq!(got, b"last words");
        s.write_all(b"bye").await.expect("server writes after it");
        s.shutdown().await.expect("server close_notify");
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.expect("client reads");
        assert_eq!(got, b"bye");
    }

    /// A client that updates its keys (and asks us to update ours) keeps talking: the
    /// KeyUpdate handling after rustls is gone, checked against rustls' client.
    #[tokio::test]
    async fn key_updates_from_the_client() {
        let (mut s, mut c) = pair(&[&rustls::version::TLS13], true).await;
        assert!(matches!(s.engine, Engine::Own(_)));
        for round in 0..3u8 {
            c.get_mut().1.refresh_traffic_keys().expect("key update");
            let msg = [round; 3000];
            // Both ends at once: the pipe holds 1,000 bytes.
            let (w, got) = tokio::join!(
                async {
                    c.write_all(&msg).await.expect("client write");
                    c.flush().await.expect("flush");
                },
                async {
                    let mut got = [0u8; 3000];
                    s.read_exact(&mut got).await.expect("server read");
                    got
                }
            );
            let ((), got) = (w, got);
            assert_eq!(got, msg);
            // Our reply goes under our new key, after our KeyUpdate.
            let (w, got) = tokio::join!(
                async {
                    s.write_all(&msg).await.expect("server write");
                    s.flush().await.expect("flush");
                },
                async {
                    let mut got = [0u8; 3000];
                    c.read_exact(&mut got).await.expect("client read");
                    got
                }
            );
            let ((), got) = (w, got);
            assert_eq!(got, msg);
        }
    }

    /// Each TLS 1.2 suite rustls offers, our records against rustls' client: the explicit
    /// nonces of AES-GCM, ChaCha20-Poly1305's implicit ones, and close_notify.
    #[tokio::test]
    async fn tls12_suites_leave_rustls_and_interoperate() {
        use rustls::crypto::ring::cipher_suite as cs;
        for suite in [
            cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        ] {
            let (server, client) = configs_with(&[&rustls::version::TLS12], true, Some(suite));
            let (a, b) = tokio::io::duplex(1000);
            let connector = tokio_rustls::TlsConnector::from(client);
            let name = ServerName::try_from("localhost").expect("name");
            let (s, c) = tokio::join!(TlsStream::accept(a, server), connector.connect(name, b));
            let (mut s, est) = s.expect("server");
            let mut c = c.expect("client");
            assert_eq!(est.suite, Some(suite.suite()));
            assert!(matches!(s.engine, Engine::Own(_)), "{suite:?}");
            let big: Vec<u8> = (0..50_000u32).map(|i| (i * 7) as u8).collect();
            let (w, got) = tokio::join!(
                async {
                    c.write_all(&big).await.expect("client write");
                    c.flush().await.expect("flush");
                },
                async {
                    let mut got = vec![0u8; big.len()];
                    s.read_exact(&mut got).await.expect("server read");
                    got
                }
            );
            let ((), got) = (w, got);
            assert_eq!(got, big);
            let (w, got) = tokio::join!(
                async {
                    s.write_all(&big).await.expect("server write");
                    s.shutdown().await.expect("close_notify");
                },
                async {
                    let mut got = Vec::new();
                    c.read_to_end(&mut got)
                        .await
                        .expect("client reads to close_notify");
                    got
                }
            );
            let ((), got) = (w, got);
            assert_eq!(got, big, "{suite:?}");
        }
    }

    /// Resumed handshakes (a ticket from the first connection) leave rustls the same way.
    #[tokio::test]
    async fn resumed_connections_leave_rustls_too() {
        let (server, client) = configs(&[&rustls::version::TLS13], true);
        let connector = tokio_rustls::TlsConnector::from(client);
        for n in 0..2 {
            let (a, b) = tokio::io::duplex(1000);
            let name = ServerName::try_from("localhost").expect("name");
            let (s, c) = tokio::join!(
                TlsStream::accept(a, Arc::clone(&server)),
                connector.connect(name, b)
            );
            let (mut s, mut c) = (s.expect("server").0, c.expect("client"));
            assert!(matches!(s.engine, Engine::Own(_)));
            c.write_all(b"ping").await.expect("write");
            let mut got = [0u8; 4];
            s.read_exact(&mut got).await.expect("read");
            // The client takes its tickets while it reads the answer.
            s.write_all(b"pong").await.expect("write");
            s.flush().await.expect("flush");
            c.read_exact(&mut got).await.expect("read");
            assert_eq!(&got, b"pong");
            let resumed = c.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
            assert_eq!(resumed, n == 1, "connection {n}");
        }
    }
}
