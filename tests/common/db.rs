//! A real PostgreSQL for tests (DESIGN, "Tests that prove something"): one fresh database per
//! test, created on [`TestDb::new`] and dropped with the [`TestDb`], so tests run in parallel
//! without seeing each other's rows.
//!
//! The server is found once per test process:
//! 1. `TOLLGATE_TEST_DATABASE_URL`, if set (it must answer: an explicit choice is not second-
//!    guessed). The special value `throwaway` skips straight to step 3.
//! 2. `postgres://postgres@127.0.0.1:5432/postgres`.
//! 3. A throwaway cluster made with `initdb` and started with `pg_ctl` on a free port, as user
//!    `postgres` when running as root (initdb refuses root). A watchdog process stops it and
//!    removes its directory when the test process exits, however it exits.
//!
//! If none of these works the test panics and says how to provide a database: a Postgres test
//! never passes by skipping.

// Each test binary uses a different part of this harness.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tollgate::testing::config::{StoreConfig, StoreErrorPolicy};

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

const HOW_TO: &str = "tollgate's Postgres tests need a PostgreSQL server (13 or later) where \
     they may create and drop databases. Set TOLLGATE_TEST_DATABASE_URL to one (e.g. \
     postgres://postgres@127.0.0.1:5432/postgres), start one on 127.0.0.1:5432 accepting \
     user postgres, or put initdb and pg_ctl on PATH so the tests can start their own.";

/// A database of its own for one test.
pub struct TestDb {
    /// Connection string for this test's database (same form as the server's).
    pub url: String,
    /// The database's name.
    pub name: String,
}

impl TestDb {
    /// Creates a fresh, empty database on the test server.
    pub async fn new() -> TestDb {
        let server = server_url();
        let name = unique_name();
        let admin = connect(server).await;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap_or_else(|e| panic!("could not create test database {name}: {e}. {HOW_TO}"));
        TestDb {
            url: with_dbname(server, &name),
            name,
        }
    }

    /// A client on this test's database, for setting up rows and asserting on them.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }

    /// A store configuration for this database, generous enough not to flake on a busy
    /// machine; tests that are about time limits set their own `timeout`.
    pub fn store_config(&self) -> StoreConfig {
        Self::store_config_for(self.url.clone())
    }

    /// The same for any connection string (another server, a relay).
    pub fn store_config_for(url: String) -> StoreConfig {
        StoreConfig {
            url: Some(url),
            pool_size: 4,
            timeout: Duration::from_secs(10),
            on_error: StoreErrorPolicy::Allow,
            migrate: true,
            sweep_interval: Duration::from_secs(60),
            synchronous_commit: false,
            memory_buckets: std::num::NonZeroUsize::MIN,
            ca_file: None,
        }
    }

    /// The server's TCP address (for tests that put a relay in between).
    pub fn server_addr(&self) -> SocketAddr {
        let config = tokio_postgres::Config::from_str(&self.url)
            .unwrap_or_else(|e| panic!("test database URL does not parse: {e}"));
        let port = config.get_ports().first().copied().unwrap_or(5432);
        config
            .get_hosts()
            .iter()
            .find_map(|host| match host {
                tokio_postgres::config::Host::Tcp(h) => (h.as_str(), port)
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut addrs| addrs.next()),
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(_) => None,
            })
            .unwrap_or_else(|| panic!("the test server has no TCP address"))
    }

    /// A connection string for this database that goes through `addr` instead of the
    /// server's own address (same user and password).
    pub fn url_through(&self, addr: SocketAddr) -> String {
        let config = tokio_postgres::Config::from_str(&self.url)
            .unwrap_or_else(|e| panic!("test database URL does not parse: {e}"));
        let mut url = format!(
            "host={} port={} dbname={}",
            addr.ip(),
            addr.port(),
            quote(&self.name)
        );
        if let Some(user) = config.get_user() {
            url.push_str(&format!(" user={}", quote(user)));
        }
        if let Some(password) = config.get_password() {
            url.push_str(&format!(
                " password={}",
                quote(&String::from_utf8_lossy(password))
            ));
        }
        url
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop cannot await, and the test's runtime may be shutting down: drop the database
        // from a thread with a runtime of its own. FORCE ends the sessions tests left open.
        let server = server_url().to_owned();
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let (client, conn) = tokio_postgres::connect(&server, tokio_postgres::NoTls)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::spawn(conn);
                client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .await
                    .map_err(|e| e.to_string())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("warning: could not drop test database {}: {e}", self.name),
            Err(_) => eprintln!("warning: dropping test database {} panicked", self.name),
        }
    }
}

/// Connects or panics with the reason.
async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "could not connect to the test database: {}. {HOW_TO}",
                chain(&e)
            )
        });
    tokio::spawn(conn);
    client
}

/// The test server's URL, found once per process (see the module docs).
fn server_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    // Discovery runs on a thread with its own runtime: the calling test's runtime is not
    // guaranteed to outlive it, and a current-thread runtime cannot block_on inside itself.
    URL.get_or_init(|| match std::thread::spawn(discover).join() {
        Ok(url) => url,
        Err(_) => panic!("no PostgreSQL server for the tests. {HOW_TO}"),
    })
}

fn discover() -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("could not build a runtime: {e}"));
    match std::env::var("TOLLGATE_TEST_DATABASE_URL") {
        Ok(url) if url == "throwaway" => {
            start_throwaway(&rt).unwrap_or_else(|e| panic!("{e}. {HOW_TO}"))
        }
        Ok(url) => match rt.block_on(answers(&url)) {
            Ok(()) => url,
            Err(e) => panic!("TOLLGATE_TEST_DATABASE_URL does not answer: {e}. {HOW_TO}"),
        },
        Err(_) => match rt.block_on(answers(DEFAULT_URL)) {
            Ok(()) => DEFAULT_URL.to_owned(),
            Err(default_err) => start_throwaway(&rt).unwrap_or_else(|e| {
                panic!("nothing answers at {DEFAULT_URL} ({default_err}), and {e}. {HOW_TO}")
            }),
        },
    }
}

/// Whether `url` answers a query within a few seconds.
async fn answers(url: &str) -> Result<(), String> {
    let attempt = async {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| chain(&e))?;
        tokio::spawn(conn);
        client
            .simple_query("SELECT 1")
            .await
            .map(|_| ())
            .map_err(|e| chain(&e))
    };
    tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .map_err(|_| "timed out".to_owned())?
}

/// Makes and starts a cluster of its own; returns its URL.
/// initdb options for a throwaway cluster: trust auth for `postgres`, no fsync, no locale.
pub const INITDB_ARGS: [&str; 8] = [
    "-U",
    "postgres",
    "-A",
    "trust",
    "--no-sync",
    "--no-locale",
    "-E",
    "UTF8",
];

fn start_throwaway(rt: &tokio::runtime::Runtime) -> Result<String, String> {
    let initdb = find_tool("initdb")?;
    let pg_ctl = find_tool("pg_ctl")?;
    let as_root = run_output(Command::new("id").arg("-u"))
        .map(|uid| uid.trim() == "0")
        .unwrap_or(false);
    // initdb refuses to run as root: the cluster belongs to user postgres then.
    let command = |program: &str| {
        if as_root {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", program]);
            c
        } else {
            Command::new(program)
        }
    };

    let dir = run_output(command("mktemp").args(["-d", "/tmp/tollgate-test-pg.XXXXXX"]))?;
    let dir = PathBuf::from(dir.trim());
    let data = dir.join("data");
    run_output(command(&initdb).arg("-D").arg(&data).args(INITDB_ARGS))?;

    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let options = format!(
        "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300",
        dir.display()
    );
    run_output(
        command(&pg_ctl)
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.join("log"))
            .args(["-w", "-t", "60", "-o", &options, "start"]),
    )?;

    // The watchdog waits for EOF on its stdin, which comes when this process exits and the
    // pipe's write end (kept open below, never written) closes; then it stops the cluster.
    let watchdog = command("sh")
        .args([
            "-c",
            "cat >/dev/null; \"$0\" -D \"$1/data\" -m immediate stop >/dev/null 2>&1; rm -rf \"$1\"",
        ])
        .arg(&pg_ctl)
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("could not start the cluster's watchdog: {e}"))?;
    // Leaking the child keeps its stdin open for the rest of the process.
    std::mem::forget(watchdog);

    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    rt.block_on(answers(&url))
        .map_err(|e| format!("the throwaway cluster does not answer: {e}"))?;
    eprintln!("tests: started a throwaway PostgreSQL cluster on 127.0.0.1:{port}");
    Ok(url)
}

/// A PostgreSQL program from PATH, or from Debian's versioned directories.
pub fn find_tool(name: &str) -> Result<String, String> {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate.display().to_string());
            }
        }
    }
    let mut versioned: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("bin").join(name))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    versioned.sort();
    versioned
        .pop()
        .map(|p| p.display().to_string())
        .ok_or_else(|| format!("{name} is not on PATH"))
}

/// Runs a command to completion; its stdout, or an error with its stderr.
pub fn run_output(command: &mut Command) -> Result<String, String> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("could not run {command:?}: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// A database name no other test (in this or another process) is using.
fn unique_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "tollgate_test_{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// `url` with its database replaced by `name`; works for URLs and key=value strings.
fn with_dbname(url: &str, name: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        // key=value form: a later key wins.
        return format!("{url} dbname={}", quote(name));
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let after_authority = &rest[authority_end..];
    let query = after_authority
        .find('?')
        .map(|q| &after_authority[q..])
        .unwrap_or("");
    format!(
        "{}{}/{name}{query}",
        &url[..rest_start],
        &rest[..authority_end]
    )
}

/// A value for a key=value connection string.
fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// An error with its causes ("error connecting to server: Connection refused ...").
fn chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}
