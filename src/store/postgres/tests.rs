use super::migrate::{fingerprint_mismatch, supported_server};
use super::pool::CONNECT_TIMEOUT;
use super::statements::{FIXED_UPSERT_SQL, SLIDING_ONE_SQL, SLIDING_UPSERT_SQL};
use super::*;
use crate::store::settings::StoreErrorPolicy;

/// The plain upsert knows no sliding estimate, so it must never get a batch with a sliding
/// limit: its parameters exist only for a batch without one, and they are the function's
/// first three and its caps. The plain sliding statement's exist only for a batch with one (a
/// fixed batch is cheaper as the plain upsert), and they are the function's first five.
#[test]
fn each_plain_statement_takes_its_batches_and_the_functions_parameters() {
    let args = |limits| IncrementArgs {
        buckets: vec!["a", "b"],
        windows: vec![60, 60],
        amounts: vec![1, 2],
        limits,
        caps: vec![Some(10), None],
        async_commit: true,
    };
    let fixed = args(None);
    let plain = fixed.fixed().expect("a fixed-window batch");
    let function = fixed.function();
    for (p, f) in plain.iter().zip([0, 1, 2, 4].map(|i| &function[i])) {
        assert_eq!(p.1, f.1, "the same parameter types, in the same order");
        assert!(std::ptr::addr_eq(p.0, f.0), "the same values");
    }
    assert!(
        args(Some(vec![None, Some(10)])).fixed().is_none(),
        "a batch with a sliding limit is the function's"
    );
    assert!(FIXED_UPSERT_SQL.contains("$4") && !FIXED_UPSERT_SQL.contains("$5"));
    // The plain sliding statement: a batch with a sliding limit only, and the function's
    // first four parameters.
    assert!(
        fixed.sliding().is_none(),
        "a fixed batch is the plain upsert's"
    );
    let with_sliding = args(Some(vec![None, Some(10)]));
    let plain = with_sliding
        .sliding()
        .expect("a batch with a sliding limit");
    for (p, f) in plain.iter().zip(&with_sliding.function()) {
        assert_eq!(p.1, f.1, "the same parameter types, in the same order");
        assert!(std::ptr::addr_eq(p.0, f.0), "the same values");
    }
    assert!(SLIDING_UPSERT_SQL.contains("$5") && !SLIDING_UPSERT_SQL.contains("$6"));
    // One sliding row: the single-row statement, with that row's values.
    let one = IncrementArgs {
        buckets: vec!["a"],
        windows: vec![60],
        amounts: vec![2],
        limits: Some(vec![Some(10)]),
        caps: vec![None],
        async_commit: true,
    };
    let plain = one.sliding_one().expect("one sliding row");
    let types: Vec<Type> = plain.iter().map(|(_, ty)| ty.clone()).collect();
    assert_eq!(types, [Type::TEXT, Type::INT8, Type::INT8, Type::INT8]);
    assert!(
        with_sliding.sliding_one().is_none(),
        "two rows: the batch statement"
    );
    let one_fixed = IncrementArgs {
        limits: Some(vec![None]),
        ..one
    };
    assert!(
        one_fixed.sliding_one().is_none(),
        "a fixed row is never the single sliding statement's"
    );
    assert!(SLIDING_ONE_SQL.contains("$4") && !SLIDING_ONE_SQL.contains("$5"));
}

/// PostgreSQL 11 and older are refused with a sentence naming the version; 12 and
/// later (tested for real: the suite's server) pass.
#[test]
fn servers_before_postgresql_12_are_refused_by_name() {
    let err = supported_server(110022, "11.22").expect_err("11 is too old");
    assert!(!err.is_retryable());
    let text = err.to_string();
    assert!(text.contains("PostgreSQL 11.22 is too old"), "{text}");
    assert!(text.contains("12 or later"), "{text}");
    assert!(supported_server(90624, "9.6.24").is_err());
    assert!(supported_server(120000, "12.0").is_ok());
    assert!(supported_server(150020, "15.20 (Debian 15.20-0+deb12u1)").is_ok());
}

/// Every statement's future is moved into a box (`Store::increment_each`), so its whole
/// size is copied per statement: 11 KiB here before the rare paths were boxed and the
/// helpers stopped taking futures by value (an `async fn` that takes a future and awaits
/// it holds it twice).
#[tokio::test]
async fn the_increment_future_stays_small() {
    let store = PostgresStore::new(&cfg("postgres://u@127.0.0.1:1/db", false)).expect("store");
    let batch = [Increment {
        bucket: Arc::from("a"),
        window_secs: 60,
        by: 1,
        sliding: None,
        enforce: None,
        check: false,
    }];
    let requests: [&[Increment]; 1] = [&batch];
    let size = std::mem::size_of_val(&store.run_requests(&requests));
    assert!(size <= 4096, "the increment's future is {size} bytes");
}

fn cfg(url: &str, synchronous_commit: bool) -> StoreConfig {
    StoreConfig {
        url: Some(url.to_owned()),
        pool_size: 4,
        timeout: Duration::from_millis(100),
        on_error: StoreErrorPolicy::Allow,
        migrate: true,
        sweep_interval: Duration::from_secs(60),
        synchronous_commit,
        memory_buckets: std::num::NonZeroUsize::MIN,
        ca_file: None,
    }
}

#[test]
fn no_startup_options_of_our_own_a_pooler_would_refuse() {
    let (pg, _) = connection_config(&cfg(
        "postgres://u:secret@h1:5432,h2:5433/db?target_session_attrs=read-write&options=-c%20statement_timeout%3D5000",
        false,
    ))
    .expect("parses");
    // The URL's own options are the operator's; tollgate adds none (PgBouncer refuses
    // the parameter; synchronous_commit is set inside the increment instead).
    assert_eq!(pg.get_options(), Some("-c statement_timeout=5000"));
    assert_eq!(pg.get_hosts().len(), 2);
    assert_eq!(
        pg.get_target_session_attrs(),
        tokio_postgres::config::TargetSessionAttrs::ReadWrite
    );
    assert_eq!(pg.get_connect_timeout(), Some(&CONNECT_TIMEOUT));
    assert_eq!(pg.get_application_name(), Some("tollgate"));
    // A connection attempt may try both hosts, each within the connect timeout.
    assert_eq!(connect_deadline(&pg), CONNECT_TIMEOUT * 2);
    let log = FailureLog::new(&pg);
    assert_eq!(
        (log.host.as_str(), log.port.as_str(), log.dbname.as_str()),
        ("h1,h2", "5432,5433", "db")
    );

    for synchronous_commit in [false, true] {
        let (pg, _) = connection_config(&cfg("host=h", synchronous_commit)).expect("parses");
        assert_eq!(pg.get_options(), None, "no startup options");
    }
    let (pg, _) = connection_config(&cfg("host=h connect_timeout=2", true)).expect("parses");
    assert_eq!(pg.get_connect_timeout(), Some(&Duration::from_secs(2)));
}

#[test]
fn every_cause_has_a_slot_in_the_failure_log() {
    // FailureLog indexes its slots by `cause as usize`.
    assert_eq!(Cause::Database as usize + 1, Cause::ALL);
    let log = FailureLog::new(&tokio_postgres::Config::new());
    assert_eq!(
        (log.host.as_str(), log.port.as_str(), log.dbname.as_str()),
        ("", "5432", "postgres")
    );
    for _ in 0..3 {
        log.note(Cause::Database, "x");
    }
    let slots = log.slots.lock().expect("lock");
    assert_eq!(slots[Cause::Database as usize].1, 2, "two left out");
    assert_eq!(
        slots[Cause::Refused as usize],
        (None, 0),
        "causes are counted apart"
    );
}

#[test]
fn health_answers_only_while_fresh() {
    let health = Health::new();
    assert_eq!(
        health.recent(Duration::from_secs(60)),
        None,
        "no outcome yet"
    );
    health.set(false);
    assert_eq!(health.recent(Duration::from_secs(60)), Some(false));
    health.set(true);
    assert_eq!(health.recent(Duration::from_secs(60)), Some(true));
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(health.recent(Duration::from_millis(1)), None, "stale");
}

#[test]
fn invalid_urls_are_refused_without_echoing_them() {
    let err =
        connection_config(&cfg("postgres://u:hunter2@h:notaport/db", false)).expect_err("bad port");
    assert!(!err.to_string().contains("hunter2"), "{err}");
}

#[test]
fn fingerprint_mismatch_explains_the_rotation() {
    let err = fingerprint_mismatch("hmac-sha256:0123456789abcdef", "sha256:unkeyed");
    let msg = err.to_string();
    assert!(msg.contains("(hmac-sha256:0123456789ab…)"), "{msg}");
    assert!(msg.contains("(sha256:unkeyed)"), "{msg}");
    assert!(msg.contains("tollgate migrate --accept-new-key"), "{msg}");
    assert!(!err.is_retryable());
}
