//! A throwaway PostgreSQL cluster of a test's own, configured the way the test needs (TLS on,
//! a `pg_hba.conf` of its choosing), on a free port, its data directory in a temporary
//! directory.
//!
//! It stops when its [`Cluster`] is dropped (also on panic), and, for a cluster kept in a
//! `static` (which is never dropped), a watchdog process stops it when the test process
//! exits, however it exits (the same mechanism as tests/common/db.rs).
//!
//! The test's own administrative client connects over the cluster's Unix socket (`local`
//! lines of `pg_hba.conf` are the test's to write), so it needs no TLS of its own.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::db::{find_tool, run_output, INITDB_ARGS};

pub struct Cluster {
    /// TCP port on 127.0.0.1.
    pub port: u16,
    /// Directory of the Unix socket (also the cluster's temporary directory).
    pub socket_dir: PathBuf,
    pg_ctl: String,
    data: PathBuf,
    as_root: bool,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self
            .command(&self.pg_ctl.clone())
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.socket_dir);
    }
}

impl Cluster {
    /// Starts a cluster with `ssl = on`, the server certificate and key of `cert` (copied so
    /// that the server's user owns the key, which PostgreSQL insists on), and `hba` as its
    /// whole `pg_hba.conf`. `leftovers` are removed with the cluster's directory when the
    /// process exits (the test PKI of a cluster kept in a `static`, which is never dropped).
    /// Panics with the reason if it cannot.
    pub fn start_tls(
        cert: &tollgate::testing::config::CertConfig,
        hba: &str,
        leftovers: &[&Path],
    ) -> Cluster {
        let initdb = find_tool("initdb").unwrap_or_else(|e| panic!("{e}"));
        let pg_ctl = find_tool("pg_ctl").unwrap_or_else(|e| panic!("{e}"));
        let as_root = run_output(Command::new("id").arg("-u"))
            .map(|uid| uid.trim() == "0")
            .unwrap_or(false);
        let mut cluster = Cluster {
            port: 0,
            socket_dir: PathBuf::new(),
            pg_ctl: pg_ctl.clone(),
            data: PathBuf::new(),
            as_root,
        };
        let dir = run_output(
            cluster
                .command("mktemp")
                .args(["-d", "/tmp/tollgate-tls-pg.XXXXXX"]),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        cluster.socket_dir = PathBuf::from(dir.trim());
        cluster.data = cluster.socket_dir.join("data");
        run_output(
            cluster
                .command(&initdb)
                .arg("-D")
                .arg(&cluster.data)
                .args(INITDB_ARGS),
        )
        .unwrap_or_else(|e| panic!("{e}"));

        // Files the server reads, owned by the server's user, readable by it alone.
        let staging = std::env::temp_dir().join(format!(
            "tollgate-tls-pg-{}-{}.hba",
            std::process::id(),
            cluster.socket_dir.display().to_string().len()
        ));
        std::fs::write(&staging, hba).expect("write pg_hba.conf");
        cluster.install(&staging, "pg_hba.conf");
        let _ = std::fs::remove_file(&staging);
        cluster.install(&cert.cert, "server.crt");
        cluster.install(&cert.key, "server.key");

        cluster.port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200 \
             -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key",
            cluster.port,
            cluster.socket_dir.display()
        );
        run_output(
            cluster
                .command(&pg_ctl)
                .arg("-D")
                .arg(&cluster.data)
                .arg("-l")
                .arg(cluster.socket_dir.join("log"))
                .args(["-w", "-t", "60", "-o", &options, "start"]),
        )
        .unwrap_or_else(|e| panic!("the TLS cluster did not start: {e}"));

        // The watchdog: stops the cluster when this process exits (EOF on its stdin). It runs
        // as this process's user (the leftovers are its files), pg_ctl as the server's.
        let stop = if as_root {
            "runuser -u postgres -- \"$0\""
        } else {
            "\"$0\""
        };
        let watchdog = Command::new("sh")
            .args([
                "-c",
                &format!(
                    "cat >/dev/null; {stop} -D \"$1/data\" -m immediate stop >/dev/null 2>&1; rm -rf \"$@\""
                ),
            ])
            .arg(&pg_ctl)
            .arg(&cluster.socket_dir)
            .args(leftovers)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the cluster's watchdog");
        std::mem::forget(watchdog);
        cluster
    }

    /// A client over the Unix socket, as `postgres`, on `dbname`.
    pub async fn admin(&self, dbname: &str) -> tokio_postgres::Client {
        let mut config = tokio_postgres::Config::new();
        config
            .host_path(&self.socket_dir)
            .port(self.port)
            .user("postgres")
            .dbname(dbname)
            .connect_timeout(Duration::from_secs(5));
        let (client, conn) = config
            .connect(tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("could not connect to the TLS cluster's socket: {e}"));
        tokio::spawn(conn);
        client
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.socket_dir.join("log")).unwrap_or_default()
    }

    fn command(&self, program: &str) -> Command {
        if self.as_root {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", program]);
            c
        } else {
            Command::new(program)
        }
    }

    /// Copies `from` into the data directory as `name`, mode 0600, owned by the server's user.
    fn install(&self, from: &Path, name: &str) {
        run_output(
            self.command("install")
                .args(["-m", "600"])
                .arg(from)
                .arg(self.data.join(name)),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}
