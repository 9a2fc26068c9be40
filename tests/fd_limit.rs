//! Out of file descriptors (issue 14, item 2; contract §9): "when accepting fails for lack of
//! descriptors it backs off and logs at most one line per second".
//!
//! The review's reproduction ran tollgate under a 256-descriptor limit until one client's
//! streams had taken them all. This binary holds a single test because it lowers this
//! process's open-file limit and takes every descriptor left, which would break any other
//! test sharing the process; a tracing subscriber set for the whole binary counts the
//! accept-failure lines of both connection workers.

mod common;

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

use common::*;

/// Counts tollgate's "accept failed" lines, and the largest count of failures a line said
/// it did not log.
#[derive(Clone, Default)]
struct AcceptFailureLines {
    lines: Arc<AtomicUsize>,
    most_not_logged: Arc<AtomicU64>,
}

#[derive(Default)]
struct Fields {
    message: String,
    not_logged: u64,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "not_logged" {
            self.not_logged = value;
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for AcceptFailureLines {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if !event.metadata().target().starts_with("tollgate") {
            return;
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        if fields.message.contains("accept failed") {
            self.lines.fetch_add(1, Ordering::SeqCst);
            self.most_not_logged
                .fetch_max(fields.not_logged, Ordering::SeqCst);
        }
    }
}

#[allow(unsafe_code)] // the rlimit calls, as in src/server/open_files.rs
fn open_file_limit() -> libc::rlimit {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
        0
    );
    limit
}

#[allow(unsafe_code)]
fn set_soft_limit(soft: libc::rlim_t) {
    let limit = libc::rlimit {
        rlim_cur: soft,
        rlim_max: open_file_limit().rlim_max,
    };
    // SAFETY: setrlimit only reads the struct it is given.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
}

/// The highest descriptor number this process has open.
fn highest_open_fd() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .expect("some descriptor is open")
}

/// With every descriptor taken, a client that connects waits in the listen backlog while
/// both workers' accepts fail with EMFILE ten times a second each: in 2.5 s that is about 50
/// failures, and at most 3 lines in the log (the review's run logged every one). Once
/// descriptors are free again the waiting client is served.
#[tokio::test]
async fn out_of_descriptors_accept_failures_are_logged_once_a_second_and_service_resumes() {
    let counter = AcceptFailureLines::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(counter.clone()))
        .expect("the only subscriber of this binary");

    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 2\nshutdown_timeout = \"1s\"\n\n\
         [upstreams.app]\nurl = \"http://@UPSTREAM@\"\n\n\
         [[routes]]\nname = \"all\"\nupstream = \"app\"\n",
        upstream.addr,
        &[],
    ))
    .await;
    let original = open_file_limit();

    // Take every descriptor under a lowered soft limit, then give one back for the client.
    set_soft_limit(highest_open_fd() + 32);
    let mut hog = Vec::new();
    let exhausted = loop {
        match std::fs::File::open("/dev/null") {
            Ok(file) => hog.push(file),
            Err(err) => break err,
        }
    };
    assert_eq!(exhausted.raw_os_error(), Some(libc::EMFILE), "{exhausted}");
    hog.pop();
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    client
        .write_all(b"GET /after-emfile HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let lines = counter.lines.load(Ordering::SeqCst);
    let most_not_logged = counter.most_not_logged.load(Ordering::SeqCst);

    // Descriptors free again: the client waiting in the backlog is accepted and served.
    drop(hog);
    set_soft_limit(original.rlim_cur);
    let mut reply = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(3), client.read_to_end(&mut reply)).await;
    assert!(
        read.is_ok(),
        "the waiting client was not served once descriptors were freed"
    );
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert_eq!(upstream.count(), 1);

    assert!(
        (1..=3).contains(&lines),
        "{lines} accept-failure lines in 2.5 s (at most one a second)"
    );
    assert!(
        most_not_logged >= 5,
        "the lines counted {most_not_logged} failures not logged; about 20 a second were"
    );
}
