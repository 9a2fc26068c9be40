//! Keys: who a request is counted as (contract §3 and §4).
//!
//! This module owns the client address (the TCP peer, or the right-to-left walk of
//! `X-Forwarded-For` when the peer is a trusted proxy), the subject each limit key takes from a
//! request, and the bucket name derived from it: `<scope>:<label>:<hex digest>` where the digest
//! is HMAC-SHA256 under `keys.secret` (plain SHA-256 without one). Subjects exist only inside
//! this module's functions: nothing here implements `Debug` or `Display` for a subject, and
//! only the digest leaves.
//!
//! A keyed header must be read alike by the limiter and the upstream, or the client chooses its
//! own bucket: it must come once (with two `X-Api-Key` fields the limiter would count one copy
//! while the upstream may read the other; contract §3), with a value of visible ASCII and no padding
//! (HTTP/2 passes `"k "` through while every HTTP/1.1 parser upstream strips it to `k`;
//! RFC 9113 8.2.1 calls it malformed), and, where names with `_` are forwarded, without an
//! underscore twin (`X_Api_Key`, which CGI and WSGI read as `X-Api-Key`). [`keyed_headers`]
//! lists the names a route's limits read, made once per route, and [`keyed_header_problem`]
//! checks exactly those per request; the proxy answers 400.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderName};
use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::config::{KeyPart, KeySpec, LimitConfig};

type HmacSha256 = Hmac<Sha256>;

/// The address a request is attributed to (contract §4).
///
/// A client can never choose its own address by sending `X-Forwarded-For`: the header is read
/// only when the TCP peer itself is trusted.
pub fn client_addr(peer: IpAddr, headers: &HeaderMap, trusted: &[IpNet]) -> IpAddr {
    let peer = canonical(peer);
    if !is_trusted(peer, trusted) {
        return peer;
    }
    // Entries are read right to left across all X-Forwarded-For fields, as if joined by ",".
    let fields: Vec<&[u8]> = headers
        .get_all("x-forwarded-for")
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    let mut chosen = peer;
    for field in fields.iter().rev() {
        for entry in field.rsplit(|b| *b == b',') {
            let Some(addr) = parse_forwarded_entry(entry) else {
                // A malformed entry stops the walk at the last good address.
                return chosen;
            };
            chosen = addr;
            if !is_trusted(addr, trusted) {
                return addr;
            }
        }
    }
    // Every entry was trusted: the leftmost one.
    chosen
}

/// Whether `addr` (already canonical) lies in one of the trusted networks.
pub fn is_trusted(addr: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|net| net.contains(&addr))
}

/// IPv4-mapped IPv6 (`::ffff:192.0.2.7`) counts as the IPv4 address it carries.
pub fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// One `X-Forwarded-For` entry: an address, optionally `[v6]` or `v4:port` as some proxies send.
fn parse_forwarded_entry(entry: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(entry).ok()?.trim();
    if let Ok(addr) = text.parse::<IpAddr>() {
        return Some(canonical(addr));
    }
    if let Some(inner) = text.strip_prefix('[') {
        let inner = inner.split(']').next()?;
        return inner
            .parse::<Ipv6Addr>()
            .ok()
            .map(|a| canonical(IpAddr::V6(a)));
    }
    let sock: std::net::SocketAddr = text.parse().ok()?;
    Some(canonical(sock.ip()))
}

/// The `ip` subject: dotted quad for IPv4; for IPv6 the address masked to `prefix` in RFC 5952
/// form with the prefix length (`2001:db8:1:2::/64`), or the bare address when `prefix` is 128.
pub fn ip_subject(addr: IpAddr, ipv6_prefix: u8) -> String {
    match canonical(addr) {
        v4 @ IpAddr::V4(_) => address_text(v4),
        IpAddr::V6(v6) if ipv6_prefix >= 128 => v6.to_string(),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let mask = if ipv6_prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(ipv6_prefix))
            };
            // std's Display for Ipv6Addr already follows RFC 5952 (lowercase, longest zero run).
            format!("{}/{}", Ipv6Addr::from(bits & mask), ipv6_prefix)
        }
    }
}

/// An address as text, as `Display` writes it. IPv4, the common case, is written by hand: on
/// the hot path (`X-Forwarded-For`, `ip` subjects) the formatting machinery behind
/// `to_string` cost more than the rest of either caller.
pub fn address_text(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => {
            let mut text = String::with_capacity(15);
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    text.push('.');
                }
                if octet >= 100 {
                    text.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    text.push(char::from(b'0' + octet / 10 % 10));
                }
                text.push(char::from(b'0' + octet % 10));
            }
            text
        }
        IpAddr::V6(_) => ip.to_string(),
    }
}

/// Turns subjects into digests. Built once (and the keyed HMAC state with it), shared by `Arc`.
#[derive(Clone)]
pub struct BucketHasher {
    keyed: Option<HmacSha256>,
    /// Tells hashers apart in the per-worker cache of `ip` buckets: two hashers built from
    /// different secrets (two servers in one process) must never share an entry. Clones keep
    /// the id: they hash alike.
    id: u64,
}

static NEXT_HASHER_ID: AtomicU64 = AtomicU64::new(1);

impl BucketHasher {
    pub fn new(secret: Option<&[u8]>) -> Self {
        let keyed = secret.and_then(|s| HmacSha256::new_from_slice(s).ok());
        BucketHasher {
            keyed,
            id: NEXT_HASHER_ID.fetch_add(1, Ordering::Relaxed),
        }
    }

    pub fn is_keyed(&self) -> bool {
        self.keyed.is_some()
    }

    /// Lowercase hex of HMAC-SHA256(secret, subject), or SHA-256(subject) without a secret.
    pub fn digest(&self, subject: &[u8]) -> String {
        let mut hex = String::with_capacity(64);
        self.digest_into(subject, &mut hex);
        hex
    }

    /// [`BucketHasher::digest`], appended to `out` (the bucket string being built).
    pub fn digest_into(&self, subject: &[u8], out: &mut String) {
        let bytes: [u8; 32] = match &self.keyed {
            Some(mac) => {
                let mut mac = mac.clone();
                mac.update(subject);
                mac.finalize().into_bytes().into()
            }
            None => Sha256::digest(subject).into(),
        };
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for byte in bytes {
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
    }

    /// What the database stores to prove every instance hashes alike; never the secret itself.
    pub fn fingerprint(&self) -> String {
        match &self.keyed {
            Some(mac) => {
                let mut mac = mac.clone();
                mac.update(b"tollgate key fingerprint v1");
                format!("hmac-sha256:{}", hex::encode(mac.finalize().into_bytes()))
            }
            None => "sha256:unkeyed".to_string(),
        }
    }
}

impl std::fmt::Debug for BucketHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketHasher")
            .field("keyed", &self.is_keyed())
            .finish()
    }
}

/// The header names the limits key on (each `header:<name>` part), once each, in limit order.
pub fn keyed_headers(limits: &[LimitConfig]) -> Vec<HeaderName> {
    let mut names: Vec<HeaderName> = Vec::new();
    for part in limits.iter().flat_map(|limit| &limit.key.parts) {
        if let KeyPart::Header(name) = part {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
    }
    names
}

/// Why the request's keyed headers cannot be counted as the upstream will read them, if they
/// cannot (see the module docs). Only the named headers are looked up (most routes name none
/// or one), so this costs a hashed lookup and a pass over the value per keyed header; the
/// request's other names are looked at only when `underscores_forwarded`.
pub fn keyed_header_problem(
    headers: &HeaderMap,
    names: &[HeaderName],
    underscores_forwarded: bool,
) -> Option<&'static str> {
    for name in names {
        let mut values = headers.get_all(name).iter();
        let Some(value) = values.next() else {
            continue;
        };
        if values.next().is_some() {
            return Some("a header a limit keys on was sent more than once");
        }
        if !is_plain_value(value.as_bytes()) {
            return Some("a header a limit keys on is padded or not visible ASCII");
        }
    }
    if underscores_forwarded && !names.is_empty() {
        let twin = headers
            .keys()
            .any(|sent| names.iter().any(|keyed| is_underscore_twin(keyed, sent)));
        if twin {
            return Some("a header a limit keys on was also sent with _ for -");
        }
    }
    None
}

/// Visible ASCII with spaces and tabs inside, none at either end: a value that every parser
/// reads as these exact bytes.
fn is_plain_value(value: &[u8]) -> bool {
    let padded = |b: Option<&u8>| matches!(b, Some(b' ' | b'\t'));
    !padded(value.first())
        && !padded(value.last())
        && value
            .iter()
            .all(|&b| b == b' ' || b == b'\t' || (0x21..=0x7e).contains(&b))
}

/// Whether `sent` is another spelling of `keyed` with `_` and `-` swapped somewhere.
fn is_underscore_twin(keyed: &HeaderName, sent: &HeaderName) -> bool {
    let (keyed, sent) = (keyed.as_str().as_bytes(), sent.as_str().as_bytes());
    keyed != sent
        && keyed.len() == sent.len()
        && keyed
            .iter()
            .zip(sent)
            .all(|(k, s)| k == s || matches!((k, s), (b'-', b'_') | (b'_', b'-')))
}

/// What a request looks like to the key derivation: its attributed address and its headers.
pub struct RequestIdentity<'a> {
    pub client: IpAddr,
    pub ipv6_prefix: u8,
    pub headers: &'a HeaderMap,
    /// The serving worker's cache of `ip` buckets; `None` (the commands, one-off plans)
    /// derives every bucket afresh.
    pub ip_buckets: Option<&'a IpBucketCache>,
}

/// The bucket this request counts in for one limit, or `None` when the limit does not apply
/// (a keyed header is missing).
pub fn bucket_for(
    scope: &str,
    spec: &KeySpec,
    who: &RequestIdentity<'_>,
    hasher: &BucketHasher,
) -> Option<Arc<str>> {
    bucket_in(&format!("{scope}:{}", spec.label()), spec, who, hasher)
}

/// [`bucket_for`] with the `<scope>:<label>` prefix already made (the proxy keeps it per
/// limit, so the hot path builds one string per bucket).
pub fn bucket_in(
    policy: &str,
    spec: &KeySpec,
    who: &RequestIdentity<'_>,
    hasher: &BucketHasher,
) -> Option<Arc<str>> {
    if spec.is_global() {
        return Some(Arc::from(policy));
    }
    if let (Some(cache), [KeyPart::Ip]) = (who.ip_buckets, spec.parts.as_slice()) {
        return Some(cache.bucket(policy, who, hasher));
    }
    let subject = subject(spec, who)?;
    Some(bucket_from(policy, &subject, hasher))
}

fn bucket_from(policy: &str, subject: &[u8], hasher: &BucketHasher) -> Arc<str> {
    let mut bucket = String::with_capacity(policy.len() + 1 + 64);
    bucket.push_str(policy);
    bucket.push(':');
    hasher.digest_into(subject, &mut bucket);
    Arc::from(bucket)
}

/// One worker's recent `ip` buckets. A keep-alive connection's client address does not
/// change between its requests, and building the bucket name (the subject text, the HMAC,
/// the hex, the string) was the largest part of the limiter's work per request.
///
/// Owned by the worker (`crate::pipeline::Worker`) and handed down in [`RequestIdentity`], so
/// two servers in one process never share one. Only its worker's thread uses it: the lock is
/// never contended, it only makes the cache shareable between that worker's tasks.
#[derive(Default)]
pub struct IpBucketCache(Mutex<IpBuckets>);

impl IpBucketCache {
    fn bucket(&self, policy: &str, who: &RequestIdentity<'_>, hasher: &BucketHasher) -> Arc<str> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bucket(policy, who, hasher)
    }

    /// Client addresses it holds buckets for.
    pub fn addresses(&self) -> usize {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_address
            .len()
    }
}

/// Bucket names of `ip` keys, by what they are derived from: the hasher, the IPv6 prefix and
/// the client address (the subject is a function of the last two), then the policy text.
/// Bounded: past [`IpBuckets::MAX_ADDRESSES`] it starts again empty, so a flood of distinct
/// addresses costs a rebuild now and then, never memory.
#[derive(Default)]
struct IpBuckets {
    by_address: HashMap<IpBucketSource, Vec<PolicyBucket>, foldhash::fast::RandomState>,
}

/// Hasher id, IPv6 prefix, client address.
type IpBucketSource = (u64, u8, IpAddr);
/// A policy's text and the bucket name under it.
type PolicyBucket = (Box<str>, Arc<str>);

impl IpBuckets {
    const MAX_ADDRESSES: usize = 4096;
    /// Policies per address (routes with an `ip` limit; reloads can add more).
    const MAX_POLICIES: usize = 16;

    fn bucket(
        &mut self,
        policy: &str,
        who: &RequestIdentity<'_>,
        hasher: &BucketHasher,
    ) -> Arc<str> {
        let key = (hasher.id, who.ipv6_prefix, who.client);
        if let Some(known) = self
            .by_address
            .get(&key)
            .and_then(|known| known.iter().find(|(p, _)| **p == *policy))
        {
            return known.1.clone();
        }
        let subject = ip_subject(who.client, who.ipv6_prefix);
        let bucket = bucket_from(policy, subject.as_bytes(), hasher);
        if self.by_address.len() >= Self::MAX_ADDRESSES && !self.by_address.contains_key(&key) {
            self.by_address.clear();
        }
        let known = self.by_address.entry(key).or_default();
        if known.len() >= Self::MAX_POLICIES {
            known.clear();
        }
        known.push((policy.into(), bucket.clone()));
        bucket
    }
}

/// The subject bytes: one part as it is; several parts each prefixed with its length (4 bytes,
/// big endian) so that no two different tuples can produce the same bytes.
fn subject(spec: &KeySpec, who: &RequestIdentity<'_>) -> Option<Vec<u8>> {
    let one = |part: &KeyPart| -> Option<Vec<u8>> {
        match part {
            KeyPart::Ip => Some(ip_subject(who.client, who.ipv6_prefix).into_bytes()),
            KeyPart::Header(name) => who.headers.get(name).map(|v| v.as_bytes().to_vec()),
            KeyPart::Global => Some(Vec::new()),
        }
    };
    if let [single] = spec.parts.as_slice() {
        return one(single);
    }
    let mut joined = Vec::new();
    for part in &spec.parts {
        let bytes = one(part)?;
        let len = u32::try_from(bytes.len()).ok()?;
        joined.extend_from_slice(&len.to_be_bytes());
        joined.extend_from_slice(&bytes);
    }
    Some(joined)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn address_text_matches_display() {
        for text in [
            "0.0.0.0",
            "9.10.99.100",
            "192.0.2.7",
            "255.255.255.255",
            "10.0.0.1",
            "2001:db8::1",
        ] {
            let ip: IpAddr = text.parse().unwrap();
            assert_eq!(address_text(ip), ip.to_string());
        }
        for n in [
            0u32,
            1,
            99,
            100,
            101,
            199,
            200,
            250,
            255,
            0x0a_64_09_ff,
            u32::MAX,
        ] {
            let ip = IpAddr::from(std::net::Ipv4Addr::from(n));
            assert_eq!(address_text(ip), ip.to_string());
        }
    }

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().expect("test cidr")).collect()
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                "x-forwarded-for",
                HeaderValue::from_str(v).expect("test header"),
            );
        }
        h
    }

    #[test]
    fn untrusted_peer_ignores_forwarded_for() {
        let peer: IpAddr = "203.0.113.9".parse().unwrap();
        let got = client_addr(peer, &xff(&["1.2.3.4"]), &nets(&["10.0.0.0/8"]));
        assert_eq!(got, peer);
    }

    #[test]
    fn trusted_peer_walks_from_the_right() {
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let got = client_addr(
            peer,
            &xff(&["6.6.6.6, 198.51.100.2", "10.0.0.7"]),
            &nets(&["10.0.0.0/8"]),
        );
        assert_eq!(got, "198.51.100.2".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn all_trusted_takes_leftmost_and_malformed_stops() {
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let trusted = nets(&["10.0.0.0/8"]);
        assert_eq!(
            client_addr(peer, &xff(&["10.1.1.1, 10.2.2.2"]), &trusted),
            "10.1.1.1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            client_addr(peer, &xff(&["5.5.5.5, garbage, 10.2.2.2"]), &trusted),
            "10.2.2.2".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn mapped_ipv4_is_ipv4_and_ipv6_is_masked() {
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(ip_subject(mapped, 64), "192.0.2.7");
        let v6: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        assert_eq!(ip_subject(v6, 64), "2001:db8:1:2::/64");
        assert_eq!(ip_subject(v6, 128), "2001:db8:1:2:aaaa::1");
    }

    #[test]
    fn digests_are_keyed_and_stable() {
        let plain = BucketHasher::new(None);
        assert_eq!(
            plain.digest(b"192.0.2.7"),
            hex::encode(Sha256::digest(b"192.0.2.7"))
        );
        let a = BucketHasher::new(Some(b"one"));
        let b = BucketHasher::new(Some(b"two"));
        assert_ne!(a.digest(b"x"), b.digest(b"x"));
        assert_eq!(a.digest(b"x"), BucketHasher::new(Some(b"one")).digest(b"x"));
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(a.digest(b"x").len(), 64);
    }

    #[test]
    fn composite_subjects_are_unambiguous() {
        let spec = KeySpec {
            parts: vec![
                KeyPart::Header(http::HeaderName::from_static("x-a")),
                KeyPart::Header(http::HeaderName::from_static("x-b")),
            ],
        };
        let hasher = BucketHasher::new(None);
        let mut h1 = HeaderMap::new();
        h1.insert("x-a", HeaderValue::from_static("ab"));
        h1.insert("x-b", HeaderValue::from_static("c"));
        let mut h2 = HeaderMap::new();
        h2.insert("x-a", HeaderValue::from_static("a"));
        h2.insert("x-b", HeaderValue::from_static("bc"));
        let who = |h| RequestIdentity {
            client: "192.0.2.1".parse().unwrap(),
            ipv6_prefix: 64,
            headers: h,
            ip_buckets: None,
        };
        let b1 = bucket_for("s", &spec, &who(&h1), &hasher).unwrap();
        let b2 = bucket_for("s", &spec, &who(&h2), &hasher).unwrap();
        assert_ne!(b1, b2);
        assert!(b1.starts_with("s:x-a+x-b:"));
        let mut missing = HeaderMap::new();
        missing.insert("x-a", HeaderValue::from_static("a"));
        assert!(bucket_for("s", &spec, &who(&missing), &hasher).is_none());
    }

    #[test]
    fn keyed_headers_are_each_named_once_and_only_repeats_of_them_count() {
        // Built by the loader, so the test needs no update when limits gain a field.
        let mut text = String::from("[upstreams.u]\nurl = \"http://127.0.0.1:9\"\n");
        text.push_str("[[routes]]\nname = \"r\"\nupstream = \"u\"\n");
        for (scope, key) in [
            ("a", "\"ip\""),
            ("b", "[\"header:X-Api-Key\", \"ip\"]"),
            ("c", "\"header:authorization\""),
            ("d", "\"header:x-api-key\""),
        ] {
            text.push_str(&format!(
                "[[routes.limits]]\nscope = \"{scope}\"\nkey = {key}\nrequests = 1\nwindow = \"1s\"\n"
            ));
        }
        let config = crate::config::load_str(std::path::Path::new("t.toml"), &text, &|_| None)
            .expect("test configuration");
        let limits = &config.routes[0].limits;
        let api_key = HeaderName::from_static("x-api-key");
        let auth = http::header::AUTHORIZATION;
        let names = keyed_headers(limits);
        assert_eq!(names, [api_key.clone(), auth.clone()]);
        let mut h = HeaderMap::new();
        h.append("x-other", HeaderValue::from_static("1"));
        h.append("x-other", HeaderValue::from_static("2"));
        h.append("x-api-key", HeaderValue::from_static("a"));
        assert_eq!(keyed_header_problem(&h, &names, false), None);
        h.append("x_api-key", HeaderValue::from_static("twin"));
        assert_eq!(keyed_header_problem(&h, &names, false), None);
        assert!(keyed_header_problem(&h, &names, true).is_some());
        h.remove("x_api-key");
        h.append("authorization", HeaderValue::from_static("b"));
        h.append("authorization", HeaderValue::from_static("c"));
        assert!(keyed_header_problem(&h, &names, false).is_some());
        for padded in [" a", "a ", "\ta", "a\t"] {
            let mut h = HeaderMap::new();
            h.append("x-api-key", HeaderValue::from_static(padded));
            assert!(
                keyed_header_problem(&h, &names, false).is_some(),
                "{padded:?}"
            );
        }
        let mut h = HeaderMap::new();
        h.append(
            "x-api-key",
            HeaderValue::from_static("key with\tinner space"),
        );
        assert_eq!(keyed_header_problem(&h, &names, false), None);
        assert!(keyed_headers(&limits[..1]).is_empty());
    }

    /// The per-worker cache of `ip` buckets answers exactly what deriving the bucket afresh
    /// gives, for every hasher, prefix, address and policy, also after it has started again
    /// empty.
    #[test]
    fn cached_ip_buckets_equal_fresh_ones() {
        let spec = KeySpec {
            parts: vec![KeyPart::Ip],
        };
        let headers = HeaderMap::new();
        let keyed = BucketHasher::new(Some(b"one"));
        let other = BucketHasher::new(Some(b"two"));
        let plain = BucketHasher::new(None);
        let cache = IpBucketCache::default();
        let fresh = |policy: &str, client: IpAddr, prefix: u8, hasher: &BucketHasher| {
            let subject = ip_subject(client, prefix);
            format!("{policy}:{}", hasher.digest(subject.as_bytes()))
        };
        let clients: Vec<IpAddr> = [
            "192.0.2.7",
            "2001:db8:1:2::5",
            "2001:db8:1:2::6",
            "::ffff:192.0.2.7",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
        for _ in 0..3 {
            for hasher in [&keyed, &other, &plain] {
                for &client in &clients {
                    for prefix in [64, 128] {
                        for policy in ["login:ip", "api:ip"] {
                            let who = RequestIdentity {
                                client,
                                ipv6_prefix: prefix,
                                headers: &headers,
                                ip_buckets: Some(&cache),
                            };
                            let cached = bucket_in(policy, &spec, &who, hasher).unwrap();
                            assert_eq!(&*cached, fresh(policy, client, prefix, hasher));
                        }
                    }
                }
            }
        }
        // Two secrets never share a bucket; two addresses of one /64 do at prefix 64 only.
        let who = |client: &str, prefix| RequestIdentity {
            client: client.parse().unwrap(),
            ipv6_prefix: prefix,
            headers: &headers,
            ip_buckets: Some(&cache),
        };
        let a = bucket_in("p:ip", &spec, &who("192.0.2.7", 64), &keyed).unwrap();
        let b = bucket_in("p:ip", &spec, &who("192.0.2.7", 64), &other).unwrap();
        assert_ne!(a, b);
        let v6a = bucket_in("p:ip", &spec, &who("2001:db8:1:2::5", 64), &keyed).unwrap();
        let v6b = bucket_in("p:ip", &spec, &who("2001:db8:1:2::6", 64), &keyed).unwrap();
        assert_eq!(v6a, v6b);
        let v6a = bucket_in("p:ip", &spec, &who("2001:db8:1:2::5", 128), &keyed).unwrap();
        let v6b = bucket_in("p:ip", &spec, &who("2001:db8:1:2::6", 128), &keyed).unwrap();
        assert_ne!(v6a, v6b);

        // Past its bound the cache starts again, and stays right.
        for n in 0..(IpBuckets::MAX_ADDRESSES as u32 + 100) {
            let client = IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + n));
            let w = RequestIdentity {
                client,
                ipv6_prefix: 64,
                headers: &headers,
                ip_buckets: Some(&cache),
            };
            let cached = bucket_in("p:ip", &spec, &w, &keyed).unwrap();
            if n % 1000 == 0 {
                assert_eq!(&*cached, fresh("p:ip", client, 64, &keyed));
            }
        }
        assert!(cache.addresses() <= IpBuckets::MAX_ADDRESSES);
        let again = bucket_in("p:ip", &spec, &who("192.0.2.7", 64), &keyed).unwrap();
        assert_eq!(again, a);
    }
}
