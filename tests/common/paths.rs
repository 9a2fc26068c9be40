//! Every pairing of tollgate's HTTP/1.1 implementations, so that one test body holds them all
//! to one contract (docs/architecture.md, `server.rs` in "Modules"): two servers (its own for
//! simple requests, `http1::server`, and hyper's) and two clients (its own for bodyless
//! plain-HTTP requests, `http1::client`, and hyper's), chosen with
//! `ServerBuilder::http1_fast_path` and `ServerBuilder::http1_direct_client`.
//!
//! A test is written once as `async fn(Paths)`, starts its tollgate with [`Paths::start`], and
//! runs through [`on_every_path`].

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

use super::Proxy;

/// Which HTTP/1.1 implementations carry the requests.
#[derive(Debug, Clone, Copy)]
pub struct Paths {
    /// tollgate's own server for simple requests (else hyper's serves every request).
    pub fast_server: bool,
    /// tollgate's own client for bodyless plain-HTTP requests (else hyper's sends every one).
    pub direct_client: bool,
}

/// Every pairing. hyper's server with tollgate's own client allowed still sends its HTTP/1.1
/// requests on hyper's client (tollgate's own takes only requests the simple path read and
/// HTTP/2 ones without a body: `RequestBody::is_absent`); it is run all the same, so that the
/// list does not depend on that choice.
pub const EVERY_PATH: [Paths; 4] = [
    Paths {
        fast_server: true,
        direct_client: true,
    },
    Paths {
        fast_server: true,
        direct_client: false,
    },
    Paths {
        fast_server: false,
        direct_client: true,
    },
    Paths {
        fast_server: false,
        direct_client: false,
    },
];

impl Paths {
    /// tollgate with `config`, serving and forwarding on these paths.
    pub async fn start(self, config: tollgate::testing::config::Config) -> Proxy {
        let builder = tollgate::Server::builder(config)
            .http1_fast_path(self.fast_server)
            .http1_direct_client(self.direct_client);
        Proxy::start_built(builder).await
    }
}

/// Runs `test` on every pairing of [`EVERY_PATH`], the four at once (each starts servers of
/// its own; most of a wire test's time is waiting), and fails naming every pairing it failed
/// on (not only the first) with that pairing's failure. A pairing's panic is caught where it
/// happens, so the test may borrow from its caller.
pub async fn on_every_path<F, Fut>(test: F)
where
    F: Fn(Paths) -> Fut,
    Fut: Future<Output = ()>,
{
    let test = &test;
    let runs = EVERY_PATH.map(|paths| async move {
        let outcome = AssertUnwindSafe(test(paths)).catch_unwind().await;
        (paths, outcome)
    });
    let mut failed = Vec::new();
    for (paths, outcome) in futures_util::future::join_all(runs).await {
        if let Err(panic) = outcome {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failed.push(format!("{paths:?}: {why}"));
        }
    }
    assert!(
        failed.is_empty(),
        "failed on {} of {} pairings:\n{}",
        failed.len(),
        EVERY_PATH.len(),
        failed.join("\n")
    );
}

/// For each test body named (`async fn name(paths: Paths)`), a `#[tokio::test]` of the same
/// name, in a module `every_path`, that runs it on every pairing ([`on_every_path`]). (Not
/// every test binary that includes `tests/common` uses it.)
#[allow(unused_macros)]
macro_rules! every_path_tests {
    ($($body:ident),+ $(,)?) => {
        mod every_path {
            $(
                #[tokio::test]
                async fn $body() {
                    $crate::common::paths::on_every_path(super::$body).await;
                }
            )+
        }
    };
}
#[allow(unused_imports)]
pub(crate) use every_path_tests;
