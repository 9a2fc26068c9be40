//! The clock connections note their activity on: milliseconds since their server started,
//! advanced every [`TICK`] by one task of that server. Connections note when bytes last moved
//! on every read and write; reading the real clock there showed up in profiles, and idle
//! timeouts need no finer grain.
//!
//! Each server owns its clock (it used to be a process-wide static): a second server in the
//! same process, or one started after another stopped, counts from its own start and is
//! ticked by its own task, which stops with it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the clock advances: the grain of idle and header-read timeouts.
pub const TICK: Duration = Duration::from_millis(50);

pub struct CoarseClock {
    base: Instant,
    now_ms: AtomicU64,
}

impl CoarseClock {
    pub fn new() -> Self {
        CoarseClock {
            base: Instant::now(),
            now_ms: AtomicU64::new(0),
        }
    }

    /// Milliseconds since the clock was made, as of its last tick.
    pub fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::Relaxed)
    }

    /// Advances the clock to the real elapsed time (never backwards).
    fn tick(&self) {
        let elapsed = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.now_ms.fetch_max(elapsed, Ordering::Relaxed);
    }

    /// Ticks every [`TICK`] until the task is aborted.
    pub async fn run(self: std::sync::Arc<Self>) {
        loop {
            self.tick();
            tokio::time::sleep(TICK).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_moves_only_when_ticked_and_never_back() {
        let clock = CoarseClock::new();
        assert_eq!(clock.now_ms(), 0);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(clock.now_ms(), 0, "no tick, no time");
        clock.tick();
        let first = clock.now_ms();
        assert!(first >= 20, "{first}");
        clock.tick();
        assert!(clock.now_ms() >= first);
    }

    #[test]
    fn two_clocks_count_from_their_own_start() {
        let older = CoarseClock::new();
        std::thread::sleep(Duration::from_millis(30));
        let newer = CoarseClock::new();
        older.tick();
        newer.tick();
        assert!(
            older.now_ms() >= newer.now_ms() + 30,
            "{} vs {}",
            older.now_ms(),
            newer.now_ms()
        );
    }
}
