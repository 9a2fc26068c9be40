//! The server's own state and start-up (issue 19, "The house"): the store is started behind
//! `store::start`, and its sweep stays quiet until the database has answered; two servers in
//! one process share no clock and no per-worker state; reloads and the access log still work
//! with their blocking work moved off the runtimes.
//!
//! Real servers on port 0, a recording upstream, real PostgreSQL where a database is named.

mod common;

use std::time::Duration;

use common::*;

/// A `[store]` body naming a database that is not there: a port that was just free.
async fn absent_database() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    format!(
        "url = \"host=127.0.0.1 port={port} user=postgres dbname=absent connect_timeout=1\"\n\
         timeout = \"300ms\"\nsweep_interval = \"100ms\""
    )
}

/// Issue 19: with the database down at start, tollgate logged "sweep failed" although nothing
/// had been counted yet: the sweep ran before the store was up. It waits for the store now.
/// A current-thread runtime, so that the subscriber set for this thread sees the store's tasks.
#[tokio::test(flavor = "current_thread")]
async fn no_sweep_warning_while_the_database_has_never_answered() {
    let (captured, _guard) = common::log::CapturedLog::warnings();
    let upstream = Upstream::start().await;
    let text = limits_config(&absent_database().await, "workers = 1", "");
    let mut proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    // Several sweep intervals, and the start-up retry's first attempts.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let text = captured.text();
    assert!(
        text.contains("postgres not ready"),
        "the start says the store is not up: {text}"
    );
    assert!(!text.contains("sweep failed"), "a spurious sweep warning: {text}");
    proxy.shutdown().await;
}
