//! Failover (contract §6): tollgate follows a PostgreSQL primary that fails over, through a
//! multi-host `store.url` with `target_session_attrs=read-write`, without a restart; and it
//! drops a pooled connection that answers "read-only transaction" (SQLSTATE 25006) instead of
//! returning it to the pool.
//!
//! Each test makes clusters of its own with initdb/pg_ctl/pg_basebackup (as user postgres when
//! running as root, since initdb refuses root) in a temporary directory. A [`Clusters`] guard
//! stops them and removes the directory when dropped, also when the test panics; a watchdog
//! process does the same if the test process dies without unwinding.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http::StatusCode;

use crate::common::*;

/// initdb, pg_ctl and pg_basebackup, of one PostgreSQL version.
struct PgBin {
    initdb: PathBuf,
    pg_ctl: PathBuf,
    pg_basebackup: PathBuf,
}

/// A program from PATH, else from Debian's versioned directories (newest version first).
fn find_program(name: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    let mut versioned: Vec<((u32, u32), PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let version = e.file_name().to_string_lossy().into_owned();
                    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
                    let key = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
                    let path = e.path().join("bin").join(name);
                    path.is_file().then_some((key, path))
                })
                .collect()
        })
        .unwrap_or_default();
    versioned.sort();
    versioned.pop().map(|(_, path)| path)
}

impl PgBin {
    /// The three programs, taken from initdb's own directory when they are there, so that the
    /// versions match (Debian's /usr/bin/pg_basebackup is a wrapper that may pick another).
    fn find() -> PgBin {
        let initdb = find_program("initdb").unwrap_or_else(|| {
            panic!(
                "initdb is neither on PATH nor under /usr/lib/postgresql/*/bin: the failover \
                 tests need PostgreSQL's server programs (initdb, pg_ctl, pg_basebackup)"
            )
        });
        let bin_dir = std::fs::canonicalize(&initdb)
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf));
        let sibling = |name: &str| {
            bin_dir
                .as_ref()
                .map(|dir| dir.join(name))
                .filter(|p| p.is_file())
                .or_else(|| find_program(name))
                .unwrap_or_else(|| panic!("{name} not found next to {initdb:?} nor on PATH"))
        };
        PgBin {
            pg_ctl: sibling("pg_ctl"),
            pg_basebackup: sibling("pg_basebackup"),
            initdb,
        }
    }
}

/// A temporary directory holding PostgreSQL clusters (one data directory and one log per
/// name). Dropping it stops every cluster (`pg_ctl stop -m immediate`) and removes it.
struct Clusters {
    dir: PathBuf,
    bin: PgBin,
    as_root: bool,
    /// `sh` waiting for EOF on its stdin, then stopping the clusters and removing `dir`.
    watchdog: Option<Child>,
}

impl Clusters {
    fn new() -> Clusters {
        let bin = PgBin::find();
        let as_root = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false);
        let mut clusters = Clusters {
            dir: PathBuf::new(),
            bin,
            as_root,
            watchdog: None,
        };
        let out = clusters
            .command("mktemp")
            .args(["-d", "/tmp/tollgate-failover.XXXXXX"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("could not run mktemp: {e}"));
        assert!(
            out.status.success(),
            "mktemp failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        clusters.dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        // The watchdog gets EOF when the guard drops its stdin, or when this process exits
        // however it exits; stopping a directory without a running server just fails.
        let watchdog = clusters
            .command("sh")
            .args([
                "-c",
                "cat >/dev/null; for d in \"$1\"/*/; do \"$0\" -D \"$d\" -m immediate -t 20 stop \
                 >/dev/null 2>&1; done; rm -rf \"$1\"",
            ])
            .arg(&clusters.bin.pg_ctl)
            .arg(&clusters.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("could not start the clusters' watchdog: {e}"));
        clusters.watchdog = Some(watchdog);
        clusters
    }

    /// `program` run as user postgres when this process is root.
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        if self.as_root {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    fn data(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    /// The last lines of a cluster's server log, for failure messages.
    fn log_tail(&self, name: &str) -> String {
        let log = std::fs::read_to_string(self.log(name)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(25)..].join("\n")
    }

    /// Runs a command to completion without blocking the runtime; its stdout, or a panic
    /// saying what failed.
    async fn run(&self, what: &str, command: Command) -> String {
        self.run_or_explain(what, command, String::new).await
    }

    /// [`Clusters::run`], with `context()` (a server log, say) added to the failure message.
    async fn run_or_explain(
        &self,
        what: &str,
        command: Command,
        context: impl FnOnce() -> String,
    ) -> String {
        let output = tokio::process::Command::from(command)
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap_or_else(|e| panic!("{what}: could not run: {e}"));
        assert!(
            output.status.success(),
            "{what} failed ({}): {}{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            context()
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Server options given on the command line, so that a base backup does not copy them.
    fn server_options(&self, port: u16) -> String {
        format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50 \
             -c wal_level=replica -c max_wal_senders=5 -c hot_standby=on",
            self.dir.display()
        )
    }

    /// initdb a primary that accepts replication from 127.0.0.1 without a password.
    async fn init_primary(&self, name: &str) {
        let mut initdb = self.command(&self.bin.initdb);
        initdb
            .arg("-D")
            .arg(self.data(name))
            .args(crate::common::db::INITDB_ARGS);
        self.run("initdb", initdb).await;
        let hba = self.data(name).join("pg_hba.conf");
        let mut text = std::fs::read_to_string(&hba).expect("read pg_hba.conf");
        text.push_str("\nhost replication all 127.0.0.1/32 trust\n");
        std::fs::write(&hba, text).expect("write pg_hba.conf");
    }

    /// A streaming standby of the cluster on `primary_port` (`pg_basebackup -R`).
    async fn base_backup(&self, primary_port: u16, name: &str) {
        let mut backup = self.command(&self.bin.pg_basebackup);
        backup
            .args(["-h", "127.0.0.1", "-p", &primary_port.to_string()])
            .args(["-U", "postgres", "-D"])
            .arg(self.data(name))
            .args(["-R", "-X", "stream", "-c", "fast", "--no-sync"]);
        self.run("pg_basebackup", backup).await;
    }

    async fn start(&self, name: &str, port: u16) {
        let mut start = self.command(&self.bin.pg_ctl);
        start
            .arg("-D")
            .arg(self.data(name))
            .arg("-l")
            .arg(self.log(name))
            .args(["-w", "-t", "30", "-o", &self.server_options(port), "start"]);
        let what = format!("pg_ctl start ({name})");
        self.run_or_explain(&what, start, || {
            format!("\nserver log:\n{}", self.log_tail(name))
        })
        .await;
    }

    async fn stop(&self, name: &str, mode: &str) {
        let mut stop = self.command(&self.bin.pg_ctl);
        stop.arg("-D")
            .arg(self.data(name))
            .args(["-m", mode, "-w", "-t", "30", "stop"]);
        self.run(&format!("pg_ctl stop -m {mode} ({name})"), stop)
            .await;
    }

    async fn promote(&self, name: &str) {
        let mut promote = self.command(&self.bin.pg_ctl);
        promote
            .arg("-D")
            .arg(self.data(name))
            .args(["-w", "-t", "30", "promote"]);
        self.run(&format!("pg_ctl promote ({name})"), promote).await;
    }
}

impl Drop for Clusters {
    fn drop(&mut self) {
        if let Some(mut watchdog) = self.watchdog.take() {
            drop(watchdog.stdin.take());
            if let Err(e) = watchdog.wait() {
                eprintln!(
                    "warning: the clusters in {} may still run: {e}",
                    self.dir.display()
                );
            }
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A client on one cluster; `options` are session settings (`-c name=value`).
async fn connect(port: u16, options: &str) -> tokio_postgres::Client {
    let mut url = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
    if !options.is_empty() {
        url.push_str(&format!(" options='{options}'"));
    }
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("could not connect to the cluster on port {port}: {e:?}"));
    tokio::spawn(conn);
    client
}

/// The count of the one bucket in `rate_limits` (0 without a row); more than one row fails.
async fn bucket_count(client: &tokio_postgres::Client) -> i64 {
    let row = client
        .query_one(
            "SELECT count(*)::int8, coalesce(sum(count), 0)::int8 FROM public.rate_limits",
            &[],
        )
        .await
        .expect("read rate_limits");
    let rows: i64 = row.get(0);
    assert!(rows <= 1, "expected one bucket row, found {rows}");
    row.get(1)
}

/// The `r` parameter of a `RateLimit` header: requests left in the window.
fn remaining(answer: &Answer) -> Option<i64> {
    let state = answer.header("ratelimit")?;
    let r = state.split(';').find_map(|p| p.strip_prefix("r="))?;
    r.parse().ok()
}

/// One `ip` limit of 1000 a (366-day) window in front of the upstream, counting in
/// PostgreSQL at `url`, failing closed.
fn tollgate_config(url: &str, pool_size: u32) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"

[store]
url = "{url}"
timeout = "500ms"
on_error = "deny"
pool_size = {pool_size}

[keys]
secret = "test-secret"

[upstreams.app]
url = "http://@UPSTREAM@"
connect_timeout = "1s"
response_timeout = "2s"

[[routes]]
name = "failover"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1000
  window = "366d"
"#
    )
}

const LIMIT: i64 = 1000;

/// Polls `check` every 100 ms until it holds or `within` passes; false if it never held.
async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Primary and streaming standby; tollgate counting on the primary through a two-host URL;
/// the primary stops, the standby is promoted: without a restart tollgate fails closed for
/// the outage, then answers 200 again within seconds and counts on, exactly, from the
/// replicated count on the promoted server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_failover_to_the_promoted_standby() {
    let test_started = Instant::now();
    let clusters = Clusters::new();
    let (primary_port, standby_port) = (free_port(), free_port());
    clusters.init_primary("primary").await;
    clusters.start("primary", primary_port).await;
    clusters.base_backup(primary_port, "standby").await;
    clusters.start("standby", standby_port).await;
    let primary = connect(primary_port, "").await;
    let streaming = eventually(Duration::from_secs(15), || async {
        let row = primary
            .query_one(
                "SELECT count(*)::int8 FROM pg_stat_replication WHERE state = 'streaming'",
                &[],
            )
            .await
            .expect("read pg_stat_replication");
        row.get::<_, i64>(0) == 1
    })
    .await;
    assert!(
        streaming,
        "the standby never streamed from the primary\nstandby log:\n{}\nprimary log:\n{}",
        clusters.log_tail("standby"),
        clusters.log_tail("primary")
    );
    let standby = connect(standby_port, "").await;
    eprintln!(
        "failover: primary on {primary_port}, streaming standby on {standby_port} after {:?}",
        test_started.elapsed()
    );

    let upstream = Upstream::start().await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{primary_port},127.0.0.1:{standby_port}/postgres\
         ?target_session_attrs=read-write"
    );
    let mut proxy = Proxy::start(config_from(&tollgate_config(&url, 4), upstream.addr, &[])).await;
    let client = h1_client();

    // Before: counted on the primary.
    const BEFORE: i64 = 5;
    for n in 1..=BEFORE {
        let answer = get(&client, &proxy.url("/")).await;
        assert_eq!(answer.status, StatusCode::OK, "request {n} before failover");
        assert_eq!(remaining(&answer), Some(LIMIT - n));
    }
    assert_eq!(bucket_count(&primary).await, BEFORE);
    // Wait until the standby has replayed them, so that none can be lost by the async
    // replication (tollgate's synchronous_commit=off does not delay the WAL sender).
    let replicated = eventually(Duration::from_secs(10), || async {
        standby
            .query_opt("SELECT 1 FROM pg_class WHERE relname = 'rate_limits'", &[])
            .await
            .expect("query the standby")
            .is_some()
            && bucket_count(&standby).await == BEFORE
    })
    .await;
    assert!(replicated, "the standby never replayed the primary's count");

    // The primary goes away: tollgate fails closed (on_error = "deny"), nothing forwarded.
    clusters.stop("primary", "fast").await;
    drop(primary);
    for n in 1..=3 {
        let answer = get(&client, &proxy.url("/")).await;
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "request {n} with no primary"
        );
        assert_eq!(answer.header("retry-after"), Some("1"));
    }
    assert_eq!(upstream.count() as i64, BEFORE);
    // Let any increment still waiting for a connection give up (store.timeout is 500ms), so
    // that the count read at promotion is the one the first post-failover request starts from.
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Promotion.
    clusters.promote("standby").await;
    let promoted = eventually(Duration::from_secs(15), || async {
        let row = standby
            .query_one("SELECT pg_is_in_recovery()", &[])
            .await
            .expect("query the standby");
        !row.get::<_, bool>(0)
    })
    .await;
    assert!(
        promoted,
        "the standby never left recovery\n{}",
        clusters.log_tail("standby")
    );
    let promoted_at = Instant::now();
    let at_promotion = bucket_count(&standby).await;
    assert_eq!(
        at_promotion, BEFORE,
        "the promoted server lost replicated increments"
    );

    // Recovery without a restart: 200 again within a bounded time.
    let mut attempts = 0i64;
    let first_ok = loop {
        let answer = get(&client, &proxy.url("/")).await;
        attempts += 1;
        if answer.status == StatusCode::OK {
            break answer;
        }
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "unexpected answer while failing over"
        );
        assert!(
            promoted_at.elapsed() < Duration::from_secs(15),
            "tollgate did not follow the failover within 15 s ({attempts} requests, all 503)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let recovery = promoted_at.elapsed();
    eprintln!("failover: first 200 {recovery:?} after promotion, {attempts} request(s)");
    // The first count on the promoted server continues from the replicated one. A request
    // that got 503 just before may still have been counted (its increment outlived its
    // decision), so the bound above is the number of attempts.
    let first_count = LIMIT - remaining(&first_ok).expect("RateLimit header");
    assert!(
        (at_promotion + 1..=at_promotion + attempts).contains(&first_count),
        "first count after failover {first_count}, replicated {at_promotion}, {attempts} attempts"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let settled = bucket_count(&standby).await;
    assert!(
        (first_count..=at_promotion + attempts).contains(&settled),
        "count {settled} on the promoted server, first 200 saw {first_count}"
    );

    // From here every request is counted exactly once, on the promoted server.
    const AFTER: i64 = 10;
    for n in 1..=AFTER {
        let answer = get(&client, &proxy.url("/")).await;
        assert_eq!(answer.status, StatusCode::OK, "request {n} after recovery");
        assert_eq!(remaining(&answer), Some(LIMIT - settled - n));
    }
    assert_eq!(bucket_count(&standby).await, settled + AFTER);
    assert_eq!(upstream.count() as i64, BEFORE + 1 + AFTER);
    let sessions: i64 = standby
        .query_one(
            "SELECT count(*)::int8 FROM pg_stat_activity WHERE application_name = 'tollgate'",
            &[],
        )
        .await
        .expect("read pg_stat_activity")
        .get(0);
    assert!(sessions >= 1, "no tollgate session on the promoted server");

    proxy.shutdown().await;
    drop(clusters);
    eprintln!("failover: done in {:?}", test_started.elapsed());
}

/// Makes the server refuse writes (as a demoted primary does: SQLSTATE 25006) or accept them
/// again; existing sessions pick the setting up at their next statement.
async fn set_read_only(admin: &tokio_postgres::Client, on: bool) {
    let change = if on {
        "ALTER SYSTEM SET default_transaction_read_only = on"
    } else {
        "ALTER SYSTEM RESET default_transaction_read_only"
    };
    admin.batch_execute(change).await.expect(change);
    admin
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .expect("reload the configuration");
}

/// tollgate's sessions, by backend pid.
async fn tollgate_pids(client: &tokio_postgres::Client) -> Vec<i32> {
    client
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'tollgate' ORDER BY pid",
            &[],
        )
        .await
        .expect("read pg_stat_activity")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// A primary that turns read-only under tollgate's pooled connection (as a demoted primary
/// does): the connection answers SQLSTATE 25006, requests fail closed, and the connection is
/// dropped rather than returned to the pool; once the server is writable again tollgate counts
/// on, without a restart, on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_a_connection_that_turned_read_only() {
    let test_started = Instant::now();
    let clusters = Clusters::new();
    let port = free_port();
    clusters.init_primary("primary").await;
    clusters.start("primary", port).await;
    // The admin session keeps writing whatever the server default says.
    let admin = connect(port, "-c default_transaction_read_only=off").await;

    let upstream = Upstream::start().await;
    let url =
        format!("postgres://postgres@127.0.0.1:{port}/postgres?target_session_attrs=read-write");
    // One pooled connection, so the one that turns read-only is the one every request uses.
    let mut proxy = Proxy::start(config_from(&tollgate_config(&url, 1), upstream.addr, &[])).await;
    let client = h1_client();
    for n in 1..=3 {
        let answer = get(&client, &proxy.url("/")).await;
        assert_eq!(answer.status, StatusCode::OK, "request {n}");
        assert_eq!(remaining(&answer), Some(LIMIT - n));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let before = loop {
        let pids = tollgate_pids(&admin).await;
        if pids.len() == 1 {
            break pids;
        }
        assert!(
            Instant::now() < deadline,
            "expected one tollgate session, found {pids:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // Existing sessions pick the new default up at their next statement.
    set_read_only(&admin, true).await;
    let mut allowed = 0i64;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = get(&client, &proxy.url("/")).await.status;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert_eq!(status, StatusCode::OK);
        allowed += 1;
        assert!(
            Instant::now() < deadline,
            "requests never failed while the server was read-only"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for n in 1..=5 {
        let answer = get(&client, &proxy.url("/")).await;
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "request {n} while read-only"
        );
    }
    assert_eq!(bucket_count(&admin).await, 3 + allowed);
    // The connection that answered 25006 was dropped, not put back in the pool: its backend
    // goes away. (New ones are refused by target_session_attrs=read-write meanwhile.)
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = tollgate_pids(&admin).await;
        if !now.iter().any(|pid| before.contains(pid)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the connection that answered read-only (pid {before:?}) is still open: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Writable again: 200 within a bounded time, on a new connection, counting on.
    set_read_only(&admin, false).await;
    let writable_at = Instant::now();
    let mut attempts = 0i64;
    let first_ok = loop {
        let answer = get(&client, &proxy.url("/")).await;
        attempts += 1;
        if answer.status == StatusCode::OK {
            break answer;
        }
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            writable_at.elapsed() < Duration::from_secs(10),
            "no recovery within 10 s of the server turning writable ({attempts} requests)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "read-only: first 200 {:?} after the server turned writable, {attempts} request(s)",
        writable_at.elapsed()
    );
    // As in the failover test: a 503 just before may have been counted late, never more.
    let counted_before = 3 + allowed;
    let first_count = LIMIT - remaining(&first_ok).expect("RateLimit header");
    assert!(
        (counted_before + 1..=counted_before + attempts).contains(&first_count),
        "first count after recovery {first_count}, {counted_before} before, {attempts} attempts"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let settled = bucket_count(&admin).await;
    assert!((first_count..=counted_before + attempts).contains(&settled));
    for n in 1..=3 {
        let answer = get(&client, &proxy.url("/")).await;
        assert_eq!(answer.status, StatusCode::OK, "request {n} after recovery");
        assert_eq!(remaining(&answer), Some(LIMIT - settled - n));
    }
    assert_eq!(bucket_count(&admin).await, settled + 3);
    let after = tollgate_pids(&admin).await;
    assert!(
        !after.is_empty() && !after.iter().any(|pid| before.contains(pid)),
        "expected a new tollgate session, before {before:?}, after {after:?}"
    );

    proxy.shutdown().await;
    drop(clusters);
    eprintln!("read-only: done in {:?}", test_started.elapsed());
}
