//! Waiting for a condition instead of sleeping for a guessed time: a test that sleeps "long
//! enough" is slow when the machine is idle and flaky when it is loaded.

use std::time::{Duration, Instant};

/// How often a condition is checked.
const POLL: Duration = Duration::from_millis(10);

/// Returns as soon as `done()` holds; panics with `what` (the failure: "... never ...") when
/// it still does not after `within`. For absence ("nothing arrives") there is nothing to poll
/// for: those waits stay fixed.
pub async fn until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} (waited {within:?})");
        tokio::time::sleep(POLL).await;
    }
}
