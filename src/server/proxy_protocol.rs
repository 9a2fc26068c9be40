//! The PROXY protocol (contract §4): the header an L4 balancer (AWS NLB, HAProxy `send-proxy-v2`)
//! puts in front of a connection to say whose it is. Versions 1 (text) and 2 (binary), as
//! HAProxy's `proxy-protocol.txt` defines them.
//!
//! Only peers listed in `server.proxy_protocol.from` are asked for one, and from them it is
//! required: a connection that does not open with a valid header within `header_read_timeout`
//! is closed. From anyone else a header is never looked for, so it is just malformed HTTP.
//!
//! The header is read before TLS and HTTP, and exactly: not one byte of what follows it is
//! consumed, so the connection goes on as the same `TcpStream` it was (no replay buffer, no
//! other stream type). That is what [`parse`] is for: it looks at the bytes the socket holds
//! (peeked, not read) and says whether they are a whole header and how long it is, or need
//! more, or can never become one. Only then are exactly that many bytes read.
//!
//! Strict, and bounded: a v1 line is at most [`V1_MAX`] bytes; a v2 header's length field may
//! announce at most [`V2_MAX_PAYLOAD`] bytes of addresses and TLVs. TLVs must tile the rest of
//! the header exactly and are otherwise skipped (tollgate uses none of them).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsFd;
use std::time::Duration;

use ipnet::IpNet;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::TcpStream;

/// The longest v1 header, `\r\n` included (the specification's figure).
pub const V1_MAX: usize = 107;
/// What a v2 header starts with.
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// The fixed part of a v2 header: signature, version and command, family and transport,
/// length.
pub const V2_FIXED: usize = 16;
/// The most address and TLV bytes a v2 header may announce. Addresses take at most 216 (Unix
/// sockets); what AWS NLB and HAProxy add as TLVs (an endpoint id, SNI, a unique id, TLS
/// details) fits many times over.
pub const V2_MAX_PAYLOAD: usize = 2048;
/// The most bytes a header of either version can take.
pub const MAX_HEADER: usize = V2_FIXED + V2_MAX_PAYLOAD;

/// What a complete header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// The balancer relays a client's connection from `source` to `destination`.
    Proxied {
        source: SocketAddr,
        destination: SocketAddr,
    },
    /// The connection carries no client's address: a v2 `LOCAL` command (the balancer's own
    /// health check), v1 `UNKNOWN`, or a v2 family tollgate cannot key on (unspecified, Unix
    /// socket). The TCP peer stays the peer.
    Local,
}

/// What the bytes seen so far are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// A whole header of `len` bytes; what follows it is the client's.
    Complete { header: Header, len: usize },
    /// A prefix of what could still be a valid header.
    Incomplete,
    /// Never a valid header, whatever follows.
    Invalid(&'static str),
}

/// Parses the start of a connection. Never reads past the header, never panics, never
/// allocates.
pub fn parse(buf: &[u8]) -> Parsed {
    match buf.first() {
        None => Parsed::Incomplete,
        Some(b'P') => parse_v1(buf),
        Some(b'\r') => parse_v2(buf),
        Some(_) => Parsed::Invalid("not a PROXY protocol header"),
    }
}

const V1_PREFIX: &[u8] = b"PROXY ";

fn parse_v1(buf: &[u8]) -> Parsed {
    let window = &buf[..buf.len().min(V1_MAX)];
    let Some(end) = window.iter().position(|&b| b == b'\n') else {
        if window.len() >= V1_MAX {
            return Parsed::Invalid("v1 header longer than 107 bytes");
        }
        // Refuse early what can never become a header (an HTTP request line, a TLS record).
        let seen = window.len().min(V1_PREFIX.len());
        if window[..seen] != V1_PREFIX[..seen] {
            return Parsed::Invalid("not a PROXY protocol header");
        }
        if window[seen..]
            .iter()
            .any(|&b| !(b == b' ' || b.is_ascii_graphic() || b == b'\r'))
        {
            return Parsed::Invalid("v1 header with a byte that is not printable ASCII");
        }
        return Parsed::Incomplete;
    };
    let len = end + 1;
    let Some(line) = window[..end].strip_suffix(b"\r") else {
        return Parsed::Invalid("v1 header not ended by CRLF");
    };
    let Some(rest) = line.strip_prefix(V1_PREFIX) else {
        return Parsed::Invalid("not a PROXY protocol header");
    };
    if rest.iter().any(|&b| !(b == b' ' || b.is_ascii_graphic())) {
        return Parsed::Invalid("v1 header with a byte that is not printable ASCII");
    }
    // UNKNOWN may be followed by anything (the specification says to ignore it).
    if rest == b"UNKNOWN" || rest.starts_with(b"UNKNOWN ") {
        return Parsed::Complete {
            header: Header::Local,
            len,
        };
    }
    let mut fields = rest.split(|&b| b == b' ');
    let (Some(family), Some(src), Some(dst), Some(sport), Some(dport), None) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
    ) else {
        return Parsed::Invalid("v1 header without exactly five fields after PROXY");
    };
    let addresses = match family {
        b"TCP4" => v1_address::<Ipv4Addr>(src).zip(v1_address::<Ipv4Addr>(dst)),
        b"TCP6" => v1_address::<Ipv6Addr>(src).zip(v1_address::<Ipv6Addr>(dst)),
        _ => return Parsed::Invalid("v1 protocol is not TCP4, TCP6 or UNKNOWN"),
    };
    let Some((src, dst)) = addresses else {
        return Parsed::Invalid("v1 address does not match its protocol");
    };
    let (Some(sport), Some(dport)) = (v1_port(sport), v1_port(dport)) else {
        return Parsed::Invalid("v1 port is not a decimal number from 0 to 65535");
    };
    Parsed::Complete {
        header: Header::Proxied {
            source: SocketAddr::new(src, sport),
            destination: SocketAddr::new(dst, dport),
        },
        len,
    }
}

fn v1_address<A: std::str::FromStr + Into<IpAddr>>(field: &[u8]) -> Option<IpAddr> {
    std::str::from_utf8(field)
        .ok()?
        .parse::<A>()
        .ok()
        .map(Into::into)
}

/// A decimal port without a sign or leading zeros ("0" itself is fine).
fn v1_port(field: &[u8]) -> Option<u16> {
    if field.is_empty()
        || field.len() > 5
        || !field.iter().all(u8::is_ascii_digit)
        || (field.len() > 1 && field[0] == b'0')
    {
        return None;
    }
    std::str::from_utf8(field).ok()?.parse().ok()
}

fn parse_v2(buf: &[u8]) -> Parsed {
    let seen = buf.len().min(V2_SIGNATURE.len());
    if buf[..seen] != V2_SIGNATURE[..seen] {
        return Parsed::Invalid("not a PROXY protocol header");
    }
    if buf.len() < V2_FIXED {
        return Parsed::Incomplete;
    }
    let version_command = buf[12];
    if version_command >> 4 != 2 {
        return Parsed::Invalid("v2 header with a version other than 2");
    }
    let local = match version_command & 0x0f {
        0 => true,
        1 => false,
        _ => return Parsed::Invalid("v2 command is neither LOCAL nor PROXY"),
    };
    let family_transport = buf[13];
    let payload = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    if payload > V2_MAX_PAYLOAD {
        return Parsed::Invalid("v2 header longer than tollgate accepts");
    }
    // LOCAL: the specification says to discard the address block whatever family it names.
    let address_len = if local {
        0
    } else {
        let family_len = match family_transport >> 4 {
            0 => 0,   // AF_UNSPEC
            1 => 12,  // AF_INET
            2 => 36,  // AF_INET6
            3 => 216, // AF_UNIX
            _ => return Parsed::Invalid("v2 address family unknown"),
        };
        match family_transport & 0x0f {
            // Unspecified, or a stream: this is TCP. A datagram transport is not.
            0 | 1 => {}
            _ => return Parsed::Invalid("v2 transport is not a stream"),
        }
        if payload < family_len {
            return Parsed::Invalid("v2 header too short for its addresses");
        }
        family_len
    };
    let len = V2_FIXED + payload;
    let Some(whole) = buf.get(..len) else {
        return Parsed::Incomplete;
    };
    let body = &whole[V2_FIXED..];
    // A LOCAL header's whole block is discarded unread, as the specification says.
    if !local && !tlvs_tile(&body[address_len..]) {
        return Parsed::Invalid("v2 TLVs do not add up to the header's length");
    }
    let header = match (local, family_transport >> 4) {
        (false, 1) => {
            let ip = |at: usize| {
                IpAddr::V4(Ipv4Addr::new(
                    body[at],
                    body[at + 1],
                    body[at + 2],
                    body[at + 3],
                ))
            };
            let port = |at: usize| u16::from_be_bytes([body[at], body[at + 1]]);
            Header::Proxied {
                source: SocketAddr::new(ip(0), port(8)),
                destination: SocketAddr::new(ip(4), port(10)),
            }
        }
        (false, 2) => {
            let ip = |at: usize| {
                let mut octets = [0u8; 16];
                octets.copy_from_slice(&body[at..at + 16]);
                IpAddr::V6(Ipv6Addr::from(octets))
            };
            let port = |at: usize| u16::from_be_bytes([body[at], body[at + 1]]);
            Header::Proxied {
                source: SocketAddr::new(ip(0), port(32)),
                destination: SocketAddr::new(ip(16), port(34)),
            }
        }
        _ => Header::Local,
    };
    Parsed::Complete { header, len }
}

/// Whether `tlvs` is a whole number of type-length-value records.
fn tlvs_tile(mut tlvs: &[u8]) -> bool {
    while !tlvs.is_empty() {
        let [_, high, low, rest @ ..] = tlvs else {
            return false;
        };
        let value = usize::from(u16::from_be_bytes([*high, *low]));
        match rest.get(value..) {
            Some(next) => tlvs = next,
            None => return false,
        }
    }
    true
}

/// Why a listed peer's connection was closed.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("no PROXY protocol header within header_read_timeout")]
    TimedOut,
    #[error("connection closed before a whole PROXY protocol header")]
    Closed,
    #[error("invalid PROXY protocol header: {0}")]
    Invalid(&'static str),
    #[error("reading the PROXY protocol header: {0}")]
    Io(#[from] io::Error),
}

/// The connection's peer for everything after accept: the source a PROXY header names when
/// the TCP peer is in `from` (which must send one), else the TCP peer itself.
pub async fn peer_after_header(
    stream: &mut TcpStream,
    peer: SocketAddr,
    from: &[IpNet],
    timeout: Duration,
) -> Result<SocketAddr, Refused> {
    if !crate::key::is_trusted(crate::key::canonical(peer.ip()), from) {
        return Ok(peer);
    }
    match read_header(stream, timeout).await? {
        Header::Proxied { source, .. } => Ok(source),
        Header::Local => Ok(peer),
    }
}

/// Reads the PROXY header that opens `stream`, within `timeout`, consuming exactly its bytes:
/// TLS or HTTP go on from the first byte after it.
pub async fn read_header(stream: &mut TcpStream, timeout: Duration) -> Result<Header, Refused> {
    match tokio::time::timeout(timeout, read_exactly_the_header(stream)).await {
        Ok(result) => result,
        Err(_) => Err(Refused::TimedOut),
    }
}

async fn read_exactly_the_header(stream: &mut TcpStream) -> Result<Header, Refused> {
    // Bounded, and only for connections from listed peers.
    let mut buf = vec![0u8; MAX_HEADER];
    // A second descriptor for the same socket, for std's `peek` (tokio's waits only for the
    // first byte, so a partial header would spin). It shares the non-blocking flag.
    let peeker = std::net::TcpStream::from(stream.as_fd().try_clone_to_owned()?);
    let mut seen = 0;
    loop {
        let ready = stream.ready(Interest::READABLE).await?;
        let peeked = stream.try_io(Interest::READABLE, || {
            let n = peeker.peek(&mut buf)?;
            if n == seen && n > 0 && !ready.is_read_closed() {
                // Nothing new since the last look: wait for the next segment. (Telling tokio
                // "would block" clears the readiness it reported, so the wait is not a spin.)
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(n)
        });
        let n = match peeked {
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
            Err(err) => return Err(err.into()),
        };
        if n == 0 || (n == seen && ready.is_read_closed()) {
            return Err(Refused::Closed);
        }
        seen = n;
        match parse(&buf[..n]) {
            Parsed::Incomplete => continue,
            Parsed::Invalid(why) => return Err(Refused::Invalid(why)),
            Parsed::Complete { header, len } => {
                // Already in the socket's buffer: this read does not wait.
                stream.read_exact(&mut buf[..len]).await?;
                return Ok(header);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v2(command: u8, family_transport: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = V2_SIGNATURE.to_vec();
        out.push(0x20 | command);
        out.push(family_transport);
        out.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// A v2 PROXY header for `source` -> `destination` (one family), with `tlvs` appended.
    fn v2_proxy(source: SocketAddr, destination: SocketAddr, tlvs: &[u8]) -> Vec<u8> {
        let mut payload = Vec::new();
        let family = match (source.ip(), destination.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                payload.extend_from_slice(&s.octets());
                payload.extend_from_slice(&d.octets());
                0x11
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                payload.extend_from_slice(&s.octets());
                payload.extend_from_slice(&d.octets());
                0x21
            }
            _ => panic!("one family"),
        };
        payload.extend_from_slice(&source.port().to_be_bytes());
        payload.extend_from_slice(&destination.port().to_be_bytes());
        payload.extend_from_slice(tlvs);
        v2(1, family, &payload)
    }

    fn v1_proxy(source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
        let family = if source.is_ipv4() { "TCP4" } else { "TCP6" };
        format!(
            "PROXY {family} {} {} {} {}\r\n",
            source.ip(),
            destination.ip(),
            source.port(),
            destination.port()
        )
        .into_bytes()
    }

    fn complete(buf: &[u8]) -> (Header, usize) {
        match parse(buf) {
            Parsed::Complete { header, len } => (header, len),
            other => panic!("{buf:?}: {other:?}"),
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn v1_tcp4_and_tcp6_give_the_source() {
        let line = b"PROXY TCP4 192.0.2.7 198.51.100.1 56324 443\r\nGET / HTTP/1.1\r\n";
        let (header, len) = complete(line);
        assert_eq!(len, 45);
        assert_eq!(
            header,
            Header::Proxied {
                source: addr("192.0.2.7:56324"),
                destination: addr("198.51.100.1:443")
            }
        );
        let line = b"PROXY TCP6 2001:db8::1 2001:db8::2 1 65535\r\n";
        let (header, len) = complete(line);
        assert_eq!(len, line.len());
        assert!(
            matches!(header, Header::Proxied { source, .. } if source == addr("[2001:db8::1]:1"))
        );
    }

    #[test]
    fn v1_unknown_keeps_the_peer() {
        assert_eq!(complete(b"PROXY UNKNOWN\r\n"), (Header::Local, 15));
        let line = b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\n";
        assert_eq!(complete(line), (Header::Local, line.len()));
    }

    #[test]
    fn v1_malformed_lines_are_invalid() {
        for line in [
            &b"PROXY TCP4 192.0.2.7 198.51.100.1 56324 443\n"[..],
            b"PROXY TCP4 2001:db8::1 198.51.100.1 1 2\r\n",
            b"PROXY TCP6 192.0.2.7 2001:db8::1 1 2\r\n",
            b"PROXY TCP4 192.0.2.7 198.51.100.1 056324 443\r\n",
            b"PROXY TCP4 192.0.2.7 198.51.100.1 65536 443\r\n",
            b"PROXY TCP4 192.0.2.7 198.51.100.1 +1 443\r\n",
            b"PROXY TCP4 192.0.2.7  198.51.100.1 1 443\r\n",
            b"PROXY TCP4 192.0.2.7 198.51.100.1 1 443 \r\n",
            b"PROXY TCP4 192.0.2.7 198.51.100.1 1\r\n",
            b"PROXY UDP4 192.0.2.7 198.51.100.1 1 2\r\n",
            b"PROXY TCP4 192.0.2.007 198.51.100.1 1 2\r\n",
            b"PROXY  TCP4 192.0.2.7 198.51.100.1 1 2\r\n",
            b"proxy TCP4 192.0.2.7 198.51.100.1 1 2\r\n",
            b"PROXY UNKNOWNX\r\n",
            b"PROXY\r\n",
        ] {
            assert!(
                matches!(parse(line), Parsed::Invalid(_)),
                "{:?}: {:?}",
                String::from_utf8_lossy(line),
                parse(line)
            );
        }
    }

    #[test]
    fn v1_line_longer_than_107_bytes_is_invalid_without_its_end() {
        let mut line = b"PROXY UNKNOWN ".to_vec();
        line.resize(V1_MAX, b'a');
        assert!(matches!(parse(&line), Parsed::Invalid(_)));
        line.truncate(V1_MAX - 2);
        line.extend_from_slice(b"\r\n");
        assert_eq!(complete(&line), (Header::Local, V1_MAX));
    }

    #[test]
    fn http_and_tls_are_refused_at_once() {
        assert!(matches!(parse(b"GET / HTTP/1.1\r\n"), Parsed::Invalid(_)));
        assert!(matches!(parse(b"POST"), Parsed::Invalid(_)));
        assert!(matches!(parse(&[0x16, 0x03, 0x01]), Parsed::Invalid(_)));
        assert!(matches!(parse(b"\r\n\r\nGET"), Parsed::Invalid(_)));
    }

    #[test]
    fn v2_ipv4_ipv6_and_local() {
        let header = v2_proxy(addr("192.0.2.7:1234"), addr("10.0.0.1:443"), &[]);
        assert_eq!(
            complete(&header),
            (
                Header::Proxied {
                    source: addr("192.0.2.7:1234"),
                    destination: addr("10.0.0.1:443")
                },
                28
            )
        );
        let header = v2_proxy(addr("[2001:db8::7]:1"), addr("[2001:db8::1]:2"), &[]);
        assert_eq!(complete(&header).1, 52);
        assert!(
            matches!(complete(&header).0, Header::Proxied { source, .. } if source == addr("[2001:db8::7]:1"))
        );
        // LOCAL, with or without an address block (which is ignored).
        assert_eq!(complete(&v2(0, 0, &[])), (Header::Local, 16));
        let with_block = v2(0, 0x11, &[1; 12]);
        assert_eq!(complete(&with_block), (Header::Local, 28));
        // PROXY with an unspecified family or a Unix socket: no address to key on.
        assert_eq!(complete(&v2(1, 0x00, &[])).0, Header::Local);
        assert_eq!(complete(&v2(1, 0x31, &[0; 216])).0, Header::Local);
    }

    #[test]
    fn v2_tlvs_are_skipped_when_well_formed() {
        // An AWS-style TLV (type 0xEA) and a NOOP.
        let tlvs = [0xEA, 0x00, 0x03, 0x01, b'v', b'p', 0x04, 0x00, 0x00];
        let header = v2_proxy(addr("192.0.2.7:1234"), addr("10.0.0.1:443"), &tlvs);
        assert_eq!(complete(&header).1, 28 + tlvs.len());
        for bad in [&[0xEA, 0x00][..], &[0xEA, 0x00, 0x05, 1, 2]] {
            let header = v2_proxy(addr("192.0.2.7:1234"), addr("10.0.0.1:443"), bad);
            assert!(matches!(parse(&header), Parsed::Invalid(_)), "{bad:?}");
        }
    }

    #[test]
    fn v2_malformed_headers_are_invalid() {
        let good = v2_proxy(addr("192.0.2.7:1234"), addr("10.0.0.1:443"), &[]);
        let mut bad_version = good.clone();
        bad_version[12] = 0x11;
        let mut bad_command = good.clone();
        bad_command[12] = 0x22;
        let mut datagram = good.clone();
        datagram[13] = 0x12;
        let mut bad_family = good.clone();
        bad_family[13] = 0x41;
        let mut short = good.clone();
        short[15] = 11;
        let mut huge = good.clone();
        huge[14..16].copy_from_slice(&((V2_MAX_PAYLOAD + 1) as u16).to_be_bytes());
        for (what, header) in [
            ("version", bad_version),
            ("command", bad_command),
            ("datagram", datagram),
            ("family", bad_family),
            ("too short for addresses", short),
            ("too long", huge),
        ] {
            assert!(matches!(parse(&header), Parsed::Invalid(_)), "{what}");
        }
    }

    fn socket_pair() -> impl Strategy<Value = (SocketAddr, SocketAddr)> {
        prop_oneof![
            (
                any::<[u8; 4]>(),
                any::<[u8; 4]>(),
                any::<u16>(),
                any::<u16>()
            )
                .prop_map(|(s, d, sp, dp)| (
                    SocketAddr::new(IpAddr::from(s), sp),
                    SocketAddr::new(IpAddr::from(d), dp)
                )),
            (
                any::<[u8; 16]>(),
                any::<[u8; 16]>(),
                any::<u16>(),
                any::<u16>()
            )
                .prop_map(|(s, d, sp, dp)| (
                    SocketAddr::new(IpAddr::from(s), sp),
                    SocketAddr::new(IpAddr::from(d), dp)
                )),
        ]
    }

    /// Well-formed TLVs, up to a few hundred bytes.
    fn tlvs() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(
            (any::<u8>(), prop::collection::vec(any::<u8>(), 0..64)),
            0..6,
        )
        .prop_map(|records| {
            let mut out = Vec::new();
            for (kind, value) in records {
                out.push(kind);
                out.extend_from_slice(&(value.len() as u16).to_be_bytes());
                out.extend_from_slice(&value);
            }
            out
        })
    }

    proptest! {
        #[test]
        fn round_trip_and_every_truncation_needs_more(
            (source, destination) in socket_pair(),
            tlvs in tlvs(),
            v1 in any::<bool>(),
            after in prop::collection::vec(any::<u8>(), 0..32),
        ) {
            let header = if v1 { v1_proxy(source, destination) } else { v2_proxy(source, destination, &tlvs) };
            let mut bytes = header.clone();
            bytes.extend_from_slice(&after);
            prop_assert_eq!(
                parse(&bytes),
                Parsed::Complete { header: Header::Proxied { source, destination }, len: header.len() }
            );
            for cut in 0..header.len() {
                prop_assert_eq!(parse(&header[..cut]), Parsed::Incomplete, "cut at {}", cut);
            }
        }

        #[test]
        fn garbage_never_panics_and_is_never_a_header(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            // Whatever it says, the length it claims is within what was given and the bound.
            if let Parsed::Complete { len, .. } = parse(&bytes) {
                prop_assert!(len <= bytes.len() && len <= MAX_HEADER);
            }
        }

        #[test]
        fn random_bytes_after_a_valid_start_are_refused_or_bounded(
            v1 in any::<bool>(),
            tail in prop::collection::vec(any::<u8>(), 0..300),
        ) {
            let mut bytes = if v1 { b"PROXY TCP4 ".to_vec() } else { V2_SIGNATURE.to_vec() };
            bytes.extend_from_slice(&tail);
            match parse(&bytes) {
                Parsed::Complete { len, header } => {
                    prop_assert!(len <= bytes.len());
                    // A complete header re-parses the same from its own bytes alone.
                    prop_assert_eq!(parse(&bytes[..len]), Parsed::Complete { header, len });
                }
                Parsed::Incomplete => prop_assert!(bytes.len() < MAX_HEADER),
                Parsed::Invalid(_) => {}
            }
        }

        #[test]
        fn an_http_request_is_never_a_header(path in "[a-z/]{0,40}", method in "GET|POST|PUT|HEAD|DELETE|OPTIONS|PRI") {
            let request = format!("{method} /{path} HTTP/1.1\r\nHost: x\r\n\r\n");
            prop_assert!(matches!(parse(request.as_bytes()), Parsed::Invalid(_)));
        }
    }
}
