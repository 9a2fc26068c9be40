//! The HTTP/1.1 framing rules tollgate applies itself, each written once: the sizes it holds a
//! head, a field section or a chunk line to, how it reads `Content-Length`, `Transfer-Encoding`
//! and a chunk-size line.
//!
//! Two readers read the same syntax on purpose with different leniency, and where they differ
//! the two variants stand side by side here:
//!
//! - **strict**, for what a client sends: the framing guard ([`super::guard`]) refuses the
//!   connection at anything two parsers could read two ways (request smuggling), and tollgate's
//!   own server ([`super::server`]) takes only heads the guard lets through. A `Content-Length`
//!   is plain digits without a leading zero and given once; a `Transfer-Encoding` is exactly
//!   `chunked`; a chunk size is at most 16 hex digits.
//! - **lenient**, for what an upstream answers: tollgate's own client ([`super::client`]) reads
//!   a response exactly as hyper's client reads it, neither more nor less leniently (the
//!   `upstream_response` fuzz target holds it to hyper's client), because refusing what hyper
//!   reads would turn a working backend into 502s: equal lengths may repeat or be listed, the
//!   last coding of the last `Transfer-Encoding` decides, a chunk size may have any number of
//!   leading zeros.
//!
//! Where a rule has one form it serves both: [`MAX_TRAILERS`], and the response length that
//! goes on to a client ([`settle_response_length`]), whichever client read the response.

use http::header::{self, HeaderValue};
use http::HeaderMap;

/// Largest request head the guard accepts (request line and fields), like nginx's default of
/// four 8k buffers, doubled: past it, 431.
pub const MAX_HEAD: usize = 64 * 1024;
/// Longest request target accepted (414), as nginx's default `large_client_header_buffers`
/// line. The proxy holds HTTP/2's `:path` to the same bound.
pub const MAX_TARGET: usize = 8 * 1024;
/// Most fields in a request head the guard parses; hyper's own limit is lower
/// ([`HYPER_MAX_FIELDS`]), and a head past that is hyper's to answer (431).
pub const GUARD_MAX_FIELDS: usize = 128;
/// hyper's limit on the fields of a head (request or response) and of a trailer section: the
/// most tollgate's own server takes in a request (a head with more is hyper's, which answers
/// 431) and its own client in a response (an error, as in hyper's client).
pub const HYPER_MAX_FIELDS: usize = 100;
/// The largest request head tollgate's own server waits for; a larger one (rare) is hyper's,
/// under the guard's own bound ([`MAX_HEAD`]).
pub const SIMPLE_MAX_HEAD: usize = 16 * 1024;
/// hyper's client's read buffer limit: a response head larger than this is an error.
pub const HYPER_MAX_RESPONSE_HEAD: usize = 8192 + 4096 * 100;
/// Largest chunk-size line (size and extensions) the guard holds back.
pub const GUARD_MAX_CHUNK_LINE: usize = 4096;
/// hyper's limit on a chunked body's extensions, counted over the whole body.
pub const HYPER_MAX_EXTENSIONS: u64 = 16 * 1024;
/// A chunk-size line of a response still without its LF past this is refused: its extensions
/// alone would be over [`HYPER_MAX_EXTENSIONS`].
pub const HYPER_MAX_CHUNK_LINE: usize = HYPER_MAX_EXTENSIONS as usize + 1024;
/// Largest trailer section, in the guard and in the client (hyper's limit).
pub const MAX_TRAILERS: usize = 16 * 1024;
/// hyper's largest body length (`DecodedLength::MAX`): two values above are its own markers.
pub const HYPER_MAX_LENGTH: u64 = u64::MAX - 2;

/// `Content-Length`, strict: a length as a sender should write it, 1 to 19 digits (few enough
/// that they always fit in a `u64`) without a leading zero but for `0` itself. Nothing else:
/// no sign, no list, no space (the guard trims the field's own whitespace first).
pub fn plain_length(value: &[u8]) -> Option<u64> {
    match value {
        [] | [b'0', _, ..] => None,
        digits if digits.len() <= 19 => {
            let mut n: u64 = 0;
            for &b in digits {
                if !b.is_ascii_digit() {
                    return None;
                }
                n = n * 10 + u64::from(b - b'0');
            }
            Some(n)
        }
        _ => None,
    }
}

/// `Content-Length`, lenient: the body length that the `Content-Length` fields `values` give,
/// as hyper reads them (`content_length_parse_all`): every comma-separated part digits, all of
/// them the same number. None when there is no such field, or any part is not digits, or two
/// disagree.
pub fn content_length<'a>(values: impl Iterator<Item = &'a [u8]>) -> Option<u64> {
    let mut length = None;
    for part in values.flat_map(|v| v.split(|&b| b == b',')) {
        let part = part.trim_ascii();
        if part.is_empty() {
            return None;
        }
        // Digits folded straight into the number, overflow refused, as `u64::from_str`.
        let mut n: u64 = 0;
        for &b in part {
            if !b.is_ascii_digit() {
                return None;
            }
            n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
        }
        if length.is_some_and(|first| first != n) {
            return None;
        }
        length = Some(n);
    }
    length
}

/// An upstream response's length fields as they go on to the client, whichever client read
/// the response: re-stated, never passed on ambiguous. A `Content-Length` sent with a
/// `Transfer-Encoding` is removed (RFC 9112 6.3: the coding frames the body and overrides the
/// length, which a proxy must remove; the client gets the body re-framed as it actually
/// arrives, not cut at a length that did not frame it). A length repeated, listed (`2, 2`) or
/// written with leading zeros goes on as one field of plain digits (RFC 9110 8.6 lets a
/// recipient replace equal values with one; the clients that read the response refused values
/// that differ): a client must not see two lengths, and hyper's encoder would answer a HEAD so
/// framed with nothing at all. One that does not read as a length (only in an answer that has
/// no body, whose length nobody read) is removed. The same rule for a response whose fields go
/// on as lines is in the client (`client::head`, `AsLines::finish`).
pub fn settle_response_length(headers: &mut HeaderMap) {
    // The map of a response whose fields went as lines (`http1::client`).
    if headers.is_empty() {
        return;
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
        return;
    }
    // The usual single plain length is recognised before an entry is taken: taking one
    // reserves room for a field, which may grow the map.
    let mut found = headers.get_all(header::CONTENT_LENGTH).iter();
    match (found.next(), found.next()) {
        (None, _) => return,
        (Some(only), None) if plain_length(only.as_bytes()).is_some() => return,
        _ => {}
    }
    let header::Entry::Occupied(mut lengths) = headers.entry(header::CONTENT_LENGTH) else {
        return;
    };
    match content_length(lengths.iter().map(HeaderValue::as_bytes)) {
        Some(n) => {
            lengths.insert(HeaderValue::from(n));
        }
        None => {
            lengths.remove_entry_mult();
        }
    }
}

/// `Transfer-Encoding`, strict: the one coding a request may carry through the guard (RFC 9112
/// 6.1 and 7): exactly `chunked`, in any case, with the field's own whitespace around it.
pub fn is_exactly_chunked(value: &[u8]) -> bool {
    std::str::from_utf8(value).is_ok_and(|v| v.trim().eq_ignore_ascii_case("chunked"))
}

/// `Transfer-Encoding`, lenient: whether a response's last `Transfer-Encoding` field ends in
/// `chunked`, as hyper's client reads it (a value that is not visible ASCII,
/// `HeaderValue::to_str`, names no coding). A response whose last coding is another is read
/// until the connection closes.
pub fn ends_in_chunked(last: &[u8]) -> bool {
    let visible = last
        .iter()
        .all(|&b| (0x20..0x7f).contains(&b) || b == b'\t');
    let last = std::str::from_utf8(last)
        .ok()
        .filter(|_| visible)
        .and_then(|v| v.rsplit(',').next())
        .map(str::trim);
    last.is_some_and(|coding| coding.eq_ignore_ascii_case("chunked"))
}

/// How far a chunk-size line may stray from the shortest spelling of its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkSizes {
    /// The guard's: at most 16 hex digits (a chunk size never needs more), whatever their
    /// value.
    Strict,
    /// hyper's decoder's: any number of digits, leading zeros included, while the size fits
    /// in 64 bits.
    Lenient,
}

/// What a chunk-size line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSize {
    /// The chunk's data bytes (0: the last chunk).
    pub size: u64,
    /// How many bytes of chunk extensions the line had (hyper limits their sum over a body).
    pub extensions: u64,
}

/// Why a chunk-size line was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadChunkLine {
    /// It does not end in CRLF.
    NoCrlf,
    /// No hex digits, too many ([`ChunkSizes::Strict`]), or something else than whitespace
    /// and extensions (without CR) after them.
    Malformed,
    /// The size does not fit in 64 bits ([`ChunkSizes::Lenient`]).
    Overflow,
}

/// A chunk-size line, its LF included: hex digits, then optional spaces or tabs (RFC 9112 7.1:
/// whitespace may follow the size before an extension, never precede it; hyper refuses the
/// leading kind, so accepting it would make the two disagree), then optional `;` extensions
/// without CR, then CRLF.
pub fn chunk_size(line: &[u8], sizes: ChunkSizes) -> Result<ChunkSize, BadChunkLine> {
    let line = line.strip_suffix(b"\r\n").ok_or(BadChunkLine::NoCrlf)?;
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || (sizes == ChunkSizes::Strict && digits > 16) {
        return Err(BadChunkLine::Malformed);
    }
    let mut size: u64 = 0;
    for &b in &line[..digits] {
        let digit = char::from(b).to_digit(16).ok_or(BadChunkLine::Malformed)?;
        size = size
            .checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(digit)))
            .ok_or(BadChunkLine::Overflow)?;
    }
    let rest = &line[digits..];
    let spaces = rest
        .iter()
        .take_while(|&&b| b == b' ' || b == b'\t')
        .count();
    let extensions = match &rest[spaces..] {
        [] => 0,
        [b';', ext @ ..] if !ext.contains(&b'\r') => ext.len() as u64,
        _ => return Err(BadChunkLine::Malformed),
    };
    Ok(ChunkSize { size, extensions })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_length_is_digits_without_a_leading_zero() {
        for (value, plain) in [
            ("0", Some(0)),
            ("10", Some(10)),
            ("", None),
            ("01", None),
            ("00", None),
            ("1 ", None),
            ("+1", None),
            ("1,1", None),
            ("9999999999999999999", Some(9_999_999_999_999_999_999)),
            ("10000000000000000000", None),
        ] {
            assert_eq!(plain_length(value.as_bytes()), plain, "{value:?}");
        }
    }

    #[test]
    fn lengths_are_read_as_hyper_reads_them() {
        let length = |values: &[&'static str]| {
            let values: Vec<HeaderValue> =
                values.iter().map(|v| HeaderValue::from_static(v)).collect();
            content_length(values.iter().map(HeaderValue::as_bytes))
        };
        assert_eq!(length(&["12"]), Some(12));
        assert_eq!(length(&["12, 12"]), Some(12));
        assert_eq!(length(&["12", "12"]), Some(12));
        assert_eq!(length(&["012"]), Some(12));
        assert_eq!(length(&["12, 13"]), None);
        assert_eq!(length(&["18446744073709551615"]), Some(u64::MAX));
        assert_eq!(length(&["18446744073709551616"]), None);
        assert_eq!(length(&["+1"]), None);
        assert_eq!(length(&["1 2"]), None);
        assert_eq!(length(&["12", "13"]), None);
        assert_eq!(length(&["-1"]), None);
        assert_eq!(length(&[""]), None);
        assert_eq!(length(&[]), None);
    }

    #[test]
    fn a_response_length_goes_on_as_one_plain_field() {
        let settled = |fields: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in fields {
                map.append(*name, HeaderValue::from_static(value));
            }
            settle_response_length(&mut map);
            let lengths = map.get_all(header::CONTENT_LENGTH).iter();
            lengths
                .map(|v| v.to_str().unwrap_or("?").to_string())
                .collect::<Vec<_>>()
        };
        let cl = "content-length";
        assert_eq!(settled(&[(cl, "12")]), ["12"]);
        assert_eq!(settled(&[(cl, "0")]), ["0"]);
        assert_eq!(settled(&[(cl, "12"), (cl, "12")]), ["12"]);
        assert_eq!(settled(&[(cl, "12, 12")]), ["12"]);
        assert_eq!(settled(&[(cl, "012")]), ["12"]);
        assert_eq!(settled(&[(cl, "00")]), ["0"]);
        // Nothing read these as a length (an answer without a body): not passed on.
        assert_eq!(settled(&[(cl, "x")]), Vec::<String>::new());
        assert_eq!(settled(&[(cl, "1"), (cl, "2")]), Vec::<String>::new());
        // Past a u64 (found by the upstream_response fuzz target, in an answer to HEAD).
        assert_eq!(
            settled(&[(cl, "99999999999999999999")]),
            Vec::<String>::new()
        );
        let largest = "18446744073709551615";
        assert_eq!(settled(&[(cl, largest)]), [largest]);
        // Beside a transfer coding: removed (RFC 9112 6.3).
        let with_te = [(cl, "12"), ("transfer-encoding", "chunked")];
        assert_eq!(settled(&with_te), Vec::<String>::new());
        assert!(settled(&[("x-a", "1")]).is_empty());
    }

    #[test]
    fn transfer_codings_are_read_strictly_for_requests_and_as_hyper_for_responses() {
        for (value, exactly, ends) in [
            ("chunked", true, true),
            (" Chunked ", true, true),
            ("gzip, chunked", false, true),
            ("chunked, gzip", false, false),
            ("xchunked", false, false),
            ("\u{e9}, chunked", false, false),
        ] {
            assert_eq!(is_exactly_chunked(value.as_bytes()), exactly, "{value:?}");
            assert_eq!(ends_in_chunked(value.as_bytes()), ends, "{value:?}");
        }
    }

    #[test]
    fn chunk_sizes_are_strict_for_the_guard_and_lenient_for_responses() {
        use ChunkSizes::{Lenient, Strict};
        let both = |line: &str| {
            let read = |sizes| chunk_size(line.as_bytes(), sizes);
            (read(Strict), read(Lenient))
        };
        let size = |size, extensions| Ok(ChunkSize { size, extensions });
        assert_eq!(both("5\r\n"), (size(5, 0), size(5, 0)));
        assert_eq!(both("a;ext=1\r\n"), (size(10, 5), size(10, 5)));
        assert_eq!(both("3 \t;x\r\n"), (size(3, 1), size(3, 1)));
        assert_eq!(
            both("ffffffffffffffff\r\n"),
            (size(u64::MAX, 0), size(u64::MAX, 0))
        );
        // Seventeen digits: never needed, refused by the guard; hyper reads the value.
        let seventeen = "00000000000000003\r\n";
        assert_eq!(both(seventeen), (Err(BadChunkLine::Malformed), size(3, 0)));
        let over = both("1ffffffffffffffff\r\n");
        assert_eq!(
            over,
            (Err(BadChunkLine::Malformed), Err(BadChunkLine::Overflow))
        );
        for bad in [
            " 3\r\n",
            "3 x\r\n",
            "3;a\rb\r\n",
            "zz\r\n",
            "\r\n",
            "3\r\r\n",
        ] {
            let malformed = Err(BadChunkLine::Malformed);
            assert_eq!(both(bad), (malformed, malformed), "{bad:?}");
        }
        let bare = Err(BadChunkLine::NoCrlf);
        assert_eq!(both("3\n"), (bare, bare));
    }
}
