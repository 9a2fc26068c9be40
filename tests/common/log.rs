//! What tollgate logs during one test: a `tracing` subscriber of the test's own, set as the
//! default for the current thread (so a current-thread runtime's tasks all write to it),
//! capturing warnings and errors as text.

use std::sync::{Arc, Mutex, OnceLock};

use tracing::subscriber::DefaultGuard;

/// The captured text, shared with the subscriber's writer.
#[derive(Clone, Default)]
pub struct CapturedLog(Arc<Mutex<Vec<u8>>>);

impl CapturedLog {
    /// Starts capturing warnings and errors on this thread until the guard is dropped.
    pub fn warnings() -> (CapturedLog, DefaultGuard) {
        let captured = CapturedLog::new();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .finish();
        (captured, tracing::subscriber::set_default(subscriber))
    }

    /// An empty capture, for a subscriber the test builds itself (any format or level).
    pub fn new() -> CapturedLog {
        ask_every_subscriber();
        CapturedLog::default()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }

    pub fn lines(&self) -> Vec<String> {
        self.text().lines().map(str::to_owned).collect()
    }
}

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CapturedLog {
    type Writer = CapturedLog;
    fn make_writer(&'a self) -> CapturedLog {
        self.clone()
    }
}

/// tracing-core decides whether a log statement is wanted once, when it first runs. While only
/// one subscriber is registered in the process, it asks just the subscriber of the thread that
/// runs the statement first: a test running in parallel on a thread without one (a
/// multi-threaded runtime's worker, say) then marks the statement unwanted for the whole
/// process, and a capture in another test silently misses its line. With a second subscriber
/// alive for the whole process, tracing asks them all, and checks each event against the
/// subscriber of its own thread.
fn ask_every_subscriber() {
    static SECOND: OnceLock<tracing::Dispatch> = OnceLock::new();
    SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
}
