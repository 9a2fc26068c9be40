//! The log's way to stderr: a bounded queue to a thread of its own, so that a request never
//! waits for a write (issue 19). Before, every access-log line was a blocking write to stderr
//! on the connection worker: a slow terminal, pipe or log collector stalled every connection
//! of that worker.
//!
//! - Each event is formatted on the thread that logs it, into a buffer of its own, and handed
//!   to the queue whole ([`QUEUE_LINES`] lines); lines are never split or interleaved.
//! - When the queue is full, the line is **dropped**, not waited for, and counted in
//!   `tollgate_log_lines_dropped_total`: the request path goes on at full speed while the log
//!   falls behind, and the count says how much of it is missing. A queue that stays full means
//!   the log's reader keeps up with less than the server writes (see docs/operations.md).
//! - The writer thread writes what is queued through a buffer and flushes whenever the queue
//!   runs empty, then rests [`BATCH_EVERY`] before it waits again, so that it is woken once
//!   per batch rather than once per line.
//! - [`FlushOnDrop`] waits (at most [`FLUSH_WAIT`]) for the queue to be written, so that the
//!   last lines before the process exits are not lost.

use std::io::{self, Write};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tracing_subscriber::fmt::MakeWriter;

/// Lines the queue holds. A line is a few hundred bytes, so a full queue is a few megabytes;
/// at the access log's rate it is some hundred milliseconds of lines, enough for a reader's
/// hiccup and short enough that the process keeps little the reader has not seen.
pub const QUEUE_LINES: usize = 8192;
/// How long [`FlushOnDrop`] waits for the writer thread.
pub const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// How long the writer rests after writing a batch before it waits for the next line. Lines
/// sent meanwhile are queued without waking it, so a busy server pays one wake-up per batch
/// instead of one per line: a wake-up per access-log line (a futex call, and a context switch
/// on the worker's own CPU) cost a quarter of the memory mode's throughput in `bench/run.sh`.
/// It is also the most a line waits in the queue when the writer keeps up.
pub const BATCH_EVERY: Duration = Duration::from_millis(5);

enum Message {
    Line(Vec<u8>),
    /// Answered once everything queued before it has been written and flushed.
    Flush(mpsc::Sender<()>),
}

/// A `MakeWriter` for `tracing_subscriber::fmt` that queues each event's line (see the module
/// notes). Cloning shares the queue and the count of dropped lines.
#[derive(Clone)]
pub struct LogWriter {
    queue: SyncSender<Message>,
    dropped: Counter,
}

/// Flushes the queue when dropped (keep it until the process is about to exit).
pub struct FlushOnDrop {
    queue: SyncSender<Message>,
}

impl LogWriter {
    /// A writer whose lines go to stderr.
    pub fn stderr() -> io::Result<(LogWriter, FlushOnDrop)> {
        LogWriter::to(io::stderr(), QUEUE_LINES)
    }

    /// A writer whose lines go to `out`, written by a thread of its own, through a queue of
    /// `capacity` lines.
    pub fn to(
        out: impl Write + Send + 'static,
        capacity: usize,
    ) -> io::Result<(LogWriter, FlushOnDrop)> {
        let (queue, lines) = mpsc::sync_channel(capacity.max(1));
        std::thread::Builder::new()
            .name("tollgate-log".into())
            .spawn(move || write_lines(lines, out))?;
        let writer = LogWriter {
            queue: queue.clone(),
            dropped: Counter::default(),
        };
        Ok((writer, FlushOnDrop { queue }))
    }

    /// Lines dropped because the queue was full (the handle `tollgate_log_lines_dropped_total`
    /// reads; see `Server::builder(..).log_drops(..)`).
    pub fn dropped(&self) -> Counter {
        self.dropped.clone()
    }
}

/// One event's line, queued when the formatter is done with it.
pub struct Line<'a> {
    text: Vec<u8>,
    owner: &'a LogWriter,
}

impl Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        if self.text.is_empty() {
            return;
        }
        let text = std::mem::take(&mut self.text);
        match self.owner.queue.try_send(Message::Line(text)) {
            Ok(()) => {}
            // Full: never wait on the request path. Disconnected: the writer thread is gone
            // (it only ends when every sender has), nothing to write to.
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.owner.dropped.inc();
            }
        }
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Line<'a> {
        Line {
            text: Vec::with_capacity(256),
            owner: self,
        }
    }
}

impl FlushOnDrop {
    /// Waits until everything queued so far is written, for at most `within`; whether it was.
    pub fn flush(&self, within: Duration) -> bool {
        let (done, written) = mpsc::channel();
        if self.queue.send(Message::Flush(done)).is_err() {
            return false;
        }
        written.recv_timeout(within).is_ok()
    }
}

impl Drop for FlushOnDrop {
    fn drop(&mut self) {
        self.flush(FLUSH_WAIT);
    }
}

/// The writer thread: takes what is queued, writes it, flushes once the queue is empty.
fn write_lines(lines: Receiver<Message>, out: impl Write) {
    let mut out = io::BufWriter::with_capacity(64 * 1024, out);
    let mut waiting: Vec<mpsc::Sender<()>> = Vec::new();
    while let Ok(first) = lines.recv() {
        let mut next = Some(first);
        while let Some(message) = next {
            match message {
                // A write error (stderr closed) loses the line; there is nowhere to say so.
                Message::Line(text) => drop(out.write_all(&text)),
                Message::Flush(done) => waiting.push(done),
            }
            next = lines.try_recv().ok();
        }
        let _ = out.flush();
        for done in waiting.drain(..) {
            let _ = done.send(());
        }
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
        let (writer, flush) = LogWriter::to(out.clone(), 16).expect("writer");
        for i in 0..10 {
            log(&writer, &format!("line {i}\n"));
        }
        assert!(flush.flush(Duration::from_secs(5)));
        let text = String::from_utf8(out.text.lock().expect("text").clone()).expect("utf8");
        let want: String = (0..10).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text, want);
        assert_eq!(writer.dropped().get(), 0);
    }

    /// A reader that stalls does not stall the logger: past the queue, lines are dropped and
    /// counted, at once.
    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let out = Recording::default();
        let stalled = out.gate.lock().expect("gate");
        let (writer, flush) = LogWriter::to(out.clone(), 4).expect("writer");
        let started = std::time::Instant::now();
        for i in 0..100 {
            log(&writer, &format!("line {i}\n"));
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "logging waited for the reader: {:?}",
            started.elapsed()
        );
        // The thread takes what is queued until the queue first runs empty, then blocks in
        // its flush; past that the queue's 4 lines fit and the rest are dropped.
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
}
