//! The access log's lines (`tollgate::testing::log_format`): what a connection worker writes
//! itself (`LineWriter`) is, to the byte, what tracing-subscriber's formats write for the
//! same request's `tracing` event (`access`): its default text format, and its JSON format
//! with the event flattened, as `TOLLGATE_LOG=json` installs it. (The duration's digits and
//! the calendar are unit-tested in `src/log_format.rs`.)

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::common::log::CapturedLog;
use tollgate::testing::log_format::{access, AccessLine, LineFormat, LineWriter};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// A timer that always says the same: the two ways' lines are then comparable whole.
#[derive(Clone)]
struct Fixed;

impl FormatTime for Fixed {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        w.write_str("2026-12-04T15:35:05.201634Z")
    }
}

/// The moment `Fixed` names.
fn fixed_time() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_398_505) + Duration::from_micros(201_634)
}

/// What tracing-subscriber writes for `line`'s event in `format`.
fn stock(format: LineFormat, line: &AccessLine<'_>) -> String {
    let captured = CapturedLog::new();
    let builder = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(captured.clone())
        .with_timer(Fixed);
    match format {
        LineFormat::Text => {
            tracing::subscriber::with_default(builder.finish(), || access(line));
        }
        LineFormat::Json => {
            let subscriber = builder.json().flatten_event(true).finish();
            tracing::subscriber::with_default(subscriber, || access(line));
        }
    }
    captured.text()
}

/// What a worker writes for `line` in `format`, after a line of its own earlier in the same
/// second (the kept second then serves it).
fn ours(format: LineFormat, line: &AccessLine<'_>) -> String {
    let mut writer = LineWriter::new(format);
    let mut block = Vec::new();
    writer.write(
        &mut block,
        line,
        fixed_time() - Duration::from_micros(200_000),
    );
    block.clear();
    writer.write(&mut block, line, fixed_time());
    String::from_utf8(block).expect("utf-8")
}

#[test]
fn access_lines_are_tracing_subscribers_text_and_json() {
    let post = http::Method::POST;
    let custom = http::Method::from_bytes(b"PURGE").expect("a valid method");
    let long_path = format!("/{}", "p".repeat(3000));
    let long_route = "r".repeat(500);
    let many: Vec<Arc<str>> = (0..200).map(|i| format!("policy{i}").into()).collect();
    let odd_names: Vec<Arc<str>> = vec!["a\"b".into(), "c\\d".into(), "é\u{1}".into()];
    let plain = |elapsed: &'static dyn Fn() -> Duration| AccessLine {
        method: &http::Method::GET,
        path: "/a%20b",
        route: "bench",
        decision: "allowed",
        violated: &[],
        status: 200,
        elapsed,
        upstream: "app",
        grpc_status: None,
        request_id: "7c38926fa3007bf9912aae60143b7147",
    };
    let lines = [
        plain(&|| Duration::from_micros(5319)),
        // Durations: none, a microsecond, whole milliseconds, the longest written without
        // the formatters, and longer ones left to them.
        plain(&|| Duration::ZERO),
        plain(&|| Duration::from_nanos(1999)),
        plain(&|| Duration::from_millis(60_000)),
        plain(&|| Duration::from_micros(999_999_999_999_999)),
        plain(&|| Duration::from_micros(1_000_000_000_000_000)),
        plain(&|| Duration::MAX),
        // Text that `Debug` or JSON escapes: quotes, backslashes, controls, DEL, non-ASCII.
        AccessLine {
            method: &post,
            path: "/q\"uo\\te\u{1b}[31m/é/\u{301}/\u{7f}/\n\r\t\u{8}\u{c}",
            route: "api \"v2\"",
            decision: "denied",
            violated: &["api:ip".into(), "api:token".into()],
            status: 429,
            elapsed: &|| Duration::from_millis(2),
            upstream: "",
            grpc_status: Some("8"),
            request_id: "id with\ttab",
        },
        // Policy names JSON escapes (text writes them as they are).
        AccessLine {
            violated: &odd_names,
            ..plain(&|| Duration::from_micros(1500))
        },
        // Long fields, and many policies.
        AccessLine {
            method: &http::Method::GET,
            path: &long_path,
            route: &long_route,
            decision: "allowed",
            violated: &many,
            status: 200,
            elapsed: &|| Duration::from_micros(123_456_789),
            upstream: "u",
            grpc_status: None,
            request_id: "r",
        },
        AccessLine {
            method: &custom,
            path: "",
            route: "(none)",
            decision: "local_allowed",
            violated: &["p".into()],
            status: 0,
            elapsed: &|| Duration::from_micros(1),
            upstream: "backup",
            grpc_status: Some(""),
            request_id: "",
        },
    ];
    for format in [LineFormat::Text, LineFormat::Json] {
        for line in &lines {
            let stock = stock(format, line);
            assert!(stock.ends_with('\n') && stock.len() > 80, "{stock}");
            assert_eq!(ours(format, line), stock, "{format:?}");
        }
    }
}
