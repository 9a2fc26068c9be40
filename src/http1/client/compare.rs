//! The own client's reader held against the map and against hyper's client: for the
//! combinatorial unit test and the differential fuzz target (`upstream_response`).

use bytes::BytesMut;
use http::header::{self, HeaderMap};
use http::Response;

use super::head::parse_head;
use super::{body_step, Answer, Framing, Head, Step};
use crate::error::RequestError;
use crate::headers;
use crate::http1::lines::ResponseLines;
use crate::http1::rules;

/// Which way [`lines_against_the_map`] found a head to go.
#[derive(Debug, PartialEq)]
pub enum WentAs {
    /// As lines, which agree with what the map would have given.
    Lines,
    /// Through the map (the lines left untouched).
    Map,
    /// Refused both ways, with the same error.
    Refused,
    /// No response yet both ways: a 1xx, or a head not all there (the lines left untouched).
    NoResponse,
}

/// Reads the response head at the start of `wire` (the answer to a GET, or to a HEAD) both
/// ways a response can reach tollgate's own HTTP/1.1 server path, and says where they
/// disagree: as lines (`Answer::Lines`), and into the map, carried through the forwarder's
/// handling (`rules::settle_response_length`, `headers::strip_hop_by_hop`) and the server
/// encoder's `Content-Length` rules. The lines, when they carry the head, must hold exactly
/// the fields the encoder would have written from the map (in any order: RFC 9110 5.3), tell
/// it the same length and whether a `Date` came, and give the same framing and keep-alive; a
/// head they do not carry must leave them untouched; an error must be the same error. For the
/// combinatorial unit test and the differential fuzz target (`upstream_response`).
pub fn lines_against_the_map(wire: &[u8], head_only: bool) -> Result<WentAs, String> {
    let mut buf = BytesMut::from(wire);
    let map = parse_head(
        &mut buf,
        &mut Vec::new(),
        head_only,
        &mut Answer::Map { room: 0 },
    );
    let mut lines = ResponseLines::default();
    let mut answer = Answer::Lines {
        lines: &mut lines,
        keep_trailer: false,
    };
    let mut buf = BytesMut::from(wire);
    let read = parse_head(&mut buf, &mut Vec::new(), head_only, &mut answer);
    let (read, map) = match (read, map) {
        (Err(err), Err(expected)) => {
            let (err, expected) = (err.to_string(), expected.to_string());
            if err != expected || !lines.bytes.is_empty() {
                return Err(format!(
                    "lines refused with {err:?}, the map with {expected:?}"
                ));
            }
            return Ok(WentAs::Refused);
        }
        (
            Ok(Some(Head::Response {
                response,
                framing,
                keep_alive,
            })),
            Ok(Some(Head::Response {
                response: mapped,
                framing: map_framing,
                keep_alive: map_keep_alive,
            })),
        ) => (
            (response, framing, keep_alive),
            (mapped, map_framing, map_keep_alive),
        ),
        (Ok(None), Ok(None)) | (Ok(Some(Head::Informational)), Ok(Some(Head::Informational))) => {
            return match lines.bytes.is_empty() {
                true => Ok(WentAs::NoResponse),
                false => Err("lines written for a head that gives no response".into()),
            };
        }
        (read, map) => {
            let what = |head: &Result<Option<Head>, RequestError>| match head {
                Err(err) => format!("error {err}"),
                Ok(None) => "no head yet".into(),
                Ok(Some(Head::Informational)) => "a 1xx".into(),
                Ok(Some(Head::Response { .. })) => "a response".into(),
            };
            return Err(format!(
                "lines read {}, the map {}",
                what(&read),
                what(&map)
            ));
        }
    };
    let ((response, framing, keep_alive), (mapped, map_framing, map_keep_alive)) = (read, map);
    if framing_text(&framing) != framing_text(&map_framing) || keep_alive != map_keep_alive {
        return Err(format!(
            "lines framed {} (keep-alive {keep_alive}), the map {} (keep-alive {map_keep_alive})",
            framing_text(&framing),
            framing_text(&map_framing)
        ));
    }
    if !response.headers().is_empty() {
        return match lines.bytes.is_empty() {
            true => Ok(WentAs::Map),
            false => Err("a head that went through the map left lines behind".into()),
        };
    }
    // What the server's encoder writes from the map once the forwarder has handled it.
    let mut map = mapped.headers().clone();
    let names = headers::FieldNames::of(&map, false);
    rules::settle_response_length(&mut map);
    headers::strip_hop_by_hop(&mut map, &names);
    let (mut expected, mut length) = (Vec::new(), None);
    for (name, value) in &map {
        let line = [name.as_str().as_bytes(), b": ", value.as_bytes()].concat();
        if name == header::CONTENT_LENGTH {
            match map_framing {
                Framing::Length(0) if head_only => {}
                Framing::Length(n) if n > 0 && length.is_none() => length = Some(n),
                _ => continue,
            }
        }
        expected.push(line);
    }
    expected.sort();
    let mut written: Vec<Vec<u8>> = lines
        .bytes
        .split(|&b| b == b'\n')
        .filter(|line| !line.is_empty())
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line).to_vec())
        .collect();
    written.sort();
    let dated = expected.iter().any(|line| line.starts_with(b"date:"));
    if written != expected || lines.length != length || lines.date != dated {
        let text = |lines: &[Vec<u8>]| {
            let lines = lines
                .iter()
                .map(|l| String::from_utf8_lossy(l).into_owned());
            lines.collect::<Vec<_>>()
        };
        return Err(format!(
            "lines {:?} (length {:?}, date {}), the map {:?} (length {length:?}, date {dated})",
            text(&written),
            lines.length,
            lines.date,
            text(&expected)
        ));
    }
    Ok(WentAs::Lines)
}

/// `framing` as text, for comparing two reads of one head.
fn framing_text(framing: &Framing) -> String {
    match framing {
        Framing::Length(n) => format!("length {n}"),
        Framing::Chunked(_) => "chunked".into(),
        Framing::UntilClose => "until close".into(),
        Framing::Done => "done".into(),
        Framing::Failed(_) => "failed".into(),
    }
}

/// A whole response, as tollgate's own client reads it.
pub type ReadResponse = (Response<()>, Vec<u8>, Option<HeaderMap>);

/// How tollgate's own client reads `wire`, all an upstream sent on a connection before it
/// closed, as the answer to a GET (or a HEAD): the response with its body and trailers, or why
/// it failed. For the differential fuzz target (`fuzz/fuzz_targets/upstream_response.rs`),
/// which reads the same bytes with hyper's client.
pub fn read_response(wire: &[u8], head_request: bool) -> Result<ReadResponse, String> {
    let mut buf = BytesMut::from(wire);
    let mut fields = Vec::new();
    let (response, mut framing) = loop {
        match parse_head(
            &mut buf,
            &mut fields,
            head_request,
            &mut Answer::Map { room: 0 },
        )
        .map_err(|e| e.to_string())?
        {
            Some(Head::Informational) => continue,
            Some(Head::Response {
                response, framing, ..
            }) => break (response, framing),
            None => return Err("connection closed before message completed".into()),
        }
    };
    let (mut body, mut trailers) = (Vec::new(), None);
    loop {
        match body_step(&mut framing, &mut buf).map_err(|e| e.to_string())? {
            Step::Frame(frame) => {
                if let Ok(data) = frame.into_data() {
                    body.extend_from_slice(&data);
                }
            }
            Step::Last(frame) => {
                trailers = frame.into_trailers().ok();
                break;
            }
            Step::End => break,
            Step::Read if matches!(framing, Framing::UntilClose) => break,
            Step::Read => return Err("connection closed in the middle of a body".into()),
        }
    }
    Ok((response, body, trailers))
}
