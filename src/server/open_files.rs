//! File descriptors (contract §9): the open-file limit is raised at start, and running out of
//! descriptors at accept time is logged at most once a second.
//!
//! Every client connection costs one descriptor and each request it has upstream at most one
//! more (an HTTP/1.1 upstream connection), so the limit a service manager or shell hands out
//! by default (often 1,024 soft) runs out long before `max_connections`. The soft limit can be
//! raised without privileges up to the hard limit, so tollgate does that before it binds
//! anything, and logs the figure.
//!
//! When accept fails anyway (EMFILE, ENFILE), the listener is fine and the accept loop backs
//! off and tries again; without a rate limit it would log a line on every try of every
//! worker, ten times a second each, exactly when the operator needs the log to stay readable.

use std::io;
use std::time::Instant;

use crate::log_gate::LogGate;

/// The process's open-file soft limit before and after [`raise_open_file_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFileLimit {
    pub before: u64,
    pub now: u64,
    pub hard: u64,
}

/// Raises the open-file soft limit (`RLIMIT_NOFILE`) to the hard limit and logs the figure.
/// A failure is logged as a warning and changes nothing (tollgate serves with the limit it
/// has).
pub fn raise_open_file_limit() -> io::Result<OpenFileLimit> {
    let result = raise_soft_limit();
    match &result {
        Ok(limit) if limit.now > limit.before => tracing::info!(
            open_files = limit.now,
            was = limit.before,
            "open-file limit raised to the hard limit"
        ),
        Ok(limit) => tracing::info!(open_files = limit.now, "open-file limit"),
        Err(err) => tracing::warn!(
            error = %err,
            "cannot raise the open-file limit; serving with the one inherited"
        ),
    }
    result
}

// The libc calls are the crate's only unsafe code (Cargo.toml's `[lints.rust]`).
#[allow(unsafe_code)]
fn raise_soft_limit() -> io::Result<OpenFileLimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given, which lives on this stack frame.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let before = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(io::Error::last_os_error());
        }
        limit = raised;
    }
    Ok(OpenFileLimit {
        before,
        now: limit.rlim_cur,
        hard: limit.rlim_max,
    })
}

/// Accept failures of one server, logged at most once per [`LogGate::EVERY`] across all its
/// workers and listeners, each line with the number of failures since the previous one.
#[derive(Default)]
pub(super) struct AcceptErrors {
    gate: LogGate,
}

impl AcceptErrors {
    pub(super) fn note(&self, err: &io::Error) {
        if let Some(not_logged) = self.due(Instant::now()) {
            let out_of_descriptors =
                matches!(err.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE));
            if out_of_descriptors {
                tracing::warn!(
                    error = %err,
                    not_logged,
                    "accept failed: out of file descriptors; backing off (raise the open-file \
                     limit or lower server.max_connections)"
                );
            } else {
                tracing::warn!(error = %err, not_logged, "accept failed; backing off");
            }
        }
    }

    /// A listed balancer's connection closed for want of a valid PROXY header (contract §4). No
    /// address in the line: the reason and the count say enough to find the balancer.
    pub(super) fn note_refused_header(&self, refused: &super::proxy_protocol::Refused) {
        if let Some(not_logged) = self.due(Instant::now()) {
            tracing::warn!(
                error = %refused,
                not_logged,
                "connection from a server.proxy_protocol.from peer closed: it must open with a \
                 PROXY protocol v1 or v2 header (is the balancer's proxy protocol turned on?)"
            );
        }
    }

    /// Whether a failure at `now` gets a line, and if so how many before it did not.
    fn due(&self, now: Instant) -> Option<u64> {
        self.gate.due(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn accept_failures_get_one_line_a_second_with_the_count_of_the_rest() {
        let errors = AcceptErrors::default();
        let start = Instant::now();
        assert_eq!(errors.due(start), Some(0));
        // Ten a second (the back-off) for 2.5 s.
        let mut lines = vec![(Duration::ZERO, 0)];
        for tick in 1..=25u32 {
            let at = Duration::from_millis(100) * tick;
            if let Some(not_logged) = errors.due(start + at) {
                lines.push((at, not_logged));
            }
        }
        assert_eq!(
            lines,
            [
                (Duration::ZERO, 0),
                (Duration::from_secs(1), 9),
                (Duration::from_secs(2), 9)
            ]
        );
    }

    #[test]
    #[allow(unsafe_code)]
    fn the_soft_limit_is_raised_to_the_hard_limit() {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in `raise_soft_limit`.
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        // One below the hard limit: low enough to need raising, high enough that the other
        // tests of this process never notice.
        let lowered = libc::rlimit {
            rlim_cur: limit.rlim_max.min(limit.rlim_cur).saturating_sub(1),
            rlim_max: limit.rlim_max,
        };
        // SAFETY: as in `raise_soft_limit`.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
        let raised = raise_open_file_limit().expect("setrlimit works here");
        assert_eq!(raised.before, lowered.rlim_cur);
        assert_eq!(raised.now, limit.rlim_max);
        assert_eq!(raised.hard, limit.rlim_max);
    }
}
