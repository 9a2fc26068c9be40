//! The access log's line: what one finished request writes (docs/operations.md, "Logs").
//!
//! A connection worker writes the line itself, into its own block (`crate::access_log`), with
//! [`LineWriter`]: no `tracing` event, no field visitor, no `core::fmt` in the common case.
//! The bytes are exactly those tracing-subscriber's formats write for the event [`access`]
//! (its default text format, or its JSON format with the event's fields flattened, as
//! `TOLLGATE_LOG=json` installs it): `tests/it/log_format.rs` formats the same lines both ways
//! and compares them, so log parsers written for either format keep working.
//!
//! [`access`] is also how a server without an access log of its own (one embedded in another
//! program, or logging to a terminal, in colour) writes the line: through `tracing`, to
//! whatever subscriber is installed.

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The target of access-log lines.
pub const ACCESS_TARGET: &str = "tollgate::access";

/// One finished request, as the access log records it.
pub struct AccessLine<'a> {
    pub method: &'a http::Method,
    /// Without the query: queries can carry credentials.
    pub path: &'a str,
    pub route: &'a str,
    pub decision: &'a str,
    /// The policies that denied the request (written comma-separated; empty when none did).
    pub violated: &'a [Arc<str>],
    pub status: u16,
    /// How long the request took (logged in milliseconds, `duration_ms`): asked only when the
    /// line is written.
    pub elapsed: &'a dyn Fn() -> Duration,
    pub upstream: &'a str,
    pub grpc_status: Option<&'a str>,
    /// Visible ASCII by construction (kept ones are checked, new ones are hex).
    pub request_id: &'a str,
}

/// Writes the access-log line of one request as a `tracing` event (at `info`, target
/// [`ACCESS_TARGET`]). The fields that cost something to compute are computed only when the
/// line is written.
pub fn access(line: &AccessLine<'_>) {
    tracing::info!(
        target: ACCESS_TARGET,
        method = %line.method,
        path = line.path,
        route = line.route,
        decision = line.decision,
        policy = %Joined(line.violated),
        status = line.status,
        duration_ms = log_ms((line.elapsed)()),
        upstream = line.upstream,
        grpc_status = line.grpc_status,
        request_id = line.request_id,
    );
}

/// Names written comma-separated.
struct Joined<'a>(&'a [Arc<str>]);

impl std::fmt::Display for Joined<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, name) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(name)?;
        }
        Ok(())
    }
}

/// A duration for a log line: milliseconds, to the microsecond (`7.39`, `58.902`). The
/// `f64` of `as_secs_f64() * 1000.0` printed 17 digits (`58.901799999999994`); a whole
/// number of microseconds over 1000 prints as the shortest decimal that reads back the same.
pub fn log_ms(elapsed: Duration) -> f64 {
    let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
    micros as f64 / 1000.0
}

/// Which of tracing-subscriber's formats the line is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineFormat {
    /// The default text format (`Format<Full>`, no colours).
    Text,
    /// The JSON format, the event's fields flattened into the object (`TOLLGATE_LOG=json`).
    Json,
}

/// Writes access-log lines in one [`LineFormat`], and keeps the text of the current second of
/// their timestamps: of `2026-12-04T15:35:05.201634Z` only the microseconds change from one
/// line to the next, so the calendar is worked out once a second, not once a line.
pub struct LineWriter {
    format: LineFormat,
    /// The second `prefix` is the text of (since 1970), if any yet.
    second: Option<u64>,
    /// `YYYY-MM-DDTHH:MM:SS.` of `second`.
    prefix: [u8; 20],
}

impl LineWriter {
    pub fn new(format: LineFormat) -> Self {
        LineWriter {
            format,
            second: None,
            prefix: [0; 20],
        }
    }

    /// Appends `line`, stamped `now`, to `out`, newline included.
    pub fn write(&mut self, out: &mut Vec<u8>, line: &AccessLine<'_>, now: SystemTime) {
        match self.format {
            LineFormat::Text => self.text(out, line, now),
            LineFormat::Json => self.json(out, line, now),
        }
    }

    /// The text format's line: `{time}  INFO tollgate::access: name=value ...`, values as
    /// `Debug` writes them (text quoted and escaped, numbers plain); `method` and `policy`
    /// are logged with `%`, so as `Display` writes them.
    fn text(&mut self, out: &mut Vec<u8>, line: &AccessLine<'_>, now: SystemTime) {
        self.timestamp(out, now);
        out.extend_from_slice(b"  INFO tollgate::access: method=");
        out.extend_from_slice(line.method.as_str().as_bytes());
        out.extend_from_slice(b" path=");
        text_str(out, line.path);
        out.extend_from_slice(b" route=");
        text_str(out, line.route);
        out.extend_from_slice(b" decision=");
        text_str(out, line.decision);
        out.extend_from_slice(b" policy=");
        for (i, name) in line.violated.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(name.as_bytes());
        }
        out.extend_from_slice(b" status=");
        out.extend_from_slice(itoa::Buffer::new().format(line.status).as_bytes());
        out.extend_from_slice(b" duration_ms=");
        write_ms(out, (line.elapsed)(), LineFormat::Text);
        out.extend_from_slice(b" upstream=");
        text_str(out, line.upstream);
        if let Some(grpc_status) = line.grpc_status {
            out.extend_from_slice(b" grpc_status=");
            text_str(out, grpc_status);
        }
        out.extend_from_slice(b" request_id=");
        text_str(out, line.request_id);
        out.push(b'\n');
    }

    /// The JSON format's line: timestamp, level, the fields in the event's order, target.
    fn json(&mut self, out: &mut Vec<u8>, line: &AccessLine<'_>, now: SystemTime) {
        out.extend_from_slice(b"{\"timestamp\":\"");
        self.timestamp(out, now);
        out.extend_from_slice(b"\",\"level\":\"INFO\",\"method\":");
        json_str(out, line.method.as_str());
        out.extend_from_slice(b",\"path\":");
        json_str(out, line.path);
        out.extend_from_slice(b",\"route\":");
        json_str(out, line.route);
        out.extend_from_slice(b",\"decision\":");
        json_str(out, line.decision);
        out.extend_from_slice(b",\"policy\":");
        if line.violated.iter().all(|name| json_plain(name)) {
            out.push(b'"');
            for (i, name) in line.violated.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(name.as_bytes());
            }
            out.push(b'"');
        } else {
            json_str(out, &Joined(line.violated).to_string());
        }
        out.extend_from_slice(b",\"status\":");
        out.extend_from_slice(itoa::Buffer::new().format(line.status).as_bytes());
        out.extend_from_slice(b",\"duration_ms\":");
        write_ms(out, (line.elapsed)(), LineFormat::Json);
        out.extend_from_slice(b",\"upstream\":");
        json_str(out, line.upstream);
        if let Some(grpc_status) = line.grpc_status {
            out.extend_from_slice(b",\"grpc_status\":");
            json_str(out, grpc_status);
        }
        out.extend_from_slice(b",\"request_id\":");
        json_str(out, line.request_id);
        out.extend_from_slice(b",\"target\":\"tollgate::access\"}\n");
    }

    /// `now` as tracing-subscriber's `SystemTime` timer writes it: UTC to the microsecond,
    /// `2026-12-04T15:35:05.201634Z`.
    fn timestamp(&mut self, out: &mut Vec<u8>, now: SystemTime) {
        let Ok(since) = now.duration_since(SystemTime::UNIX_EPOCH) else {
            return stock_time(out);
        };
        let second = since.as_secs();
        if self.second != Some(second) {
            let mut text = [0u8; 27];
            let Some(whole) = utc_micros(second, 0, &mut text) else {
                return stock_time(out);
            };
            self.prefix.copy_from_slice(&whole.as_bytes()[..20]);
            self.second = Some(second);
        }
        let mut micros = [0u8; 7];
        let mut value = since.subsec_micros();
        for place in micros[..6].iter_mut().rev() {
            *place = b'0' + (value % 10) as u8;
            value /= 10;
        }
        micros[6] = b'Z';
        out.extend_from_slice(&self.prefix);
        out.extend_from_slice(&micros);
    }
}

/// A clock before 1970 or after 9999: the stock timer's text for it.
fn stock_time(out: &mut Vec<u8>) {
    use tracing_subscriber::fmt::time::FormatTime;
    let mut text = String::new();
    let writer = &mut tracing_subscriber::fmt::format::Writer::new(&mut text);
    if tracing_subscriber::fmt::time::SystemTime
        .format_time(writer)
        .is_err()
    {
        text = "<unknown time>".into();
    }
    out.extend_from_slice(text.as_bytes());
}

/// `value` as `Debug` writes a `str`: quoted, with `"`, `\`, controls and some non-ASCII
/// escaped. Printable ASCII other than those two stays as it is, which is the common case.
fn text_str(out: &mut Vec<u8>, value: &str) {
    if none_special(value.as_bytes(), text_special) {
        out.push(b'"');
        out.extend_from_slice(value.as_bytes());
        out.push(b'"');
    } else {
        let _ = write!(out, "{value:?}");
    }
}

/// Whether serde_json writes `value` between quotes as it is: no control character, `"` or
/// `\` (anything else, non-ASCII included, it leaves alone).
fn json_plain(value: &str) -> bool {
    none_special(value.as_bytes(), json_special)
}

/// `value` as a JSON string, as serde_json writes it.
fn json_str(out: &mut Vec<u8>, value: &str) {
    if json_plain(value) {
        out.push(b'"');
        out.extend_from_slice(value.as_bytes());
        out.push(b'"');
    } else {
        let _ = serde_json::to_writer(&mut *out, value);
    }
}

// The checks for text that needs no escaping look at eight bytes at once (the fields are
// short: a byte at a time, or a vector loop's set-up, cost more than the rest of the field).
// Each is exact for the question "is any byte of `x` such": a borrow or carry between bytes
// happens only past a byte that already answers it (Hacker's Delight, 6-1; the bit hacks
// `haszero` and `hasless`).
const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Nonzero when a byte of `x` is below `n` (at most 128).
fn any_below(x: u64, n: u8) -> u64 {
    x.wrapping_sub(ONES * u64::from(n)) & !x & HIGHS
}

/// Nonzero when a byte of `x` is `b`.
fn any_equal(x: u64, b: u8) -> u64 {
    any_below(x ^ (ONES * u64::from(b)), 1)
}

/// Nonzero when a byte of `x` is one `Debug` escapes in a `str` or is not ASCII: a control,
/// DEL, `"`, `\`, or 0x80 and above.
fn text_special(x: u64) -> u64 {
    // A byte of 0x7F or more gets its high bit from the `+ 1` or has it already.
    let high = (x.wrapping_add(ONES) | x) & HIGHS;
    any_below(x, b' ') | high | any_equal(x, b'"') | any_equal(x, b'\\')
}

/// Nonzero when a byte of `x` is one serde_json escapes: a control, `"` or `\`.
fn json_special(x: u64) -> u64 {
    any_below(x, b' ') | any_equal(x, b'"') | any_equal(x, b'\\')
}

/// Whether `special` finds nothing in `value`, read as little-endian words of eight bytes.
/// Past the last whole word, the last eight bytes are read again (overlapping); a value
/// shorter than a word is read in two overlapping halves, the rest of the word spaces,
/// which neither check finds.
fn none_special(value: &[u8], special: fn(u64) -> u64) -> bool {
    let len = value.len();
    let word = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&value[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    let half = |at: usize| {
        let mut bytes = [0u8; 4];
        bytes.copy_from_slice(&value[at..at + 4]);
        u64::from(u32::from_le_bytes(bytes))
    };
    const SPACES: u64 = ONES * b' ' as u64;
    let found = match len {
        0 => 0,
        1 => special(u64::from(value[0]) | (SPACES << 8)),
        2 | 3 => {
            let pair = |at: usize| u64::from(u16::from_le_bytes([value[at], value[at + 1]]));
            special(pair(0) | (pair(len - 2) << 16) | (SPACES << 32))
        }
        4..=7 => special(half(0) | (half(len - 4) << 32)),
        _ => {
            let mut found = special(word(len - 8));
            for at in (0..len - 8).step_by(8) {
                found |= special(word(at));
            }
            found
        }
    };
    found == 0
}

/// The most microseconds [`write_ms`] writes itself: their milliseconds are below 1e12.
const EXACT_MICROS: u128 = 1_000_000_000_000_000;

/// `elapsed` as `Debug` (text) or serde_json (JSON) writes the `f64` [`log_ms`] makes of it:
/// the whole milliseconds, then `.0`, or the point and up to three digits without their
/// trailing zeros (`5.319`, `2.0`, `1.5`). Written from the integer, without the `f64`.
///
/// Why this is their text: both write the shortest decimal that reads back as the same
/// `f64`, without an exponent in this range. With `m` microseconds (below 2^53, so exact),
/// the `f64` is the one nearest to the decimal `m / 1000`, so that decimal reads back as it;
/// below 1e12 the spacing of `f64`s is under 0.001, so no other decimal of at most three
/// places reads back as it too. Longer durations (over 31 years) are left to the formatters.
fn write_ms(out: &mut Vec<u8>, elapsed: Duration, format: LineFormat) {
    let micros = elapsed.as_micros();
    let Some(micros) = u64::try_from(micros).ok().filter(|_| micros < EXACT_MICROS) else {
        let ms = log_ms(elapsed);
        let _ = match format {
            LineFormat::Text => write!(out, "{ms:?}"),
            LineFormat::Json => serde_json::to_writer(&mut *out, &ms).map_err(std::io::Error::from),
        };
        return;
    };
    let (whole, fraction) = (micros / 1000, micros % 1000);
    out.extend_from_slice(itoa::Buffer::new().format(whole).as_bytes());
    let digit = |d: u64| b'0' + (d % 10) as u8;
    let text = [
        b'.',
        digit(fraction / 100),
        digit(fraction / 10),
        digit(fraction),
    ];
    let keep = if fraction % 100 == 0 {
        2
    } else if fraction % 10 == 0 {
        3
    } else {
        4
    };
    out.extend_from_slice(&text[..keep]);
}

/// `secs` after 1970 and `micros` written as `YYYY-MM-DDTHH:MM:SS.ffffffZ` into `out`, or
/// `None` past the year 9999 (which the format cannot hold in four digits).
fn utc_micros(secs: u64, micros: u32, out: &mut [u8; 27]) -> Option<&str> {
    let days = secs / 86_400;
    let of_day = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    if year > 9999 {
        return None;
    }
    let digits = |out: &mut [u8], value: u64| {
        let mut value = value;
        for place in out.iter_mut().rev() {
            *place = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    digits(&mut out[0..4], year);
    out[4] = b'-';
    digits(&mut out[5..7], month);
    out[7] = b'-';
    digits(&mut out[8..10], day);
    out[10] = b'T';
    digits(&mut out[11..13], of_day / 3600);
    out[13] = b':';
    digits(&mut out[14..16], of_day / 60 % 60);
    out[16] = b':';
    digits(&mut out[17..19], of_day % 60);
    out[19] = b'.';
    digits(&mut out[20..26], u64::from(micros));
    out[26] = b'Z';
    std::str::from_utf8(out).ok()
}

/// The proleptic Gregorian date of a count of days since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, for days on or after the epoch): eras of 400 years, years starting in
/// March so that the leap day is the last of the year.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A duration as a line writes it, in both formats, against `Debug`'s and serde_json's
    /// text of the `f64` that [`log_ms`] makes of it (what the `tracing` event logs).
    #[test]
    fn durations_are_written_as_debug_and_serde_json_write_them() {
        let check = |elapsed: Duration| {
            let ms = log_ms(elapsed);
            for (format, want) in [
                (LineFormat::Text, format!("{ms:?}")),
                (LineFormat::Json, serde_json::to_string(&ms).expect("json")),
            ] {
                let mut ours = Vec::new();
                write_ms(&mut ours, elapsed, format);
                assert_eq!(String::from_utf8(ours), Ok(want), "{elapsed:?}");
            }
        };
        // Every microsecond up to 2 s, then every 997th up to 100 s (nanoseconds dropped).
        let sampled = (2_000_000u64.div_ceil(997) * 997..100_000_000).step_by(997);
        for micros in (0..2_000_000u64).chain(sampled) {
            check(Duration::from_nanos(micros * 1000 + micros % 1000));
        }
        // Large ones, on both sides of where the formatters take over, and the largest.
        let mut m: u64 = 1;
        while m < 1 << 62 {
            check(Duration::from_micros(m));
            check(Duration::from_micros(m + 999));
            m = m * 3 + 1;
        }
        for micros in [EXACT_MICROS - 1, EXACT_MICROS, EXACT_MICROS + 1] {
            check(Duration::from_micros(u64::try_from(micros).expect("fits")));
        }
        check(Duration::MAX);
    }

    /// The word-at-a-time checks answer as a byte-at-a-time check would: every byte value at
    /// every position of values of every length up to 20, among plain bytes.
    #[test]
    fn the_word_checks_find_exactly_the_special_bytes() {
        let text = |b: u8| !(b' '..=b'~').contains(&b) || b == b'"' || b == b'\\';
        let json = |b: u8| b < b' ' || b == b'"' || b == b'\\';
        for len in 0..=20 {
            let mut value = vec![b'a'; len];
            assert!(none_special(&value, text_special) && none_special(&value, json_special));
            for at in 0..len {
                for b in 0..=255u8 {
                    value[at] = b;
                    assert_eq!(
                        none_special(&value, text_special),
                        !text(b),
                        "{len} {at} {b}"
                    );
                    assert_eq!(
                        none_special(&value, json_special),
                        !json(b),
                        "{len} {at} {b}"
                    );
                    // Next to the largest and smallest plain bytes, which are nearest to a
                    // borrow or a carry.
                    for neighbour in [b' ', b'~', 0x7f, 0xff] {
                        if at + 1 < len {
                            value[at + 1] = neighbour;
                            let t = text(b) || text(neighbour);
                            let j = json(b) || json(neighbour);
                            assert_eq!(none_special(&value, text_special), !t);
                            assert_eq!(none_special(&value, json_special), !j);
                            value[at + 1] = b'a';
                        }
                    }
                }
                value[at] = b'a';
            }
        }
    }

    #[test]
    fn utc_micros_writes_the_calendar() {
        let cases = [
            (0, 0, "1970-01-01T00:00:00.000000Z"),
            (1_796_398_505, 201_634, "2026-12-04T15:35:05.201634Z"),
            // The leap days of a year divisible by 400, and the day after one that is not.
            (951_782_400, 999_999, "2000-02-29T00:00:00.999999Z"),
            (4_107_542_399, 1, "2100-02-28T23:59:59.000001Z"),
            (4_107_542_400, 0, "2100-03-01T00:00:00.000000Z"),
            (253_402_300_799, 0, "9999-12-31T23:59:59.000000Z"),
        ];
        for (secs, micros, text) in cases {
            assert_eq!(utc_micros(secs, micros, &mut [0; 27]), Some(text), "{secs}");
        }
        assert_eq!(utc_micros(253_402_300_800, 0, &mut [0; 27]), None);
    }

    /// The second kept from one line to the next is replaced when the clock moves on (or
    /// back), and only the microseconds are written anew.
    #[test]
    fn the_kept_second_follows_the_clock() {
        let mut writer = LineWriter::new(LineFormat::Text);
        let at = |secs: u64, micros: u32| {
            SystemTime::UNIX_EPOCH
                + Duration::from_secs(secs)
                + Duration::from_micros(micros.into())
        };
        let cases = [
            (1_796_398_505, 201_634),
            (1_796_398_505, 7),
            (1_796_398_506, 0),
            (1_796_398_505, 999_999),
            (4_107_542_399, 1),
            (4_107_542_400, 0),
        ];
        for (secs, micros) in cases {
            let mut ours = Vec::new();
            writer.timestamp(&mut ours, at(secs, micros));
            let mut whole = [0; 27];
            let want = utc_micros(secs, micros, &mut whole).expect("in range");
            assert_eq!(std::str::from_utf8(&ours), Ok(want));
        }
    }

    #[test]
    fn timestamps_agree_with_the_stock_timer() {
        use tracing_subscriber::fmt::format::Writer;
        use tracing_subscriber::fmt::time::FormatTime;
        let mut writer = LineWriter::new(LineFormat::Json);
        // Seconds may tick between the two readings: equal to the second, or taken again.
        let agree = (0..5).any(|_| {
            let mut stock = String::new();
            tracing_subscriber::fmt::time::SystemTime
                .format_time(&mut Writer::new(&mut stock))
                .expect("formats");
            let mut ours = Vec::new();
            writer.timestamp(&mut ours, SystemTime::now());
            let ours = String::from_utf8(ours).expect("utf8");
            stock.len() == ours.len() && stock[..19] == ours[..19] && ours.ends_with('Z')
        });
        assert!(agree);
    }
}
