//! Counter stores (contract §3 and §6): exact counts under concurrency, one statement per
//! batch, epoch-aligned windows, saturation, migrations applied once, the key fingerprint,
//! the sweep, and failure within `store.timeout`. Every Postgres test runs against a fresh
//! database of its own (tests/common/db.rs); the semantic tests run on both stores.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::common::db::TestDb;
use crate::common::RefusedPort;
use tollgate::testing::store::memory::MemoryStore;
use tollgate::testing::store::postgres::{FingerprintChange, InitError, PostgresStore};
use tollgate::testing::store::{Increment, Store, StoreError};

fn inc(bucket: &str, window_secs: u32, by: u32) -> Increment {
    Increment {
        bucket: Arc::from(bucket),
        window_secs,
        by,
        sliding: None,
        enforce: None,
        check: false,
    }
}

/// A window long enough that no test straddles its end (the next boundary of a 366-day
/// window is months away at any moment a test could run).
const LONG: u32 = 366 * 86_400;

async fn pg_store(db: &TestDb) -> Arc<PostgresStore> {
    let store = PostgresStore::new(&db.store_config()).expect("store builds");
    store
        .initialize("fingerprint-a", true)
        .await
        .expect("initialize");
    store
}

// ---------------------------------------------------------------------------------------------
// Semantics shared by both stores.

/// 50 tasks × 40 increments of one bucket: every count from 1 to 2000 is seen exactly once
/// (no lost update, no two requests given the same position).
async fn exact_under_concurrency(store: Arc<dyn Store>) {
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let batch = [inc("test:global", LONG, 1)];
                let mut seen = Vec::with_capacity(40);
                for _ in 0..40 {
                    let counted = store.increment(&batch).await.expect("increment");
                    seen.push(counted[0].count);
                }
                seen
            })
        })
        .collect();
    let mut all = Vec::with_capacity(2000);
    for task in tasks {
        all.extend(task.await.expect("task"));
    }
    all.sort_unstable();
    assert_eq!(all, (1..=2000).collect::<Vec<u32>>());
}

/// Several buckets, windows and amounts in one batch; answers come back in batch order even
/// though the statement works in bucket order.
async fn batch_in_order(store: &dyn Store) {
    let batch = [
        inc("z:ip:1", 60, 1),
        inc("a:ip:1", 3600, 5),
        inc("m:global", LONG, 2),
    ];
    let first = store.increment(&batch).await.expect("first");
    assert_eq!(first.iter().map(|c| c.count).collect::<Vec<_>>(), [1, 5, 2]);
    let second = store.increment(&batch).await.expect("second");
    assert_eq!(
        second.iter().map(|c| c.count).collect::<Vec<_>>(),
        [2, 10, 4]
    );
    for (c, i) in second.iter().zip(&batch) {
        let len_ms = i64::from(i.window_secs) * 1000;
        assert_eq!(c.window_end_ms % len_ms, 0, "{}", i.bucket);
        assert!(c.now_ms < c.window_end_ms && c.window_end_ms - len_ms <= c.now_ms);
    }
    // Peek reads the same counts without changing them; an unknown bucket reads 0.
    let mut peek_batch = batch.to_vec();
    peek_batch.push(inc("never:seen", 60, 1));
    let peeked = store.peek(&peek_batch).await.expect("peek");
    assert_eq!(
        peeked.iter().map(|p| p.count).collect::<Vec<_>>(),
        [2, 10, 4, 0]
    );
    assert_eq!(peeked[3].window_end_ms % 60_000, 0);
    let again = store.peek(&peek_batch).await.expect("peek again");
    assert_eq!(
        again.iter().map(|p| p.count).collect::<Vec<_>>(),
        [2, 10, 4, 0]
    );
    assert!(store.increment(&[]).await.expect("empty").is_empty());
}

/// Batches sharing buckets, each listing them in a different order, run at once: none
/// deadlocks or errors (the statement locks rows in bucket order), and no update is lost.
async fn overlapping_batches(store: Arc<dyn Store>) {
    let buckets: Vec<String> = (0..10).map(|i| format!("overlap:{i}")).collect();
    let tasks: Vec<_> = (0..20)
        .map(|t| {
            let store = Arc::clone(&store);
            let mut order = buckets.clone();
            order.rotate_left(t % 10);
            if t % 2 == 1 {
                order.reverse();
            }
            tokio::spawn(async move {
                let batch: Vec<Increment> = order.iter().map(|b| inc(b, LONG, 1)).collect();
                for _ in 0..20 {
                    store.increment(&batch).await.expect("increment");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    let batch: Vec<Increment> = buckets.iter().map(|b| inc(b, LONG, 1)).collect();
    let peeked = store.peek(&batch).await.expect("peek");
    assert!(peeked.iter().all(|p| p.count == 400), "{peeked:?}");
}

/// A flooded bucket saturates at i32::MAX and never errors.
async fn saturates(store: &dyn Store, bucket: &str) {
    let batch = [inc(bucket, LONG, 100)];
    let counted = store.increment(&batch).await.expect("increment");
    assert_eq!(counted[0].count, i32::MAX as u32);
    let counted = store
        .increment(&[inc(bucket, LONG, u32::MAX)])
        .await
        .expect("increment by u32::MAX");
    assert_eq!(counted[0].count, i32::MAX as u32);
}

// ---------------------------------------------------------------------------------------------
// Postgres.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_concurrent_increments_are_exact() {
    let db = TestDb::new().await;
    let store = pg_store(&db).await;
    exact_under_concurrency(store.clone()).await;
    let client = db.client().await;
    let row = client
        .query_one("SELECT count(*), max(count) FROM rate_limits", &[])
        .await
        .expect("select");
    assert_eq!(row.get::<_, i64>(0), 1);
    assert_eq!(row.get::<_, i32>(1), 2000);
    assert!(store.ready());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_overlapping_batches_neither_deadlock_nor_lose_updates() {
    let db = TestDb::new().await;
    let store = pg_store(&db).await;
    overlapping_batches(store).await;
}

#[tokio::test]
async fn pg_batch_counts_each_bucket() {
    let db = TestDb::new().await;
    let store = pg_store(&db).await;
    batch_in_order(&*store).await;
    let client = db.client().await;
    let rows = client
        .query("SELECT bucket, count FROM rate_limits ORDER BY bucket", &[])
        .await
        .expect("select");
    let got: Vec<(String, i32)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        got,
        [
            ("a:ip:1".to_owned(), 10),
            ("m:global".to_owned(), 4),
            ("z:ip:1".to_owned(), 2)
        ]
    );
    // The contract says buckets in a batch are distinct; a duplicate is refused, not
    // double-counted.
    let dup = store.increment(&[inc("d", 60, 1), inc("d", 60, 1)]).await;
    assert!(matches!(dup, Err(StoreError::Query(_))), "{dup:?}");
}

#[tokio::test]
async fn pg_windows_are_epoch_aligned_from_the_database_clock() {
    let db = TestDb::new().await;
    let store = pg_store(&db).await;
    let windows = [7u32, 60, 3600, 86_400, LONG];
    let batch: Vec<Increment> = windows
        .iter()
        .map(|w| inc(&format!("w:{w}"), *w, 1))
        .collect();
    let counted = store.increment(&batch).await.expect("increment");
    let client = db.client().await;
    for (c, w) in counted.iter().zip(windows) {
        let row = client
            .query_one(
                "SELECT extract(epoch FROM window_start)::int8, extract(epoch FROM expires_at)::int8
                 FROM rate_limits WHERE bucket = $1",
                &[&format!("w:{w}")],
            )
            .await
            .expect("row");
        let (start, expires): (i64, i64) = (row.get(0), row.get(1));
        let w = i64::from(w);
        assert_eq!(start % w, 0, "window {w}");
        assert_eq!(expires, start + w, "window {w}");
        assert_eq!(c.window_end_ms, expires * 1000, "window {w}");
        assert!(
            start * 1000 <= c.now_ms && c.now_ms < c.window_end_ms,
            "window {w}"
        );
    }
    // now_ms is the database's clock: compare with the server's now().
    let db_now: i64 = client
        .query_one("SELECT floor(extract(epoch FROM now()) * 1000)::int8", &[])
        .await
        .expect("now")
        .get(0);
    assert!((db_now - counted[0].now_ms).abs() < 5_000);
}

#[tokio::test]
async fn pg_counts_saturate_at_i32_max() {
    let db = TestDb::new().await;
    let store = pg_store(&db).await;
    let client = db.client().await;
    client
        .execute(
            "INSERT INTO rate_limits (bucket, window_start, count, expires_at)
             SELECT 'flood', to_timestamp(s), 2147483640, to_timestamp(s + $1)
             FROM (SELECT (floor(extract(epoch FROM now()))::int8 / $1) * $1 AS s) t",
            &[&i64::from(LONG)],
        )
        .await
        .expect("pre-insert");
    saturates(&*store, "flood").await;
}

#[tokio::test]
async fn pg_concurrent_initialize_applies_each_migration_once() {
    let db = TestDb::new().await;
    let stores: Vec<_> = (0..5)
        .map(|_| PostgresStore::new(&db.store_config()).expect("store builds"))
        .collect();
    let tasks: Vec<_> = stores
        .iter()
        .map(|s| {
            let s = Arc::clone(s);
            tokio::spawn(async move { s.initialize("fingerprint-a", true).await })
        })
        .collect();
    for task in tasks {
        task.await.expect("task").expect("initialize");
    }
    assert!(stores.iter().all(|s| s.ready()));
    let client = db.client().await;
    let rows = client
        .query(
            "SELECT version, name FROM public.tollgate_migrations ORDER BY version",
            &[],
        )
        .await
        .expect("select");
    let got: Vec<(i32, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        got,
        [
            (1, "0001_rate_limits".to_owned()),
            (2, "0002_tollgate_settings".to_owned()),
            (3, "0003_increment_function".to_owned()),
            (4, "0004_instances".to_owned()),
            (5, "0005_joint_decision".to_owned()),
            (6, "0006_reserved_shares".to_owned()),
            (7, "0007_request_cost".to_owned()),
            (8, "0008_denied_adds_nothing".to_owned()),
            (9, "0009_overrides".to_owned())
        ]
    );
    // The seed's schema, in schema public.
    let idx: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_indexes
             WHERE schemaname = 'public' AND indexname = 'rate_limits_expires_idx'",
            &[],
        )
        .await
        .expect("index")
        .get(0);
    assert_eq!(idx, 1);
}

#[tokio::test]
async fn pg_migrate_twice_applies_nothing_the_second_time() {
    let db = TestDb::new().await;
    let store = PostgresStore::new(&db.store_config()).expect("store builds");
    let first = store.migrate("fp", false).await.expect("first migrate");
    assert_eq!(
        first.applied,
        [
            "0001_rate_limits",
            "0002_tollgate_settings",
            "0003_increment_function",
            "0004_instances",
            "0005_joint_decision",
            "0006_reserved_shares",
            "0007_request_cost",
            "0008_denied_adds_nothing",
            "0009_overrides"
        ]
    );
    assert_eq!(first.fingerprint, FingerprintChange::Written);
    let second = store.migrate("fp", false).await.expect("second migrate");
    assert!(second.applied.is_empty(), "{second}");
    assert_eq!(second.fingerprint, FingerprintChange::Unchanged);
    assert!(second.to_string().contains("no migration applied"));
}

#[tokio::test]
async fn pg_fingerprint_mismatch_is_refused_until_rotated() {
    let db = TestDb::new().await;
    let old = PostgresStore::new(&db.store_config()).expect("store builds");
    old.initialize("fingerprint-old", true)
        .await
        .expect("first instance");

    let new = PostgresStore::new(&db.store_config()).expect("store builds");
    let err = new
        .initialize("fingerprint-new", true)
        .await
        .expect_err("a different key is refused");
    assert!(matches!(err, InitError::FingerprintMismatch(_)), "{err}");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("--accept-new-key"), "{err}");
    assert!(!new.ready());
    assert!(matches!(
        new.increment(&[inc("b", 60, 1)]).await,
        Err(StoreError::Unavailable(_))
    ));

    // `tollgate migrate` without the flag refuses too; with it, the fingerprint is replaced.
    let err = new
        .migrate("fingerprint-new", false)
        .await
        .expect_err("migrate without --accept-new-key");
    assert!(matches!(err, InitError::FingerprintMismatch(_)));
    let report = new
        .migrate("fingerprint-new", true)
        .await
        .expect("rotation");
    assert_eq!(report.fingerprint, FingerprintChange::Replaced);

    let restarted_old = PostgresStore::new(&db.store_config()).expect("store builds");
    let err = restarted_old
        .initialize("fingerprint-old", true)
        .await
        .expect_err("the old key is refused now");
    assert!(matches!(err, InitError::FingerprintMismatch(_)));
    let restarted_new = PostgresStore::new(&db.store_config()).expect("store builds");
    restarted_new
        .initialize("fingerprint-new", false)
        .await
        .expect("the new key is accepted");
}

#[tokio::test]
async fn pg_initialize_without_migrate_needs_the_schema() {
    let db = TestDb::new().await;
    let store = PostgresStore::new(&db.store_config()).expect("store builds");
    let err = store
        .initialize("fp", false)
        .await
        .expect_err("schema missing");
    assert!(matches!(err, InitError::SchemaBehind { .. }), "{err}");
    assert!(err.is_retryable());
    store.migrate("fp", false).await.expect("migrate");
    let other = PostgresStore::new(&db.store_config()).expect("store builds");
    other.initialize("fp", false).await.expect("initialize");
    assert!(other.ready());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_sweep_deletes_exactly_the_expired_rows() {
    let db = TestDb::new().await;
    let store = pg_store(&db).await;
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO rate_limits (bucket, window_start, count, expires_at)
             SELECT 'old:' || i, now() - interval '2 hours', 1, now() - interval '1 hour'
             FROM generate_series(1, 2500) i;
             INSERT INTO rate_limits (bucket, window_start, count, expires_at)
             SELECT 'just-ended:' || i, now() - interval '60 seconds', 1, now() - interval '1 ms'
             FROM generate_series(1, 10) i;
             INSERT INTO rate_limits (bucket, window_start, count, expires_at)
             SELECT 'live:' || i, now() - interval '10 seconds', 1, now() + interval '1 hour'
             FROM generate_series(1, 3) i;",
        )
        .await
        .expect("rows");
    store
        .increment(&[inc("live:counted", 3600, 1)])
        .await
        .expect("increment");

    // Two sweepers at once: one at a time holds the lock, together they delete each expired
    // row exactly once.
    let other = pg_store(&db).await;
    let (a, b) = tokio::join!(store.sweep_once(1000), other.sweep_once(1000));
    let deleted = a.expect("sweep a") + b.expect("sweep b");
    assert_eq!(deleted, 2510);

    let rows = client
        .query("SELECT bucket FROM rate_limits ORDER BY bucket", &[])
        .await
        .expect("select");
    let left: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(left, ["live:1", "live:2", "live:3", "live:counted"]);
    assert_eq!(store.sweep_once(1000).await.expect("sweep again"), 0);
}

#[tokio::test]
async fn pg_store_is_unavailable_until_initialized() {
    let db = TestDb::new().await;
    let store = PostgresStore::new(&db.store_config()).expect("store builds");
    assert!(!store.ready());
    assert_eq!(store.kind(), "postgres");
    let err = store.increment(&[inc("b", 60, 1)]).await;
    assert!(matches!(err, Err(StoreError::Unavailable(_))), "{err:?}");
    let err = store.peek(&[inc("b", 60, 1)]).await;
    assert!(matches!(err, Err(StoreError::Unavailable(_))), "{err:?}");
}

/// A failed statement keeps the database's own error as the cause (issue 19: errors kept as
/// `String` lost their source chains): the chain under the `StoreError` reaches the
/// `tokio_postgres::Error`, with the server's message.
#[tokio::test]
async fn pg_statement_error_keeps_the_database_error_as_its_source() {
    let db = TestDb::new().await;
    let store = pg_store(&db).await;
    db.client()
        .await
        .batch_execute("DROP TABLE public.rate_limits CASCADE")
        .await
        .expect("drop the counters table");
    let err = store
        .increment(&[inc("b", 60, 1)])
        .await
        .expect_err("the increment fails without its table");
    assert!(matches!(err, StoreError::Query(_)), "{err:?}");
    assert_caused_by_postgres(&err);
    assert!(err.to_string().contains("rate_limits"), "{err}");
}

/// `err`'s `source()` chain reaches the `tokio_postgres::Error` that caused it.
fn assert_caused_by_postgres(err: &(dyn std::error::Error + 'static)) {
    let mut chain = Vec::new();
    let mut next = err.source();
    while let Some(e) = next {
        chain.push(e);
        next = e.source();
    }
    assert!(
        chain.iter().any(|e| e.is::<tokio_postgres::Error>()),
        "no tokio_postgres::Error under {err}: {:?}",
        chain.iter().map(|e| e.to_string()).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn pg_closed_port_fails_fast_and_is_unreachable() {
    let db = TestDb::new().await;
    let closed = RefusedPort::new();
    let mut cfg = db.store_config();
    cfg.url = Some(db.url_through(closed.addr));
    cfg.timeout = Duration::from_millis(300);
    let store = PostgresStore::new(&cfg).expect("construction never connects");

    let started = Instant::now();
    let err = store
        .initialize("fp", true)
        .await
        .expect_err("nothing listens");
    assert!(matches!(err, InitError::Unreachable(_)), "{err}");
    assert!(err.is_retryable());
    assert_caused_by_postgres(&err);
    assert!(started.elapsed() < Duration::from_secs(5));

    let started = Instant::now();
    assert!(store.increment(&[inc("b", 60, 1)]).await.is_err());
    assert!(started.elapsed() < cfg.timeout + Duration::from_millis(200));
    assert!(!store.ready());
}

#[tokio::test]
async fn pg_fatal_errors_are_not_unreachable() {
    let db = TestDb::new().await;
    let mut cfg = db.store_config();
    cfg.url = Some(format!(
        "{} dbname='tollgate_no_such_database'",
        db.url_through(db.server_addr())
    ));
    let store = PostgresStore::new(&cfg).expect("store builds");
    let err = store.initialize("fp", true).await.expect_err("no database");
    assert!(matches!(err, InitError::Database(_)), "{err}");
    assert!(!err.is_retryable());
    assert_caused_by_postgres(&err);

    let mut cfg = db.store_config();
    cfg.url = Some("postgres://h:notaport/db".to_owned());
    assert!(PostgresStore::new(&cfg).is_err());
}

/// A TCP relay in front of the database that can stall (a partition or a hung server) or
/// die (a closed port), to test failures after a successful start.
struct Relay {
    addr: SocketAddr,
    frozen: watch::Sender<bool>,
    tasks: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
}

impl Relay {
    async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (frozen, _) = watch::channel(false);
        let tasks = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, tasks2) = (frozen.clone(), Arc::clone(&tasks));
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let up = tokio::spawn(pump(cr, sw, tx.subscribe()));
                let down = tokio::spawn(pump(sr, cw, tx.subscribe()));
                if let Ok(mut t) = tasks2.lock() {
                    t.extend([up, down]);
                }
            }
        });
        if let Ok(mut t) = tasks.lock() {
            t.push(accept);
        }
        Relay {
            addr,
            frozen,
            tasks,
        }
    }

    fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }

    /// Closes the listener and every relayed connection.
    fn kill(&self) {
        if let Ok(mut t) = self.tasks.lock() {
            for task in t.drain(..) {
                task.abort();
            }
        }
    }
}

/// Copies bytes one way, holding them while frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_stalled_or_lost_database_fails_within_timeout_and_recovers() {
    let db = TestDb::new().await;
    let relay = Relay::start(db.server_addr()).await;
    let mut cfg = db.store_config();
    cfg.url = Some(db.url_through(relay.addr));
    cfg.timeout = Duration::from_millis(300);
    let margin = Duration::from_millis(250);
    let store = PostgresStore::new(&cfg).expect("store builds");
    store.initialize("fp", true).await.expect("initialize");
    let batch = [inc("b", LONG, 1)];
    assert_eq!(store.increment(&batch).await.expect("healthy")[0].count, 1);
    assert!(store.ready());

    // Stalled: the statement gets no answer; the call gives up at store.timeout.
    relay.freeze(true);
    for _ in 0..3 {
        let started = Instant::now();
        let err = store.increment(&batch).await;
        let elapsed = started.elapsed();
        assert!(matches!(err, Err(StoreError::Timeout)), "{err:?}");
        assert!(elapsed < cfg.timeout + margin, "took {elapsed:?}");
        assert!(!store.ready());
    }

    // Back: the store recovers by itself.
    relay.freeze(false);
    let mut recovered = None;
    for _ in 0..50 {
        if let Ok(c) = store.increment(&batch).await {
            recovered = Some(c[0].count);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let count = recovered.expect("recovers once the database answers again");
    // Increments sent while stalled may have been applied late: count is at least 2.
    assert!(count >= 2, "{count}");
    assert!(store.ready());

    // Gone: connections reset and the port closes; calls still end within store.timeout.
    relay.kill();
    for _ in 0..3 {
        let started = Instant::now();
        let err = store.increment(&batch).await;
        let elapsed = started.elapsed();
        assert!(err.is_err(), "{err:?}");
        assert!(elapsed < cfg.timeout + margin, "took {elapsed:?}");
        assert!(!store.ready());
    }
}

// ---------------------------------------------------------------------------------------------
// Memory.

/// A clock the test moves by hand.
fn manual_clock(start_ms: i64) -> (Arc<AtomicI64>, MemoryStore) {
    let now = Arc::new(AtomicI64::new(start_ms));
    let clock = Arc::clone(&now);
    (
        now,
        MemoryStore::with_clock(move || clock.load(Ordering::SeqCst)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mem_concurrent_increments_are_exact() {
    let store = Arc::new(MemoryStore::new());
    exact_under_concurrency(store.clone()).await;
    assert_eq!(store.kind(), "memory");
    assert!(store.ready());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mem_overlapping_batches_lose_no_update() {
    overlapping_batches(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn mem_batch_counts_each_bucket() {
    let store = MemoryStore::new();
    batch_in_order(&store).await;
}

#[tokio::test]
async fn mem_counts_saturate_at_i32_max() {
    let store = MemoryStore::new();
    store
        .increment(&[inc("flood", LONG, 2_147_483_640)])
        .await
        .expect("increment");
    saturates(&store, "flood").await;
}

#[tokio::test]
async fn mem_windows_are_epoch_aligned_and_roll_over() {
    // 10:00:05.250 on some day, in unix ms.
    let day = 1_700_006_400_000i64;
    let (now, store) = manual_clock(day + 36_005_250);
    let batch = [inc("m", 60, 1)];
    let c = store.increment(&batch).await.expect("increment")[0];
    assert_eq!(c.count, 1);
    assert_eq!(c.window_end_ms % 60_000, 0);
    assert_eq!(c.window_end_ms, day + 36_060_000);
    assert_eq!(c.now_ms, day + 36_005_250);

    // Last millisecond of the window: same window.
    now.store(day + 36_059_999, Ordering::SeqCst);
    assert_eq!(store.increment(&batch).await.expect("inc")[0].count, 2);
    // Window end: a new window, counted from zero.
    now.store(day + 36_060_000, Ordering::SeqCst);
    let c = store.increment(&batch).await.expect("inc")[0];
    assert_eq!((c.count, c.window_end_ms), (1, day + 36_120_000));
    let p = store.peek(&batch).await.expect("peek")[0];
    assert_eq!((p.count, p.window_end_ms), (1, day + 36_120_000));

    // The clock stepping back does not forget what was counted.
    now.store(day + 36_059_000, Ordering::SeqCst);
    assert_eq!(store.increment(&batch).await.expect("inc")[0].count, 2);
}

#[tokio::test]
async fn mem_sweep_keeps_memory_bounded_by_live_buckets() {
    let (now, store) = manual_clock(1_700_000_000_000);
    let short: Vec<Increment> = (0..3).map(|i| inc(&format!("s{i}"), 10, 1)).collect();
    let long: Vec<Increment> = (0..2).map(|i| inc(&format!("l{i}"), 3600, 1)).collect();
    store.increment(&short).await.expect("short");
    store.increment(&long).await.expect("long");
    assert_eq!(store.len(), 5);
    now.fetch_add(10_000, Ordering::SeqCst);
    assert_eq!(store.sweep(), 3);
    assert_eq!(store.len(), 2);
    let counts: HashMap<u32, usize> =
        store
            .peek(&long)
            .await
            .expect("peek")
            .iter()
            .fold(HashMap::new(), |mut m, p| {
                *m.entry(p.count).or_default() += 1;
                m
            });
    assert_eq!(counts, HashMap::from([(1, 2)]));

    // Without sweeps, cleanup on insert bounds the map: 20 rounds of 5000 one-second
    // buckets, each round a second later, never hold more than a few rounds' worth.
    for round in 0..20 {
        now.fetch_add(1_000, Ordering::SeqCst);
        let batch: Vec<Increment> = (0..5000)
            .map(|i| inc(&format!("r{round}:{i}"), 1, 1))
            .collect();
        store.increment(&batch).await.expect("round");
    }
    assert!(store.len() < 25_000, "{} buckets held", store.len());
    assert!(store.removed_total() > 50_000);
}
