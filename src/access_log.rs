//! The access log's way out of a connection worker (docs/operations.md, "Logs"): each worker
//! writes its requests' lines into a block of its own and hands whole blocks to the log
//! writer (`crate::log_writer`), as nginx's `access_log ... buffer=64k flush=1s` does.
//!
//! Before, every line was a `tracing` event: the macro's field set, a visitor per field, and
//! a lock of the writer's shared batch per line, a quarter more instructions per request
//! (docs/performance.md, "Timers, clock and log"). Now:
//!
//! - A line is formatted straight into the worker's block by `log_format::LineWriter`, in
//!   exactly the bytes tracing-subscriber's formats write (a test holds them to it). The
//!   block's lock is the worker's own: taken from elsewhere only by the flush timer and the
//!   shutdown, so it is uncontended. (A lock rather than a cell because worker 0 runs on the
//!   caller's runtime, which may be multi-threaded, as a test's is.)
//! - The block goes to the writer's batch, one lock and mostly no copy, when it holds
//!   [`BLOCK_BYTES`], or at most [`FLUSH_EVERY`] after its first line, by the worker's timer
//!   task ([`WorkerLog::flush_on_timer`]), and whatever it holds when the server shuts down
//!   (`RunningServer::shutdown`) or the worker is dropped: SIGTERM loses no line.
//! - A hand-over never waits: lines that do not fit in the writer's batch are dropped whole
//!   and counted in `tollgate_log_lines_dropped_total` (`LogWriter::write_block`).
//! - Lines are never split or interleaved; one worker's lines stay in order, and lines of
//!   different workers are in time order only within a block.
//!
//! Whether access lines are written at all is decided once, at start, by `RUST_LOG`
//! (`cli::logging`); a server given no [`AccessLog`] logs them through `tracing`
//! (`log_format::access`).

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use tokio::sync::Notify;

use crate::log_format::{AccessLine, LineFormat, LineWriter};
use crate::log_writer::LogWriter;

/// A worker hands its block over once it holds this much: about 260 lines of 250 bytes, some
/// milliseconds of a busy worker's lines. nginx's `buffer=64k`.
pub const BLOCK_BYTES: usize = 64 * 1024;

/// A block's buffer: room for a line past [`BLOCK_BYTES`] (a line of the longest path may
/// still grow it, once).
const BLOCK_CAPACITY: usize = BLOCK_BYTES + 4096;

/// The longest a line waits in its worker's block. Short enough that someone following the
/// log sees a request at once and that a crash (not SIGTERM, which writes everything) loses
/// little; long enough that a lightly loaded worker hands over tens of lines at a time, not
/// one. A busy worker fills its block first: this bounds latency, not cost. (nginx's
/// `flush=1s` is ten times longer; its block is also its write, where here the writer
/// thread batches every worker's blocks once more.)
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// The process's access log when tollgate writes it itself (`tollgate run`): the writer its
/// workers hand their blocks to and the format of the lines. Given to a server by
/// `ServerBuilder::access_log`.
#[derive(Clone)]
pub struct AccessLog {
    writer: LogWriter,
    format: LineFormat,
}

impl AccessLog {
    pub fn new(writer: LogWriter, format: LineFormat) -> Self {
        AccessLog { writer, format }
    }

    /// Lines dropped because the writer's batch was full (shared with every line of its
    /// writer: `tollgate_log_lines_dropped_total`).
    pub fn dropped(&self) -> Counter {
        self.writer.dropped()
    }
}

/// One connection worker's block of access-log lines (see the module notes).
pub struct WorkerLog {
    writer: LogWriter,
    block: Mutex<Block>,
    /// A line went into an empty block: the timer task starts its wait.
    first_line: Notify,
}

struct Block {
    text: Vec<u8>,
    lines: LineWriter,
}

impl WorkerLog {
    pub fn new(log: &AccessLog) -> Self {
        WorkerLog {
            writer: log.writer.clone(),
            block: Mutex::new(Block {
                text: Vec::with_capacity(BLOCK_CAPACITY),
                lines: LineWriter::new(log.format),
            }),
            first_line: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Block> {
        // A panic while it was held can only have been mid-line: the lines before are whole.
        self.block.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes `line` into the block, and hands the block over if that filled it.
    pub fn write(&self, line: &AccessLine<'_>) {
        let mut guard = self.lock();
        let block = &mut *guard;
        let was_empty = block.text.is_empty();
        block.lines.write(&mut block.text, line, SystemTime::now());
        if block.text.len() >= BLOCK_BYTES {
            self.hand_over(block);
        } else if was_empty {
            drop(guard);
            self.first_line.notify_one();
        }
    }

    /// Hands what the block holds to the writer.
    pub fn flush(&self) {
        self.hand_over(&mut self.lock());
    }

    fn hand_over(&self, block: &mut Block) {
        if block.text.is_empty() {
            return;
        }
        self.writer.write_block(&mut block.text);
        // What comes back may be the writer's buffer (`write_block`): any size. Keep a block's,
        // so that lines do not grow it on the request path, nor hold a large one.
        let capacity = block.text.capacity();
        if !(BLOCK_CAPACITY..=4 * BLOCK_CAPACITY).contains(&capacity) {
            block.text = Vec::with_capacity(BLOCK_CAPACITY);
        }
    }

    /// Hands the block over [`FLUSH_EVERY`] after a line went into it empty, for ever: the
    /// worker's task while its server runs.
    pub async fn flush_on_timer(&self) {
        loop {
            self.first_line.notified().await;
            tokio::time::sleep(FLUSH_EVERY).await;
            self.flush();
        }
    }
}

impl Drop for WorkerLog {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{self, Write};
    use std::sync::Arc;

    /// An output that records what reaches it, and can be held shut (a reader that stalls).
    #[derive(Clone, Default)]
    struct Recording {
        text: Arc<Mutex<Vec<u8>>>,
        gate: Arc<Mutex<()>>,
    }

    impl Write for Recording {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let _open = self.gate.lock().expect("gate");
            self.text.lock().expect("text").extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Recording {
        fn lines(&self) -> Vec<String> {
            let text = self.text.lock().expect("text").clone();
            String::from_utf8(text)
                .expect("utf8")
                .lines()
                .map(str::to_owned)
                .collect()
        }
    }

    fn request(id: &str, write: impl FnOnce(&AccessLine<'_>)) {
        write(&AccessLine {
            method: &http::Method::GET,
            path: "/a",
            route: "r",
            decision: "allowed",
            violated: &[],
            status: 200,
            elapsed: &|| Duration::from_micros(1500),
            upstream: "u",
            grpc_status: None,
            request_id: id,
        });
    }

    /// Lines wait in the block until it is full or flushed, then arrive whole and in order.
    #[test]
    fn a_block_is_handed_over_when_full_or_flushed() {
        let out = Recording::default();
        let (writer, flush) = LogWriter::to(out.clone(), 1 << 20).expect("writer");
        let worker = WorkerLog::new(&AccessLog::new(writer, LineFormat::Text));
        request("first", |l| worker.write(l));
        assert!(flush.flush(Duration::from_secs(5)));
        assert!(out.lines().is_empty(), "a line left the block early");
        // Lines of about 130 bytes: the block fills within 600.
        for i in 0..600 {
            request(&i.to_string(), |l| worker.write(l));
        }
        assert!(flush.flush(Duration::from_secs(5)));
        let handed = out.lines().len();
        assert!(handed > 0 && handed < 601, "{handed} lines written");
        worker.flush();
        assert!(flush.flush(Duration::from_secs(5)));
        let lines = out.lines();
        assert_eq!(lines.len(), 601);
        assert!(lines[0].ends_with("request_id=\"first\""), "{}", lines[0]);
        for (i, line) in lines[1..].iter().enumerate() {
            assert!(line.ends_with(&format!("request_id=\"{i}\"")), "{line}");
        }
    }

    /// A stalled reader never stalls a worker: what does not fit in the writer's batch is
    /// dropped in whole lines and counted, at once; the rest arrives intact.
    #[test]
    fn a_full_writer_drops_and_counts_whole_lines_instead_of_waiting() {
        let out = Recording::default();
        let stalled = out.gate.lock().expect("gate");
        // Room for about 60 lines of about 130 bytes.
        let (writer, flush) = LogWriter::to(out.clone(), 8000).expect("writer");
        let log = AccessLog::new(writer, LineFormat::Json);
        let worker = WorkerLog::new(&log);
        let started = std::time::Instant::now();
        let sent = 5000;
        for i in 0..sent {
            request(&i.to_string(), |l| worker.write(l));
        }
        worker.flush();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "logging waited for the reader: {:?}",
            started.elapsed()
        );
        let dropped = log.dropped().get();
        assert!(dropped > 0 && dropped < sent, "{dropped} dropped");
        drop(stalled);
        assert!(flush.flush(Duration::from_secs(5)));
        let lines = out.lines();
        assert_eq!(lines.len() as u64 + dropped, sent);
        for line in &lines {
            let value: serde_json::Value = serde_json::from_str(line).expect("a whole line");
            assert_eq!(value["target"], "tollgate::access");
        }
    }

    /// The timer task hands over a block that never fills, and does again for a line
    /// after that: nothing else flushes here.
    #[tokio::test(flavor = "current_thread")]
    async fn the_timer_hands_over_a_block_that_does_not_fill() {
        let out = Recording::default();
        let (writer, _flush) = LogWriter::to(out.clone(), 1 << 20).expect("writer");
        let worker = Arc::new(WorkerLog::new(&AccessLog::new(writer, LineFormat::Text)));
        let timer = tokio::spawn({
            let worker = worker.clone();
            async move { worker.flush_on_timer().await }
        });
        for (round, id) in ["a", "b"].into_iter().enumerate() {
            request(id, |l| worker.write(l));
            let until = std::time::Instant::now() + Duration::from_secs(10);
            while out.lines().len() < round + 1 {
                assert!(
                    std::time::Instant::now() < until,
                    "line {id} not handed over"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(out.lines().len(), round + 1);
        }
        timer.abort();
    }
}
