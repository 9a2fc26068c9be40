//! The text log format (`tollgate::testing::log_format`): access-log lines written by tollgate's own
//! formatter are the bytes tracing-subscriber's stock format writes for the same event, and
//! every other line is left to the stock format. (The duration's digits and the calendar are
//! unit-tested in `src/log_format.rs`.)

use std::sync::Arc;

use crate::common::log::CapturedLog;
use tollgate::testing::log_format::{access, AccessLine, TextFormat};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// A timer that always says the same: the two formats' lines are then comparable whole.
#[derive(Clone)]
struct Fixed;

impl FormatTime for Fixed {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        w.write_str("2026-12-04T15:35:05.201634Z")
    }
}

/// What `emit` logs through tracing-subscriber's stock format and through `TextFormat`.
fn both(emit: impl Fn()) -> (String, String) {
    let stock = CapturedLog::new();
    let ours = CapturedLog::new();
    let stock_subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(stock.clone())
        .event_format(tracing_subscriber::fmt::format().with_timer(Fixed))
        .finish();
    let our_subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(ours.clone())
        .event_format(TextFormat::with_timer(Fixed))
        .finish();
    tracing::subscriber::with_default(stock_subscriber, &emit);
    tracing::subscriber::with_default(our_subscriber, &emit);
    (stock.text(), ours.text())
}

#[test]
fn access_lines_are_the_stock_formats_text() {
    let post = http::Method::POST;
    let custom = http::Method::from_bytes(b"PURGE").expect("a valid method");
    let long_path = format!("/{}", "p".repeat(3000));
    let long_route = "r".repeat(500);
    let many: Vec<Arc<str>> = (0..200).map(|i| format!("policy{i}").into()).collect();
    let lines = [
        AccessLine {
            method: &http::Method::GET,
            path: "/a%20b",
            route: "bench",
            decision: "allowed",
            violated: &[],
            status: 200,
            duration_ms: &|| 5.319,
            upstream: "app",
            grpc_status: None,
            request_id: "7c38926fa3007bf9912aae60143b7147",
        },
        // Text that `Debug` escapes: quotes, backslashes, controls, non-ASCII.
        AccessLine {
            method: &post,
            path: "/q\"uo\\te\u{1b}[31m/é/\u{301}",
            route: "api \"v2\"",
            decision: "denied",
            violated: &["api:ip".into(), "api:token".into()],
            status: 429,
            duration_ms: &|| 2.0,
            upstream: "",
            grpc_status: Some("8"),
            request_id: "id with\ttab",
        },
        // Long fields, and many policies.
        AccessLine {
            method: &http::Method::GET,
            path: &long_path,
            route: &long_route,
            decision: "allowed",
            violated: &many,
            status: 200,
            duration_ms: &|| 123456.789,
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
            duration_ms: &|| 0.001,
            upstream: "backup",
            grpc_status: Some(""),
            request_id: "",
        },
    ];
    for line in &lines {
        let (stock, ours) = both(|| access(line));
        assert!(stock.ends_with('\n') && stock.len() > 80, "{stock}");
        assert_eq!(ours, stock);
    }
}

#[test]
fn other_lines_are_left_to_the_stock_format() {
    let (stock, ours) = both(|| {
        tracing::warn!(peer = "x", "a message with \"quotes\"");
        tracing::info!(target: "tollgate::access", "a message on the access target");
        tracing::info!(target: "tollgate::access", r#type = "raw", status = 1u64);
        let span = tracing::info_span!("conn", id = 7);
        let _in = span.enter();
        access(&AccessLine {
            method: &http::Method::GET,
            path: "/",
            route: "r",
            decision: "allowed",
            violated: &[],
            status: 200,
            duration_ms: &|| 1.5,
            upstream: "u",
            grpc_status: None,
            request_id: "i",
        });
    });
    assert!(stock.contains("conn{id=7}: tollgate::access"), "{stock}");
    assert_eq!(ours, stock);
}
