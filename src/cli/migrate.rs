//! `tollgate migrate`: the database brought to this binary's schema (docs/operations.md,
//! "Migrations").

use std::process::ExitCode;

use crate::config::Config;
use crate::key::BucketHasher;
use crate::store::postgres::PostgresStore;

use super::output::{say, Out};

/// `tollgate migrate`: pending migrations applied (and, with `--accept-new-key`, the stored key
/// fingerprint replaced); the report printed.
pub async fn migrate(config: Config, accept_new_key: bool, out: &mut Out<'_>) -> ExitCode {
    if config.store.url.is_none() {
        eprintln!(
            "{}: store.url is not set: the memory store has nothing to migrate",
            config.source.display()
        );
        return ExitCode::from(2);
    }
    let hasher = BucketHasher::new(config.keys.secret.as_deref());
    let store = match PostgresStore::new(&config.store) {
        Ok(store) => store,
        Err(err) => {
            eprintln!("tollgate: {err}");
            return ExitCode::from(1);
        }
    };
    match store.migrate(&hasher.fingerprint(), accept_new_key).await {
        Ok(report) => {
            say!(out, "{report}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("tollgate: migrate failed: {err}");
            ExitCode::from(1)
        }
    }
}
