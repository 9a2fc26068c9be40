//! The store-failure breaker: stops paying a full `store.timeout` per request while the store
//! stays down (see [`Breaker`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Fails fast while the store is down. Closed: every call goes to the store. It opens for
/// [`Breaker::COOL_DOWN`] after [`Breaker::THRESHOLD`] consecutive failures, or after
/// [`Breaker::THRESHOLD_IF_SLOW`] when one of them was slow (took at least half of
/// `store.timeout`); then one call at a time probes the store until one succeeds.
///
/// A slow failure cost its request most of a timeout, and the next call to a store that
/// hangs, or that refuses connections while the pool waits its whole budget for one, costs
/// as much: waiting for five such failures made the first five requests per instance pay a
/// full timeout each (docs/operations.md, "When the store fails"). One slow failure alone
/// may be a straggler on a healthy store, which the next success forgets; a second failure
/// with no success in between means the store is failing.
///
/// A call holds an [`Attempt`] while it waits for the store. The probe's permit is released
/// when the attempt is dropped without an outcome (the request was cancelled: client gone,
/// stream reset, idle close, shutdown), so a cancelled probe never leaves the breaker open
/// for good (contract §5: it always recovers by itself).
pub struct Breaker {
    base: Instant,
    /// Consecutive failures since the last success: all of them in the low half, the slow
    /// ones in the high half. One word, so that a success on a healthy store reads one atomic
    /// and writes nothing.
    failures: AtomicU64,
    /// A failure that took at least this long is slow.
    slow: Duration,
    /// Milliseconds since `base` until which calls are skipped; 0 = closed.
    open_until_ms: AtomicU64,
    probing: AtomicBool,
}

/// Leave to call the store, from [`Breaker::attempt`]; report how the call ended with
/// [`Attempt::succeeded`] or [`Attempt::failed`]. Dropping it without either (a cancelled
/// call) tells the breaker nothing about the store, but frees the probe it may hold.
#[must_use = "an attempt reports how the store call ended"]
pub struct Attempt<'a> {
    breaker: &'a Breaker,
    /// This call is the one probe after a cool-down.
    probe: bool,
}

impl Attempt<'_> {
    pub fn succeeded(mut self) {
        self.probe = false;
        self.breaker.record_success();
    }

    /// The call failed after `took`. Returns true when this failure opened the breaker (it
    /// was closed until now).
    pub fn failed(mut self, took: Duration) -> bool {
        self.probe = false;
        self.breaker.record_failure(took >= self.breaker.slow)
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if self.probe {
            // The cool-down is over, so the next call probes at once.
            self.breaker.probing.store(false, Ordering::Release);
        }
    }
}

/// One failure in [`Breaker::failures`]; a slow one adds [`SLOW_FAILURE`] too.
const FAILURE: u64 = 1;
const SLOW_FAILURE: u64 = 1 << 32;

impl Breaker {
    pub const THRESHOLD: u32 = 5;
    /// Consecutive failures that open the breaker when one of them was slow.
    pub const THRESHOLD_IF_SLOW: u32 = 2;
    pub const COOL_DOWN: Duration = Duration::from_millis(500);

    /// A breaker for store calls bounded by `timeout` (`store.timeout`).
    pub fn new(timeout: Duration) -> Self {
        Breaker {
            base: Instant::now(),
            failures: AtomicU64::new(0),
            slow: timeout / 2,
            open_until_ms: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64
    }

    /// Leave to call the store now, or `None` while the breaker skips it.
    pub fn attempt(&self) -> Option<Attempt<'_>> {
        let until = self.open_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Some(Attempt {
                breaker: self,
                probe: false,
            });
        }
        if self.now_ms() < until {
            return None;
        }
        // Cool-down over: exactly one caller probes.
        self.probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Attempt {
                breaker: self,
                probe: true,
            })
    }

    fn record_success(&self) {
        // Every decision on a healthy store ends here: reading finds nothing to reset and
        // leaves the cache lines shared between the workers. (A failure racing with this is
        // as if it came after it.) `probing` is only ever set while open.
        if self.failures.load(Ordering::Acquire) == 0
            && self.open_until_ms.load(Ordering::Acquire) == 0
        {
            return;
        }
        self.failures.store(0, Ordering::Release);
        self.open_until_ms.store(0, Ordering::Release);
        self.probing.store(false, Ordering::Release);
    }

    fn record_failure(&self, slow: bool) -> bool {
        let add = if slow {
            FAILURE + SLOW_FAILURE
        } else {
            FAILURE
        };
        let failures = self
            .failures
            .fetch_add(add, Ordering::AcqRel)
            .wrapping_add(add);
        let (all, slow) = (failures as u32, (failures >> 32) as u32);
        let was_probing = self.probing.swap(false, Ordering::AcqRel);
        let threshold = if slow > 0 {
            Self::THRESHOLD_IF_SLOW
        } else {
            Self::THRESHOLD
        };
        if all >= threshold || was_probing {
            let until = self.now_ms() + Self::COOL_DOWN.as_millis() as u64;
            let before = self.open_until_ms.swap(until.max(1), Ordering::AcqRel);
            return before == 0;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The breaker of a 1 s `store.timeout`, and failures that took little and half of it.
    const BUDGET: Duration = Duration::from_secs(1);
    const QUICK: Duration = Duration::from_millis(10);
    const SLOW: Duration = Duration::from_millis(500);

    #[test]
    fn breaker_opens_and_probes() {
        let b = Breaker::new(BUDGET);
        for _ in 0..Breaker::THRESHOLD - 1 {
            assert!(!b.attempt().expect("closed").failed(QUICK));
        }
        assert!(b.attempt().expect("closed").failed(QUICK), "opens");
        assert!(b.attempt().is_none());
        std::thread::sleep(Breaker::COOL_DOWN + Duration::from_millis(20));
        let probe = b.attempt().expect("one probe after the cool-down");
        assert!(b.attempt().is_none(), "only one probe at a time");
        assert!(
            !probe.failed(QUICK),
            "a failed probe re-opens, no new warning"
        );
        assert!(b.attempt().is_none());
        std::thread::sleep(Breaker::COOL_DOWN + Duration::from_millis(20));
        b.attempt().expect("probe").succeeded();
        assert!(b.attempt().is_some());
    }

    /// Issue 47, item 5: two failures in a row open the breaker when one of them cost most
    /// of a timeout, rather than five; a slow one alone, followed by a success, is forgotten
    /// (a straggler).
    #[test]
    fn two_failures_in_a_row_open_the_breaker_when_one_was_slow() {
        let b = Breaker::new(BUDGET);
        let fail = |took| b.attempt().expect("closed").failed(took);
        assert!(!fail(SLOW), "one may be a straggler");
        b.attempt().expect("closed").succeeded();
        assert!(!fail(QUICK), "the straggler was forgotten by the success");
        assert!(fail(SLOW), "a quick and a slow one open");
        assert!(b.attempt().is_none());
        std::thread::sleep(Breaker::COOL_DOWN + Duration::from_millis(20));
        b.attempt().expect("probe").succeeded();
        assert!(!fail(SLOW));
        assert!(fail(SLOW), "two slow ones open");
        std::thread::sleep(Breaker::COOL_DOWN + Duration::from_millis(20));
        b.attempt().expect("probe").succeeded();
        for _ in 0..Breaker::THRESHOLD - 1 {
            assert!(!fail(QUICK), "closed again, the counts start over");
        }
        assert!(fail(QUICK), "five quick ones open");
    }

    #[test]
    fn a_dropped_probe_lets_the_next_call_probe() {
        let b = Breaker::new(BUDGET);
        for _ in 0..Breaker::THRESHOLD {
            let _ = b.attempt().expect("closed").failed(QUICK);
        }
        std::thread::sleep(Breaker::COOL_DOWN + Duration::from_millis(20));
        let probe = b.attempt().expect("probe");
        assert!(b.attempt().is_none());
        drop(probe);
        let next = b
            .attempt()
            .expect("the cancelled probe's place goes to the next call");
        next.succeeded();
        assert!(b.attempt().is_some(), "closed again");
    }
}
