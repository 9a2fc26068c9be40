//! The clock a memory store counts windows by: the system's, or a test's own.
//!
//! Windows are epoch-aligned, so crossing a boundary on the system clock means waiting for
//! it; a [`ManualClock`] handed to `Server::builder(...).clock(...)` moves when the test says
//! so. (A PostgreSQL store counts on the database's clock, which nothing here can move.)

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Unix time in milliseconds, from wherever the owner says.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> i64 + Send + Sync>);

impl Clock {
    /// This process's clock ([`super::unix_now_ms`]).
    pub fn system() -> Self {
        Clock(Arc::new(super::unix_now_ms))
    }

    pub fn from_fn(now_ms: impl Fn() -> i64 + Send + Sync + 'static) -> Self {
        Clock(Arc::new(now_ms))
    }

    pub fn now_ms(&self) -> i64 {
        (self.0)()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::system()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

/// A clock that stands still until it is moved (tests).
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// Stopped at `unix_ms`.
    pub fn at(unix_ms: i64) -> Self {
        ManualClock(Arc::new(AtomicI64::new(unix_ms)))
    }

    pub fn set(&self, unix_ms: i64) {
        self.0.store(unix_ms, Ordering::SeqCst);
    }

    pub fn advance(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.0.fetch_add(ms, Ordering::SeqCst);
    }

    pub fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }

    /// The [`Clock`] that reads this one.
    pub fn clock(&self) -> Clock {
        let now = self.0.clone();
        Clock::from_fn(move || now.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let hand = ManualClock::at(10_000);
        let clock = hand.clock();
        assert_eq!(clock.now_ms(), 10_000);
        hand.advance(Duration::from_millis(1500));
        assert_eq!(clock.now_ms(), 11_500);
        hand.set(5);
        assert_eq!(clock.now_ms(), 5);
    }

    #[test]
    fn the_system_clock_is_unix_time() {
        let now = Clock::system().now_ms();
        // After 2020-01-01, as any machine running this is.
        assert!(now > 1_577_836_800_000, "{now}");
    }
}
