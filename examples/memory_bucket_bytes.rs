//! What a live bucket of the memory store costs in resident memory (docs/performance.md,
//! "Memory per bucket"). Run by `bench/memory_bucket_bytes.sh`.
//!
//! Drives `KEYS` distinct buckets, named as the proxy names them (`<scope>:<label>:<hex of a
//! SHA-256>`), one increment each, through a memory store of the default bound
//! (`store.memory_buckets`, 1,000,000), and prints the growth of this process's RSS divided by
//! the buckets held. Each increment's name is dropped after its call, as the proxy drops a
//! request's plan: what stays is what the store keeps. Then the clock moves past the window and
//! as many new keys go in: memory is reused, so the second figure stays near zero.
//!
//! Usage: memory_bucket_bytes [KEYS] [WINDOW_SECS] [fixed|sliding]

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use tollgate::testing::config::DEFAULT_MEMORY_BUCKETS;
use tollgate::testing::metrics::MemoryStoreMetrics;
use tollgate::testing::store::memory::MemoryStore;
use tollgate::testing::store::{Increment, Store};

/// This process's resident set in bytes (`VmRSS` of `/proc/self/status`, in KiB).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

/// The `n`-th key's bucket name, as `key::bucket_in` makes it for an `X-Api-Key` limit.
fn bucket(round: u64, n: u64) -> Arc<str> {
    let digest = Sha256::digest(format!("client-{round}-{n}"));
    Arc::from(format!("bench:x-api-key:{}", hex::encode(digest)))
}

/// Sends `keys` new buckets through `store`, one request each; returns the RSS growth.
fn drive(store: &MemoryStore, round: u64, keys: u64, window_secs: u32, sliding: bool) -> u64 {
    let before = rss_bytes();
    for n in 0..keys {
        let batch = [Increment {
            bucket: bucket(round, n),
            window_secs,
            by: 1,
            sliding: sliding.then_some(100),
            enforce: Some(100),
            check: false,
        }];
        let counted = store
            .increment_now(&batch)
            .expect("the memory store answers at once")
            .expect("counted");
        assert_eq!(counted[0].count, 1, "key {n} is new");
    }
    rss_bytes().saturating_sub(before)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let keys: u64 = args.next().map_or(500_000, |a| a.parse().expect("KEYS"));
    let window_secs: u32 = args
        .next()
        .map_or(3600, |a| a.parse().expect("WINDOW_SECS"));
    let sliding = match args.next().as_deref() {
        None | Some("fixed") => false,
        Some("sliding") => true,
        Some(other) => panic!("fixed or sliding, not {other:?}"),
    };
    let now = Arc::new(AtomicI64::new(1_750_000_000_000));
    let clock = Arc::clone(&now);
    let bound = NonZeroUsize::new(DEFAULT_MEMORY_BUCKETS).expect("non-zero");
    let store = MemoryStore::bounded_with_clock(bound, MemoryStoreMetrics::default(), move || {
        clock.load(Ordering::Relaxed)
    });
    // Warm the allocator and the hasher on a few buckets that the figure leaves out.
    drive(&store, u64::MAX, 1000, window_secs, sliding);
    let held = store.len() as u64;

    let grown = drive(&store, 0, keys, window_secs, sliding);
    let live = store.len() as u64 - held;
    assert_eq!(
        store.evictions_total(),
        0,
        "nothing evicted: all {live} are live"
    );
    println!(
        "{live} live buckets ({} window of {window_secs} s): RSS +{:.1} MB, {:.1} bytes per bucket",
        if sliding { "sliding" } else { "fixed" },
        grown as f64 / 1e6,
        grown as f64 / live as f64
    );

    // Past the window (and a sliding limit's extra one): the same number of new keys.
    let past = i64::from(window_secs) * 2000 + 1;
    now.fetch_add(past, Ordering::Relaxed);
    let again = drive(&store, 1, keys, window_secs, sliding);
    println!(
        "{keys} new buckets after those windows ended: RSS +{:.1} MB, {:.1} bytes per bucket",
        again as f64 / 1e6,
        again as f64 / keys as f64
    );
}
