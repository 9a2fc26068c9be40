//! A chunked response body, read as hyper's decoder reads one: chunk-size lines by the lenient
//! rule ([`rules::chunk_size`]), hyper's limits on extensions and trailers, every line ended by
//! CRLF.

use std::io;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http_body::Frame;

use super::Step;
use crate::http1::rules::{
    self, ChunkSizes, HYPER_MAX_CHUNK_LINE, HYPER_MAX_EXTENSIONS, HYPER_MAX_FIELDS, MAX_TRAILERS,
};

/// Where a chunked body's reader is.
pub(super) enum Chunked {
    /// A chunk-size line; the chunk extensions' bytes so far in this body.
    Size(u64),
    /// Data bytes still to come in this chunk, then CRLF (and the extensions so far).
    Data(u64, u64),
    /// The CRLF after a chunk's data.
    DataEnd(u64),
    /// After the last chunk: the trailer section.
    Trailers,
}

/// One step of a chunked body.
pub(super) fn chunk_step(chunk: &mut Chunked, buf: &mut BytesMut) -> io::Result<Step> {
    loop {
        match chunk {
            Chunked::Size(extensions) => {
                let Some(end) = memchr::memchr(b'\n', buf) else {
                    if buf.len() > HYPER_MAX_CHUNK_LINE {
                        return Err(invalid_body("chunk extensions over limit"));
                    }
                    return Ok(Step::Read);
                };
                let line = buf.split_to(end + 1);
                let (size, extension) = parse_chunk_line(&line)?;
                *extensions += extension;
                if *extensions >= HYPER_MAX_EXTENSIONS {
                    return Err(invalid_body("chunk extensions over limit"));
                }
                let extensions = *extensions;
                *chunk = if size == 0 {
                    Chunked::Trailers
                } else {
                    Chunked::Data(size, extensions)
                };
            }
            Chunked::Data(left, extensions) => {
                if buf.is_empty() {
                    return Ok(Step::Read);
                }
                let take = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
                *left -= take as u64;
                let data = buf.split_to(take).freeze();
                if *left == 0 {
                    *chunk = Chunked::DataEnd(*extensions);
                }
                return Ok(Step::Frame(Frame::data(data)));
            }
            Chunked::DataEnd(extensions) => {
                if buf.len() < 2 {
                    return Ok(Step::Read);
                }
                if &buf[..2] != b"\r\n" {
                    return Err(invalid_body("chunk data not followed by CRLF"));
                }
                buf.advance(2);
                *chunk = Chunked::Size(*extensions);
            }
            Chunked::Trailers => {
                if buf.starts_with(b"\r\n") {
                    buf.advance(2);
                    return Ok(Step::End);
                }
                let Some(end) = memchr::memmem::find(buf, b"\r\n\r\n") else {
                    if buf.len() > MAX_TRAILERS {
                        return Err(invalid_body("invalid trailer section"));
                    }
                    return Ok(Step::Read);
                };
                let section = buf.split_to(end + 4).freeze();
                // Every line ends in CRLF, as hyper's decoder insists (httparse alone would
                // take a bare LF).
                let bare = section
                    .windows(2)
                    .any(|w| (w[1] == b'\n' && w[0] != b'\r') || (w[0] == b'\r' && w[1] != b'\n'))
                    || section.first() == Some(&b'\n');
                if bare {
                    return Err(invalid_body("trailer line not ended by CRLF"));
                }
                let trailers = parse_trailers(&section)?;
                return Ok(Step::Last(Frame::trailers(trailers)));
            }
        }
    }
}

/// A chunk-size line (with its LF) as hyper's decoder reads one ([`rules::chunk_size`],
/// leniently): the size, and how many bytes of extensions it had.
fn parse_chunk_line(line: &[u8]) -> io::Result<(u64, u64)> {
    match rules::chunk_size(line, ChunkSizes::Lenient) {
        Ok(chunk) => Ok((chunk.size, chunk.extensions)),
        Err(rules::BadChunkLine::Overflow) => Err(invalid_body("chunk size overflows")),
        Err(_) => Err(invalid_body("invalid chunk-size line")),
    }
}

/// The trailer fields of a chunked body (the section with its final empty line).
fn parse_trailers(section: &Bytes) -> io::Result<HeaderMap> {
    let mut slots = [httparse::EMPTY_HEADER; HYPER_MAX_FIELDS];
    let fields = match httparse::parse_headers(section, &mut slots) {
        Ok(httparse::Status::Complete((_, fields))) => fields,
        _ => return Err(invalid_body("invalid trailer section")),
    };
    let mut trailers = HeaderMap::with_capacity(fields.len());
    for field in fields.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| invalid_body("invalid trailer field name"))?;
        let value = HeaderValue::from_maybe_shared(section.slice_ref(field.value))
            .map_err(|_| invalid_body("invalid trailer field value"))?;
        trailers.append(name, value);
    }
    Ok(trailers)
}

pub(super) fn invalid_body(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}
