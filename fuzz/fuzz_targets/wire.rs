//! The fake client socket the wire-level fuzz targets (`framing`, `simple_head`) feed their
//! input through.

use std::cell::RefCell;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A client socket: reads return the input in the given pieces, writes are recorded.
pub struct Wire<'a> {
    pub input: &'a [u8],
    pub at: usize,
    pub pieces: &'a [u8],
    pub piece: usize,
    pub written: &'a RefCell<Vec<u8>>,
}

impl AsyncRead for Wire<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let want = match self.pieces.get(self.piece) {
            Some(&size) => usize::from(size).max(1),
            None => usize::MAX,
        };
        self.piece += 1;
        let n = want.min(buf.remaining()).min(self.input.len() - self.at);
        let from = self.at;
        buf.put_slice(&self.input[from..from + n]);
        self.at += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Wire<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.written.borrow_mut().extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
