//! Wire-level fuzzing of the HTTP/1.1 framing guard (src/http1/guard.rs).
//!
//! The input is a client's byte stream plus the sizes of the reads it arrives in. The guard
//! runs over a fake socket twice, once with everything in one read and once split as the
//! input says, and must:
//! - never panic, never loop, never change a byte: what it hands on is a prefix of the input;
//! - hand on everything, or refuse, and refuse the same streams however they are split (a
//!   verdict that depends on read boundaries is a smuggling primitive);
//! - answer a refusal with nothing or with its own 400/431, and nothing after it.
#![no_main]

use std::cell::RefCell;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, ReadBuf};
use tollgate::testing::http1::guard::FramingGuard;

mod wire;

use wire::Wire;

/// What the guard did with one stream: the bytes it handed on and what it wrote back.
struct Outcome {
    delivered: Vec<u8>,
    written: Vec<u8>,
}

fn run(input: &[u8], pieces: &[u8], read_buffer: usize) -> Outcome {
    let written = RefCell::new(Vec::new());
    let wire = Wire {
        input,
        at: 0,
        pieces,
        piece: 0,
        written: &written,
    };
    let mut guard = FramingGuard::new(wire);
    let mut cx = Context::from_waker(Waker::noop());
    let mut delivered = Vec::new();
    let mut buffer = vec![0u8; read_buffer];
    // Every read either moves at least one input byte or ends the stream; anything more is
    // a loop.
    for _ in 0..=input.len() + pieces.len() + 4 {
        let mut buf = ReadBuf::new(&mut buffer);
        match Pin::new(&mut guard).poll_read(&mut cx, &mut buf) {
            Poll::Ready(Ok(())) if buf.filled().is_empty() => {
                drop(guard);
                return Outcome {
                    delivered,
                    written: written.into_inner(),
                };
            }
            Poll::Ready(Ok(())) => delivered.extend_from_slice(buf.filled()),
            Poll::Ready(Err(err)) => panic!("the fake socket never fails, yet: {err}"),
            Poll::Pending => panic!("the fake socket never waits, yet the guard did"),
        }
    }
    panic!("the guard kept reading without progress");
}

fn refused(outcome: &Outcome, input: &[u8]) -> bool {
    assert!(
        input.starts_with(&outcome.delivered),
        "the guard changed or reordered bytes"
    );
    let refused = outcome.delivered.len() < input.len();
    if refused {
        assert!(
            outcome.written.is_empty()
                || outcome.written.starts_with(b"HTTP/1.1 400 ")
                || outcome.written.starts_with(b"HTTP/1.1 431 "),
            "a refusal answers with the guard's own 400 or 431 only"
        );
    } else {
        assert!(outcome.written.is_empty(), "wrote to a stream it accepted");
    }
    refused
}

fuzz_target!(|data: &[u8]| {
    // Layout: [pieces count][pieces...][read buffer size: 2 bytes][stream...]
    let Some((&count, rest)) = data.split_first() else {
        return;
    };
    let count = usize::from(count % 32).min(rest.len());
    let (pieces, rest) = rest.split_at(count);
    let (size, input) = match rest {
        [a, b, input @ ..] => (usize::from(u16::from_le_bytes([*a, *b])) % 16384 + 1, input),
        _ => return,
    };
    let whole = run(input, &[], 1 << 17);
    let split = run(input, pieces, size);
    assert_eq!(
        refused(&whole, input),
        refused(&split, input),
        "the verdict depends on how the stream was split"
    );
});
