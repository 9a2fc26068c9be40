//! TLS to PostgreSQL (contract §6; issue 15, "No TLS at all"): `sslmode` `require`,
//! `verify-full` with the trust root from `sslrootcert` or `store.ca_file`, a wrong CA (never
//! ready, a log line that names the cause and what to change), a server that only accepts TLS
//! (`hostssl` lines only) with the default `prefer`, the limit of 3 holding exactly over TLS,
//! and what `tollgate check` refuses.
//!
//! Every test uses one shared throwaway cluster started by this file (`ssl = on`, a server
//! certificate for `localhost` and `127.0.0.1` issued by a test CA, only `hostssl` lines for
//! TCP), with a database of its own.

use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use http::StatusCode;

use crate::common::pg_cluster::Cluster;
use crate::common::tls::TestPki;
use crate::common::*;

/// TCP connections must be TLS (`hostssl`); the Unix socket is for the test's own client.
/// Role `tollgate_scram` must give a password (SCRAM-SHA-256, as managed services ask). The
/// cluster is this process's own, so fixed role names collide with no one.
const HBA: &str = "local all all trust\n\
                   hostssl all tollgate_scram 127.0.0.1/32 scram-sha-256\n\
                   hostssl all all 127.0.0.1/32 trust\n";

struct Shared {
    cluster: Cluster,
    pki: TestPki,
    /// A CA that did not issue the server's certificate.
    other_pki: TestPki,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let pki = TestPki::new();
        let other_pki = TestPki::new();
        let cert = pki.issue("pg-server", &["localhost", "127.0.0.1"]);
        let cluster = Cluster::start_tls(&cert, HBA, &[&pki.dir, &other_pki.dir]);
        Shared {
            cluster,
            pki,
            other_pki,
        }
    })
}

/// A database of this test's own on the shared cluster.
async fn database(tag: &str) -> String {
    let name = format!("tls_{tag}_{}", std::process::id());
    let admin = shared().cluster.admin("postgres").await;
    // Two statements: CREATE DATABASE cannot run in the implicit transaction of a batch.
    for sql in [
        format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"),
        format!("CREATE DATABASE \"{name}\""),
    ] {
        admin
            .batch_execute(&sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }
    name
}

/// `host=… port=… dbname=… user=postgres` plus `extra`.
fn url(host: &str, dbname: &str, extra: &str) -> String {
    format!(
        "host={host} port={} dbname={dbname} user=postgres connect_timeout=5 {extra}",
        shared().cluster.port
    )
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

async fn proxy(upstream: &Upstream, store: &str) -> Proxy {
    let text = limits_config(store, "\n[admin]\nlisten = \"127.0.0.1:0\"", API_ROUTE);
    Proxy::start(config_from(&text, upstream.addr, &[])).await
}

fn store(url: &str, extra: &str) -> String {
    format!("url = \"{url}\"\ntimeout = \"5s\"\non_error = \"deny\"\npool_size = 4\n{extra}")
}

async fn api(client: &H1Client, proxy: &Proxy, key: &str) -> Answer {
    let req = http::Request::get(proxy.url("/api"))
        .header("x-api-key", key)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .expect("request");
    send(client, req).await
}

/// A decision counted by the store (not let through or refused by the failure policy).
async fn counted(client: &H1Client, proxy: &Proxy, key: &str) {
    let answer = api(client, proxy, key).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    assert!(
        answer.header("ratelimit").is_some(),
        "the decision was counted"
    );
}

/// tollgate's sessions on `dbname` and whether each is encrypted, from `pg_stat_ssl`.
async fn sessions_encrypted(dbname: &str) -> Vec<bool> {
    let admin = shared().cluster.admin("postgres").await;
    admin
        .query(
            "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s ON s.pid = a.pid \
             WHERE a.datname = $1 AND a.application_name = 'tollgate'",
            &[&dbname],
        )
        .await
        .expect("pg_stat_ssl")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

async fn assert_encrypted(dbname: &str) {
    let sessions = sessions_encrypted(dbname).await;
    assert!(!sessions.is_empty(), "tollgate has sessions on {dbname}");
    assert!(
        sessions.iter().all(|ssl| *ssl),
        "every tollgate session is encrypted: {sessions:?}"
    );
}

/// Issue 15: "`sslmode=require` fails with 'no TLS implementation configured' while
/// `tollgate check` says OK." Start-up must succeed, decisions be counted, and `pg_stat_ssl`
/// show every tollgate backend encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_encrypts_every_session() {
    let db = database("require").await;
    let upstream = Upstream::start().await;
    let mut proxy = proxy(
        &upstream,
        &store(&url("127.0.0.1", &db, "sslmode=require"), ""),
    )
    .await;
    let client = h1_client();
    counted(&client, &proxy, "a").await;
    assert_encrypted(&db).await;
    proxy.shutdown().await;
}

/// Issue 15: "`verify-full` is refused by the config check; `sslrootcert` gets a message that
/// does not name the option." With the test CA as `sslrootcert`, the server's certificate is
/// verified against 127.0.0.1 (an IP address SAN) and tollgate counts over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_sslrootcert() {
    let db = database("rootcert").await;
    let upstream = Upstream::start().await;
    let extra = format!(
        "sslmode=verify-full sslrootcert={}",
        shared().pki.ca_file.display()
    );
    let mut proxy = proxy(&upstream, &store(&url("127.0.0.1", &db, &extra), "")).await;
    counted(&h1_client(), &proxy, "a").await;
    assert_encrypted(&db).await;
    proxy.shutdown().await;
}

/// The same with the trust root in `store.ca_file` and a DNS name (`localhost`) to check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_store_ca_file() {
    let db = database("cafile").await;
    let upstream = Upstream::start().await;
    let extra = format!("ca_file = \"{}\"", shared().pki.ca_file.display());
    let mut proxy = proxy(
        &upstream,
        &store(&url("localhost", &db, "sslmode=verify-full"), &extra),
    )
    .await;
    counted(&h1_client(), &proxy, "a").await;
    assert_encrypted(&db).await;
    proxy.shutdown().await;
}

/// A certificate from a CA that is not the trust root: tollgate keeps serving under its
/// failure policy (`deny`: 503) and is never ready, and says why in a warning that names the
/// cause (`tls`), the database and what to change. A current-thread runtime, so that the
/// subscriber set for this thread sees every task.
#[tokio::test(flavor = "current_thread")]
async fn wrong_ca_is_never_ready_and_says_why() {
    let (captured, _guard) = crate::common::log::CapturedLog::warnings();

    let db = database("wrongca").await;
    let upstream = Upstream::start().await;
    let extra = format!("ca_file = \"{}\"", shared().other_pki.ca_file.display());
    let mut proxy = proxy(
        &upstream,
        &store(&url("127.0.0.1", &db, "sslmode=verify-full"), &extra),
    )
    .await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    let client = h1_client();
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        let ready = get(&client, &format!("http://{admin}/readyz")).await;
        assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE, "never ready");
        let decision = api(&client, &proxy, "a").await;
        assert_eq!(
            decision.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "decisions fail under on_error = deny"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(upstream.count(), 0, "nothing was let through");
    let text = captured.text();
    let line = text
        .lines()
        .find(|l| l.contains("WARN") && (l.contains("cause=\"tls\"") || l.contains("cause=tls")))
        .unwrap_or_else(|| panic!("a warning with cause tls:\n{text}"));
    assert!(line.contains("host=127.0.0.1"), "{line}");
    assert!(
        line.contains(&format!("port={}", shared().cluster.port)),
        "{line}"
    );
    assert!(line.contains(&format!("dbname={db}")), "{line}");
    assert!(line.contains("not trusted"), "{line}");
    assert!(
        line.contains("store.ca_file"),
        "says what to change: {line}"
    );
    proxy.shutdown().await;
}

/// Issue 15: "a TLS-only server is unusable, and the default `sslmode=prefer` silently
/// connects in plaintext." The cluster's `pg_hba.conf` has only `hostssl` lines for TCP; with
/// no `sslmode` in the URL tollgate must connect, over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_prefer_uses_tls_on_a_tls_only_server() {
    let db = database("prefer").await;
    let upstream = Upstream::start().await;
    let mut proxy = proxy(&upstream, &store(&url("127.0.0.1", &db, ""), "")).await;
    counted(&h1_client(), &proxy, "a").await;
    assert_encrypted(&db).await;
    proxy.shutdown().await;
}

/// The limit holds exactly over TLS: of 12 concurrent requests with one key and a limit of 3,
/// exactly 3 are allowed and the rest get 429; a 13th, after them, is 429 too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_of_three_holds_exactly_over_tls() {
    let db = database("limit").await;
    let upstream = Upstream::start().await;
    let extra = format!(
        "sslmode=verify-full sslrootcert={}",
        shared().pki.ca_file.display()
    );
    let mut proxy = proxy(&upstream, &store(&url("localhost", &db, &extra), "")).await;
    let client = h1_client();
    let answers = futures_util::future::join_all((0..12).map(|_| api(&client, &proxy, "k"))).await;
    let allowed = answers
        .iter()
        .filter(|a| a.status == StatusCode::OK)
        .count();
    let limited = answers
        .iter()
        .filter(|a| a.status == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((allowed, limited), (3, 9), "exactly 3 of 12 allowed");
    assert_eq!(
        api(&client, &proxy, "k").await.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the 4th request after the first 3 is limited"
    );
    assert_eq!(upstream.count(), 3);
    assert_encrypted(&db).await;
    proxy.shutdown().await;
}

/// The errors `tollgate check` (the configuration loader) reports for `store`.
fn check_errors(store: &str) -> String {
    let text = format!("[store]\n{store}\n");
    match tollgate::testing::config::load_str(Path::new("test.toml"), &text, &|_| None) {
        Ok(_) => String::new(),
        Err(errors) => errors.to_string(),
    }
}

/// `tollgate check` validates what it can: a `store.ca_file` that holds no PEM certificate,
/// an `sslrootcert` that does not exist, `verify-full` with no host name to check (a Unix
/// socket directory), an unknown `sslmode`, a client certificate option; none of the messages
/// repeats the URL's password.
#[test]
fn check_rejects_bad_trust_roots_and_verify_full_without_a_host() {
    let dir = std::env::temp_dir().join(format!("tollgate-pg-tls-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let not_pem = dir.join("not-a-ca.pem");
    std::fs::write(&not_pem, "this is not a certificate\n").expect("write");

    let errors = check_errors(&format!(
        "url = \"postgres://u:hunter2@db/x?sslmode=verify-full\"\nca_file = \"{}\"",
        not_pem.display()
    ));
    assert!(errors.contains("store.ca_file"), "{errors}");
    assert!(errors.contains("no certificate"), "{errors}");

    let errors = check_errors(&format!(
        "url = \"postgres://u:hunter2@db/x?sslmode=verify-full&sslrootcert={}\"",
        dir.join("missing.pem").display()
    ));
    assert!(errors.contains("sslrootcert"), "{errors}");
    assert!(!errors.contains("hunter2"), "{errors}");

    let errors = check_errors(
        "url = \"host=/var/run/postgresql dbname=x password=hunter2 sslmode=verify-full\"",
    );
    assert!(errors.contains("store.url"), "{errors}");
    assert!(errors.contains("verify-full"), "{errors}");
    assert!(errors.contains("host name"), "{errors}");
    assert!(!errors.contains("hunter2"), "{errors}");

    let errors = check_errors("url = \"postgres://u:hunter2@db/x?sslmode=verify-partly\"");
    assert!(errors.contains("sslmode"), "{errors}");
    assert!(!errors.contains("hunter2"), "{errors}");

    let errors = check_errors("url = \"postgres://u:hunter2@db/x?sslcert=client.pem\"");
    assert!(errors.contains("sslcert"), "{errors}");
    assert!(!errors.contains("hunter2"), "{errors}");

    // And what is right passes.
    let ok = check_errors(&format!(
        "url = \"postgres://u:hunter2@db/x?sslmode=verify-ca\"\nca_file = \"{}\"",
        shared_free_ca(&dir).display()
    ));
    assert_eq!(ok, "", "a valid CA file and verify-ca pass");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A CA certificate file that needs no cluster.
fn shared_free_ca(dir: &Path) -> std::path::PathBuf {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = params.self_signed(&key).expect("CA");
    let path = dir.join("ca.pem");
    std::fs::write(&path, ca.pem()).expect("write");
    path
}

/// `verify-ca` checks the chain only; `verify-full` checks the name too. Connecting to the
/// cluster's address under a name its certificate does not carry (`hostaddr` is where to
/// connect, `host` the name to check): `verify-full` is refused with a message that says what
/// to change, `verify-ca` counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_accepts_a_name_that_verify_full_refuses() {
    let db = database("names").await;
    let store_for = |mode: &str| {
        let url = format!(
            "host=db.invalid hostaddr=127.0.0.1 port={} dbname={db} user=postgres sslmode={mode} sslrootcert={}",
            shared().cluster.port,
            shared().pki.ca_file.display()
        );
        crate::common::db::TestDb::store_config_for(url)
    };
    let full = tollgate::testing::store::postgres::PostgresStore::new(&store_for("verify-full"))
        .expect("store");
    let err = full
        .initialize("fp", true)
        .await
        .expect_err("the name is not in the certificate");
    let message = err.to_string();
    assert!(
        message.contains("does not match the host name") && message.contains("verify-ca"),
        "{message}"
    );
    assert!(err.is_retryable(), "not ready, not fatal: {message}");

    let ca = tollgate::testing::store::postgres::PostgresStore::new(&store_for("verify-ca"))
        .expect("store");
    ca.initialize("fp", true)
        .await
        .expect("verify-ca does not check the name");
}

/// Managed services authenticate with a password: SCRAM-SHA-256 over tollgate's TLS, with
/// channel binding (`channel_binding=require` in the URL: tokio-postgres refuses to go on
/// without SCRAM-SHA-256-PLUS, and the server checks the certificate hash tollgate sends),
/// through migrations and a counted decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_password_over_tls() {
    let db = database("scram").await;
    let role = "tollgate_scram";
    let admin = shared().cluster.admin("postgres").await;
    admin
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN PASSWORD 'tls-test-pw'; \
             ALTER DATABASE \"{db}\" OWNER TO {role}"
        ))
        .await
        .expect("role");
    let upstream = Upstream::start().await;
    let url = format!(
        "host=localhost port={} dbname={db} user={role} password=tls-test-pw channel_binding=require sslmode=verify-full sslrootcert={}",
        shared().cluster.port,
        shared().pki.ca_file.display()
    );
    // The password is really checked (the SCRAM line applies, not the trust line).
    let mut wrong =
        crate::common::db::TestDb::store_config_for(url.replace("tls-test-pw", "wrong"));
    wrong.timeout = Duration::from_secs(5);
    let err = tollgate::testing::store::postgres::PostgresStore::new(&wrong)
        .expect("store")
        .initialize("fp", true)
        .await
        .expect_err("a wrong password is refused");
    assert!(err.to_string().contains("28P01"), "{err}");

    let mut proxy = proxy(&upstream, &store(&url, "")).await;
    counted(&h1_client(), &proxy, "a").await;
    assert_encrypted(&db).await;
    proxy.shutdown().await;
}

/// The same through the binary: before TLS support `tollgate check` said "configuration OK"
/// for `sslmode=require` and then every connection failed; now a URL it cannot honour exits
/// 2 with one line naming `store.url`, and a good one passes.
#[test]
fn tollgate_check_exits_2_on_verify_full_over_a_unix_socket() {
    let dir = std::env::temp_dir().join(format!("tollgate-pg-tls-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let run = |url: &str| {
        let path = dir.join("proxy.toml");
        std::fs::write(
            &path,
            format!(
                "[store]\nurl = \"{url}\"\n[upstreams.a]\nurl = \"http://127.0.0.1:9\"\n\
                 [[routes]]\nname = \"r\"\nupstream = \"a\"\n"
            ),
        )
        .expect("write");
        tollgate_check(&path)
    };
    let out = run("host=/var/run/postgresql dbname=x sslmode=verify-full");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("store.url") && stderr.contains("verify-full"),
        "{stderr}"
    );
    let out = run("postgres://tollgate@db.internal/x?sslmode=require");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
