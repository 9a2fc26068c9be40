//! Start-up against the database (docs/operations.md, "The database"): the embedded
//! migrations, each applied exactly once however many instances start at once, and the key
//! fingerprint (contract §3), checked, stored when there is none, or replaced with
//! `tollgate migrate --accept-new-key`, under the same advisory lock.
//! [`PostgresStore::initialize`] and [`PostgresStore::migrate`] run them on a connection of
//! their own, outside the pool, every statement under start-up timeouts of its own.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use super::errors::{cause, classify, describe, Cause, InitError};
use super::{PoolError, PostgresStore};
use crate::error::Detail;

/// Advisory lock serialising migrations and fingerprint writes across instances.
/// The bytes spell "tollgate", so the key is recognisable in `pg_locks`.
pub(super) const MIGRATION_LOCK: i64 = 0x746f_6c6c_6761_7465;

/// Upper bound on one `initialize`/`migrate` run. Waiting for another instance's migration is
/// part of it. Past it the attempt counts as unreachable and can be retried.
const INIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Server-side bound on how long a start-up transaction may sit idle waiting for tollgate's
/// next statement (microseconds, normally). It ends the session of a run whose client
/// vanished mid-transaction (a network black hole: the server sees no close) instead of
/// letting it hold the migration lock, and so stall every later start-up, for hours.
const INIT_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(10);

/// The settings row holding the key fingerprint.
const FINGERPRINT_SETTING: &str = "key_fingerprint";

/// One embedded migration.
struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

/// Every migration, in the order they apply. Versions are the files' numeric prefixes.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_rate_limits",
        sql: include_str!("../../../migrations/0001_rate_limits.sql"),
    },
    Migration {
        version: 2,
        name: "0002_tollgate_settings",
        sql: include_str!("../../../migrations/0002_tollgate_settings.sql"),
    },
    Migration {
        version: 3,
        name: "0003_increment_function",
        sql: include_str!("../../../migrations/0003_increment_function.sql"),
    },
    Migration {
        version: 4,
        name: "0004_instances",
        sql: include_str!("../../../migrations/0004_instances.sql"),
    },
    Migration {
        version: 5,
        name: "0005_joint_decision",
        sql: include_str!("../../../migrations/0005_joint_decision.sql"),
    },
    Migration {
        version: 6,
        name: "0006_reserved_shares",
        sql: include_str!("../../../migrations/0006_reserved_shares.sql"),
    },
    Migration {
        version: 7,
        name: "0007_request_cost",
        sql: include_str!("../../../migrations/0007_request_cost.sql"),
    },
    Migration {
        version: 8,
        name: "0008_denied_adds_nothing",
        sql: include_str!("../../../migrations/0008_denied_adds_nothing.sql"),
    },
    Migration {
        version: 9,
        name: "0009_overrides",
        sql: include_str!("../../../migrations/0009_overrides.sql"),
    },
];

/// What happened to the stored key fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FingerprintChange {
    /// It already matched.
    Unchanged,
    /// There was none; this one was stored.
    Written,
    /// A different one was replaced (`--accept-new-key`).
    Replaced,
}

/// The outcome of [`PostgresStore::migrate`] (`tollgate migrate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// Names of the migrations applied by this run, in order; empty when already up to date.
    pub applied: Vec<&'static str>,
    pub fingerprint: FingerprintChange,
}

impl fmt::Display for MigrateReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.applied.is_empty() {
            write!(f, "schema up to date, no migration applied")?;
        } else {
            write!(
                f,
                "applied {} migration(s): {}",
                self.applied.len(),
                self.applied.join(", ")
            )?;
        }
        let fp = match self.fingerprint {
            FingerprintChange::Unchanged => "key fingerprint unchanged",
            FingerprintChange::Written => "key fingerprint stored",
            FingerprintChange::Replaced => "key fingerprint replaced",
        };
        write!(f, "; {fp}")
    }
}

impl PostgresStore {
    /// Prepares the database for counting: applies pending migrations when `migrate`, then
    /// checks the key fingerprint (storing it if the database has none). Until this has
    /// succeeded the store does not count.
    ///
    /// On [`InitError::is_retryable`] errors the caller keeps serving under its failure
    /// policy and calls this again later (contract §1); on the others it stops.
    pub async fn initialize(&self, fingerprint: &str, migrate: bool) -> Result<(), InitError> {
        let run = async {
            let mut client = self.connect_for_init(true).await?;
            if migrate {
                let applied = apply_migrations(&mut client).await?;
                if !applied.is_empty() {
                    tracing::info!(applied = ?applied, "applied database migrations");
                }
            } else {
                check_schema(&mut client).await?;
            }
            let change = settle_fingerprint(&mut client, fingerprint, false).await?;
            if change == FingerprintChange::Written {
                tracing::info!("stored the key fingerprint in the database");
            }
            Ok(())
        };
        let result = tokio::time::timeout(INIT_TIMEOUT, run)
            .await
            .unwrap_or_else(|_| {
                Err(InitError::Unreachable(
                    format!("database initialization did not finish within {INIT_TIMEOUT:?}")
                        .into(),
                ))
            });
        if result.is_ok() {
            self.initialized.store(true, Ordering::Release);
            self.health.set(true);
        }
        result
    }

    /// `tollgate migrate`: applies pending migrations and checks the key fingerprint; with
    /// `accept_new_key` a different stored fingerprint is replaced instead of refused.
    /// Running it again applies nothing.
    pub async fn migrate(
        &self,
        fingerprint: &str,
        accept_new_key: bool,
    ) -> Result<MigrateReport, InitError> {
        let run = async {
            let mut client = self.connect_for_init(false).await?;
            let applied = apply_migrations(&mut client).await?;
            let fingerprint = settle_fingerprint(&mut client, fingerprint, accept_new_key).await?;
            Ok(MigrateReport {
                applied,
                fingerprint,
            })
        };
        let result = tokio::time::timeout(INIT_TIMEOUT, run)
            .await
            .unwrap_or_else(|_| {
                Err(InitError::Unreachable(
                    format!("migration did not finish within {INIT_TIMEOUT:?}").into(),
                ))
            });
        if result.is_ok() {
            self.initialized.store(true, Ordering::Release);
            self.health.set(true);
        }
        result
    }

    /// A connection of its own (not from the pool) for initialization: it can wait on the
    /// migration lock far longer than `store.timeout`, and the real connect error (refused,
    /// authentication, ...) comes back instead of a pool timeout. It is closed when dropped.
    /// Nothing tollgate sets stays on it (`SET LOCAL` only), so through a pooler the server
    /// session goes back to the pool as it came.
    ///
    /// With `log`, a failure also goes to the failure log: a background start-up that keeps
    /// failing (a TLS certificate that is not trusted, say) must say so at warning level, not
    /// only at debug. `tollgate migrate` reports its one error itself.
    async fn connect_for_init(&self, log: bool) -> Result<Client, InitError> {
        match self.pool.dedicated_connection().await {
            Ok(pooled) => Ok(pooled.client),
            Err(PoolError::Postgres(e)) => {
                if log {
                    self.failures.note(cause(&e), &describe(&e));
                }
                let at = self.failures.location();
                let located = |m: Detail| m.map_text(|text| format!("{text} ({at})"));
                Err(match classify(e, InitError::Database) {
                    InitError::Unreachable(m) => InitError::Unreachable(located(m)),
                    InitError::Database(m) => InitError::Database(located(m)),
                    other => other,
                })
            }
            Err(deadline) => {
                if log {
                    self.failures.note(Cause::Timeout, &deadline.to_string());
                }
                Err(InitError::Unreachable(Detail::caused_by(
                    deadline.to_string(),
                    deadline,
                )))
            }
        }
    }
}

/// Sets the timeouts of tollgate's own start-up statements for this transaction only (contract §6):
/// a role's `statement_timeout` or `lock_timeout` (say 50 ms) would otherwise cancel the
/// wait for another instance's migration and fail start-up. [`INIT_TIMEOUT`] bounds the
/// whole run on the client; the same bound on the server keeps a run whose client went away
/// from waiting on. `SET LOCAL` ends with the transaction, so nothing stays on the session
/// (a pooler would hand it to other clients).
async fn own_timeouts(tx: &tokio_postgres::Transaction<'_>) -> Result<(), tokio_postgres::Error> {
    let ms = INIT_TIMEOUT.as_millis();
    let idle = INIT_IDLE_IN_TRANSACTION.as_millis();
    tx.batch_execute(&format!(
        "SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}; \
         SET LOCAL idle_in_transaction_session_timeout = {idle}"
    ))
    .await
}

/// The oldest PostgreSQL the migrations run on, as `server_version_num`: 0005's functions
/// set `plan_cache_mode`, which PostgreSQL 12 introduced (11 refuses the `CREATE FUNCTION`).
const OLDEST_SERVER: i32 = 120000;

/// Refuses a server older than [`OLDEST_SERVER`] (fatal: only an upgrade helps). `version`
/// is the server's own `server_version` text, for the message: `server_version_num` has no
/// single layout to print from (11.22 is 110022, 9.6.24 is 90624).
pub(super) fn supported_server(version_num: i32, version: &str) -> Result<(), InitError> {
    if version_num >= OLDEST_SERVER {
        return Ok(());
    }
    Err(InitError::Database(
        format!(
            "PostgreSQL {version} is too old: tollgate's migrations need PostgreSQL 12 or later"
        )
        .into(),
    ))
}

/// Applies every embedded migration the database has not recorded, each in its own
/// transaction holding the migration advisory lock, and returns the names applied.
///
/// The lock is taken before looking at `tollgate_migrations`, so of N instances starting at
/// once one applies a migration and the others, once they get the lock, find it recorded.
/// Creating the bookkeeping table happens under the lock too: concurrent
/// `CREATE TABLE IF NOT EXISTS` can fail on a catalog unique index.
async fn apply_migrations(client: &mut Client) -> Result<Vec<&'static str>, InitError> {
    // The usual start: every migration is recorded already. One read says so, instead of a
    // locked transaction per migration (N instances starting at once would queue on the lock
    // once per migration, and a slow start-up serves under the failure policy meanwhile).
    // A recorded migration is committed and migrations only add, so skipping is safe.
    match check_schema(client).await {
        Ok(()) => return Ok(Vec::new()),
        Err(InitError::SchemaBehind { .. }) => {}
        Err(other) => return Err(other),
    }
    // Something is to be applied: first make sure the server can take it, so that an old
    // server gets a sentence instead of a syntax error from the middle of a migration.
    let version = async {
        // In a transaction for its own timeouts, as every start-up statement.
        let tx = client.transaction().await?;
        own_timeouts(&tx).await?;
        let version = tx
            .query_typed_one(
                "SELECT current_setting('server_version_num')::int4, current_setting('server_version')",
                &[],
            )
            .await?;
        tx.rollback().await?;
        Ok(version)
    }
    .await
    .map_err(|e| classify(e, InitError::Database))?;
    supported_server(version.get(0), version.get(1))?;
    let mut applied = Vec::new();
    for migration in MIGRATIONS {
        let db_err = |e: tokio_postgres::Error| classify(e, InitError::Database);
        let tx = client.transaction().await.map_err(db_err)?;
        own_timeouts(&tx).await.map_err(db_err)?;
        tx.execute_typed(
            "SELECT pg_advisory_xact_lock($1)",
            &[(&MIGRATION_LOCK, Type::INT8)],
        )
        .await
        .map_err(db_err)?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS public.tollgate_migrations (
                 version    integer     PRIMARY KEY,
                 name       text        NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await
        .map_err(db_err)?;
        let done = tx
            .query_typed_opt(
                "SELECT 1 FROM public.tollgate_migrations WHERE version = $1",
                &[(&migration.version, Type::INT4)],
            )
            .await
            .map_err(db_err)?
            .is_some();
        if done {
            tx.rollback().await.map_err(db_err)?;
            continue;
        }
        let mig_err = |e: tokio_postgres::Error| {
            classify(e, |message| InitError::Migration {
                name: migration.name,
                message,
            })
        };
        tx.batch_execute(migration.sql).await.map_err(mig_err)?;
        tx.execute_typed(
            "INSERT INTO public.tollgate_migrations (version, name) VALUES ($1, $2)",
            &[
                (&migration.version, Type::INT4),
                (&migration.name, Type::TEXT),
            ],
        )
        .await
        .map_err(mig_err)?;
        tx.commit().await.map_err(mig_err)?;
        tracing::info!(migration = migration.name, "applied migration");
        applied.push(migration.name);
    }
    Ok(applied)
}

/// With `store.migrate = false`: refuses to count against a schema that lacks a migration
/// this binary relies on. Versions the binary does not know (a newer tollgate migrated) are
/// fine: migrations only add.
async fn check_schema(client: &mut Client) -> Result<(), InitError> {
    let db_err = |e: tokio_postgres::Error| classify(e, InitError::Database);
    // A transaction only for its own timeouts (a role's lock_timeout must not fail start-up
    // while a migration job holds a lock); it writes nothing.
    let client = client.transaction().await.map_err(db_err)?;
    own_timeouts(&client).await.map_err(db_err)?;
    let exists: bool = client
        .query_typed_one(
            "SELECT to_regclass('public.tollgate_migrations') IS NOT NULL",
            &[],
        )
        .await
        .map_err(db_err)?
        .try_get(0)
        .map_err(db_err)?;
    let recorded: HashSet<i32> = if exists {
        let rows = client
            .query_typed("SELECT version FROM public.tollgate_migrations", &[])
            .await
            .map_err(db_err)?;
        rows.iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(db_err)?
    } else {
        HashSet::new()
    };
    client.rollback().await.map_err(db_err)?;
    match MIGRATIONS.iter().find(|m| !recorded.contains(&m.version)) {
        Some(m) => Err(InitError::SchemaBehind { missing: m.name }),
        None => Ok(()),
    }
}

/// Checks the stored key fingerprint against `fingerprint` (contract §3), storing it if there is
/// none and replacing it when `accept_new_key`. Under the migration lock, so two instances
/// starting with different keys on an empty database cannot both "store first": one stores,
/// the other is refused.
async fn settle_fingerprint(
    client: &mut Client,
    fingerprint: &str,
    accept_new_key: bool,
) -> Result<FingerprintChange, InitError> {
    let db_err = |e: tokio_postgres::Error| classify(e, InitError::Database);
    let tx = client.transaction().await.map_err(db_err)?;
    own_timeouts(&tx).await.map_err(db_err)?;
    tx.execute_typed(
        "SELECT pg_advisory_xact_lock($1)",
        &[(&MIGRATION_LOCK, Type::INT8)],
    )
    .await
    .map_err(db_err)?;
    // Read first and insert only when there is nothing: an instance whose role may only read
    // the settings (migrate = false behind a deploy job) must be able to check the stored
    // fingerprint, and `INSERT ... ON CONFLICT DO NOTHING` needs INSERT even when the row is
    // there. The lock above makes read-then-insert safe.
    let existing: Option<String> = tx
        .query_typed_opt(
            "SELECT value FROM public.tollgate_settings WHERE name = $1",
            &[(&FINGERPRINT_SETTING, Type::TEXT)],
        )
        .await
        .map_err(db_err)?
        .map(|row| row.try_get(0))
        .transpose()
        .map_err(db_err)?;
    let inserted_now = existing.is_none();
    let stored = match existing {
        Some(stored) => stored,
        None => {
            tx.execute_typed(
                "INSERT INTO public.tollgate_settings (name, value) VALUES ($1, $2)",
                &[
                    (&FINGERPRINT_SETTING, Type::TEXT),
                    (&fingerprint, Type::TEXT),
                ],
            )
            .await
            .map_err(db_err)?;
            fingerprint.to_owned()
        }
    };
    let change = if inserted_now {
        FingerprintChange::Written
    } else if stored == fingerprint {
        FingerprintChange::Unchanged
    } else if accept_new_key {
        tx.execute_typed(
            "UPDATE public.tollgate_settings SET value = $2, updated_at = now() WHERE name = $1",
            &[
                (&FINGERPRINT_SETTING, Type::TEXT),
                (&fingerprint, Type::TEXT),
            ],
        )
        .await
        .map_err(db_err)?;
        tracing::warn!("replaced the key fingerprint stored in the database (--accept-new-key)");
        FingerprintChange::Replaced
    } else {
        // Roll back now rather than on drop, so the migration lock is released before the
        // caller goes on (a dropped transaction only rolls back when its connection task
        // next runs).
        tx.rollback().await.map_err(db_err)?;
        return Err(fingerprint_mismatch(&stored, fingerprint));
    };
    tx.commit().await.map_err(db_err)?;
    Ok(change)
}

/// The refusal of contract §3: what is wrong, why it matters, how to rotate on purpose.
pub(super) fn fingerprint_mismatch(stored: &str, configured: &str) -> InitError {
    InitError::FingerprintMismatch(format!(
        "the key fingerprint stored in the database ({}) differs from this configuration's \
         ({}): keys.secret is not the one the other instances use, so this instance would put \
         the same clients in different buckets and silently multiply every limit. If the \
         secret was rotated on purpose, stop every instance, then run \
         `tollgate migrate --accept-new-key` with the new configuration",
        short(stored),
        short(configured)
    ))
}

/// Enough of a fingerprint for an operator to tell two apart: a `scheme:` prefix (such as
/// `hmac-sha256:`) is kept whole, then the first 12 characters of the rest.
fn short(fingerprint: &str) -> String {
    let (scheme, rest) = match fingerprint.split_once(':') {
        Some((scheme, rest)) => (&fingerprint[..scheme.len() + 1], rest),
        None => ("", fingerprint),
    };
    let head: String = rest.chars().take(12).collect();
    let more = if rest.chars().count() > 12 { "…" } else { "" };
    format!("{scheme}{head}{more}")
}
