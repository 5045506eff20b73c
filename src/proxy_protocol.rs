//! The PROXY protocol, versions 1 (text) and 2 (binary), as sent by HAProxy, nginx
//! `stream`, AWS NLB and others in front of a listener with `listeners.proxy_protocol`
//! (<https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt>).
//!
//! - [`scan`] and [`parse`] are pure: how long the header at the start of some bytes
//!   is, and the client address it carries.
//! - [`read_header`] reads exactly the header from a socket (never a byte of what
//!   follows: the protocol, or a TLS ClientHello, comes next), under a deadline.
//!
//! A `LOCAL` (v2) or `UNKNOWN` (v1) header, and v2's `AF_UNSPEC` and `AF_UNIX`, say the
//! connection is the balancer's own (health checks): the socket's address is kept.
//! Anything else that is not a valid header is refused, and the connection closed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Deadline for the whole header, from accept.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

const V1_PREFIX: &[u8] = b"PROXY ";
/// A v1 header is one line of at most 107 bytes, CRLF included.
const V1_MAX: usize = 107;
const V2_SIG: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// Address and TLV bytes accepted after v2's 16-byte fixed part (HAProxy's TLVs and
/// AWS's VPC endpoint id are tens of bytes; the wire allows 65,535).
const V2_MAX_PAYLOAD: usize = 1024;

/// Why a header was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    #[error("no PROXY protocol header")]
    Missing,
    #[error("PROXY v1 header longer than 107 bytes")]
    V1TooLong,
    #[error("malformed PROXY v1 header")]
    V1Malformed,
    #[error("PROXY v2 header with {0} bytes of addresses (limit 1024)")]
    V2TooLong(usize),
    #[error("unsupported PROXY v2 version or command {0:#04x}")]
    V2Command(u8),
    #[error("unsupported PROXY v2 address family {0:#04x}")]
    V2Family(u8),
    #[error("PROXY v2 addresses shorter than their family")]
    V2Short,
    #[error("connection closed before the PROXY header ended")]
    Eof,
    #[error("no PROXY header within {0:?}")]
    Timeout(Duration),
    #[error("reading the PROXY header: {0}")]
    Io(String),
    #[error("shutdown while waiting for the PROXY header")]
    Shutdown,
}

/// How long the header at the start of `buf` is: `Ok(Some(len))` once that is known
/// (the bytes may not all be there yet), `Ok(None)` if more bytes are needed to tell,
/// `Err` as soon as `buf` cannot start a header. Every byte of an incomplete header
/// (`Ok(None)`) belongs to the header.
pub fn scan(buf: &[u8]) -> Result<Option<usize>, ProxyError> {
    let v1 = buf.len().min(V1_PREFIX.len());
    let v2 = buf.len().min(V2_SIG.len());
    if buf.get(..v1) == V1_PREFIX.get(..v1) && !buf.is_empty() {
        if buf.len() < V1_PREFIX.len() {
            return Ok(None);
        }
        let window = &buf[..buf.len().min(V1_MAX)];
        return match window.windows(2).position(|w| w == b"\r\n") {
            Some(i) => Ok(Some(i + 2)),
            None if buf.len() >= V1_MAX => Err(ProxyError::V1TooLong),
            None => Ok(None),
        };
    }
    if buf.get(..v2) == V2_SIG.get(..v2) {
        let Some(len) = buf.get(14..16) else {
            return Ok(None);
        };
        let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
        if len > V2_MAX_PAYLOAD {
            return Err(ProxyError::V2TooLong(len));
        }
        return Ok(Some(16 + len));
    }
    Err(ProxyError::Missing)
}

/// The client address in a whole header (as long as [`scan`] said): `None` for a
/// `LOCAL` / `UNKNOWN` / non-IP header (keep the socket's address).
pub fn parse(header: &[u8]) -> Result<Option<SocketAddr>, ProxyError> {
    if header.starts_with(V1_PREFIX) {
        parse_v1(header)
    } else if header.starts_with(V2_SIG) {
        parse_v2(header)
    } else {
        Err(ProxyError::Missing)
    }
}

fn parse_v1(header: &[u8]) -> Result<Option<SocketAddr>, ProxyError> {
    let line = header
        .strip_suffix(b"\r\n")
        .and_then(|l| std::str::from_utf8(l).ok())
        .ok_or(ProxyError::V1Malformed)?;
    let mut fields = line.split(' ');
    let _proxy = fields.next();
    let family = fields.next().ok_or(ProxyError::V1Malformed)?;
    if family == "UNKNOWN" {
        // The rest of the line is to be ignored.
        return Ok(None);
    }
    let rest: Vec<&str> = fields.collect();
    let [src, dst, sport, dport] = rest[..] else {
        return Err(ProxyError::V1Malformed);
    };
    let ip = |s: &str| -> Result<IpAddr, ProxyError> {
        match family {
            "TCP4" => s.parse::<Ipv4Addr>().map(IpAddr::V4),
            "TCP6" => s.parse::<Ipv6Addr>().map(IpAddr::V6),
            _ => return Err(ProxyError::V1Malformed),
        }
        .map_err(|_| ProxyError::V1Malformed)
    };
    let port = |s: &str| -> Result<u16, ProxyError> {
        // Decimal, no sign, no leading zero (the spec's form).
        if s.is_empty()
            || !s.bytes().all(|b| b.is_ascii_digit())
            || (s.len() > 1 && s.starts_with('0'))
        {
            return Err(ProxyError::V1Malformed);
        }
        s.parse().map_err(|_| ProxyError::V1Malformed)
    };
    let src = ip(src)?;
    ip(dst)?;
    let sport = port(sport)?;
    port(dport)?;
    Ok(Some(SocketAddr::new(src, sport)))
}

fn parse_v2(header: &[u8]) -> Result<Option<SocketAddr>, ProxyError> {
    let (&ver_cmd, &family) = match header.get(12..14) {
        Some([a, b]) => (a, b),
        _ => return Err(ProxyError::V2Short),
    };
    let addrs = header.get(16..).ok_or(ProxyError::V2Short)?;
    match ver_cmd {
        // version 2, LOCAL: the balancer's own connection
        0x20 => return Ok(None),
        // version 2, PROXY
        0x21 => {}
        other => return Err(ProxyError::V2Command(other)),
    }
    let port = |b: &[u8]| u16::from_be_bytes([b[0], b[1]]);
    match family {
        // TCP over IPv4: src 4, dst 4, src port 2, dst port 2
        0x11 => {
            let a = addrs.get(..12).ok_or(ProxyError::V2Short)?;
            let ip = Ipv4Addr::new(a[0], a[1], a[2], a[3]);
            Ok(Some(SocketAddr::new(IpAddr::V4(ip), port(&a[8..10]))))
        }
        // TCP over IPv6: src 16, dst 16, src port 2, dst port 2
        0x21 => {
            let a = addrs.get(..36).ok_or(ProxyError::V2Short)?;
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&a[..16]);
            let ip = Ipv6Addr::from(octets);
            Ok(Some(SocketAddr::new(IpAddr::V6(ip), port(&a[32..34]))))
        }
        // AF_UNSPEC, AF_UNIX stream: no IP address to use
        0x00 | 0x31 => Ok(None),
        other => Err(ProxyError::V2Family(other)),
    }
}

/// Reads exactly the PROXY header from `stream` within [`HEADER_TIMEOUT`] and returns
/// the client's address (`socket_peer` for a `LOCAL` / `UNKNOWN` header). Bytes are
/// peeked first and only the header's are consumed.
pub async fn read_header(
    stream: &mut TcpStream,
    socket_peer: SocketAddr,
) -> Result<SocketAddr, ProxyError> {
    match tokio::time::timeout(HEADER_TIMEOUT, read_header_inner(stream)).await {
        Err(_elapsed) => Err(ProxyError::Timeout(HEADER_TIMEOUT)),
        Ok(Err(e)) => Err(e),
        Ok(Ok(addr)) => Ok(addr.unwrap_or(socket_peer)),
    }
}

async fn read_header_inner(stream: &mut TcpStream) -> Result<Option<SocketAddr>, ProxyError> {
    let io = |e: std::io::Error| ProxyError::Io(e.to_string());
    let mut header = Vec::new();
    let mut peeked = [0u8; 16 + V2_MAX_PAYLOAD];
    loop {
        let n = stream.peek(&mut peeked).await.map_err(io)?;
        if n == 0 {
            return Err(ProxyError::Eof);
        }
        let have = header.len();
        header.extend_from_slice(&peeked[..n]);
        let take = match scan(&header)? {
            Some(len) => len.min(header.len()),
            // all of it is header
            None => header.len(),
        };
        header.truncate(take);
        // Consume what is header among the peeked bytes (they are in the socket still).
        let mut consumed = vec![0u8; take - have];
        stream.read_exact(&mut consumed).await.map_err(io)?;
        if let Some(len) = scan(&header)? {
            if header.len() == len {
                return parse(&header);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2(cmd: u8, family: u8, addrs: &[u8]) -> Vec<u8> {
        let mut h = V2_SIG.to_vec();
        h.push(cmd);
        h.push(family);
        h.extend_from_slice(&(addrs.len() as u16).to_be_bytes());
        h.extend_from_slice(addrs);
        h
    }

    #[test]
    fn v1_headers() {
        let h = b"PROXY TCP4 203.0.113.7 10.0.0.1 56324 1883\r\nCONNECT";
        assert_eq!(scan(h), Ok(Some(44)));
        assert_eq!(
            parse(&h[..44]),
            Ok(Some("203.0.113.7:56324".parse().unwrap()))
        );
        let h = b"PROXY TCP6 2001:db8::1 2001:db8::2 4000 5672\r\n";
        assert_eq!(parse(h), Ok(Some("[2001:db8::1]:4000".parse().unwrap())));
        assert_eq!(parse(b"PROXY UNKNOWN\r\n"), Ok(None));
        assert_eq!(parse(b"PROXY UNKNOWN ff::1 ff::2 1 2\r\n"), Ok(None));
        for bad in [
            &b"PROXY TCP4 203.0.113.7 10.0.0.1 56324\r\n"[..],
            b"PROXY TCP4 2001:db8::1 10.0.0.1 1 2\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 65536 1\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 01 1\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 -1 1\r\n",
            b"PROXY TCP4  1.2.3.4 5.6.7.8 1 1\r\n",
            b"PROXY UDP4 1.2.3.4 5.6.7.8 1 1\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 1 1 extra\r\n",
        ] {
            let len = scan(bad).unwrap().unwrap();
            assert_eq!(parse(&bad[..len]), Err(ProxyError::V1Malformed), "{bad:?}");
        }
    }

    #[test]
    fn scan_needs_more_refuses_garbage_and_long_lines() {
        assert_eq!(scan(b""), Ok(None));
        assert_eq!(scan(b"PRO"), Ok(None));
        assert_eq!(scan(b"PROXY TCP4 1.2.3.4"), Ok(None));
        assert_eq!(scan(b"\r\n\r\n\0\r\nQU"), Ok(None));
        assert_eq!(scan(b"GET / HTTP/1.1\r\n"), Err(ProxyError::Missing));
        assert_eq!(scan(&[0x10, 0x0c, 0, 4]), Err(ProxyError::Missing));
        assert_eq!(scan(b"PROXZ"), Err(ProxyError::Missing));
        let long = [b"PROXY ".as_slice(), &[b'x'; 120]].concat();
        assert_eq!(scan(&long), Err(ProxyError::V1TooLong));
        let mut big = v2(0x21, 0x11, &[]);
        big[14..16].copy_from_slice(&2000u16.to_be_bytes());
        assert_eq!(scan(&big), Err(ProxyError::V2TooLong(2000)));
    }

    #[test]
    fn v2_headers() {
        let mut a4 = vec![203, 0, 113, 7, 10, 0, 0, 1];
        a4.extend_from_slice(&56324u16.to_be_bytes());
        a4.extend_from_slice(&1883u16.to_be_bytes());
        let h = v2(0x21, 0x11, &a4);
        assert_eq!(scan(&h), Ok(Some(28)));
        assert_eq!(parse(&h), Ok(Some("203.0.113.7:56324".parse().unwrap())));
        // TLVs after the addresses are skipped.
        let mut with_tlv = a4.clone();
        with_tlv.extend_from_slice(&[0x04, 0x00, 0x02, b'h', b'i']);
        assert_eq!(
            parse(&v2(0x21, 0x11, &with_tlv)),
            Ok(Some("203.0.113.7:56324".parse().unwrap()))
        );
        let mut a6 = Vec::new();
        a6.extend_from_slice(&"2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
        a6.extend_from_slice(&"2001:db8::2".parse::<Ipv6Addr>().unwrap().octets());
        a6.extend_from_slice(&4000u16.to_be_bytes());
        a6.extend_from_slice(&5672u16.to_be_bytes());
        assert_eq!(
            parse(&v2(0x21, 0x21, &a6)),
            Ok(Some("[2001:db8::1]:4000".parse().unwrap()))
        );
        assert_eq!(parse(&v2(0x20, 0x00, &[])), Ok(None), "LOCAL");
        assert_eq!(parse(&v2(0x21, 0x00, &[])), Ok(None), "AF_UNSPEC");
        assert_eq!(
            parse(&v2(0x22, 0x11, &a4)),
            Err(ProxyError::V2Command(0x22))
        );
        assert_eq!(
            parse(&v2(0x11, 0x11, &a4)),
            Err(ProxyError::V2Command(0x11))
        );
        assert_eq!(parse(&v2(0x21, 0x12, &a4)), Err(ProxyError::V2Family(0x12)));
        assert_eq!(parse(&v2(0x21, 0x11, &a4[..11])), Err(ProxyError::V2Short));
        assert_eq!(parse(&v2(0x21, 0x21, &a4)), Err(ProxyError::V2Short));
    }

    #[test]
    fn scan_and_parse_survive_every_truncation_and_flip() {
        let mut a4 = vec![203, 0, 113, 7, 10, 0, 0, 1, 1, 2, 3, 4];
        a4.extend_from_slice(&[0x04, 0x00, 0x01, b'x']);
        for h in [
            v2(0x21, 0x11, &a4),
            b"PROXY TCP6 2001:db8::1 2001:db8::2 4000 5672\r\n".to_vec(),
        ] {
            for n in 0..=h.len() {
                let _ = scan(&h[..n]).map(|l| l.map(|l| parse(&h[..l.min(n)])));
                for i in 0..n {
                    let mut bad = h[..n].to_vec();
                    bad[i] ^= 0xff;
                    let _ = scan(&bad).map(|l| l.map(|l| parse(&bad[..l.min(n)])));
                }
            }
        }
    }

    #[tokio::test]
    async fn reads_exactly_the_header_even_in_pieces() {
        use tokio::io::AsyncWriteExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.set_nodelay(true).unwrap();
            for piece in [
                &b"PROXY TCP4 "[..],
                b"198.51.100.2 10.0.0.1 ",
                b"4242 1883\r",
            ] {
                c.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            c.write_all(b"\nhello").await.unwrap();
            c
        });
        let (mut s, peer) = l.accept().await.unwrap();
        let got = read_header(&mut s, peer).await.unwrap();
        assert_eq!(got, "198.51.100.2:4242".parse().unwrap());
        let mut rest = [0u8; 5];
        s.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"hello");
        drop(client.await.unwrap());
    }
}
