//! Header rewriting, as pure functions over `HeaderMap`s (contract §5).
//!
//! - Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection and are removed in both
//!   directions: `Connection` and every header it names, plus the fixed list below (which has
//!   `HTTP2-Settings`, h2c's connection option, whether `Connection` names it or not). `TE:
//!   trailers` survives because gRPC needs it end to end.
//! - Of the upgrades, only WebSocket is ever forwarded ([`wants_websocket`]), and only a `101`
//!   that switches to it is accepted ([`switches_to_websocket`]).
//! - `X-Forwarded-For/Proto/Host` and `X-Real-IP` tell the upstream who the client was;
//!   `Forwarded` (RFC 7239) passes only from a trusted proxy, since tollgate does not write
//!   it and a backend that believes a client's own would be spoofed.
//! - Header names with `_` are dropped unless configured otherwise: CGI and WSGI map `_` and
//!   `-` alike, so `X_Api_Key` would reach such a backend as the `X-Api-Key` a limit keys on.
//! - `RateLimit-Policy`/`RateLimit` (draft-ietf-httpapi-ratelimit-headers, structured-field
//!   lists) and the legacy `X-RateLimit-*` trio tell the client where it stands.
//! - `X-Request-Id` ([`request_id`]) is the client's only when a trusted proxy sent a sane
//!   one; otherwise tollgate makes a new one, so a client cannot pick the id that correlates
//!   its requests in the logs.
//! - gRPC (contract §5c): [`is_grpc`] tells a gRPC call by its `content-type`, and
//!   [`grpc_trailers_only`] writes the fields of tollgate's own answers to one.

use std::net::IpAddr;

use http::header::{self, HeaderName, HeaderValue};
use http::HeaderMap;
use http_body::Body;

use crate::config::RateLimitHeaders;
use crate::limit::LimitOutcome;

/// As `HeaderName`s, so removing them needs no parsing of a string per request.
static HOP_BY_HOP: [HeaderName; 10] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    // h2c's settings (RFC 7540 3.2.1) travel with `Upgrade: h2c`, which is never forwarded.
    HeaderName::from_static("http2-settings"),
];

/// Where `Connection`, `TE`, `Trailer` and `Upgrade` are in [`HOP_BY_HOP`].
const CONNECTION_AT: usize = 0;
const TE_AT: usize = 5;
const TRAILER_AT: usize = 6;
const UPGRADE_AT: usize = 8;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
static FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// The comma-separated tokens of every `name` field, trimmed, empty ones skipped. Borrowed:
/// this runs several times per request and allocates nothing.
fn tokens<'a>(headers: &'a HeaderMap, name: &HeaderName) -> impl Iterator<Item = &'a str> {
    value_tokens(headers.get_all(name).iter())
}

/// The tokens of the given field values, as [`tokens`] splits them: [`raw_tokens`] of each,
/// empty ones skipped.
fn value_tokens<'a>(
    values: impl Iterator<Item = &'a HeaderValue>,
) -> impl Iterator<Item = &'a str> {
    values
        .flat_map(|v| raw_tokens(v.as_bytes()))
        .filter(|t| !t.is_empty())
        // Visible ASCII, which `raw_tokens` alone yields, is always UTF-8.
        .filter_map(|t| std::str::from_utf8(t).ok())
}

/// The comma-separated tokens of one field value, trimmed, as hyper reads them: a value that
/// is not visible ASCII (`HeaderValue::to_str` fails) has none. For tollgate's own HTTP/1.1
/// path, which reads fields hyper would have read (`http1::server`,
/// `http1::client`).
pub fn raw_tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    let visible = value
        .iter()
        .all(|&b| b == b'\t' || (b' '..0x7f).contains(&b));
    let parts = value.split(|&b| b == b',').filter(move |_| visible);
    parts.map(<[u8]>::trim_ascii)
}

/// Whether a field value lists `token` (any case), as hyper's `connection_has` reads it.
pub fn lists_token(value: &[u8], token: &str) -> bool {
    raw_tokens(value).any(|t| t.eq_ignore_ascii_case(token.as_bytes()))
}

/// The one upgrade tollgate forwards.
const WEBSOCKET: &str = "websocket";

/// Whether the request asks to upgrade to WebSocket (`Connection: upgrade` and `websocket`
/// among the `Upgrade` tokens). Any other upgrade (`h2c` above all: an HTTP/2 tunnel past
/// routing and every limit) is not one to forward: its request goes as a plain one.
pub fn wants_websocket(headers: &HeaderMap) -> bool {
    tokens(headers, &header::CONNECTION).any(|t| t.eq_ignore_ascii_case("upgrade"))
        && tokens(headers, &header::UPGRADE).any(|t| t.eq_ignore_ascii_case(WEBSOCKET))
}

/// Whether a `101` switches to WebSocket and to nothing else (one `Upgrade` token).
pub fn switches_to_websocket(headers: &HeaderMap) -> bool {
    let mut offered = tokens(headers, &header::UPGRADE);
    offered
        .next()
        .is_some_and(|t| t.eq_ignore_ascii_case(WEBSOCKET))
        && offered.next().is_none()
}

/// `Upgrade: websocket`, what goes upstream for a WebSocket request and back on its `101`.
pub fn websocket_upgrade() -> HeaderValue {
    HeaderValue::from_static(WEBSOCKET)
}

/// Whether the request says it accepts trailers (`TE: trailers`).
pub fn accepts_trailers(headers: &HeaderMap) -> bool {
    tokens(headers, &header::TE).any(|t| {
        t.split(';')
            .next()
            .is_some_and(|coding| coding.trim().eq_ignore_ascii_case("trailers"))
    })
}

/// A field name that [`FieldNames`] notes.
#[derive(Debug, PartialEq)]
enum Noted {
    /// Its place in [`HOP_BY_HOP`].
    HopByHop(usize),
    ForwardedFor,
    Forwarded,
    /// `X-Forwarded-Proto`, `X-Forwarded-Host` or `X-Real-IP`.
    OtherForwarding,
    /// A field tollgate sets on its responses: `X-Request-Id`, `RateLimit`, `RateLimit-Policy`
    /// or one of the `X-RateLimit-*` trio.
    Own,
}

/// What the lower-case field name `name` is to [`FieldNames`] (a test holds the places to
/// [`HOP_BY_HOP`]). A match on the text is a switch on its length and one comparison: looking
/// the name up in the list compared it with every entry of its length, and cost more than the
/// rest of the scan.
fn noted(name: &[u8]) -> Option<Noted> {
    Some(Noted::HopByHop(match name {
        b"connection" => CONNECTION_AT,
        b"keep-alive" => 1,
        b"proxy-connection" => 2,
        b"proxy-authenticate" => 3,
        b"proxy-authorization" => 4,
        b"te" => TE_AT,
        b"trailer" => TRAILER_AT,
        b"transfer-encoding" => 7,
        b"upgrade" => UPGRADE_AT,
        b"http2-settings" => 9,
        b"x-forwarded-for" => return Some(Noted::ForwardedFor),
        b"forwarded" => return Some(Noted::Forwarded),
        b"x-forwarded-proto" | b"x-forwarded-host" | b"x-real-ip" => {
            return Some(Noted::OtherForwarding)
        }
        b"x-request-id"
        | b"ratelimit"
        | b"ratelimit-policy"
        | b"x-ratelimit-limit"
        | b"x-ratelimit-remaining"
        | b"x-ratelimit-reset" => return Some(Noted::Own),
        _ => return None,
    }))
}

/// What the forwarder does with an upstream's response field, by its lower-case name, on its
/// way to the client: the rules of [`strip_hop_by_hop`] and [`remove_replaced`] for a
/// response, for a reader that writes the kept fields as lines instead of a map
/// (`http1::client`).
#[derive(Debug, PartialEq)]
pub enum ResponseField {
    /// Goes to the client as it is.
    Kept,
    /// Hop-by-hop (`Keep-Alive`, `Transfer-Encoding`, `Upgrade`, ...): removed.
    HopByHop,
    /// `Connection`: removed, with the fields it names.
    Connection,
    /// `TE`: removed, and put back as `TE: trailers` when it listed `trailers`.
    Te,
    /// `Trailer`: removed, and put back for a client that takes trailers.
    Trailer,
    /// One that tollgate sets itself: removed when tollgate sets it on this response.
    Own,
}

/// What [`ResponseField`] `lower` (a lower-case field name) is.
pub fn response_field(lower: &[u8]) -> ResponseField {
    match noted(lower) {
        Some(Noted::HopByHop(CONNECTION_AT)) => ResponseField::Connection,
        Some(Noted::HopByHop(TE_AT)) => ResponseField::Te,
        Some(Noted::HopByHop(TRAILER_AT)) => ResponseField::Trailer,
        Some(Noted::HopByHop(_)) => ResponseField::HopByHop,
        Some(Noted::Own) => ResponseField::Own,
        _ => ResponseField::Kept,
    }
}

/// What one pass over a message's field names found: which of [`HOP_BY_HOP`] it carries,
/// whether it carries the client's own `X-Forwarded-For` and `Forwarded`, and, when asked,
/// whether any name has `_`. A request's names are looked over once for everything that asks
/// (underscores, the WebSocket upgrade, trailers, hop-by-hop removal, [`add_forwarded`])
/// rather than once each, and asking about a field the message does not carry costs no
/// hashed lookup.
///
/// It describes the names as they were when scanned, and is taken before anything is added to
/// the message: a field it says is absent is absent; one it says is present may have been
/// removed since (by [`strip_hop_by_hop`], when `Connection` names it), and is then looked up
/// and found missing. [`drop_underscored`] removes only names that it notes none of.
#[derive(Debug, Clone, Copy)]
pub struct FieldNames {
    hop_by_hop: [bool; HOP_BY_HOP.len()],
    forwarded_for: bool,
    forwarded: bool,
    /// `X-Forwarded-Proto`, `X-Forwarded-Host` or `X-Real-IP` ([`FieldNames::forwarding`]).
    other_forwarding: bool,
    /// Any field tollgate sets on its responses ([`Noted::Own`]).
    own: bool,
    /// `None`: not looked for.
    underscored: Option<bool>,
}

impl FieldNames {
    /// A message without any of the noted fields.
    const NONE: FieldNames = FieldNames {
        hop_by_hop: [false; HOP_BY_HOP.len()],
        forwarded_for: false,
        forwarded: false,
        other_forwarding: false,
        own: false,
        underscored: Some(false),
    };

    /// The scan; `underscores`: look for names with `_` too (for [`drop_underscored`]; a
    /// byte-by-byte look at every name, which a response does not need).
    pub fn of(headers: &HeaderMap, underscores: bool) -> Self {
        let mut found = FieldNames {
            underscored: None,
            ..FieldNames::NONE
        };
        let mut underscored = false;
        for name in headers.keys() {
            let text = name.as_str();
            match noted(text.as_bytes()) {
                Some(Noted::HopByHop(i)) => found.hop_by_hop[i] = true,
                Some(Noted::ForwardedFor) => found.forwarded_for = true,
                Some(Noted::Forwarded) => found.forwarded = true,
                Some(Noted::OtherForwarding) => found.other_forwarding = true,
                Some(Noted::Own) => found.own = true,
                None if underscores => underscored |= is_underscored(text),
                None => {}
            }
        }
        found.underscored = underscores.then_some(underscored);
        found
    }

    /// Whether the message carries any field [`add_forwarded`] joins, keeps, replaces or
    /// removes: `X-Forwarded-For`, `-Proto`, `-Host`, `X-Real-IP` or `Forwarded`.
    fn forwarding(&self) -> bool {
        self.forwarded_for || self.forwarded || self.other_forwarding
    }

    /// [`wants_websocket`]: false at once without `Connection` and `Upgrade`.
    pub fn wants_websocket(&self, headers: &HeaderMap) -> bool {
        self.hop_by_hop[CONNECTION_AT] && self.hop_by_hop[UPGRADE_AT] && wants_websocket(headers)
    }

    /// [`accepts_trailers`]: false at once without `TE`.
    pub fn accepts_trailers(&self, headers: &HeaderMap) -> bool {
        self.hop_by_hop[TE_AT] && accepts_trailers(headers)
    }

    /// The `Trailer` announcement for the message's next HTTP/1.1 hop, taken before
    /// [`strip_hop_by_hop`] removes it: the trailer fields the message announces, as one
    /// value, when `body` can still carry trailers there; else None.
    ///
    /// `Trailer` is hop-by-hop, but hyper's HTTP/1.1 encoder (and `http1::server`'s) sends only
    /// the trailer fields it announces, so the forwarder puts it back for a body whose
    /// trailers pass through. Only a chunked body carries trailers (RFC 9112 7.1.2), and an
    /// encoder chunks only a body that has not ended and whose length it does not know: any
    /// other (a request without a body, a body sent with its length, the answer to a HEAD)
    /// ends without trailers, and its `Trailer` would be a hop-by-hop field passed on with
    /// nothing to announce. Every `Trailer` line counts (several are joined with ", ", as a
    /// list field may be).
    pub fn trailer(&self, headers: &HeaderMap, body: &impl Body) -> Option<HeaderValue> {
        if !self.hop_by_hop[TRAILER_AT] || !may_carry_trailers(body) {
            return None;
        }
        let mut lines = headers.get_all(header::TRAILER).iter();
        let first = lines.next()?;
        let Some(second) = lines.next() else {
            return Some(first.clone());
        };
        let mut joined = first.as_bytes().to_vec();
        for line in std::iter::once(second).chain(lines) {
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(line.as_bytes());
        }
        // Joined from valid values with a valid separator: never refused.
        HeaderValue::from_bytes(&joined).ok()
    }
}

/// Whether `body` may end in trailers on an HTTP/1.1 hop: it has not ended, and its length
/// is not known, so the encoder chunks it ([`FieldNames::trailer`]).
fn may_carry_trailers(body: &impl Body) -> bool {
    !body.is_end_stream() && body.size_hint().exact().is_none()
}

/// Whether a `Connection` value is one option that names no header of the message
/// (`keep-alive` or `close`): nearly every value seen, recognised without tokenising.
pub fn is_plain_connection_option(value: &[u8]) -> bool {
    value.eq_ignore_ascii_case(b"keep-alive") || value.eq_ignore_ascii_case(b"close")
}

/// The headers that the message's `Connection` fields name, except options that are no
/// header of the message (`close`) or that the fixed list removes anyway (`keep-alive`,
/// `upgrade`, ...). Those are nearly every token seen, and they are recognised as text
/// before any parsing.
fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    let values = headers.get_all(header::CONNECTION).iter();
    value_tokens(values.filter(|v| !is_plain_connection_option(v.as_bytes())))
        .filter(|t| {
            !t.eq_ignore_ascii_case("close")
                && !HOP_BY_HOP
                    .iter()
                    .any(|h| t.eq_ignore_ascii_case(h.as_str()))
        })
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect()
}

/// Removes every hop-by-hop header. Keeps `TE: trailers` when the sender offered it. `names`
/// is what [`FieldNames::of`] found in `headers`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, names: &FieldNames) {
    // The scan found which of the fixed list are present; most messages carry none, or only
    // `Connection`, and a hashed removal per absent name would cost more than the rest of
    // this function.
    let present = names.hop_by_hop;
    if !present.contains(&true) {
        return;
    }
    let wants_trailers = present[TE_AT] && accepts_trailers(headers);
    let named = if present[CONNECTION_AT] {
        connection_named(headers)
    } else {
        Vec::new()
    };
    for name in named {
        headers.remove(name);
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, here)| *here) {
        headers.remove(name);
    }
    if wants_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// What the upstream learns about the client.
#[derive(Clone, Copy)]
pub struct ForwardedFor<'a> {
    /// The TCP peer's address as text, made once per connection ([`peer_value`]).
    pub peer: &'a HeaderValue,
    /// Whether the peer is a trusted proxy whose own `X-Forwarded-*` are believed.
    pub peer_trusted: bool,
    /// The client address of contract §4 (what the limiter keys on) as text, for `X-Real-IP`.
    pub client: &'a HeaderValue,
    /// `http` or `https`: how the client reached tollgate.
    pub proto: &'static str,
    /// The authority the client asked for, as a field value
    /// ([`crate::normalise::Authority::value`]); `None` for an HTTP/1.0 request that named no
    /// host.
    pub host: Option<&'a HeaderValue>,
}

/// The peer's address as an `X-Forwarded-For` entry. A connection's peer never changes, so
/// this is made once per connection rather than formatted and validated per request.
pub fn peer_value(peer: IpAddr) -> HeaderValue {
    let text = crate::key::address_text(crate::key::canonical(peer));
    // An address's text is digits, dots, colons and hex letters: always a valid value.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

/// Appends the peer to `X-Forwarded-For`; sets `X-Forwarded-Proto` and `X-Forwarded-Host`,
/// keeping the client's own values only when the peer is trusted; sets `X-Real-IP` to the
/// client address whoever the peer is (it is tollgate's own conclusion, trusted proxies
/// included); removes `Forwarded` unless the peer is trusted. `names`: [`FieldNames::of`] the
/// request, which says when there is no client's own `X-Forwarded-For` or `Forwarded` to
/// look up.
pub fn add_forwarded(headers: &mut HeaderMap, fwd: &ForwardedFor<'_>, names: &FieldNames) {
    let previous: Vec<&str> = if names.forwarded_for {
        headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .collect()
    } else {
        Vec::new()
    };
    let value = if previous.is_empty() {
        Some(fwd.peer.clone())
    } else {
        let mut joined = previous.join(", ");
        joined.push_str(", ");
        joined.push_str(fwd.peer.to_str().unwrap_or("unknown"));
        HeaderValue::from_str(&joined).ok()
    };
    if let Some(value) = value {
        headers.insert(X_FORWARDED_FOR.clone(), value);
    }
    if !(fwd.peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(
            X_FORWARDED_PROTO.clone(),
            HeaderValue::from_static(fwd.proto),
        );
    }
    if !(fwd.peer_trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        match fwd.host {
            Some(host) => {
                headers.insert(X_FORWARDED_HOST.clone(), host.clone());
            }
            None => {
                headers.remove(&X_FORWARDED_HOST);
            }
        }
    }
    // `insert` replaces every field of the name: a client cannot add a second copy.
    headers.insert(X_REAL_IP.clone(), fwd.client.clone());
    if !fwd.peer_trusted && names.forwarded {
        headers.remove(&FORWARDED);
    }
}

/// What tollgate adds to a forwarded request where the client sent nothing to replace: the
/// `X-Request-Id` it made for a request that carried none, and the fields of [`add_forwarded`]
/// for a request that carried none of those. They go after the request's own fields, in the
/// order the map would have had them: tollgate's own HTTP/1.1 client writes them straight into
/// the head ([`Added::each_field`]), hyper's clients get them in the map ([`Added::move_into`]). The
/// usual request, on tollgate's own client, is then sent without five hashed inserts into its
/// map (about 1,500 instructions).
#[derive(Default)]
pub struct Added<'a> {
    request_id: Option<RequestId>,
    forwarded: Option<ForwardedFor<'a>>,
}

impl<'a> Added<'a> {
    /// `request_id`: the id [`request_id`] made and did not put in the map.
    pub fn new(request_id: Option<RequestId>) -> Self {
        Added {
            request_id,
            forwarded: None,
        }
    }

    /// [`add_forwarded`]: kept for later when `names` (the scan of `headers`) found none of the
    /// fields it reads or replaces, so that the map holds nothing it would change; else done in
    /// the map now.
    pub fn forwarding(
        &mut self,
        headers: &mut HeaderMap,
        fwd: ForwardedFor<'a>,
        names: &FieldNames,
    ) {
        if names.forwarding() {
            headers.reserve(4);
            add_forwarded(headers, &fwd, names);
        } else {
            self.forwarded = Some(fwd);
        }
    }

    /// Puts what is still kept into `headers` (for hyper's clients); afterwards nothing is
    /// kept, so a request that goes on to another origin does not get the fields twice.
    pub fn move_into(&mut self, headers: &mut HeaderMap) {
        if self.request_id.is_none() && self.forwarded.is_none() {
            return;
        }
        headers.reserve(5);
        if let Some(id) = self.request_id.take() {
            headers.insert(X_REQUEST_ID.clone(), id.to_value());
        }
        if let Some(fwd) = self.forwarded.take() {
            // The scan found none of the client's own: nothing to join, keep or remove.
            add_forwarded(headers, &fwd, &FieldNames::NONE);
        }
    }

    /// Hands each field that is kept to `field` (name and value), in the order
    /// [`Added::move_into`] puts them into a map, for tollgate's own client to write as field
    /// lines (`http1::client`).
    pub fn each_field(&self, mut field: impl FnMut(&HeaderName, &[u8])) {
        if let Some(id) = &self.request_id {
            field(&X_REQUEST_ID, id.as_bytes());
        }
        if let Some(fwd) = &self.forwarded {
            field(&X_FORWARDED_FOR, fwd.peer.as_bytes());
            field(&X_FORWARDED_PROTO, fwd.proto.as_bytes());
            if let Some(host) = fwd.host {
                field(&X_FORWARDED_HOST, host.as_bytes());
            }
            field(&X_REAL_IP, fwd.client.as_bytes());
        }
    }
}

/// Whether a field name has `_`, which CGI and WSGI read as `-` (nginx's
/// `underscores_in_headers`): the one test of the rule, for the scan and the removal.
fn is_underscored(name: &str) -> bool {
    name.as_bytes().contains(&b'_')
}

/// Removes every field whose name contains `_` (nginx's `underscores_in_headers off`). The
/// scan (`names`, of `headers`, made with `underscores`) finds none in nearly every request;
/// only then are names collected.
pub fn drop_underscored(headers: &mut HeaderMap, names: &FieldNames) {
    if names.underscored == Some(false) {
        return;
    }
    let names: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_underscored(n.as_str()))
        .cloned()
        .collect();
    for name in names {
        headers.remove(name);
    }
}

/// HTTP/2 may split `cookie` into several fields; HTTP/1.1 wants one, joined by `; `
/// (RFC 9113 8.2.3).
pub fn join_cookies(headers: &mut HeaderMap) {
    let values: Vec<HeaderValue> = headers.get_all(header::COOKIE).iter().cloned().collect();
    if values.len() < 2 {
        return;
    }
    let mut joined = Vec::new();
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    if let Ok(value) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, value);
    }
}

/// The `nth` member (from 0) of a rate-limit field: `"<policy>"<a><x><b><y>`, after a `, `
/// unless it is the first.
fn push_member(out: &mut Vec<u8>, nth: usize, policy: &str, a: &[u8], x: u64, b: &[u8], y: u64) {
    if nth > 0 {
        out.extend_from_slice(b", ");
    }
    out.push(b'"');
    out.extend_from_slice(policy.as_bytes());
    out.push(b'"');
    out.extend_from_slice(a);
    out.extend_from_slice(itoa::Buffer::new().format(x).as_bytes());
    out.extend_from_slice(b);
    out.extend_from_slice(itoa::Buffer::new().format(y).as_bytes());
}

/// The `RateLimit-Policy` value for the non-shadow outcomes (`"<policy>";q=<requests>;w=<window>,
/// ...`), or `None` when there is none. It depends only on configuration, so a route makes
/// it once for the case where all its limits apply (see [`add_rate_limit_headers`]).
pub fn rate_limit_policy_value(outcomes: &[LimitOutcome]) -> Option<HeaderValue> {
    let mut policy = Vec::with_capacity(64);
    for (nth, o) in outcomes.iter().filter(|o| !o.shadow).enumerate() {
        let (requests, window) = (u64::from(o.requests), u64::from(o.window_secs));
        push_member(
            &mut policy,
            nth,
            &o.policy,
            b";q=",
            requests,
            b";w=",
            window,
        );
    }
    if policy.is_empty() {
        return None;
    }
    HeaderValue::from_maybe_shared(bytes::Bytes::from(policy)).ok()
}

/// Adds the rate-limit fields for the applicable non-shadow limits. `policy`, when given, is
/// the ready `RateLimit-Policy` value for exactly these outcomes.
///
/// The values are written straight into byte buffers (integers with `itoa`): built with
/// `format!` and joined, these fields were a quarter of the limiter's cost per request.
pub fn add_rate_limit_headers(
    to: &mut impl ResponseFields,
    mode: RateLimitHeaders,
    outcomes: &[LimitOutcome],
    policy: Option<&HeaderValue>,
) {
    let visible = || outcomes.iter().filter(|o| !o.shadow);
    if visible().next().is_none() {
        return;
    }
    if matches!(mode, RateLimitHeaders::Draft | RateLimitHeaders::Both) {
        // `"<policy>";q=<requests>;w=<window>, ...` and `"<policy>";r=<left>;t=<reset>, ...`
        // The route's ready value is only borrowed: as lines it is copied, not shared.
        let made = match policy {
            Some(_) => None,
            None => rate_limit_policy_value(outcomes),
        };
        if let Some(policy) = policy.or(made.as_ref()) {
            to.value(&RATELIMIT_POLICY, policy);
        }
        to.written(&RATELIMIT, Indexing::Never, |state| {
            let mut valid = true;
            for (nth, o) in visible().enumerate() {
                let (left, reset) = (u64::from(o.remaining()), o.reset_secs);
                valid &= is_field_text(&o.policy);
                push_member(state, nth, &o.policy, b";r=", left, b";t=", reset);
            }
            valid
        });
    }
    if matches!(mode, RateLimitHeaders::Legacy | RateLimitHeaders::Both) {
        // The most restrictive: fewest requests left, then the longest wait.
        if let Some(o) = visible().min_by_key(|o| (o.remaining(), std::cmp::Reverse(o.reset_secs)))
        {
            let number = |n: u64| {
                move |out: &mut Vec<u8>| {
                    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
                    true
                }
            };
            let (limit, left) = (u64::from(o.requests), u64::from(o.remaining()));
            to.written(&X_RATELIMIT_LIMIT, Indexing::Allowed, number(limit));
            to.written(&X_RATELIMIT_REMAINING, Indexing::Never, number(left));
            to.written(&X_RATELIMIT_RESET, Indexing::Never, number(o.reset_secs));
        }
    }
}

/// Removes from an upstream's response the fields tollgate is about to set on it, for a
/// response whose scan (`FieldNames::own`) found some: `X-Request-Id` (always set), and the
/// rate-limit fields [`add_rate_limit_headers`] sets for these `outcomes` in this `mode`. Then
/// what tollgate sets is added after the upstream's fields, the same whether it goes into the
/// map or onto the wire ([`ResponseFields`]).
pub fn remove_replaced(
    headers: &mut HeaderMap,
    names: &FieldNames,
    mode: RateLimitHeaders,
    outcomes: &[LimitOutcome],
) {
    if !names.own {
        return;
    }
    headers.remove(&X_REQUEST_ID);
    if !outcomes.iter().any(|o| !o.shadow) {
        return;
    }
    if matches!(mode, RateLimitHeaders::Draft | RateLimitHeaders::Both) {
        headers.remove(&RATELIMIT_POLICY);
        headers.remove(&RATELIMIT);
    }
    if matches!(mode, RateLimitHeaders::Legacy | RateLimitHeaders::Both) {
        headers.remove(&X_RATELIMIT_LIMIT);
        headers.remove(&X_RATELIMIT_REMAINING);
        headers.remove(&X_RATELIMIT_RESET);
    }
}

/// Where the fields tollgate sets on a response go (`X-Request-Id` and the rate-limit fields):
/// into its map (this module's implementation), which hyper's servers encode (HTTP/2 honours
/// their never-indexed mark), or, for tollgate's own HTTP/1.1 server, straight onto the wire as
/// field lines written after the map's fields (`http1::lines`), where hyper's encoder puts
/// fields inserted into the map last. The map holds none of their names when they are set
/// ([`remove_replaced`]), so both give the same head.
pub trait ResponseFields {
    /// Sets `X-Request-Id` to `id`.
    fn request_id(&mut self, id: &RequestId);

    /// Sets `name` to `value`.
    fn value(&mut self, name: &HeaderName, value: &HeaderValue);

    /// Sets `name` to the value `write` writes, unless `write` says that what it took from
    /// outside tollgate's own digits and punctuation (a policy name) is not valid field text
    /// ([`is_field_text`]): then the field is left out rather than sent broken. Only that
    /// part is checked, rather than every byte of the value: about 150 instructions a
    /// request.
    fn written(
        &mut self,
        name: &HeaderName,
        indexing: Indexing,
        write: impl FnOnce(&mut Vec<u8>) -> bool,
    );
}

impl ResponseFields for HeaderMap {
    /// As a shared value, marked never indexed.
    fn request_id(&mut self, id: &RequestId) {
        self.insert(X_REQUEST_ID.clone(), id.to_value());
    }

    /// Shared with the map.
    fn value(&mut self, name: &HeaderName, value: &HeaderValue) {
        self.insert(name.clone(), value.clone());
    }

    fn written(
        &mut self,
        name: &HeaderName,
        indexing: Indexing,
        write: impl FnOnce(&mut Vec<u8>) -> bool,
    ) {
        let mut value = Vec::with_capacity(64);
        if write(&mut value) {
            insert(self, name, value, indexing);
        }
    }
}

/// Whether `text` may be part of a field value, by `HeaderValue`'s own rule (visible ASCII,
/// space, tab and obs-text), so that the lines and the map leave out the same values.
fn is_field_text(text: &str) -> bool {
    text.bytes().all(|b| (b >= 0x20 && b != 0x7f) || b == b'\t')
}

static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest request id kept from a trusted proxy.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Whether a request id may be kept: 1 to [`MAX_REQUEST_ID_LEN`] visible ASCII characters (no
/// space, no control, nothing a log line would have to escape).
pub fn is_valid_request_id(value: &HeaderValue) -> bool {
    let bytes = value.as_bytes();
    (1..=MAX_REQUEST_ID_LEN).contains(&bytes.len()) && bytes.iter().all(|b| b.is_ascii_graphic())
}

/// A request's id ([`request_id`]): one tollgate made, or the one a trusted peer sent.
///
/// A made id stays a plain array until a map needs it as a field value ([`RequestId::to_value`]:
/// only hyper's servers and clients do): the simple path writes it into the upstream's head,
/// the response's lines and the log line from the array, without the allocation, reference
/// count and free that a shared value cost every request.
#[derive(Clone, Debug)]
pub enum RequestId {
    /// 128 random bits as 32 lower-case hex digits ([`RequestId::random`]).
    Made([u8; 32]),
    /// A valid id a trusted peer sent ([`is_valid_request_id`]), marked never indexed.
    Kept(HeaderValue),
}

impl RequestId {
    /// A new id. The generator is rand's thread-local one, seeded from the OS and reseeded
    /// by itself: no system call per id.
    pub fn random() -> Self {
        let bits: u128 = rand::random();
        let mut text = [0u8; 32];
        // 16 bytes always fit 32 hex digits.
        let _ = hex::encode_to_slice(bits.to_be_bytes(), &mut text);
        RequestId::Made(text)
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            RequestId::Made(text) => text,
            RequestId::Kept(value) => value.as_bytes(),
        }
    }

    /// As text, for the log line: hex digits, or a kept id's visible ASCII.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).unwrap_or("")
    }

    /// As a field value for a map, marked never indexed.
    pub fn to_value(&self) -> HeaderValue {
        match self {
            // An owned array is one allocation whose clone is a reference count, where a
            // copied slice is promoted to a second, shared allocation at its first clone.
            RequestId::Made(text) => never_indexed(
                HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(*text))
                    .unwrap_or_else(|_| HeaderValue::from_static("0")),
            ),
            RequestId::Kept(value) => value.clone(),
        }
    }
}

/// `value`, marked to be sent as an HTTP/2 literal that is never indexed (RFC 7541 6.2.3).
///
/// For the values that change with every message: the request id, the requests left and the
/// reset time. Indexed, each such value is added to the connection's HPACK table only to push
/// out entries that could have been reused, and h2's encoder, before it adds one, compares it
/// with every earlier value under the same name still in the table: with a new request id per
/// response the table fills with ids, and each response's fields cost more. Never indexed, they
/// go out as literals, as nginx writes all of its response fields. HTTP/1.1 ignores the mark.
fn never_indexed(mut value: HeaderValue) -> HeaderValue {
    value.set_sensitive(true);
    value
}

/// The request's id: the one it carries when `peer_trusted` says the peer is a trusted proxy
/// and there is exactly one valid value, else a new one. `peer_trusted` is asked only when
/// there is a value to keep. A new id replaces every copy the client sent in `headers`; when
/// the client sent none, the map is left alone and the id comes back as the second value too,
/// to be added to the forwarded request ([`Added`]).
pub fn request_id(
    headers: &mut HeaderMap,
    peer_trusted: impl FnOnce() -> bool,
) -> (RequestId, Option<RequestId>) {
    let mut sent = headers.get_all(&X_REQUEST_ID).iter();
    match (sent.next(), sent.next()) {
        (Some(value), None) if is_valid_request_id(value) && peer_trusted() => {
            (RequestId::Kept(never_indexed(value.clone())), None)
        }
        (None, _) => {
            let id = RequestId::random();
            (id.clone(), Some(id))
        }
        _ => {
            let id = RequestId::random();
            headers.insert(X_REQUEST_ID.clone(), id.to_value());
            (id, None)
        }
    }
}

/// Whether the request is a gRPC call: `content-type` is `application/grpc` or starts with
/// `application/grpc+` (gRPC's HTTP/2 protocol), in any letter case. Asked only when tollgate
/// answers a request itself, or once before forwarding.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return false;
    };
    let value = value.as_bytes();
    value.len() >= GRPC.len()
        && value[..GRPC.len()].eq_ignore_ascii_case(GRPC)
        && matches!(value.get(GRPC.len()), None | Some(b'+'))
}

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
static GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// What gRPC's `grpc-message` must percent-encode: every byte outside printable ASCII, and `%`
/// itself.
const GRPC_MESSAGE_ESCAPED: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');

/// The fields of a trailers-only gRPC response (status and trailers in one header block, no
/// body): `content-type: application/grpc`, `grpc-status` and the percent-encoded
/// `grpc-message`. The HTTP status stays 200, as gRPC requires.
pub fn grpc_trailers_only(headers: &mut HeaderMap, status: &'static str, message: &str) {
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(GRPC_STATUS.clone(), HeaderValue::from_static(status));
    let encoded = percent_encoding::utf8_percent_encode(message, GRPC_MESSAGE_ESCAPED).to_string();
    insert(
        headers,
        &GRPC_MESSAGE,
        encoded.into_bytes(),
        Indexing::Allowed,
    );
}

/// `Retry-After` in whole seconds; for a gRPC call also `grpc-retry-pushback-ms`, the same
/// wait in milliseconds, which gRPC's retry policy honours in place of its own backoff.
pub fn set_retry_after(headers: &mut HeaderMap, secs: u64, grpc: bool) {
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    if grpc {
        headers.insert(
            GRPC_RETRY_PUSHBACK_MS.clone(),
            HeaderValue::from(secs.saturating_mul(1000)),
        );
    }
}

/// Whether a field's value may enter HTTP/2's HPACK table ([`never_indexed`]).
#[derive(Clone, Copy)]
pub enum Indexing {
    /// The same from response to response (a limit's size).
    Allowed,
    /// Changes with every response (the requests left, the reset time).
    Never,
}

/// Sets `name` unless `value` is not a valid field value (a policy name with a control
/// character, say): then the field is left out rather than sent broken.
fn insert(headers: &mut HeaderMap, name: &HeaderName, value: Vec<u8>, indexing: Indexing) {
    if let Ok(value) = HeaderValue::from_maybe_shared(bytes::Bytes::from(value)) {
        let value = match indexing {
            Indexing::Allowed => value,
            Indexing::Never => never_indexed(value),
        };
        headers.insert(name.clone(), value);
    }
}

/// What the tests of the rate-limit fields run through, in both their forms (here and in
/// `http1::lines`): outcome sets with shadow limits, several limits, none, and a policy name
/// no field value may carry; and every `rate_limit_headers` mode.
#[cfg(test)]
pub(crate) fn sample_outcome_sets() -> [Vec<LimitOutcome>; 5] {
    let outcome = |policy: &str, count: u32, shadow: bool| LimitOutcome {
        policy: policy.into(),
        requests: 10,
        window_secs: 60,
        count,
        cost: 1,
        added: true,
        reset_secs: 42,
        shadow,
        sliding: None,
    };
    [
        vec![outcome("per-ip", 3, false)],
        vec![outcome("per-ip", 3, false), outcome("per-key", 9, false)],
        vec![outcome("per-ip", 3, true)],
        vec![
            outcome("bad\u{1}name", 3, false),
            outcome("per-key", 12, true),
        ],
        vec![],
    ]
}

/// See [`sample_outcome_sets`].
#[cfg(test)]
pub(crate) const RATE_LIMIT_MODES: [RateLimitHeaders; 4] = [
    RateLimitHeaders::Draft,
    RateLimitHeaders::Legacy,
    RateLimitHeaders::Both,
    RateLimitHeaders::None,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_read_as_hyper_reads_them() {
        assert!(lists_token(b"keep-alive, Close", "close"));
        assert!(!lists_token(b"closed", "close"));
        // A value that is not visible ASCII lists nothing (`HeaderValue::to_str` fails).
        assert!(!lists_token(b"close, caf\xc3\xa9", "close"));
        let tokens: Vec<&[u8]> = raw_tokens(b" a ,\tb,, c").collect();
        assert_eq!(tokens, [&b"a"[..], b"b", b"", b"c"]);
    }

    /// [`strip_hop_by_hop`] after its scan, as the forwarder runs it.
    fn strip(h: &mut HeaderMap) {
        let names = FieldNames::of(h, false);
        strip_hop_by_hop(h, &names);
    }

    /// [`add_forwarded`] after its scan.
    fn forward(h: &mut HeaderMap, fwd: &ForwardedFor<'_>) {
        let names = FieldNames::of(h, false);
        add_forwarded(h, fwd, &names);
    }

    /// [`drop_underscored`] after its scan.
    fn drop(h: &mut HeaderMap) {
        let names = FieldNames::of(h, true);
        drop_underscored(h, &names);
    }

    /// A body as an HTTP/1.1 encoder sees it before sending: `None` for one whose length is
    /// unknown (chunked), `Some(n)` for one of `n` bytes (0: ended). It is never polled.
    struct Known(Option<u64>);

    impl Body for Known {
        type Data = bytes::Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
            std::task::Poll::Ready(None)
        }

        fn is_end_stream(&self) -> bool {
            self.0 == Some(0)
        }

        fn size_hint(&self) -> http_body::SizeHint {
            self.0
                .map_or_else(http_body::SizeHint::new, http_body::SizeHint::with_exact)
        }
    }

    const CHUNKED: Known = Known(None);

    /// Every `Trailer` line is part of the announcement: hyper's HTTP/1.1 encoder would drop
    /// the trailers of a second line that the forwarded message lacked.
    #[test]
    fn the_trailer_announcement_covers_every_trailer_line() {
        let mut h = HeaderMap::new();
        assert_eq!(FieldNames::of(&h, false).trailer(&h, &CHUNKED), None);
        h.append(header::TRAILER, HeaderValue::from_static("grpc-status"));
        let names = FieldNames::of(&h, false);
        assert_eq!(names.trailer(&h, &CHUNKED).unwrap(), "grpc-status");
        h.append(header::TRAILER, HeaderValue::from_static("grpc-message"));
        h.append(header::TRAILER, HeaderValue::from_static("x-checksum"));
        let names = FieldNames::of(&h, false);
        assert_eq!(
            names.trailer(&h, &CHUNKED).unwrap(),
            "grpc-status, grpc-message, x-checksum"
        );
    }

    /// Only a body that goes chunked can carry trailers on an HTTP/1.1 hop: with no body, or
    /// one of known length, `Trailer` is not announced (issue 47: a bodyless GET carried the
    /// client's `Trailer` to the upstream).
    #[test]
    fn the_trailer_announcement_goes_only_with_a_body_that_carries_trailers() {
        let mut h = HeaderMap::new();
        h.append(header::TRAILER, HeaderValue::from_static("x-checksum"));
        let names = FieldNames::of(&h, false);
        assert_eq!(names.trailer(&h, &CHUNKED).unwrap(), "x-checksum");
        assert_eq!(names.trailer(&h, &Known(Some(0))), None, "no body");
        assert_eq!(names.trailer(&h, &Known(Some(3))), None, "a known length");
    }

    /// The scan answers as the functions it saves a lookup for, and its answer survives
    /// `drop_underscored` (which runs between the scan and the forwarder's questions).
    #[test]
    fn the_one_scan_answers_like_the_lookups_it_saves() {
        let fields: [(&str, &str); 12] = [
            ("x-forwarded-for", "198.51.100.1"),
            ("forwarded", "for=198.51.100.1"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "b"),
            ("x-real-ip", "198.51.100.2"),
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
            ("te", "trailers;q=1"),
            ("trailer", "grpc-status"),
            ("x_api_key", "k"),
            ("host", "a"),
            ("transfer-encoding", "chunked"),
        ];
        // Every subset of the fields; `seen`: some subset wants the upgrade, takes trailers,
        // announces them.
        let mut seen = [false; 3];
        for mask in 0u32..1 << fields.len() {
            let mut h = HeaderMap::new();
            for (i, (name, value)) in fields.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    h.append(*name, value.parse().unwrap());
                }
            }
            let underscored = h.keys().any(|n| n.as_str().contains('_'));
            // A scan that did not look for underscores leaves `drop_underscored` to look.
            let mut unscanned = h.clone();
            drop_underscored(&mut unscanned, &FieldNames::of(&h, false));
            assert!(!unscanned.keys().any(|n| n.as_str().contains('_')), "{h:?}");
            let names = FieldNames::of(&h, true);
            assert_eq!(names.underscored, Some(underscored), "{h:?}");
            drop_underscored(&mut h, &names);
            assert_eq!(h, unscanned);
            assert_eq!(names.wants_websocket(&h), wants_websocket(&h), "{h:?}");
            assert_eq!(names.accepts_trailers(&h), accepts_trailers(&h), "{h:?}");
            assert_eq!(
                names.trailer(&h, &CHUNKED),
                h.get(header::TRAILER).cloned(),
                "{h:?}"
            );
            seen[0] |= names.wants_websocket(&h);
            seen[1] |= names.accepts_trailers(&h);
            seen[2] |= names.trailer(&h, &CHUNKED).is_some();
            for (i, hop) in HOP_BY_HOP.iter().enumerate() {
                assert_eq!(names.hop_by_hop[i], h.contains_key(hop), "{hop} in {h:?}");
            }
            assert_eq!(names.forwarded_for, h.contains_key(&X_FORWARDED_FOR));
            assert_eq!(names.forwarded, h.contains_key(&FORWARDED));
            let forwarding = [
                &X_FORWARDED_FOR,
                &X_FORWARDED_PROTO,
                &X_FORWARDED_HOST,
                &X_REAL_IP,
                &FORWARDED,
            ];
            let any = forwarding.iter().any(|name| h.contains_key(*name));
            assert_eq!(names.forwarding(), any, "{h:?}");
        }
        assert_eq!(
            seen, [true; 3],
            "each question was answered yes at least once"
        );
    }

    /// The rate-limit fields written as lines are the lines the map would be encoded to, in
    /// every mode, with shadow limits and with a policy name no field value may carry; and an
    /// upstream's own copies are removed exactly where they would have been replaced.
    #[test]
    fn the_fields_tollgate_sets_replace_the_upstreams() {
        let (sets, modes) = (sample_outcome_sets(), RATE_LIMIT_MODES);
        for outcomes in &sets {
            for mode in modes {
                let context = format!("{mode:?} {outcomes:?}");

                // An upstream that sent every such field: the ones tollgate sets in this mode
                // are gone before it sets them (a value it cannot send leaves neither), the
                // others pass.
                let mut upstream = HeaderMap::new();
                let own = [
                    &X_REQUEST_ID,
                    &RATELIMIT,
                    &RATELIMIT_POLICY,
                    &X_RATELIMIT_LIMIT,
                    &X_RATELIMIT_REMAINING,
                    &X_RATELIMIT_RESET,
                ];
                for name in own {
                    upstream.insert(name.clone(), HeaderValue::from_static("upstream"));
                }
                let names = FieldNames::of(&upstream, false);
                assert!(names.own, "{upstream:?}");
                remove_replaced(&mut upstream, &names, mode, outcomes);
                let visible = outcomes.iter().any(|o| !o.shadow);
                for name in own {
                    let draft = *name == RATELIMIT || *name == RATELIMIT_POLICY;
                    let set = *name == X_REQUEST_ID
                        || visible
                            && match mode {
                                RateLimitHeaders::Draft => draft,
                                RateLimitHeaders::Legacy => !draft,
                                RateLimitHeaders::Both => true,
                                RateLimitHeaders::None => false,
                            };
                    assert_eq!(upstream.contains_key(name), !set, "{name} {context}");
                }
            }
        }
    }

    #[test]
    fn request_ids_are_kept_only_from_trusted_peers_and_when_sane() {
        let with = |values: &[&str], trusted: bool| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(&X_REQUEST_ID, v.parse().unwrap());
            }
            let (id, to_add) = request_id(&mut h, || trusted);
            // Added only where the client sent none: then the map was left alone.
            assert_eq!(to_add.is_some(), values.is_empty(), "{values:?}");
            assert_eq!(h.contains_key(&X_REQUEST_ID), !values.is_empty());
            // What the upstream gets: one id, the one logged and answered.
            Added::new(to_add).move_into(&mut h);
            assert_eq!(h.get_all(&X_REQUEST_ID).iter().count(), 1);
            assert_eq!(h[&X_REQUEST_ID], id.as_bytes());
            id.as_str().to_string()
        };
        assert_eq!(with(&["trace-1"], true), "trace-1");
        for trusted in [false, true] {
            let id = with(&[], trusted);
            assert_eq!(id.len(), 32);
        }
        let max = "a".repeat(MAX_REQUEST_ID_LEN);
        assert_eq!(with(&[&max], true), max.as_str());
        for refused in [
            &["trace-1"][..],
            &["a".repeat(129).as_str()],
            &["a b"],
            &[""],
            &["a", "b"],
        ] {
            let trusted = refused != ["trace-1"];
            let id = with(refused, trusted);
            assert_eq!(id.len(), 32, "{refused:?}");
            assert!(id.as_bytes().iter().all(u8::is_ascii_hexdigit));
        }
        assert_ne!(
            RequestId::random().as_bytes(),
            RequestId::random().as_bytes()
        );
        // In a map, a made id is marked never indexed like a kept one.
        assert!(RequestId::random().to_value().is_sensitive());
    }

    #[test]
    fn grpc_is_told_by_its_content_type() {
        let with = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
            is_grpc(&h)
        };
        assert!(with("application/grpc"));
        assert!(with("application/grpc+proto"));
        assert!(with("Application/GRPC+json"));
        assert!(!with("application/grpcx"));
        assert!(!with("application/grpc-web"));
        assert!(!with("application/json"));
        assert!(!with("application/grp"));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        let mut h = HeaderMap::new();
        grpc_trailers_only(&mut h, "8", "100% über\nlimit");
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(h["content-type"], "application/grpc");
        // Spaces and other printable ASCII stay; `%`, non-ASCII and controls are encoded.
        assert_eq!(h["grpc-message"], "100%25 %C3%BCber%0Alimit");
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert("connection", "close, x-secret-hop".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("te", "trailers, deflate".parse().unwrap());
        h.insert("transfer-encoding", "chunked".parse().unwrap());
        h.insert("x-end-to-end", "yes".parse().unwrap());
        strip(&mut h);
        assert!(h.get("x-secret-hop").is_none());
        assert!(h.get("keep-alive").is_none());
        assert!(h.get("transfer-encoding").is_none());
        assert_eq!(h.get("te").unwrap(), "trailers");
        assert_eq!(h.get("x-end-to-end").unwrap(), "yes");
    }

    #[test]
    fn the_hop_by_hop_index_is_the_place_in_the_list() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(
                noted(name.as_str().as_bytes()),
                Some(Noted::HopByHop(i)),
                "{name}"
            );
        }
        assert_eq!(
            noted(X_FORWARDED_FOR.as_str().as_bytes()),
            Some(Noted::ForwardedFor)
        );
        assert_eq!(noted(FORWARDED.as_str().as_bytes()), Some(Noted::Forwarded));
        for name in [&X_FORWARDED_PROTO, &X_FORWARDED_HOST, &X_REAL_IP] {
            assert_eq!(
                noted(name.as_str().as_bytes()),
                Some(Noted::OtherForwarding),
                "{name}"
            );
        }
        for other in [
            "host",
            "x-connection",
            "connectio",
            "tes",
            "x-forwarded-prot",
            "x-real-ips",
            "",
        ] {
            assert_eq!(noted(other.as_bytes()), None, "{other}");
        }
    }

    #[test]
    fn connection_options_that_are_hop_by_hop_names_are_removed_once() {
        assert_eq!(HOP_BY_HOP[TE_AT], header::TE);
        let mut h = HeaderMap::new();
        h.insert("connection", "Keep-Alive, TE, x-named".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("x-named", "1".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, ["te", "x-kept"], "{h:?}");
        // Without `TE` there is nothing to keep.
        let mut h = HeaderMap::new();
        h.insert("connection", "keep-alive".parse().unwrap());
        strip(&mut h);
        assert!(h.is_empty(), "{h:?}");
    }

    #[test]
    fn strip_leaves_a_message_without_hop_by_hop_fields_alone() {
        let mut h = HeaderMap::new();
        h.insert("host", "a".parse().unwrap());
        h.insert("x-end-to-end", "yes".parse().unwrap());
        let before = h.clone();
        strip(&mut h);
        assert_eq!(h, before);
        // Upper-case tokens name headers too.
        h.insert("connection", "X-End-To-End, Upgrade".parse().unwrap());
        h.insert("upgrade", "websocket".parse().unwrap());
        assert!(wants_websocket(&h));
        strip(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("host"));
    }

    #[test]
    fn only_websocket_is_an_upgrade_to_forward() {
        let with = |connection: &str, upgrade: &str| {
            let mut h = HeaderMap::new();
            h.insert("connection", connection.parse().unwrap());
            h.insert("upgrade", upgrade.parse().unwrap());
            h
        };
        assert!(wants_websocket(&with("Upgrade", "WebSocket")));
        assert!(wants_websocket(&with(
            "keep-alive, upgrade",
            "h2c, websocket"
        )));
        assert!(!wants_websocket(&with("Upgrade, HTTP2-Settings", "h2c")));
        assert!(!wants_websocket(&with("keep-alive", "websocket")));
        assert!(!wants_websocket(&with("upgrade", "websocket/13x, tls/1.0")));

        assert!(switches_to_websocket(&with("upgrade", "websocket")));
        assert!(switches_to_websocket(&with("upgrade", "WebSocket")));
        assert!(!switches_to_websocket(&with("upgrade", "h2c")));
        assert!(!switches_to_websocket(&with("upgrade", "websocket, h2c")));
        assert!(!switches_to_websocket(&HeaderMap::new()));
    }

    #[test]
    fn http2_settings_is_hop_by_hop_even_when_connection_does_not_name_it() {
        let mut h = HeaderMap::new();
        h.insert("upgrade", "h2c".parse().unwrap());
        h.insert(
            "http2-settings",
            "AAMAAABkAARAAAAAAAIAAAAA".parse().unwrap(),
        );
        h.insert("x-end-to-end", "yes".parse().unwrap());
        strip(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["x-end-to-end"]);
    }

    #[test]
    fn forwarded_for_appends() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "198.51.100.1".parse().unwrap());
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        let peer = peer_value("192.0.2.9".parse().unwrap());
        forward(
            &mut h,
            &ForwardedFor {
                peer: &peer,
                peer_trusted: false,
                client: &peer,
                proto: "http",
                host: Some(&HeaderValue::from_static("api.example")),
            },
        );
        assert_eq!(h.get("x-forwarded-for").unwrap(), "198.51.100.1, 192.0.2.9");
        assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(h.get("x-forwarded-proto").unwrap(), "http");
        assert_eq!(h.get("x-forwarded-host").unwrap(), "api.example");
    }

    /// The scan is taken before hop-by-hop removal, which may remove an `X-Forwarded-For`
    /// that `Connection` names: the scan says present, the look-up finds nothing.
    #[test]
    fn a_forwarded_for_removed_after_the_scan_is_not_repeated() {
        let mut h = HeaderMap::new();
        h.insert("connection", "x-forwarded-for, forwarded".parse().unwrap());
        h.insert("x-forwarded-for", "6.6.6.6".parse().unwrap());
        h.insert("forwarded", "for=6.6.6.6".parse().unwrap());
        let names = FieldNames::of(&h, true);
        strip_hop_by_hop(&mut h, &names);
        let peer = peer_value("192.0.2.9".parse().unwrap());
        let fwd = ForwardedFor {
            peer: &peer,
            peer_trusted: false,
            client: &peer,
            proto: "http",
            host: None,
        };
        add_forwarded(&mut h, &fwd, &names);
        assert_eq!(
            h.get_all("x-forwarded-for").iter().collect::<Vec<_>>(),
            [&peer]
        );
        assert!(!h.contains_key("forwarded"));
    }

    #[test]
    fn forwarded_for_starts_with_the_peer_alone() {
        let mut h = HeaderMap::new();
        let peer = peer_value("::ffff:192.0.2.9".parse().unwrap());
        assert_eq!(peer, "192.0.2.9", "IPv4-mapped peers are written as IPv4");
        forward(
            &mut h,
            &ForwardedFor {
                peer: &peer,
                peer_trusted: true,
                client: &peer,
                proto: "https",
                host: Some(&HeaderValue::from_static("api.example")),
            },
        );
        assert_eq!(h.get("x-forwarded-for").unwrap(), "192.0.2.9");
        assert_eq!(h.get("x-forwarded-proto").unwrap(), "https");
        assert_eq!(peer_value("2001:db8::1".parse().unwrap()), "2001:db8::1");
    }

    #[test]
    fn real_ip_is_replaced_and_forwarded_passes_only_from_a_trusted_peer() {
        let peer = peer_value("10.0.0.1".parse().unwrap());
        let client = peer_value("198.51.100.7".parse().unwrap());
        for trusted in [false, true] {
            let mut h = HeaderMap::new();
            h.append("x-real-ip", HeaderValue::from_static("6.6.6.6"));
            h.append("x-real-ip", HeaderValue::from_static("7.7.7.7"));
            h.append("forwarded", HeaderValue::from_static("for=6.6.6.6"));
            h.append("x-forwarded-host", HeaderValue::from_static("spoofed"));
            forward(
                &mut h,
                &ForwardedFor {
                    peer: &peer,
                    peer_trusted: trusted,
                    client: &client,
                    proto: "http",
                    host: None,
                },
            );
            let real: Vec<_> = h.get_all("x-real-ip").iter().collect();
            assert_eq!(real, ["198.51.100.7"]);
            assert_eq!(h.contains_key("forwarded"), trusted);
            // No host to tell: a client's own X-Forwarded-Host passes only from a trusted peer.
            assert_eq!(h.contains_key("x-forwarded-host"), trusted);
        }
    }

    #[test]
    fn underscored_names_are_dropped() {
        let mut h = HeaderMap::new();
        h.append("x_api_key", HeaderValue::from_static("a"));
        h.append("x_api_key", HeaderValue::from_static("b"));
        h.append("x-custom_field", HeaderValue::from_static("c"));
        h.append("x-api-key", HeaderValue::from_static("d"));
        drop(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["x-api-key"]);
        let before = h.clone();
        drop(&mut h);
        assert_eq!(h, before);
    }
}
