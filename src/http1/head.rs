//! The start of an HTTP/1.1 head, found and placed without copying: shared by the framing
//! guard, tollgate's own server and its own client.

use super::rules::MAX_HEAD;

/// What the bytes at the start of a read hold, line by line (for the guard's
/// `FramingGuard::whole_head` and tollgate's own server, `http1::server`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadScan {
    /// A whole head of `end` bytes, every line ended by CRLF; `folded`: a line of it starts
    /// with whitespace (an obsolete fold).
    Whole { end: usize, folded: bool },
    /// No empty line within the first [`MAX_HEAD`] bytes (yet), and nothing irregular.
    Unfinished,
    /// Empty, a leading empty line, or a line ended by anything but CRLF: for the guard's
    /// byte-by-byte way to judge.
    Irregular,
}

/// Scans `bytes` for a head whose lines all end in CRLF. One plain pass: heads are short, and
/// the next CR or LF is found with memchr (vectorised) instead of a loop over every byte, which
/// cost about 900 instructions per request (callgrind, docs/performance.md).
pub fn scan_head(bytes: &[u8]) -> HeadScan {
    let window = &bytes[..bytes.len().min(MAX_HEAD)];
    if matches!(window.first(), None | Some(b'\r' | b'\n')) {
        return HeadScan::Irregular;
    }
    let mut folded = false;
    let mut line_start = 0;
    while let Some(offset) = memchr::memchr2(b'\r', b'\n', &window[line_start..]) {
        let i = line_start + offset;
        if window[i] == b'\n' {
            return HeadScan::Irregular;
        }
        match window.get(i + 1) {
            Some(b'\n') => {}
            // A CR at the end of what has come so far: its LF may be in the next read.
            None => return HeadScan::Unfinished,
            Some(_) => return HeadScan::Irregular,
        }
        if i == line_start {
            let end = i + 2;
            return HeadScan::Whole { end, folded };
        }
        line_start = i + 2;
        folded |= matches!(window.get(line_start), Some(b' ' | b'\t'));
    }
    HeadScan::Unfinished
}

/// Where `part` (a slice httparse gave of a head) lies in `head`; None when it does not lie in
/// it (httparse gives a static empty reason phrase, for one).
pub fn place_in(head: &[u8], part: &[u8]) -> Option<std::ops::Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(head.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= head.len()).then_some(start..end)
}
