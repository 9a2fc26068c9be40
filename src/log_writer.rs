//! The log's way to stderr: a bounded buffer emptied by a thread of its own, so that a request
//! never waits for a write (issue 19). Before, every access-log line was a blocking write to
//! stderr on the connection worker: a slow terminal, pipe or log collector stalled every
//! connection of that worker.
//!
//! - `tracing_subscriber::fmt` formats each event into its own per-thread buffer and then
//!   writes it with one `write_all` through a [`Line`]. A `Line` holds the batch's lock while
//!   it lives, so lines are never split or interleaved, and it copies the text straight into
//!   the batch: no allocation per line, and no memory that one thread allocates and another
//!   frees, as the queue of per-line buffers it replaces had. The bound is in bytes, which is
//!   what a full batch costs, whatever the lines' lengths.
//! - When the batch holds [`QUEUE_BYTES`], a line that does not fit is **dropped** whole, not
//!   waited for, and counted in `tollgate_log_lines_dropped_total`: the request path goes on at
//!   full speed while the log falls behind, and the count says how much of it is missing. A
//!   batch that stays full means the log's reader keeps up with less than the server writes
//!   (see docs/operations.md).
//! - The writer thread swaps the batch for its own empty buffer, writes and flushes it, then
//!   rests [`BATCH_EVERY`] before it looks again; it is woken only by the first line after it
//!   found the batch empty, so that a busy server pays one wake-up per batch, not per line.
//! - Access-log lines come in blocks rather than one by one: each connection worker formats
//!   its own into a block and hands it over whole ([`LogWriter::write_block`], one lock per
//!   block; `crate::access_log`), usually by swapping it with the empty batch rather than
//!   copying it. Lines of a block that do not fit are dropped and counted alike, whole.
//! - [`FlushOnDrop`] waits (at most [`FLUSH_WAIT`]) for what was logged to be written, so that
//!   the last lines before the process exits are not lost.

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use tracing_subscriber::fmt::MakeWriter;

/// Bytes the batch holds: some 8,000 lines of about 250 bytes. At the access log's rate that is
/// some hundred milliseconds of lines, enough for a reader's hiccup and short enough that the
/// process keeps little the reader has not seen.
pub const QUEUE_BYTES: usize = 2 << 20;
/// How long [`FlushOnDrop`] waits for the writer thread.
pub const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// How long the writer rests after writing a batch before it looks for the next one. Lines
/// logged meanwhile are batched without waking it, so a busy server pays one wake-up per batch
/// instead of one per line (a futex call, and a context switch on the worker's own CPU, per
/// line otherwise; docs/performance.md, row "Log writer without an allocation per line").
/// It is also the most a line waits in the batch when the writer keeps up.
pub const BATCH_EVERY: Duration = Duration::from_millis(5);

/// What the loggers and the writer thread share.
struct Shared {
    batch: Mutex<Batch>,
    /// The writer waits here for a line (or for its last user to go).
    line_logged: Condvar,
    /// Flushes wait here for a batch to be written.
    batch_written: Condvar,
    capacity: usize,
}

struct Batch {
    text: Vec<u8>,
    /// The writer found the batch empty and waits for `line_logged`.
    writer_idle: bool,
    /// Batches taken by the writer, and of those, written and flushed.
    taken: u64,
    written: u64,
    /// Every [`LogWriter`] and [`FlushOnDrop`] is gone: nothing more will be logged.
    closed: bool,
}

impl Batch {
    /// Wakes the writer if it found the batch empty and waits, and there is now something to
    /// write: once per batch, not per line.
    fn wake_writer(&mut self, line_logged: &Condvar) {
        if self.writer_idle && !self.text.is_empty() {
            self.writer_idle = false;
            line_logged.notify_one();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Batch> {
        // A panic while the lock was held can only have been mid-copy of a line; the batch is
        // still bytes worth writing.
        self.batch.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The handles' common part: when the last one goes, the writer thread ends.
struct Users(Arc<Shared>);

impl Drop for Users {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.line_logged.notify_one();
    }
}

/// A `MakeWriter` for `tracing_subscriber::fmt` that batches each event's line (see the module
/// notes). Cloning shares the batch and the count of dropped lines.
#[derive(Clone)]
pub struct LogWriter {
    users: Arc<Users>,
    dropped: Counter,
}

/// Flushes what was logged when dropped (keep it until the process is about to exit).
pub struct FlushOnDrop {
    users: Arc<Users>,
}

impl LogWriter {
    /// A writer whose lines go to stderr.
    pub fn stderr() -> io::Result<(LogWriter, FlushOnDrop)> {
        LogWriter::to(io::stderr(), QUEUE_BYTES)
    }

    /// A writer whose lines go to `out`, written by a thread of its own, through a batch of
    /// at most `capacity` bytes.
    pub fn to(
        out: impl Write + Send + 'static,
        capacity: usize,
    ) -> io::Result<(LogWriter, FlushOnDrop)> {
        let shared = Arc::new(Shared {
            batch: Mutex::new(Batch {
                text: Vec::new(),
                writer_idle: false,
                taken: 0,
                written: 0,
                closed: false,
            }),
            line_logged: Condvar::new(),
            batch_written: Condvar::new(),
            capacity: capacity.max(1),
        });
        let for_thread = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("tollgate-log".into())
            .spawn(move || write_batches(&for_thread, out))?;
        let users = Arc::new(Users(shared));
        let writer = LogWriter {
            users: Arc::clone(&users),
            dropped: Counter::default(),
        };
        Ok((writer, FlushOnDrop { users }))
    }

    /// Lines dropped because the batch was full (the handle `tollgate_log_lines_dropped_total`
    /// reads; see `Server::builder(..).log_drops(..)`).
    pub fn dropped(&self) -> Counter {
        self.dropped.clone()
    }

    /// Puts `block`, whole lines each ending in a newline, into the batch under one lock: as
    /// many of its first lines as fit; the rest are dropped and counted, never waited for.
    /// (A connection worker's block of access-log lines, `crate::access_log`.) `block` comes
    /// back empty: when the batch held nothing, as it mostly does, the block becomes the batch
    /// without a copy and `block` is the batch's empty buffer.
    pub fn write_block(&self, block: &mut Vec<u8>) {
        let shared = &*self.users.0;
        let mut batch = shared.lock();
        let room = shared.capacity.saturating_sub(batch.text.len());
        let mut lost = 0;
        if batch.text.is_empty() && block.len() <= room {
            std::mem::swap(&mut batch.text, block);
        } else {
            let fits = if block.len() <= room {
                block.len()
            } else {
                block[..room]
                    .iter()
                    .rposition(|&b| b == b'\n')
                    .map_or(0, |last| last + 1)
            };
            batch.text.extend_from_slice(&block[..fits]);
            lost = block[fits..].iter().filter(|&&b| b == b'\n').count();
            block.clear();
        }
        batch.wake_writer(&shared.line_logged);
        drop(batch);
        if lost > 0 {
            self.dropped.inc_by(u64::try_from(lost).unwrap_or(u64::MAX));
        }
    }
}

/// One event's line, copied into the batch as it is written, under the batch's lock.
pub struct Line<'a> {
    batch: MutexGuard<'a, Batch>,
    shared: &'a Shared,
    dropped: &'a Counter,
    /// Where this line starts in the batch.
    start: usize,
    /// The line did not fit: what was copied of it is taken back, the rest ignored.
    overflowed: bool,
}

impl Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !self.overflowed {
            if self.batch.text.len() + buf.len() > self.shared.capacity {
                self.overflowed = true;
                let start = self.start;
                self.batch.text.truncate(start);
            } else {
                self.batch.text.extend_from_slice(buf);
            }
        }
        // Never an error: a dropped line is counted, and the request path does not care.
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        if self.overflowed {
            self.dropped.inc();
            return;
        }
        self.batch.wake_writer(&self.shared.line_logged);
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Line<'a> {
        let shared = &*self.users.0;
        let batch = shared.lock();
        let start = batch.text.len();
        Line {
            batch,
            shared,
            dropped: &self.dropped,
            start,
            overflowed: false,
        }
    }
}

impl FlushOnDrop {
    /// Waits until everything logged so far is written, for at most `within`; whether it was.
    pub fn flush(&self, within: Duration) -> bool {
        let shared = &*self.users.0;
        let deadline = Instant::now() + within;
        let mut batch = shared.lock();
        let target = batch.taken + u64::from(!batch.text.is_empty());
        batch.wake_writer(&shared.line_logged);
        while batch.written < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            batch = match shared.batch_written.wait_timeout(batch, left) {
                Ok((b, _)) => b,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }
}

impl Drop for FlushOnDrop {
    fn drop(&mut self) {
        self.flush(FLUSH_WAIT);
    }
}

/// The writer thread: takes the batch, writes and flushes it, rests, and waits for the next
/// line once the batch is empty. Ends when every handle is gone and the batch is written.
fn write_batches(shared: &Shared, mut out: impl Write) {
    let mut taken: Vec<u8> = Vec::new();
    loop {
        let mut batch = shared.lock();
        while batch.text.is_empty() {
            if batch.closed {
                return;
            }
            batch.writer_idle = true;
            batch = match shared.line_logged.wait(batch) {
                Ok(b) => b,
                Err(p) => p.into_inner(),
            };
        }
        batch.writer_idle = false;
        std::mem::swap(&mut batch.text, &mut taken);
        batch.taken += 1;
        drop(batch);
        // A write error (stderr closed) loses the batch; there is nowhere to say so.
        let _ = out.write_all(&taken);
        let _ = out.flush();
        taken.clear();
        let mut batch = shared.lock();
        batch.written = batch.taken;
        drop(batch);
        shared.batch_written.notify_all();
        std::thread::sleep(BATCH_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

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

    fn log(writer: &LogWriter, line: &str) {
        let mut w = writer.make_writer();
        w.write_all(line.as_bytes()).expect("write");
    }

    #[test]
    fn lines_arrive_whole_and_in_order() {
        let out = Recording::default();
        let (writer, flush) = LogWriter::to(out.clone(), 1024).expect("writer");
        for i in 0..10 {
            log(&writer, &format!("line {i}\n"));
        }
        assert!(flush.flush(Duration::from_secs(5)));
        let text = String::from_utf8(out.text.lock().expect("text").clone()).expect("utf8");
        let want: String = (0..10).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text, want);
        assert_eq!(writer.dropped().get(), 0);
    }

    /// A reader that stalls does not stall the logger: past the batch's capacity, lines are
    /// dropped and counted, at once.
    #[test]
    fn a_full_batch_drops_and_counts_instead_of_waiting() {
        let out = Recording::default();
        let stalled = out.gate.lock().expect("gate");
        // Room for four of these lines (7 or 8 bytes each).
        let (writer, flush) = LogWriter::to(out.clone(), 32).expect("writer");
        let started = std::time::Instant::now();
        for i in 0..100 {
            log(&writer, &format!("line {i}\n"));
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "logging waited for the reader: {:?}",
            started.elapsed()
        );
        // The thread takes the first batch and blocks writing it; past that the batch's four
        // lines fit and the rest are dropped.
        let dropped = writer.dropped().get();
        assert!(dropped > 0 && dropped < 100, "{dropped} dropped");
        drop(stalled);
        assert!(flush.flush(Duration::from_secs(5)));
        let lines = out
            .text
            .lock()
            .expect("text")
            .split(|b| *b == b'\n')
            .count()
            - 1;
        assert_eq!(lines as u64, 100 - dropped);
    }

    /// A line written in several pieces that does not fit is dropped whole: the reader never
    /// sees part of a line, and the lines around it are intact.
    #[test]
    fn a_line_that_does_not_fit_is_dropped_whole() {
        let out = Recording::default();
        let stalled = out.gate.lock().expect("gate");
        let (writer, flush) = LogWriter::to(out.clone(), 24).expect("writer");
        // Taken by the writer at once, which then blocks on the gate.
        log(&writer, "first\n");
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while writer.users.0.lock().taken == 0 {
            assert!(std::time::Instant::now() < until, "the writer took nothing");
            std::thread::sleep(Duration::from_millis(1));
        }
        log(&writer, "second line\n");
        {
            let mut w = writer.make_writer();
            w.write_all(b"third: fits ").expect("write");
            w.write_all(b"but not this part\n").expect("write");
        }
        log(&writer, "fourth\n");
        assert_eq!(writer.dropped().get(), 1);
        drop(stalled);
        assert!(flush.flush(Duration::from_secs(5)));
        let text = String::from_utf8(out.text.lock().expect("text").clone()).expect("utf8");
        assert_eq!(text, "first\nsecond line\nfourth\n");
    }

    /// A block becomes the batch when the batch is empty, and is copied behind what it holds
    /// otherwise, as far as whole lines fit; the rest of its lines are dropped and counted.
    #[test]
    fn blocks_arrive_whole_and_in_order_with_the_lines_around_them() {
        let out = Recording::default();
        let stalled = out.gate.lock().expect("gate");
        let (writer, flush) = LogWriter::to(out.clone(), 40).expect("writer");
        // Taken by the writer at once, which then blocks on the gate.
        log(&writer, "first\n");
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while writer.users.0.lock().taken == 0 {
            assert!(std::time::Instant::now() < until, "the writer took nothing");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut block = b"b1 one\nb1 two\n".to_vec();
        writer.write_block(&mut block);
        assert!(block.is_empty());
        log(&writer, "line\n");
        // 19 bytes held, 21 free: of these 30, the first two lines (14 bytes) fit.
        let mut block = b"b2 one\nb2 two\nb2 three\nb2 4\n".to_vec();
        writer.write_block(&mut block);
        assert!(block.is_empty());
        assert_eq!(writer.dropped().get(), 2);
        drop(stalled);
        assert!(flush.flush(Duration::from_secs(5)));
        let text = String::from_utf8(out.text.lock().expect("text").clone()).expect("utf8");
        assert_eq!(text, "first\nb1 one\nb1 two\nline\nb2 one\nb2 two\n");
    }

    /// When every handle is gone, the writer thread writes what is left and ends.
    #[test]
    fn the_writer_thread_ends_with_its_last_handle() {
        let out = Recording::default();
        let (writer, flush) = LogWriter::to(out.clone(), 1024).expect("writer");
        let shared = Arc::downgrade(&writer.users.0);
        log(&writer, "last\n");
        drop(writer);
        drop(flush);
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while shared.upgrade().is_some() {
            assert!(
                std::time::Instant::now() < until,
                "the writer thread is still running"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*out.text.lock().expect("text"), b"last\n");
    }
}
