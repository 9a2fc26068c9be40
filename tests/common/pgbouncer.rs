//! A real PgBouncer in front of a test's database (contract §6, "Connection poolers"): started by
//! the test on a free port, in session or transaction pooling mode, and stopped when the
//! [`PgBouncer`] is dropped.
//!
//! It is Debian's `pgbouncer` package (`.ci/run` installs it when it is missing). PgBouncer
//! refuses to run as root, so when the tests run as root it is started with `-u postgres`
//! (it drops privileges itself, so the child process is PgBouncer and the guard can stop it).
//! Readiness is PgBouncer's own "process up" log line, read from its stderr, not a sleep.

// Each test binary uses a different part of this harness.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use super::db::TestDb;

/// How PgBouncer hands server connections to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A client keeps one server connection for as long as it is connected.
    Session,
    /// A client gets a server connection for one transaction only; each statement outside
    /// an explicit transaction may run on a different one.
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// A running PgBouncer; dropped, it is killed and its directory removed.
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    /// Where clients connect.
    pub addr: SocketAddr,
    /// Server connections per (database, user) pair (`default_pool_size`).
    pub pool_size: u32,
    /// Everything PgBouncer logged so far.
    log: Arc<Mutex<String>>,
}

impl PgBouncer {
    /// PgBouncer in `mode` in front of `db`, with `pool_size` server connections.
    pub fn start(db: &TestDb, mode: PoolMode, pool_size: u32) -> PgBouncer {
        PgBouncer::start_with_users(db, mode, pool_size, &[])
    }

    /// The same, also letting in the login roles `users` (besides the database URL's own user),
    /// each with a pool of its own.
    pub fn start_with_users(
        db: &TestDb,
        mode: PoolMode,
        pool_size: u32,
        users: &[&str],
    ) -> PgBouncer {
        let server = db.server_addr();
        // A free port found by binding port 0: PgBouncer cannot report a port it chose. If
        // another process takes it in between, PgBouncer says so and the next attempt uses
        // another.
        let mut last_error = String::new();
        for _ in 0..5 {
            match try_start(db, server, mode, pool_size, users) {
                Ok(bouncer) => return bouncer,
                Err(e) => last_error = e,
            }
        }
        panic!("pgbouncer did not start: {last_error}");
    }

    /// A connection string for the test's database through this PgBouncer.
    pub fn url(&self, db: &TestDb) -> String {
        db.url_through(self.addr)
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn try_start(
    db: &TestDb,
    server: SocketAddr,
    mode: PoolMode,
    pool_size: u32,
    users: &[&str],
) -> Result<PgBouncer, String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let dir = std::env::temp_dir().join(format!(
        "tollgate-pgbouncer-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("temp dir: {e}"))?;
    let user = user_of(&db.url);
    let ini = format!(
        "[databases]\n\
         {name} = host={host} port={port_db} dbname={name}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         auth_type = trust\n\
         auth_file = {dir}/userlist.txt\n\
         pool_mode = {mode}\n\
         default_pool_size = {pool_size}\n\
         max_client_conn = 500\n\
         server_reset_query = DISCARD ALL\n\
         server_tls_sslmode = disable\n",
        name = db.name,
        host = server.ip(),
        port_db = server.port(),
        dir = dir.display(),
        mode = mode.as_str(),
    );
    let ini_path = dir.join("pgbouncer.ini");
    std::fs::write(&ini_path, ini).map_err(|e| format!("write ini: {e}"))?;
    let userlist: String = std::iter::once(user.as_str())
        .chain(users.iter().copied())
        .map(|user| format!("\"{user}\" \"\"\n"))
        .collect();
    std::fs::write(dir.join("userlist.txt"), userlist)
        .map_err(|e| format!("write userlist: {e}"))?;
    // PgBouncer reads these after dropping privileges to `postgres`.
    for (path, mode) in [
        (dir.clone(), 0o755),
        (ini_path.clone(), 0o644),
        (dir.join("userlist.txt"), 0o644),
    ] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("chmod: {e}"))?;
    }

    let mut command = Command::new(program());
    if running_as_root() {
        command.args(["-u", "postgres"]);
    }
    let mut child = command
        .arg(&ini_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not run pgbouncer (apt-get install -y pgbouncer): {e}"))?;
    let stderr = child.stderr.take().ok_or("no stderr")?;
    let log = Arc::new(Mutex::new(String::new()));
    let (up_tx, up_rx) = mpsc::channel::<bool>();
    {
        let log = log.clone();
        std::thread::spawn(move || {
            let mut up_tx = Some(up_tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains("process up") {
                    if let Some(tx) = up_tx.take() {
                        let _ = tx.send(true);
                    }
                }
                if let Ok(mut log) = log.lock() {
                    log.push_str(&line);
                    log.push('\n');
                }
            }
            // EOF: the process ended (or closed stderr) before saying it was up.
            if let Some(tx) = up_tx.take() {
                let _ = tx.send(false);
            }
        });
    }
    let up = up_rx.recv_timeout(Duration::from_secs(10)).unwrap_or(false);
    let bouncer = PgBouncer {
        child,
        dir,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        pool_size,
        log,
    };
    if up {
        Ok(bouncer)
    } else {
        Err(bouncer.log())
    }
}

/// PgBouncer from PATH, or where Debian puts it.
fn program() -> String {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("pgbouncer").is_file() {
                return dir.join("pgbouncer").display().to_string();
            }
        }
    }
    "/usr/sbin/pgbouncer".to_owned()
}

/// Whether this process runs as root: `/proc/self` belongs to the effective user.
fn running_as_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// The user name of a connection string (PgBouncer's auth file must list it).
fn user_of(url: &str) -> String {
    url.parse::<tokio_postgres::Config>()
        .ok()
        .and_then(|c| c.get_user().map(str::to_owned))
        .unwrap_or_else(|| "postgres".to_owned())
}
