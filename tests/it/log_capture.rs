//! The test harness's log capture (tests/common/log.rs) sees every warning of its own thread,
//! even when the log statement first ran on a thread without a subscriber. Without that, a test
//! asserting on a log line fails at random when a test running in parallel reaches the same
//! statement first (seen in tests/it/local_fallback.rs: the local fallback's announcement missing).

use crate::common::log::CapturedLog;

fn announce() {
    tracing::warn!("a line the capture must see");
}

#[test]
fn a_statement_first_run_on_a_thread_without_a_subscriber_is_still_captured() {
    let (log, _guard) = CapturedLog::warnings();
    std::thread::spawn(announce)
        .join()
        .expect("the other thread");
    announce();
    assert_eq!(
        log.lines()
            .iter()
            .filter(|l| l.contains("a line the capture must see"))
            .count(),
        1,
        "only this thread's line, and not lost:\n{}",
        log.text()
    );
}
