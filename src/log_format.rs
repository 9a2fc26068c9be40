//! The text format of log lines (the default; `TOLLGATE_LOG=json` uses tracing-subscriber's
//! JSON format instead, untouched).
//!
//! Every request writes one access-log line, so its formatting is on the request path: with
//! tracing-subscriber's stock format the line cost 14.5k instructions, where the rest of a
//! memory-mode request costs 41k (docs/performance.md). Most of that is generic machinery the
//! line does not need: `core::fmt` for every piece, colour styles painted even with colours
//! off, `Debug` on every text field and on the duration's float. [`TextFormat`] writes
//! access-log lines directly, in exactly the text the stock format writes (a test holds the two
//! to the same bytes), and hands every other event to the stock format: the other lines are
//! rare, and keep everything it does.
//!
//! The access log's one event is [`access`]: `tests/it/log_format.rs` formats that same call site
//! both ways.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{Format, Full, Writer};
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The target of access-log lines, the only ones [`TextFormat`] writes itself.
pub const ACCESS_TARGET: &str = "tollgate::access";

/// One finished request, as the access log records it.
pub struct AccessLine<'a> {
    pub method: &'a http::Method,
    /// Without the query: queries can carry credentials.
    pub path: &'a str,
    pub route: &'a str,
    pub decision: &'a str,
    /// The policies that denied the request (written comma-separated; empty when none did).
    pub violated: &'a [std::sync::Arc<str>],
    pub status: u16,
    /// How long the request took, in milliseconds: asked only when the line is written.
    pub duration_ms: &'a dyn Fn() -> f64,
    pub upstream: &'a str,
    pub grpc_status: Option<&'a str>,
    /// Visible ASCII by construction (kept ones are checked, new ones are hex).
    pub request_id: &'a str,
}

/// Writes the access-log line of one request (at `info`, target [`ACCESS_TARGET`]). The
/// fields that cost something to compute are computed only when the line is written.
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
struct Joined<'a>(&'a [std::sync::Arc<str>]);

impl fmt::Display for Joined<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
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
pub fn log_ms(elapsed: std::time::Duration) -> f64 {
    let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
    micros as f64 / 1000.0
}

/// The text format: access-log lines written directly, every other line by `stock`, both
/// stamped by the same `timer`.
pub struct TextFormat<T = UtcMicros> {
    timer: T,
    stock: Format<Full, T>,
}

impl TextFormat<UtcMicros> {
    pub fn new() -> Self {
        TextFormat::with_timer(UtcMicros)
    }
}

impl Default for TextFormat<UtcMicros> {
    fn default() -> Self {
        TextFormat::new()
    }
}

impl<T: FormatTime + Clone> TextFormat<T> {
    pub fn with_timer(timer: T) -> Self {
        TextFormat {
            stock: Format::default().with_timer(timer.clone()),
            timer,
        }
    }
}

impl<S, N, T> FormatEvent<S, N> for TextFormat<T>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    T: FormatTime,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        // Colours (a terminal) and spans around the event are the stock format's business:
        // neither happens on the request path of a server whose log is not a terminal.
        if meta.target() != ACCESS_TARGET
            || writer.has_ansi_escapes()
            || ctx
                .event_scope()
                .is_some_and(|mut scope| scope.next().is_some())
            || meta
                .fields()
                .iter()
                .any(|field| written_specially(field.name()))
        {
            return self.stock.format_event(ctx, writer, event);
        }
        // The stock layout: time, a space, the level right-aligned in five, target, fields.
        if self.timer.format_time(&mut writer).is_err() {
            writer.write_str("<unknown time>")?;
        }
        writer.write_str(match *meta.level() {
            Level::TRACE => " TRACE ",
            Level::DEBUG => " DEBUG ",
            Level::INFO => "  INFO ",
            Level::WARN => "  WARN ",
            Level::ERROR => " ERROR ",
        })?;
        writer.write_str(meta.target())?;
        writer.write_str(": ")?;
        let mut fields = Fields {
            line: writer.by_ref(),
            first: true,
            result: Ok(()),
        };
        event.record(&mut fields);
        fields.result?;
        writer.write_str("\n")
    }
}

/// Whether the stock format writes a field other than as `name=value`: a message without its
/// name, a raw identifier without its `r#`, a bridged `log` record's metadata not at all.
fn written_specially(name: &str) -> bool {
    name == "message" || name.starts_with("r#") || name.starts_with("log.")
}

/// Writes `name=value` pairs separated by one space, each value as the stock format writes it
/// (`Debug`: text quoted and escaped, numbers plain), the common cases without `core::fmt`.
struct Fields<'w> {
    line: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl Fields<'_> {
    /// Writes one field: the separator, the name, and `=` with the value (written by
    /// `value`, which starts with the `=`: text fields write `="` as one piece).
    fn write(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_err() {
            return;
        }
        let line = &mut self.line;
        let separated = if std::mem::take(&mut self.first) {
            Ok(())
        } else {
            line.write_str(" ")
        };
        self.result = separated
            .and_then(|()| line.write_str(field.name()))
            .and_then(|()| value(line));
    }

    /// An integer field, as `Debug` writes it (its digits), with `itoa`.
    fn integer(&mut self, field: &Field, value: impl itoa::Integer) {
        self.write(field, |line| {
            line.write_str("=")?;
            line.write_str(itoa::Buffer::new().format(value))
        });
    }
}

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.write(field, |line| {
            // `Debug` of a str: quoted, with `"`, `\`, controls and some non-ASCII escaped.
            // Printable ASCII other than those two stays as it is.
            if value
                .bytes()
                .all(|b| matches!(b, b' '..=b'~') && b != b'"' && b != b'\\')
            {
                line.write_str("=\"")?;
                line.write_str(value)?;
                line.write_str("\"")
            } else {
                write!(line, "={value:?}")
            }
        });
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.integer(field, value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.integer(field, value);
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.write(field, |line| {
            line.write_str("=")?;
            write_f64(line, value)
        });
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.write(field, |line| {
            line.write_str(if value { "=true" } else { "=false" })
        });
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.write(field, |line| write!(line, "={value:?}"));
    }
}

/// `value` as `Debug` writes it, a whole number of thousandths without `core::fmt`.
fn write_f64(out: &mut impl fmt::Write, value: f64) -> fmt::Result {
    let Some((whole, fraction)) = thousandths(value) else {
        return write!(out, "{value:?}");
    };
    out.write_str(itoa::Buffer::new().format(whole))?;
    // `.0`, or the point and three digits without their trailing zeros.
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
    out.write_str(std::str::from_utf8(&text[..keep]).map_err(|_| fmt::Error)?)
}

/// `value` as a whole part and thousandths when it is a whole number of thousandths (as the
/// access log's durations are, see [`log_ms`]): `5.319` is `(5, 319)`. `None` for anything
/// else. Written as `5.319`, `2.0` or `1.5`, that is the text `Debug` gives `value`.
///
/// Why this is `Debug`'s text: `Debug` writes the shortest decimal that reads back as the
/// same `f64`, without an exponent from 1e-4 to 1e16. `value` is the `f64` nearest to the
/// decimal `m / 1000` (checked below), so that decimal reads back as it; below 1e12 the
/// spacing of `f64`s is under 0.001, so no decimal with fewer digits reads back as it too.
fn thousandths(value: f64) -> Option<(u64, u64)> {
    // (`-0.0` is in the range, and `Debug` writes its sign.)
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

/// UTC wall-clock time with microseconds, `2026-12-04T15:35:05.201634Z`: the text of
/// tracing-subscriber's `SystemTime` timer, written without `core::fmt`.
#[derive(Clone, Copy, Debug, Default)]
pub struct UtcMicros;

impl FormatTime for UtcMicros {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        let now = std::time::SystemTime::now();
        let mut text = [0u8; 27];
        match now
            .duration_since(std::time::UNIX_EPOCH)
            .ok()
            .and_then(|since| utc_micros(since.as_secs(), since.subsec_micros(), &mut text))
        {
            Some(text) => w.write_str(text),
            // A clock before 1970 or after 9999: the stock timer's text for it.
            None => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
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

    #[test]
    fn durations_are_written_as_debug_writes_them() {
        let check = |value: f64| {
            let mut ours = String::new();
            write_f64(&mut ours, value).expect("writes");
            assert_eq!(ours, format!("{value:?}"), "{value}");
        };
        // Whole numbers of microseconds, as `log_ms` makes them: every one up to 2 s, then
        // every multiple of 997 up to 100 s.
        let sampled = (2_000_000u64.div_ceil(997) * 997..100_000_000).step_by(997);
        for micros in (0..2_000_000u64).chain(sampled) {
            check(micros as f64 / 1000.0);
        }
        // Large ones, near where the shortcut stops, and values it leaves to `Debug`.
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

    #[test]
    fn utc_micros_agrees_with_the_stock_timer() {
        let now = |timer: &dyn FormatTime| {
            let mut text = String::new();
            timer
                .format_time(&mut Writer::new(&mut text))
                .expect("formats");
            text
        };
        // Seconds may tick between the two readings: equal to the second, or taken again.
        let agree = (0..5).any(|_| {
            let stock = now(&tracing_subscriber::fmt::time::SystemTime);
            let ours = now(&UtcMicros);
            stock.len() == ours.len() && stock[..19] == ours[..19] && ours.ends_with('Z')
        });
        assert!(agree);
    }
}
