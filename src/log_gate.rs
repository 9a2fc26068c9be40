//! A warning that can repeat on every request or every retry gets at most one line per
//! interval, each line with the number of occurrences left out since the previous one: the log
//! stays readable exactly when something keeps going wrong.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// One line per [`LogGate::EVERY`] at most, across every thread that shares it.
#[derive(Default)]
pub struct LogGate {
    state: Mutex<Gated>,
}

#[derive(Default)]
struct Gated {
    last_line: Option<Instant>,
    not_logged: u64,
}

impl LogGate {
    /// At most one line per this much time.
    pub const EVERY: Duration = Duration::from_secs(1);

    /// Whether an occurrence at `now` gets a line, and if so how many before it did not.
    pub fn due(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match state.last_line {
            Some(last) if now.saturating_duration_since(last) < Self::EVERY => {
                state.not_logged += 1;
                None
            }
            _ => {
                state.last_line = Some(now);
                Some(std::mem::take(&mut state.not_logged))
            }
        }
    }
}
