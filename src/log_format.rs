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
    /// How long the request took, in milliseconds: asked only when the line is written.
    pub duration_ms: &'a dyn Fn() -> f64,
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
        duration_ms = (line.duration_ms)(),
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
        let duration = (line.duration_ms)();
        if !write_thousandths(out, duration) {
            let _ = write!(out, "{duration:?}");
        }
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
        let duration = (line.duration_ms)();
        if !write_thousandths(out, duration) {
            let _ = serde_json::to_writer(&mut *out, &duration);
        }
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
    // Every byte looked at (no early exit), which the compiler turns into a vector loop.
    let plain = value.bytes().fold(true, |plain, b| {
        plain & (b' '..=b'~').contains(&b) & (b != b'"') & (b != b'\\')
    });
    if plain {
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
    value.bytes().fold(true, |plain, b| {
        plain & (b >= b' ') & (b != b'"') & (b != b'\\')
    })
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

/// Writes `value` when it is a whole number of thousandths below 1e12 (as the access log's
/// durations are, see [`log_ms`]), as both `Debug` and serde_json write it: the whole part,
/// then `.0`, or the point and up to three digits without their trailing zeros. False,
/// and nothing written, for any other value.
fn write_thousandths(out: &mut Vec<u8>, value: f64) -> bool {
    let Some((whole, fraction)) = thousandths(value) else {
        return false;
    };
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
    true
}

/// `value` as a whole part and thousandths when it is a whole number of thousandths (as the
/// access log's durations are, see [`log_ms`]): `5.319` is `(5, 319)`. `None` for anything
/// else. Written as `5.319`, `2.0` or `1.5`, that is the text `Debug` (and serde_json) gives
/// `value`.
///
/// Why this is their text: both write the shortest decimal that reads back as the same `f64`,
/// without an exponent in this range. `value` is the `f64` nearest to the decimal `m / 1000`
/// (checked below), so that decimal reads back as it; below 1e12 the spacing of `f64`s is
/// under 0.001, so no decimal with fewer digits reads back as it too.
fn thousandths(value: f64) -> Option<(u64, u64)> {
    // (`-0.0` is in the range, and both write its sign.)
    if !(0.0..1e12).contains(&value) || value.is_sign_negative() {
        return None;
    }
    let m = (value * 1000.0).round();
    if m / 1000.0 != value {
        return None;
    }
    // Below 1e15, exactly.
    let m = m as u64;
    Some((m / 1000, m % 1000))
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

    /// The text of `value` in a line, in both formats, against `Debug`'s and serde_json's.
    #[test]
    fn durations_are_written_as_debug_and_serde_json_write_them() {
        let check = |value: f64| {
            let mut ours = Vec::new();
            if !write_thousandths(&mut ours, value) {
                assert_eq!(thousandths(value), None, "{value}");
                return;
            }
            let ours = String::from_utf8(ours).expect("utf8");
            assert_eq!(ours, format!("{value:?}"), "{value}");
            assert_eq!(
                ours,
                serde_json::to_string(&value).expect("json"),
                "{value}"
            );
        };
        // Whole numbers of microseconds, as `log_ms` makes them: every one up to 2 s, then
        // every multiple of 997 up to 100 s.
        let sampled = (2_000_000u64.div_ceil(997) * 997..100_000_000).step_by(997);
        for micros in (0..2_000_000u64).chain(sampled) {
            check(micros as f64 / 1000.0);
        }
        // Large ones, near where the shortcut stops, and values it leaves to the fallbacks.
        let mut m: u64 = 1;
        while m < 1 << 62 {
            check(m as f64 / 1000.0);
            check((m + 999) as f64 / 1000.0);
            m = m * 3 + 1;
        }
        for value in [
            0.0001,
            0.00001,
            0.1234,
            1e-9,
            1e12,
            1e16,
            1e300,
            -0.0,
            -1.5,
            f64::NAN,
            f64::INFINITY,
        ] {
            check(value);
        }
        assert_eq!(thousandths(5.319), Some((5, 319)));
        assert_eq!(thousandths(0.1234), None);
        assert_eq!(thousandths(-1.5), None);
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
