//! Bounded memory whatever clients send (contract §9, issue 14 item 10), the rate-limit
//! fields of denials answered from the exhausted-bucket cache (contract §5), and commands whose
//! stdout is closed early (`tollgate check | head -1`).
//!
//! Review reproductions: the memory store grew 206 bytes per distinct key with no cap (500k
//! keys: 7 MB to 108 MB); a cached denial listed only the exhausted limit in `RateLimit` and
//! `RateLimit-Policy`; `tollgate check | head -1` panicked on the closed pipe (exit 101).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

use sha2::{Digest, Sha256};

use tollgate::testing::config::DEFAULT_MEMORY_BUCKETS;
use tollgate::testing::limit::{Limiter, Outcomes, PlannedLimit, Verdict};
use tollgate::testing::metrics::{MemoryStoreMetrics, Metrics};
use tollgate::testing::store::memory::MemoryStore;
use tollgate::testing::store::{Clock, Increment, Store};

use common::db::TestDb;
use common::*;

/// The system allocator, keeping count of the heap bytes each thread has taken and not
/// given back, so that a test can weigh what it keeps while other tests run beside it.
struct CountingAlloc;

thread_local! {
    static HEAP_HELD: Cell<isize> = const { Cell::new(0) };
}

fn count_heap(delta: isize) {
    // `try_with`: the allocator also runs while a thread's locals are being torn down.
    let _ = HEAP_HELD.try_with(|held| held.set(held.get() + delta));
}

// SAFETY: every call is passed on to `System` unchanged; the count is a thread-local `Cell`,
// which neither allocates nor blocks. (The crate's lint policy allows unsafe code only by
// name: a global allocator cannot be written without it.)
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            count_heap(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            count_heap(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        System.dealloc(p, layout);
        count_heap(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = System.realloc(p, layout, new_size);
        if !q.is_null() {
            count_heap(new_size as isize - layout.size() as isize);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

/// Heap bytes this thread holds (see [`CountingAlloc`]).
fn heap_held() -> isize {
    HEAP_HELD.with(Cell::get)
}

/// Issue 47: a live bucket of the memory store cost 221 bytes of RSS (500,000 keys grew it by
/// 105 MB; the default bound of 1,000,000 buckets is 221 MB), against about 128 for a state
/// of an nginx `limit_req` zone. 96,000 buckets named as the proxy names them, one request
/// each, through a store of the default bound: the heap the store keeps for them, slack of
/// its vectors and tables included, is under 128 bytes a bucket. Each request's own name is
/// dropped after its call, as the proxy drops it: a store that kept the name would pay for it
/// here. (`bench/memory_bucket_bytes.sh` measures the RSS; docs/performance.md, "Memory per
/// bucket".)
#[test]
fn a_live_memory_bucket_holds_under_128_bytes_of_heap() {
    const KEYS: usize = 96_000;
    let buckets = NonZeroUsize::new(DEFAULT_MEMORY_BUCKETS).expect("non-zero");
    let store = MemoryStore::bounded(buckets, MemoryStoreMetrics::default());
    let before = heap_held();
    for n in 0..KEYS {
        let digest = hex::encode(Sha256::digest(n.to_le_bytes()));
        let batch = [Increment {
            bucket: Arc::from(format!("api:x-api-key:{digest}")),
            window_secs: 3600,
            by: 1,
            sliding: None,
            enforce: Some(100),
            check: false,
        }];
        let counted = store
            .increment_now(&batch)
            .expect("at once")
            .expect("counted");
        assert_eq!(counted[0].count, 1);
    }
    let per_bucket = (heap_held() - before) as f64 / KEYS as f64;
    assert_eq!(store.len(), KEYS);
    assert!(
        per_bucket < 128.0,
        "{per_bucket:.1} bytes of heap per live bucket"
    );
}

/// The value of the first series in `text` that starts with `series`.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn scrape(client: &H1Client, admin: SocketAddr) -> String {
    let answer = get(client, &format!("http://{admin}/metrics")).await;
    assert_eq!(answer.status, StatusCode::OK);
    answer.text()
}

fn keyed(url: &str, key: &str) -> Request<Full<Bytes>> {
    Request::get(url)
        .header("x-api-key", key)
        .body(Full::new(Bytes::new()))
        .expect("request")
}

/// A memory store of `memory_buckets = 100` and a route limited per `X-Api-Key`.
fn bounded_store_config(requests: u32) -> String {
    limits_config(
        "memory_buckets = 100",
        "[admin]\nlisten = \"127.0.0.1:0\"",
        &format!(
            r#"
[[routes]]
name = "keyed"
path_prefix = "/keyed"
upstream = "app"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = {requests}
  window = "1h"
"#
        ),
    )
}

/// The review: 500k distinct keys took the memory store from 7 MB to 108 MB. With
/// `memory_buckets = 100`, a thousand distinct keys through the proxy never make it hold more
/// than 100 buckets; every bucket past the bound is one eviction, counted exactly in
/// `/metrics`; and the LRU keeps a bucket that is used: a client that keeps coming back
/// between the churn (50 new keys between two of its requests, fewer than the bound) keeps its
/// count, so it gets exactly its 5 requests and stays denied after them. A store that forgot
/// in insertion order (or at random) would hand it a fresh budget.
#[tokio::test]
async fn memory_store_keeps_at_most_memory_buckets_and_evicts_the_least_recently_used() {
    let upstream = Upstream::start().await;
    let text = bounded_store_config(5);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    let client = h1_client();
    let url = proxy.url("/keyed");

    let mut regular_allowed = 0;
    let mut churn_keys = 0usize;
    for round in 0..20 {
        let answer = send(&client, keyed(&url, "regular-client")).await;
        match answer.status {
            StatusCode::OK => regular_allowed += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("round {round}: unexpected {other}"),
        }
        // 50 clients never seen before, each within its limit.
        for _ in 0..50 {
            let key = format!("churn-{churn_keys}");
            churn_keys += 1;
            assert_eq!(
                send(&client, keyed(&url, &key)).await.status,
                StatusCode::OK
            );
        }
        let metrics = scrape(&client, admin).await;
        let held = metric(&metrics, "tollgate_memory_buckets ").expect("bucket gauge");
        assert!(held <= 100.0, "round {round}: {held} buckets held");
    }
    assert_eq!(
        regular_allowed, 5,
        "the regular client's bucket was forgotten while it was in use"
    );
    let metrics = scrape(&client, admin).await;
    // 1000 churn buckets and the regular client's, into a store of 100.
    assert_eq!(
        metric(&metrics, "tollgate_memory_evictions_total "),
        Some((churn_keys + 1 - 100) as f64),
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "tollgate_memory_buckets "), Some(100.0));
    // Each churn key was allowed once, the regular client 5 times.
    assert_eq!(upstream.count(), churn_keys + 5);
}

/// The other side of nginx-style eviction, as contract §9 states it: a client whose bucket was
/// forgotten starts a new count. With 150 new keys between two of its requests (more than the
/// bound), the first client's bucket is evicted and its next request is allowed again.
#[tokio::test]
async fn a_bucket_unused_while_the_bound_churns_is_forgotten() {
    let upstream = Upstream::start().await;
    let text = bounded_store_config(1);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let client = h1_client();
    let url = proxy.url("/keyed");
    // Under its limit (1 of 1 used, not exceeded): not in the exhausted-bucket cache.
    assert_eq!(
        send(&client, keyed(&url, "first")).await.status,
        StatusCode::OK
    );
    for n in 0..150 {
        let key = format!("other-{n}");
        assert_eq!(
            send(&client, keyed(&url, &key)).await.status,
            StatusCode::OK
        );
    }
    assert_eq!(
        send(&client, keyed(&url, "first")).await.status,
        StatusCode::OK,
        "the least recently used bucket should have been forgotten"
    );
    let metrics = proxy.server().metrics().render();
    assert_eq!(
        metric(&metrics, "tollgate_memory_evictions_total "),
        Some(52.0),
        "151 buckets into 100, then `first` again"
    );
}

/// `memory_buckets` is validated: a whole number from 1. With a database URL it is accepted
/// (contract §2's own example has both) and ignored, with a warning at start.
#[test]
fn memory_buckets_is_validated() {
    let load = |store: &str| {
        let text = limits_config(store, "", "").replace("@UPSTREAM@", "127.0.0.1:9");
        tollgate::testing::config::load_str(Path::new("t.toml"), &text, &|_| None)
    };
    let config = load("").expect("defaults");
    assert_eq!(config.store.memory_buckets.get(), 1_000_000);
    let config = load("memory_buckets = 7").expect("7");
    assert_eq!(config.store.memory_buckets.get(), 7);
    for bad in [
        "memory_buckets = 0",
        "memory_buckets = -1",
        "memory_buckets = \"10\"",
    ] {
        let errors = load(bad).expect_err(bad).to_string();
        assert!(errors.contains("store.memory_buckets"), "{bad}: {errors}");
    }
    let config = load("url = \"postgres://db/x\"\nmemory_buckets = 10").expect("with a url");
    assert_eq!(config.store.memory_buckets.get(), 10);
}

/// The exhausted-bucket cache is bounded (16 shards of 8192): a flood of distinct keys, each
/// pushed over its limit, never makes it hold more, and once it is full the store still
/// decides every request exactly: every key's second request is denied, cached or not, and so
/// is every later one.
#[tokio::test]
async fn exhausted_cache_stays_bounded_and_denials_stay_exact_when_it_is_full() {
    let store = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let limiter = Limiter::new(store, Duration::from_secs(5), 1, metrics, Clock::system());
    let bound = Limiter::CACHED_DENIALS_MAX;
    let plan = |n: usize| {
        [PlannedLimit {
            policy: Arc::from("flood:x-api-key"),
            bucket: Arc::from(format!("flood:x-api-key:{n:064x}")),
            requests: 1,
            window_secs: 3600,
            shadow: false,
            sliding: false,
            reserve: false,
            cost: 1,
            charged_after: false,
        }]
    };
    let mut outcomes = Outcomes::new();
    for n in 0..bound + 2000 {
        let plans = plan(n);
        assert!(matches!(
            limiter.decide(0, &plans, &mut outcomes).await,
            Verdict::Allow { .. }
        ));
        assert!(
            matches!(
                limiter.decide(0, &plans, &mut outcomes).await,
                Verdict::Deny { .. }
            ),
            "key {n}: its second request must be denied"
        );
        if n % 1024 == 0 {
            assert!(limiter.cached_denials() <= bound);
        }
    }
    assert!(limiter.cached_denials() <= bound);
    // Filled (a shard that is full refuses more while another may still have a little room).
    assert!(
        limiter.cached_denials() > bound - bound / 50,
        "{} cached",
        limiter.cached_denials()
    );
    // The keys exhausted last, most of them not cached, are still denied every time.
    for n in bound..bound + 2000 {
        assert!(
            matches!(
                limiter.decide(0, &plan(n), &mut outcomes).await,
                Verdict::Deny { .. }
            ),
            "key {n} was let through once the cache was full"
        );
    }
    // A fresh key is decided by the store, exactly.
    let fresh = plan(usize::MAX);
    assert!(matches!(
        limiter.decide(0, &fresh, &mut outcomes).await,
        Verdict::Allow { .. }
    ));
    for _ in 0..5 {
        assert!(matches!(
            limiter.decide(0, &fresh, &mut outcomes).await,
            Verdict::Deny { .. }
        ));
    }
}

/// The review: a denial answered from the exhausted-bucket cache listed only the exhausted
/// limit. A route with two limits, the first exhausted: the first denial (decided by the
/// store) and the next ones (from the cache) list both members in `RateLimit-Policy` and
/// `RateLimit`, in the same order.
#[tokio::test]
async fn cached_denial_lists_every_applicable_limit() {
    let upstream = Upstream::start().await;
    let text = limits_config(
        "",
        "",
        r#"
[[routes]]
name = "two"
path_prefix = "/two"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1
  window = "1h"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 100
  window = "1d"
"#,
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let client = h1_client();
    let url = proxy.url("/two");
    assert_eq!(send(&client, keyed(&url, "k")).await.status, StatusCode::OK);
    let policy = "\"two:ip\";q=1;w=3600, \"two:x-api-key\";q=100;w=86400";
    let members = |value: &str| -> Vec<(String, u64, u64)> {
        value
            .split(", ")
            .map(|member| {
                let mut parts = member.split(';');
                let name = parts.next().expect("name").to_string();
                let mut r = None;
                let mut t = None;
                for p in parts {
                    if let Some(v) = p.strip_prefix("r=") {
                        r = v.parse().ok();
                    } else if let Some(v) = p.strip_prefix("t=") {
                        t = v.parse().ok();
                    }
                }
                (name, r.expect("r"), t.expect("t"))
            })
            .collect()
    };
    let mut first_denial = None;
    for attempt in 0..3 {
        let denied = send(&client, keyed(&url, "k")).await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            denied.header("ratelimit-policy"),
            Some(policy),
            "attempt {attempt}"
        );
        let state = members(denied.header("ratelimit").expect("RateLimit"));
        let names: Vec<&str> = state.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["\"two:ip\"", "\"two:x-api-key\""],
            "attempt {attempt}"
        );
        assert_eq!(state[0].1, 0, "the exhausted limit has nothing left");
        assert!((1..=3600).contains(&state[0].2), "{state:?}");
        // The other limit was not exceeded; its window is a day long.
        assert!(state[1].1 <= 100 && state[1].1 > 0, "{state:?}");
        assert!((1..=86_400).contains(&state[1].2), "{state:?}");
        match &first_denial {
            None => first_denial = Some(state),
            Some(first) => {
                // The cache does not count the other limit: it reports its window's end
                // (the same epoch-aligned window) and what the store's denial left of it.
                assert!(first[1].2.abs_diff(state[1].2) <= 1, "{first:?} {state:?}");
                assert!(state[1].1 >= first[1].1, "{first:?} {state:?}");
            }
        }
    }
    assert_eq!(upstream.count(), 1);
}

/// Runs tollgate with `args`, its stdout a pipe whose read end is closed at once, or after the
/// first line has been read; returns how it exited.
fn tollgate_with_stdout_closed(args: &[&str], after_first_line: bool) -> std::process::ExitStatus {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .env_remove("TOLLGATE_CONFIG")
        .env_remove("TOLLGATE_DATABASE_URL")
        .env_remove("TOLLGATE_KEY_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run tollgate");
    let stdout = child.stdout.take().expect("stdout pipe");
    if after_first_line {
        let mut first = String::new();
        BufReader::new(stdout)
            .read_line(&mut first)
            .expect("first line");
        assert!(!first.is_empty(), "no output at all");
        // The reader (and the pipe's read end) is dropped here, like `head -1` exiting.
    } else {
        drop(stdout);
    }
    child.wait().expect("tollgate exits")
}

/// The review: `tollgate check | head -1` panicked on the closed pipe (exit 101). The
/// configuration has enough routes that `check` prints far more than a pipe buffer holds, so
/// it is still writing when the reader goes away after the first line.
#[test]
fn check_with_stdout_closed_after_the_first_line_exits_0() {
    let dir = std::env::temp_dir().join(format!("tollgate-pipe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("many-routes.toml");
    let mut file = std::fs::File::create(&path).expect("config file");
    writeln!(
        file,
        "[server]\nlisten = [\"127.0.0.1:0\"]\n[upstreams.app]\nurl = \"http://127.0.0.1:9\""
    )
    .expect("write");
    for n in 0..3000 {
        writeln!(
            file,
            "[[routes]]\nname = \"route-{n}\"\npath_prefix = \"/r{n}\"\nupstream = \"app\"\n  [[routes.limits]]\n  key = \"ip\"\n  requests = 5\n  window = \"1m\""
        )
        .expect("write");
    }
    drop(file);
    let status =
        tollgate_with_stdout_closed(&["check", "--config", path.to_str().expect("utf-8")], true);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(status.code(), Some(0), "{status}");
}

/// `explain` writes to a stdout whose reader has gone: the normal exit code, no panic.
#[test]
fn explain_with_stdout_closed_exits_0() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.toml.example");
    let status = tollgate_with_stdout_closed(
        &[
            "explain",
            "--config",
            example.to_str().expect("utf-8"),
            "POST",
            "http://api.example.com/login",
        ],
        false,
    );
    assert_eq!(status.code(), Some(0), "{status}");
}

/// `migrate` prints its report to a stdout whose reader has gone: still 0 (the migration
/// was applied), no panic.
#[tokio::test]
async fn migrate_with_stdout_closed_exits_0() {
    let db = TestDb::new().await;
    let dir = std::env::temp_dir().join(format!("tollgate-migrate-pipe-{}", db.name));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n[store]\nurl = \"{}\"\n[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n",
            db.url
        ),
    )
    .expect("config file");
    let config = path.to_str().expect("utf-8").to_string();
    let status = tokio::task::spawn_blocking(move || {
        tollgate_with_stdout_closed(&["migrate", "--config", &config], false)
    })
    .await
    .expect("migrate ran");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(status.code(), Some(0), "{status}");
    let applied: i64 = db
        .client()
        .await
        .query_one("SELECT count(*) FROM tollgate_migrations", &[])
        .await
        .expect("migrations table")
        .get(0);
    assert!(applied >= 1);
}

/// Sends `head`, then `filler` over and over (up to 4 MiB) on one connection, and returns
/// whether tollgate closed the connection `within` that time: a guard that buffered whatever
/// the client sends would keep reading instead.
async fn closes_before_buffering(
    proxy: &Proxy,
    head: &[u8],
    filler: &[u8],
    within: Duration,
) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    let head = head.to_vec();
    let filler = filler.to_vec();
    let writing = tokio::spawn(async move {
        writer.write_all(&head).await?;
        let mut sent = 0;
        while sent < 4 << 20 {
            writer.write_all(&filler).await?;
            sent += filler.len();
        }
        // Keep the write side open (dropping it would send a FIN, ending the body early).
        std::future::pending::<()>().await;
        Ok::<_, std::io::Error>(writer)
    });
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(within, reader.read_to_end(&mut sink))
        .await
        .is_ok();
    writing.abort();
    closed
}

/// The framing guard's per-connection buffer (read only here: http1/guard.rs is another part's)
/// is bounded for chunk-size lines: an endless chunk extension is cut at its bound (4 KiB)
/// rather than buffered, and the connection is closed.
#[tokio::test]
async fn an_endless_chunk_size_line_is_not_buffered() {
    let upstream = Upstream::start().await;
    let text = format!("{BASE}\n[[routes]]\nname = \"open\"\nupstream = \"app\"\n");
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let head = b"POST /upload HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\n";
    let endless_line = [head.as_slice(), b"5;ext="].concat();
    assert!(
        closes_before_buffering(
            &proxy,
            &endless_line,
            &[b'a'; 16 * 1024],
            Duration::from_secs(5)
        )
        .await,
        "a 4 MiB chunk-size line was read on"
    );
    // The control: 4 MiB of well-formed chunks are streamed on, not cut.
    let chunk = [b"4000\r\n".as_slice(), &[b'c'; 0x4000], b"\r\n"].concat();
    assert!(
        !closes_before_buffering(&proxy, head, &chunk, Duration::from_secs(1)).await,
        "a well-formed chunked upload was cut"
    );
}

/// The same for the trailer section (bound 16 KiB): endless trailer fields close the
/// connection.
#[tokio::test]
async fn endless_trailers_are_not_buffered() {
    let upstream = Upstream::start().await;
    let text = format!("{BASE}\n[[routes]]\nname = \"open\"\nupstream = \"app\"\n");
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let head =
        b"POST /upload HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n";
    let field = format!("x-trailer: {}\r\n", "b".repeat(1000));
    assert!(
        closes_before_buffering(&proxy, head, field.as_bytes(), Duration::from_secs(5)).await,
        "4 MiB of trailer fields were read on"
    );
}

/// The per-worker cache of `ip` bucket names (key.rs) holds 4096 addresses at most and starts
/// again empty past it. Seen from outside, that bound costs a rebuild, never a wrong bucket:
/// with one worker and 6000 distinct client addresses between two requests of one client
/// (more than the bound, so the cache was cleared in between), that client's count goes on
/// in the same bucket and its limit holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ip_name_cache_bound_never_changes_a_bucket() {
    let upstream = Upstream::start().await;
    let text = limits_config(
        "",
        "workers = 1\ntrusted_proxies = [\"127.0.0.1/32\"]",
        r#"
[[routes]]
name = "per-ip"
path_prefix = "/ip"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"
"#,
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let url = proxy.url("/ip");
    let from = |addr: String| {
        Request::get(&url)
            .header("x-forwarded-for", addr)
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    let client = h1_client();
    let regular = "198.51.100.7".to_string();
    assert_eq!(
        send(&client, from(regular.clone())).await.status,
        StatusCode::OK
    );
    let mut tasks = Vec::new();
    for part in 0..6u32 {
        let client = client.clone();
        let requests: Vec<_> = (0..1000u32)
            .map(|i| from(std::net::Ipv4Addr::from(0x0a00_0000 + part * 1000 + i).to_string()))
            .collect();
        tasks.push(tokio::spawn(async move {
            for request in requests {
                assert_eq!(send(&client, request).await.status, StatusCode::OK);
            }
        }));
    }
    for task in tasks {
        task.await.expect("churn");
    }
    assert_eq!(
        send(&client, from(regular.clone())).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&client, from(regular)).await.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the regular client got a new bucket after the cache was cleared"
    );
    let metrics = proxy.server().metrics().render();
    assert_eq!(metric(&metrics, "tollgate_memory_buckets "), Some(6001.0));
}
