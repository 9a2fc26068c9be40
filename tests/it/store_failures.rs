//! How tollgate lives through a failing PostgreSQL (contract §5, §6 and §7; issue 14,
//! items 7 and 9): the breaker recovers whatever happened to its probe, connections lost in
//! a network black hole do not hold the pool forever, `/readyz` follows whether decisions
//! succeed (a dropped table, a revoked privilege, a read-only database), store failures are
//! logged with their cause and the database's address at most once a second, a role's own
//! `statement_timeout` does not fail start-up, and migrations leave no setting on the session.
//!
//! Each test has a fresh database (tests/common/db.rs), real tollgate servers on port 0 and a
//! recording upstream.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

use crate::common::db::TestDb;
use crate::common::faulty::FaultyTcp;
use crate::common::*;
use tollgate::testing::store::postgres::PostgresStore;
use tollgate::testing::store::{Increment, Store};

/// A request to `/api` carrying `X-Api-Key: key`.
fn keyed(proxy: &Proxy, key: &str) -> Request<Full<Bytes>> {
    Request::get(proxy.url("/api"))
        .header("x-api-key", key)
        .body(Full::new(Bytes::new()))
        .expect("request")
}

/// Route `api` (`/api`): 3 requests per hour per `X-Api-Key`.
const API_ROUTE: &str = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 3
  window = "1h"
"#;

/// Whether the answer was counted by the store: counted answers carry the rate-limit
/// headers, a request let through by `on_error = "allow"` carries none.
fn counted(answer: &Answer) -> bool {
    answer.header("ratelimit").is_some()
}

/// Sends keyed requests until one is counted by the store, for at most `within`.
async fn until_counted(client: &H1Client, proxy: &Proxy, key: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if counted(&send(client, keyed(proxy, key)).await) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// With a fresh key: `requests` are allowed and counted, the next one is denied.
async fn limit_holds(client: &H1Client, proxy: &Proxy, key: &str, requests: usize) {
    for i in 1..=requests {
        let answer = send(client, keyed(proxy, key)).await;
        assert_eq!(answer.status, StatusCode::OK, "request {i} of {requests}");
        assert!(counted(&answer), "request {i} was not counted");
    }
    let answer = send(client, keyed(proxy, key)).await;
    assert_eq!(
        answer.status,
        StatusCode::TOO_MANY_REQUESTS,
        "request {} must be denied",
        requests + 1
    );
}

// ---------------------------------------------------------------------------------------------
// Item 7: the breaker and the pool recover by themselves.

/// Review, item 7: "If the one request probing a failing store is cancelled (client gone,
/// stream reset, idle close), the breaker never lets another call through, and with the
/// default on_error = allow every limit is off until a restart."
///
/// The store hangs (a stalled relay), decisions time out and open the breaker; after the
/// cool-down the one probe is an HTTP/2 request whose stream the client resets while the probe
/// waits on the hung store. Once the store answers again, decisions must be counted again and
/// a limit of 3 must deny the 4th request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_breaker_probe_does_not_leave_every_limit_off() {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let store = format!(
        "url = \"{}\"\ntimeout = \"300ms\"\non_error = \"allow\"\npool_size = 2",
        db.url_through(relay.addr)
    );
    let text = limits_config(&store, "", API_ROUTE);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let client = h1_client();
    assert!(counted(&send(&client, keyed(&proxy, "warm")).await));

    relay.stall();
    for i in 0..5 {
        let answer = send(&client, keyed(&proxy, "during")).await;
        assert_eq!(answer.status, StatusCode::OK, "failed open, request {i}");
        assert!(
            !counted(&answer),
            "a hung store cannot have counted request {i}"
        );
    }
    // The breaker is open now; once its cool-down has passed, the next request is the probe.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let h2 = h2c_client();
    let probe = tokio::time::timeout(Duration::from_millis(150), h2.request(keyed(&proxy, "p")));
    assert!(
        probe.await.is_err(),
        "the probe cannot finish while the store hangs"
    );
    // The reset has reached tollgate and the probing request is gone.
    drop(h2);
    tokio::time::sleep(Duration::from_millis(200)).await;

    relay.up();
    assert!(
        until_counted(&client, &proxy, "after", Duration::from_secs(4)).await,
        "decisions were never counted again after the store came back: the cancelled probe \
         left the breaker open for good"
    );
    limit_holds(&client, &proxy, "fresh", 3).await;
}

/// What the black hole does to the connections through it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hole {
    Open,
    Swallowing,
}

/// A relay that can turn into a network black hole: while swallowing, every byte in either
/// direction is read and dropped, and connections are accepted and never answered. A
/// connection that lived through the hole stays dead after it closes (its bytes are gone, as
/// when a firewall or NAT lost the flow's state, or TCP backs off its retransmissions for
/// minutes); only connections made afterwards work. This is what a hung network looks like to
/// a client, unlike [`FaultyTcp::stall`], which delivers the held bytes late.
struct BlackHole {
    addr: SocketAddr,
    state: watch::Sender<(Hole, u64)>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl BlackHole {
    async fn start(target: SocketAddr, open: bool) -> BlackHole {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let first = if open { Hole::Open } else { Hole::Swallowing };
        let (state, watcher) = watch::channel((first, 0u64));
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let watcher = watcher.clone();
                tokio::spawn(async move {
                    let (hole, era) = *watcher.borrow();
                    if hole == Hole::Swallowing {
                        swallow(client).await;
                        return;
                    }
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(
                        hole_pump(cr, sw, watcher.clone(), era),
                        hole_pump(sr, cw, watcher, era)
                    );
                });
            }
        });
        BlackHole { addr, state, task }
    }

    fn swallow(&self) {
        self.state.send_modify(|(hole, era)| {
            *hole = Hole::Swallowing;
            *era += 1;
        });
    }

    fn open(&self) {
        self.state.send_modify(|(hole, _)| *hole = Hole::Open);
    }
}

/// Reads and drops everything, never answering, until the peer closes.
async fn swallow(mut stream: TcpStream) {
    let mut buf = vec![0u8; 4096];
    while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
}

/// Copies one direction while the hole has stayed open since the connection was made; after
/// that, drops everything it reads.
async fn hole_pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    watcher: watch::Receiver<(Hole, u64)>,
    era: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if *watcher.borrow() != (Hole::Open, era) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Sends requests until one gets `status`, for at most `within`; the last status seen.
async fn until_status(
    client: &H1Client,
    url: &str,
    status: StatusCode,
    within: Duration,
) -> StatusCode {
    let deadline = Instant::now() + within;
    loop {
        let got = get(client, url).await.status;
        if got == status || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Review, item 7, second case: "with the database hung from just after start
/// (store.timeout = 2s), decisions kept timing out after it came back in 3 of 6 runs".
///
/// The cause: tokio-postgres' `connect_timeout` bounds only the TCP connect, not the start-up
/// and authentication exchange, and bb8 counts a connection being made against `pool_size`
/// (and starts another only when more callers wait than connections are being made). A
/// connect that happened while the database hung never finished, so once `pool_size` of them
/// were stuck, every decision waited for a connection that never came, long after the
/// database was back. Whether that happened depended on whether the pool had to (re)connect
/// during the hang. Here the hang always catches the pool's connects: right after start the
/// pool is empty, and statements cut off by a timeout drop their connection. The scenario runs
/// twice in a row on one server, then once with the database hung before start (the
/// background initialisation's connect must not hang either).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_hung_after_start_does_not_keep_decisions_failing() {
    let db = TestDb::new().await;
    let hole = BlackHole::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    // connect_timeout bounds a whole connection attempt, so that recovery is quick here.
    let store = format!(
        "url = \"{} connect_timeout=1\"\ntimeout = \"300ms\"\non_error = \"deny\"\npool_size = 2",
        db.url_through(hole.addr)
    );
    let text = limits_config(&store, "", &ip_route());
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let client = h1_client();
    let url = proxy.url("/api");

    for round in 0..2 {
        hole.swallow();
        for _ in 0..4 {
            let status = get(&client, &url).await.status;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "round {round}");
        }
        hole.open();
        let status = until_status(&client, &url, StatusCode::OK, Duration::from_secs(5)).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "round {round}: decisions still failed 5 s after the database came back"
        );
    }
    drop(proxy);

    // Hung from before the first connection: the start-up wait gives up, the background
    // initialisation keeps trying, and counting starts soon after the database is back.
    let hole = BlackHole::start(db.server_addr(), false).await;
    let store = format!(
        "url = \"{} connect_timeout=1\"\ntimeout = \"300ms\"\non_error = \"deny\"\npool_size = 2",
        db.url_through(hole.addr)
    );
    let text = limits_config(&store, "", &ip_route());
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let url = proxy.url("/api");
    // Long enough for the background initialisation's first retry (after 250 ms) to connect
    // into the hole.
    for _ in 0..6 {
        let status = get(&client, &url).await.status;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    hole.open();
    let status = until_status(&client, &url, StatusCode::OK, Duration::from_secs(5)).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "decisions still failed 5 s after a database hung at start came back"
    );
}

// ---------------------------------------------------------------------------------------------
// Item 9: readiness follows whether decisions succeed.

/// Route `api` limited to 1000 per hour per client address.
fn ip_route() -> String {
    API_ROUTE
        .replace("header:x-api-key", "ip")
        .replace("requests = 3", "requests = 1000")
}

/// A proxy on `url` with an admin listener, `on_error = "deny"` (a failing decision is a 503)
/// and route `api` limited to 1000 per hour per client address.
async fn ready_proxy(upstream: &Upstream, url: &str) -> (Proxy, SocketAddr) {
    let store = format!("url = \"{url}\"\ntimeout = \"1s\"\non_error = \"deny\"\npool_size = 2");
    let text = limits_config(&store, "\n[admin]\nlisten = \"127.0.0.1:0\"", &ip_route());
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    (proxy, admin)
}

/// The status of a decision and of `/readyz`.
async fn decision_and_ready(client: &H1Client, proxy: &Proxy, admin: SocketAddr) -> (u16, u16) {
    let decision = get(client, &proxy.url("/api")).await.status.as_u16();
    let ready = get(client, &format!("http://{admin}/readyz"))
        .await
        .status
        .as_u16();
    (decision, ready)
}

/// `/readyz` polled until it says `status`, for at most `within`; the last status seen.
async fn ready_until(client: &H1Client, admin: SocketAddr, status: u16, within: Duration) -> u16 {
    let url = format!("http://{admin}/readyz");
    let deadline = Instant::now() + within;
    loop {
        let got = get(client, &url).await.status.as_u16();
        if got == status || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Breaks the store with `break_sql`, checks that decisions and `/readyz` both fail, repairs
/// it with `repair_sql`, and checks that `/readyz` comes back by itself with no decision
/// traffic (the idle probe), then that decisions succeed.
async fn readiness_follows(
    upstream: &Upstream,
    url: &str,
    admin_db: &tokio_postgres::Client,
    break_sql: &str,
    repair_sql: &str,
    what: &str,
) {
    let (proxy, admin) = ready_proxy(upstream, url).await;
    let client = h1_client();
    assert_eq!(
        decision_and_ready(&client, &proxy, admin).await,
        (200, 200),
        "healthy"
    );

    admin_db.batch_execute(break_sql).await.expect("break");
    // A session made before the change may still work for a moment (pg_terminate_backend
    // does not wait for the backend to exit); then every decision fails.
    let failing = until_status(
        &client,
        &proxy.url("/api"),
        StatusCode::SERVICE_UNAVAILABLE,
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        failing,
        StatusCode::SERVICE_UNAVAILABLE,
        "{what}: decisions fail"
    );
    assert_eq!(
        decision_and_ready(&client, &proxy, admin).await,
        (503, 503),
        "{what}: decisions fail, so /readyz must say 503"
    );
    // And with no decision traffic at all, the idle probe sees it too.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        ready_until(&client, admin, 503, Duration::ZERO).await,
        503,
        "{what}: the idle probe must exercise the real statement"
    );

    admin_db.batch_execute(repair_sql).await.expect("repair");
    assert_eq!(
        ready_until(&client, admin, 200, Duration::from_secs(5)).await,
        200,
        "{what}: /readyz must come back by itself once repaired"
    );
    let decision = until_status(
        &client,
        &proxy.url("/api"),
        StatusCode::OK,
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(decision, StatusCode::OK, "{what}: decisions succeed again");
}

/// Review, item 9: "After DROP TABLE rate_limits ... every decision fails while /readyz says
/// 200".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_the_counter_table_is_missing() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let admin_db = db.client().await;
    readiness_follows(
        &upstream,
        &db.url,
        &admin_db,
        "ALTER TABLE public.rate_limits RENAME TO rate_limits_away",
        "ALTER TABLE public.rate_limits_away RENAME TO rate_limits",
        "missing table",
    )
    .await;
    // And truly dropped: the decisions and the probe both fail.
    let (proxy, admin) = ready_proxy(&upstream, &db.url).await;
    let client = h1_client();
    // CASCADE: the reserved shares' ledger (tollgate_shares) has a foreign key to it.
    admin_db
        .batch_execute("DROP TABLE public.rate_limits CASCADE")
        .await
        .expect("drop");
    let _ = get(&client, &proxy.url("/api")).await;
    assert_eq!(
        decision_and_ready(&client, &proxy, admin).await,
        (503, 503),
        "DROP TABLE rate_limits"
    );
}

/// A login role of this test's own ([`Role::new`]: one allowed to create tables in the test
/// database's `public` schema; a test may also make one with grants of its own); dropped,
/// with what it owns, by [`Role::drop_now`].
struct Role {
    name: String,
}

impl Role {
    async fn new(db: &TestDb, admin_db: &tokio_postgres::Client) -> Role {
        let name = format!("{}_role", db.name);
        admin_db
            .batch_execute(&format!(
                "CREATE ROLE \"{name}\" LOGIN; GRANT ALL ON SCHEMA public TO \"{name}\""
            ))
            .await
            .expect("create role");
        Role { name }
    }

    /// `db`'s URL, connecting as this role.
    fn url(&self, db: &TestDb) -> String {
        format!("{} user={}", db.url_through(db.server_addr()), self.name)
    }

    async fn drop_now(self, admin_db: &tokio_postgres::Client) {
        let name = &self.name;
        let _ = admin_db
            .batch_execute(&format!(
                "REASSIGN OWNED BY \"{name}\" TO CURRENT_USER; DROP OWNED BY \"{name}\"; \
                 SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'"
            ))
            .await;
        // Its sessions take a moment to end after pg_terminate_backend.
        for _ in 0..50 {
            if admin_db
                .batch_execute(&format!("DROP ROLE IF EXISTS \"{name}\""))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Review, item 9: "... a REVOKE INSERT ... every decision fails while /readyz says 200".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_insert_is_revoked() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let admin_db = db.client().await;
    let role = Role::new(&db, &admin_db).await;
    let name = role.name.clone();
    readiness_follows(
        &upstream,
        &role.url(&db),
        &admin_db,
        &format!("REVOKE INSERT ON public.rate_limits FROM \"{name}\""),
        &format!("GRANT INSERT ON public.rate_limits TO \"{name}\""),
        "INSERT revoked",
    )
    .await;
    role.drop_now(&admin_db).await;
}

/// Review, item 9: "... or on a read-only database (default_transaction_read_only) every
/// decision fails while /readyz says 200". The setting applies to new sessions, so tollgate's
/// sessions are ended when it is switched on (as a failover to a standby would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_the_database_is_read_only() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let admin_db = db.client().await;
    let name = &db.name;
    let end_sessions = format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = '{name}' AND application_name = 'tollgate'"
    );
    readiness_follows(
        &upstream,
        &db.url,
        &admin_db,
        &format!(
            "ALTER DATABASE \"{name}\" SET default_transaction_read_only = on; {end_sessions}"
        ),
        &format!("ALTER DATABASE \"{name}\" RESET default_transaction_read_only; {end_sessions}"),
        "read-only database",
    )
    .await;
}

/// Review, item 9 / contract §5: "Store failures are logged with their cause and the database's
/// host, port and name, at most a line per second per cause" (with a count of the rest).
/// A current-thread runtime, so that the subscriber set for this thread sees every task.
#[tokio::test(flavor = "current_thread")]
async fn store_failure_warning_names_cause_and_database_once_a_second() {
    let (captured, _guard) = crate::common::log::CapturedLog::warnings();

    let db = TestDb::new().await;
    let mut cfg = db.store_config();
    cfg.url = Some(format!(
        "{} password=not-a-real-secret",
        db.url_through(db.server_addr())
    ));
    cfg.timeout = Duration::from_secs(2);
    let store = PostgresStore::new(&cfg).expect("store");
    store.initialize("fp", true).await.expect("initialize");
    let batch = [Increment {
        bucket: Arc::from("api:ip:x"),
        window_secs: 3600,
        by: 1,
        sliding: None,
        enforce: None,
        check: false,
    }];
    store.increment(&batch).await.expect("healthy");
    db.client()
        .await
        .batch_execute("DROP TABLE public.rate_limits CASCADE")
        .await
        .expect("drop");

    let failing = |captured: &crate::common::log::CapturedLog| -> Vec<String> {
        captured
            .lines()
            .into_iter()
            .filter(|l| l.contains("WARN") && l.contains("missing table"))
            .collect()
    };
    for _ in 0..20 {
        assert!(store.increment(&batch).await.is_err());
    }
    let lines = failing(&captured);
    assert_eq!(lines.len(), 1, "one line per second per cause: {lines:#?}");
    let line = &lines[0];
    let addr = db.server_addr();
    assert!(line.contains(&format!("host={}", addr.ip())), "{line}");
    assert!(line.contains(&format!("port={}", addr.port())), "{line}");
    assert!(line.contains(&format!("dbname={}", db.name)), "{line}");
    assert!(line.contains("42P01"), "the server's code: {line}");
    assert!(!line.contains("not-a-real-secret"), "{line}");

    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(store.increment(&batch).await.is_err());
    let lines = failing(&captured);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(
        lines[1].contains("suppressed=19"),
        "the next line counts what was left out: {}",
        lines[1]
    );
}

// ---------------------------------------------------------------------------------------------
// contract §6: a role's timeouts and the session the migrations leave behind.

/// The advisory lock key tollgate's migrations take ("tollgate" in ASCII).
const MIGRATION_LOCK: i64 = 0x746f_6c6c_6761_7465;

/// Review, smaller defects: "A role-level statement_timeout (57014 while waiting for the
/// migration lock) makes start-up exit 1." Another session holds the migration lock for
/// 700 ms while tollgate starts as a role with `statement_timeout = 50ms` and
/// `lock_timeout = 50ms`; start-up must wait for it and succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_statement_timeout_does_not_fail_start_up() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let admin_db = db.client().await;
    let role = Role::new(&db, &admin_db).await;
    admin_db
        .batch_execute(&format!(
            "ALTER ROLE \"{0}\" SET statement_timeout = '50ms'; \
             ALTER ROLE \"{0}\" SET lock_timeout = '50ms'",
            role.name
        ))
        .await
        .expect("role timeouts");

    let holder = db.client().await;
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await
        .expect("hold the migration lock");
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(700)).await;
        holder
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await
            .expect("release");
        holder
    });

    let store = format!("url = \"{}\"\ntimeout = \"2s\"", role.url(&db));
    let text = limits_config(&store, "", API_ROUTE);
    let started = tollgate::Server::start(config_from(&text, upstream.addr, &[])).await;
    let _ = release.await;
    let server = match started {
        Ok(server) => server,
        Err(err) => panic!("start-up failed under the role's statement_timeout: {err}"),
    };
    let proxy = Proxy {
        addr: server.listen_addrs[0],
        server: Some(server),
    };
    limit_holds(&h1_client(), &proxy, "k", 3).await;
    drop(proxy);
    role.drop_now(&admin_db).await;
}

/// A stand-in for a session-mode pooler: relays one client connection to the server and,
/// when the client says goodbye (Terminate), keeps the server session instead of ending it,
/// handing it to the test as the next client of the pool would get it.
async fn session_keeping_relay(target: SocketAddr) -> (SocketAddr, oneshot::Receiver<TcpStream>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (give, kept) = oneshot::channel();
    tokio::spawn(async move {
        let Ok((mut client, _)) = listener.accept().await else {
            return;
        };
        let Ok(mut server) = TcpStream::connect(target).await else {
            return;
        };
        // The start-up packet has no type byte; every later client message does.
        let mut started = false;
        let mut from_client = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        let mut reply = vec![0u8; 16 * 1024];
        loop {
            tokio::select! {
                read = client.read(&mut buf) => {
                    let Ok(n) = read else { return };
                    if n == 0 {
                        return;
                    }
                    from_client.extend_from_slice(&buf[..n]);
                    // Forward whole messages; stop at Terminate.
                    loop {
                        let (head, len) = if started {
                            if from_client.len() < 5 {
                                break;
                            }
                            let len = u32::from_be_bytes([
                                from_client[1], from_client[2], from_client[3], from_client[4],
                            ]) as usize;
                            (1, len)
                        } else {
                            if from_client.len() < 4 {
                                break;
                            }
                            let len = u32::from_be_bytes([
                                from_client[0], from_client[1], from_client[2], from_client[3],
                            ]) as usize;
                            (0, len)
                        };
                        if from_client.len() < head + len {
                            break;
                        }
                        let message: Vec<u8> = from_client.drain(..head + len).collect();
                        if started && message[0] == b'X' {
                            let _ = give.send(server);
                            return;
                        }
                        // An SSLRequest (answered 'N' here: no TLS) is followed by the real
                        // start-up packet.
                        let ssl_request = !started && len == 8 && message[4..8] == [4, 210, 22, 47];
                        if !ssl_request {
                            started = true;
                        }
                        if server.write_all(&message).await.is_err() {
                            return;
                        }
                    }
                }
                read = server.read(&mut reply) => {
                    let Ok(n) = read else { return };
                    if n == 0 || client.write_all(&reply[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    (addr, kept)
}

/// `SHOW search_path` on a raw server session, by the simple query protocol.
async fn show_search_path(session: &mut TcpStream) -> String {
    let query = b"SHOW search_path\0";
    let mut message = vec![b'Q'];
    message.extend_from_slice(&((query.len() + 4) as u32).to_be_bytes());
    message.extend_from_slice(query);
    session.write_all(&message).await.expect("send query");
    let mut input = Vec::new();
    let mut value = None;
    let mut buf = vec![0u8; 4096];
    loop {
        while input.len() >= 5 {
            let len = u32::from_be_bytes([input[1], input[2], input[3], input[4]]) as usize;
            if input.len() < 1 + len {
                break;
            }
            let message: Vec<u8> = input.drain(..1 + len).collect();
            match message[0] {
                // DataRow: int16 columns, then int32 length and the bytes of each.
                b'D' => {
                    let n = i32::from_be_bytes([message[7], message[8], message[9], message[10]]);
                    let n = usize::try_from(n).expect("not null");
                    value = Some(String::from_utf8_lossy(&message[11..11 + n]).into_owned());
                }
                b'E' => panic!("SHOW failed: {}", String::from_utf8_lossy(&message)),
                b'Z' => return value.expect("a row"),
                _ => {}
            }
        }
        let read = tokio::time::timeout(Duration::from_secs(5), session.read(&mut buf))
            .await
            .expect("the kept session answers")
            .expect("read");
        assert!(read > 0, "the server ended the kept session");
        input.extend_from_slice(&buf[..read]);
    }
}

/// Review, smaller defects: "the migrations' SET search_path = public stays on the session
/// (through a pooler it leaks to other clients)". `tollgate migrate` runs through a relay that
/// keeps the server session when tollgate disconnects, as a pooler does; the next client of
/// that session must find the search_path it would have had anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_leave_no_search_path_on_the_session() {
    let db = TestDb::new().await;
    let admin_db = db.client().await;
    let name = &db.name;
    // A database default other than `public`, so that a leaked `public` shows.
    admin_db
        .batch_execute(&format!(
            "ALTER DATABASE \"{name}\" SET search_path = \"$user\", public, pg_temp"
        ))
        .await
        .expect("database default");
    let (addr, kept) = session_keeping_relay(db.server_addr()).await;
    let mut cfg = db.store_config();
    cfg.url = Some(format!("{} sslmode=disable", db.url_through(addr)));
    let store = PostgresStore::new(&cfg).expect("store");
    let report = store.migrate("fp", false).await.expect("migrate");
    assert!(!report.applied.is_empty(), "{report}");
    drop(store);
    let mut session = tokio::time::timeout(Duration::from_secs(5), kept)
        .await
        .expect("tollgate closes its migration session")
        .expect("the relay kept the session");
    assert_eq!(
        show_search_path(&mut session).await,
        "\"$user\", public, pg_temp",
        "the migrations changed the session's search_path"
    );
}

/// Issue 15, "roles as operators make them": a runtime role that may not create anything
/// serves with `migrate = false` once a deploy job (here: the database owner) has migrated.
/// It can read and write the counters and read the schema's records, nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_create_serves_with_migrate_false_after_a_deploy_job_migrated() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let admin_db = db.client().await;
    // The deploy job: the owner migrates (and stores the key fingerprint), then stops.
    let (mut owner, _) = ready_proxy(&upstream, &db.url).await;
    owner.shutdown().await;

    let name = format!("{}_runtime", db.name);
    admin_db
        .batch_execute(&format!(
            "CREATE ROLE \"{name}\" LOGIN; \
             REVOKE CREATE ON SCHEMA public FROM PUBLIC; \
             GRANT USAGE ON SCHEMA public TO \"{name}\"; \
             GRANT SELECT ON ALL TABLES IN SCHEMA public TO \"{name}\"; \
             GRANT INSERT, UPDATE, DELETE ON public.rate_limits TO \"{name}\"; \
             GRANT INSERT, UPDATE, DELETE ON public.tollgate_instances TO \"{name}\"; \
             GRANT INSERT, UPDATE, DELETE ON public.tollgate_shares TO \"{name}\""
        ))
        .await
        .expect("create the runtime role");
    let can_create: bool = admin_db
        .query_one(
            &format!("SELECT has_schema_privilege('{name}', 'public', 'CREATE')"),
            &[],
        )
        .await
        .expect("privilege")
        .get(0);
    assert!(!can_create, "the runtime role must not be able to create");

    let url = format!("{} user={name}", db.url_through(db.server_addr()));
    let store = format!("url = \"{url}\"\ntimeout = \"1s\"\non_error = \"deny\"\nmigrate = false");
    let routes = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"

[[routes]]
name = "shared"
path_prefix = "/shared"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"
  reserve = true
"#;
    let text = limits_config(&store, "\n[admin]\nlisten = \"127.0.0.1:0\"", routes);
    let started: f64 = admin_db
        .query_one("SELECT extract(epoch FROM now())::float8", &[])
        .await
        .expect("database clock")
        .get(0);
    let mut proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    let client = h1_client();
    let statuses = [
        get(&client, &proxy.url("/api")).await.status.as_u16(),
        get(&client, &proxy.url("/api")).await.status.as_u16(),
        get(&client, &proxy.url("/api")).await.status.as_u16(),
    ];
    assert_eq!(
        statuses,
        [200, 200, 429],
        "the limit holds under the runtime role"
    );
    let mut reserved = Vec::new();
    for _ in 0..3 {
        reserved.push(get(&client, &proxy.url("/shared")).await.status.as_u16());
    }
    assert_eq!(
        reserved,
        [200, 200, 429],
        "a reserve limit under the runtime role"
    );
    assert_eq!(
        ready_until(&client, admin, 200, Duration::from_secs(3)).await,
        200
    );
    // It registers in the instance registry (contract §5b) with exactly these grants.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows: i64 = admin_db
            .query_one(
                "SELECT count(*) FROM tollgate_instances WHERE extract(epoch FROM started_at) >= $1::float8",
                &[&started],
            )
            .await
            .expect("registry")
            .get(0);
        if rows == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the runtime role never registered: {rows} row(s)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.shutdown().await;
    Role { name }.drop_now(&admin_db).await;
}
