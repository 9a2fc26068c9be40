//! The server's own state and start-up (issue 19, "The house"): the store is started behind
//! the server's store start-up (`server/store_start.rs`), and its sweep stays quiet until the database has answered; two servers in
//! one process share no clock and no per-worker state; reloads and the access log still work
//! with their blocking work moved off the runtimes.
//!
//! Real servers on port 0, a recording upstream, real PostgreSQL where a database is named.

use std::time::Duration;

use crate::common::*;

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
    let (captured, _guard) = crate::common::log::CapturedLog::warnings();
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
    assert!(
        !text.contains("sweep failed"),
        "a spurious sweep warning: {text}"
    );
    proxy.shutdown().await;
}

/// Route `per_ip` (`/per-ip`): 100 requests per hour per client address.
const PER_IP: &str = r#"
[[routes]]
name = "per_ip"
path_prefix = "/per-ip"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 100
  window = "1h"
"#;

/// Issue 19: the coarse clock was a process-wide static counting from the first server's
/// start, and the `ip` bucket cache a thread-local that every server's worker on a thread
/// shared. Two servers in this one process (their worker 0 on this one thread) now each have
/// their own: the clock counts from each one's start and goes on after the other stops, and
/// requests through one fill only that server's cache.
#[tokio::test(flavor = "current_thread")]
async fn two_servers_in_one_process_share_no_clock_and_no_worker_state() {
    let upstream = Upstream::start().await;
    let text = limits_config("", "workers = 1", PER_IP);
    let mut first = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut second = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    // Both clocks have ticked since the second start.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (a, b) = (
        first.server().coarse_clock_ms(),
        second.server().coarse_clock_ms(),
    );
    assert!(
        a >= b + 300,
        "each server's clock counts from its own start: first {a} ms, second {b} ms"
    );

    let client = h1_client();
    for _ in 0..3 {
        assert_eq!(
            get(&client, &first.url("/per-ip")).await.status,
            http::StatusCode::OK
        );
    }
    let cached = |proxy: &Proxy| -> usize {
        proxy
            .server()
            .workers()
            .iter()
            .map(|w| w.ip_buckets().addresses())
            .sum()
    };
    assert_eq!(
        cached(&first),
        1,
        "the first server cached its client's bucket"
    );
    assert_eq!(
        cached(&second),
        0,
        "the second server's workers saw no request"
    );

    // The first server's clock stops with it; the second's goes on.
    first.shutdown().await;
    let before = second.server().coarse_clock_ms();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = second.server().coarse_clock_ms();
    assert!(after >= before + 100, "{before} -> {after}");
    assert_eq!(
        get(&client, &second.url("/per-ip")).await.status,
        http::StatusCode::OK
    );
    assert_eq!(cached(&second), 1);
    second.shutdown().await;
}
