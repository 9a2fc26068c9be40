//! A command's standard output (`check`, `migrate`, `explain`, `reset`).
//!
//! A reader that has gone away (`tollgate check | head -1`) ends the output, not the command:
//! the line is dropped (as is every later one: the pipe stays closed) and the command finishes
//! with its usual exit code, where `println!` would panic (exit 101). Any other failure to
//! write is kept, and `main` reports it and exits 1.

use std::io::{self, Write};

/// `println!` for a command's output, through [`Out::say`].
macro_rules! say {
    ($out:expr, $($arg:tt)*) => {
        $out.say(format_args!($($arg)*))
    };
}
pub(crate) use say;

/// Where a command's lines go: stdout, or a buffer in the unit tests.
pub struct Out<'w> {
    writer: Box<dyn Write + 'w>,
    closed: bool,
    failed: Option<io::Error>,
}

impl Out<'static> {
    pub fn stdout() -> Out<'static> {
        Out::to(io::stdout())
    }
}

impl<'w> Out<'w> {
    pub fn to(writer: impl Write + 'w) -> Out<'w> {
        Out {
            writer: Box::new(writer),
            closed: false,
            failed: None,
        }
    }

    /// Writes one line, unless the output is closed or has failed.
    pub fn say(&mut self, line: std::fmt::Arguments<'_>) {
        if self.closed || self.failed.is_some() {
            return;
        }
        match writeln!(self.writer, "{line}").and_then(|()| self.writer.flush()) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::BrokenPipe => self.closed = true,
            Err(err) => self.failed = Some(err),
        }
    }

    /// The first write failure other than a closed pipe, if any.
    pub fn finish(self) -> Result<(), io::Error> {
        self.failed.map_or(Ok(()), Err)
    }
}

/// What a request of `limit` takes and when (contract §3d): ` cost 3`, ` count [401, 403]`,
/// ` cost_header x-ratelimit-cost`; nothing for the defaults.
pub(super) fn units_text(limit: &crate::config::LimitConfig) -> String {
    let mut text = String::new();
    if limit.cost > 1 {
        text.push_str(&format!(" cost {}", limit.cost));
    }
    if limit.count != crate::config::Counting::All {
        text.push_str(&format!(" count {}", limit.count));
    }
    if let Some(name) = &limit.cost_header {
        text.push_str(&format!(" cost_header {name}"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Broken(io::ErrorKind);

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from(self.0))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_are_written_in_order() {
        let mut buf = Vec::new();
        let mut out = Out::to(&mut buf);
        say!(out, "one {}", 1);
        say!(out, "two");
        out.finish().expect("no failure");
        assert_eq!(String::from_utf8(buf).expect("utf-8"), "one 1\ntwo\n");
    }

    #[test]
    fn a_closed_pipe_ends_the_output_but_is_no_failure() {
        let mut out = Out::to(Broken(io::ErrorKind::BrokenPipe));
        say!(out, "dropped");
        assert!(out.closed);
        assert!(out.finish().is_ok());
    }

    #[test]
    fn another_write_error_is_reported() {
        let mut out = Out::to(Broken(io::ErrorKind::StorageFull));
        say!(out, "lost");
        let err = out.finish().expect_err("a full disk is reported");
        assert_eq!(err.kind(), io::ErrorKind::StorageFull);
    }
}
