//! Per-subject overrides in the database (contract §3e; `migrations/0009_overrides.sql`):
//! what `tollgate override` writes and lists, with a `NOTIFY` to every instance in the same
//! transaction, and what each running instance reads into memory
//! (`crate::limit::overrides`). Every statement goes through the pool as a statement (or a
//! transaction) of its own: nothing is kept on a session, so it works through any pooler.

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use super::errors::query_error;
use super::pool::statement_bound;
use super::PostgresStore;
use crate::store::StoreError;
use crate::store::{Override, OverrideMap};

/// The `NOTIFY` channel of `tollgate override` (contract §3e). Payload: the bucket changed,
/// `<scope>:<label>:<digest>` or `<scope>:global`; every listener reads the table again.
pub const OVERRIDES_CHANNEL: &str = "tollgate_overrides";

/// The bucket name of a row: `<scope>:<label>:<digest>`, or `<scope>:global` (no digest).
const BUCKET_OF_ROW: &str =
    "scope || ':' || label || CASE WHEN digest = '' THEN '' ELSE ':' || digest END";

/// An RFC 3339 text of a `timestamptz` column, in UTC, to the second.
fn rfc3339(column: &str) -> String {
    format!("to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')")
}

/// The overrides in force (`until` not passed on the database's clock), each as its bucket,
/// `requests` and `until` in unix milliseconds (`NULL`: no end).
fn load_sql() -> String {
    format!(
        "SELECT {BUCKET_OF_ROW}, requests, floor(extract(epoch FROM until) * 1000)::int8 \
         FROM public.tollgate_overrides WHERE until IS NULL OR until > now()"
    )
}

/// Stores (or replaces) the override of `($1 scope, $2 label, $3 digest)`: `$4` requests,
/// `$5` until (RFC 3339 text, or `NULL`), `$6` note. Answers the `requests` it replaced
/// (`NULL`: there was none, or it had ended).
const SET_SQL: &str = "\
WITH old AS (
    SELECT requests, until FROM public.tollgate_overrides
    WHERE scope = $1 AND label = $2 AND digest = $3
)
INSERT INTO public.tollgate_overrides AS o (scope, label, digest, requests, until, note, set_at)
VALUES ($1, $2, $3, $4, $5::text::timestamptz, $6, now())
ON CONFLICT (scope, label, digest) DO UPDATE
    SET requests = EXCLUDED.requests, until = EXCLUDED.until, note = EXCLUDED.note,
        set_at = EXCLUDED.set_at
RETURNING (SELECT requests FROM old WHERE until IS NULL OR until > now())";

/// Deletes the override of `($1 scope, $2 label, $3 digest)`; answers the `requests` it had,
/// and whether it was in force.
const REMOVE_SQL: &str = "\
DELETE FROM public.tollgate_overrides
WHERE scope = $1 AND label = $2 AND digest = $3
RETURNING requests, until IS NULL OR until > now()";

/// Where one override is stored: its bucket by parts (contract §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverrideKey {
    pub scope: String,
    pub label: String,
    /// Lowercase hex of the subject's digest; empty for a `global` limit.
    pub digest: String,
}

impl OverrideKey {
    /// The bucket this is: `<scope>:<label>:<digest>`, or `<scope>:global`.
    pub fn bucket(&self) -> String {
        if self.digest.is_empty() {
            format!("{}:{}", self.scope, self.label)
        } else {
            format!("{}:{}:{}", self.scope, self.label, self.digest)
        }
    }
}

/// What `tollgate override set` stores.
#[derive(Debug, Clone)]
pub struct OverrideSet {
    pub key: OverrideKey,
    pub requests: u32,
    /// RFC 3339, already checked.
    pub until: Option<String>,
    pub note: String,
}

/// One row as `tollgate override list` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedOverride {
    pub bucket: String,
    /// `<scope>:<label>`, the limit it belongs to.
    pub policy: String,
    pub requests: u32,
    /// RFC 3339 in UTC, to the second; `None`: no end.
    pub until: Option<String>,
    /// Whether `until` has passed (on the database's clock).
    pub ended: bool,
    pub note: String,
    pub set_at: String,
}

impl PostgresStore {
    /// Every override in force, as the decision path's map. The whole table is read, so the
    /// wait is the server's own bound on tollgate's statements (`store.timeout` and a second),
    /// not a decision's budget: ten thousand rows from a distant database must not fail.
    pub async fn load_overrides(&self) -> Result<OverrideMap, StoreError> {
        self.require_initialized()?;
        let sql = load_sql();
        let read = async {
            let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
            conn.run(|| conn.query_typed(&sql, &[]))
                .await
                .map_err(|e| self.fail(e))
        };
        let rows = tokio::time::timeout(statement_bound(self.timeout), read)
            .await
            .map_err(|_| StoreError::Timeout)??;
        rows.iter().map(loaded).collect()
    }

    /// Stores `set`, and notifies every listening instance at commit. Answers the `requests`
    /// of the override it replaced, if one was in force.
    pub async fn set_override(&self, set: &OverrideSet) -> Result<Option<u32>, StoreError> {
        let requests = i32::try_from(set.requests)
            .map_err(|_| StoreError::Query("requests is out of range".into()))?;
        let k = &set.key;
        let params: [(&(dyn ToSql + Sync), Type); 6] = [
            (&k.scope, Type::TEXT),
            (&k.label, Type::TEXT),
            (&k.digest, Type::TEXT),
            (&requests, Type::INT4),
            (&set.until, Type::TEXT),
            (&set.note, Type::TEXT),
        ];
        let row = self.changing(&set.key, SET_SQL, &params).await?;
        let old: Option<i32> = row.try_get(0).map_err(query_error)?;
        Ok(old.and_then(|r| u32::try_from(r).ok()))
    }

    /// Deletes the override of `key`, and notifies every listening instance at commit.
    /// Answers its `requests` and whether it was in force; `None`: there was none.
    pub async fn remove_override(
        &self,
        key: &OverrideKey,
    ) -> Result<Option<(u32, bool)>, StoreError> {
        let params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&key.scope, Type::TEXT),
            (&key.label, Type::TEXT),
            (&key.digest, Type::TEXT),
        ];
        let Some(row) = self.changing_opt(key, REMOVE_SQL, &params).await? else {
            return Ok(None);
        };
        let requests: i32 = row.try_get(0).map_err(query_error)?;
        let in_force: bool = row.try_get(1).map_err(query_error)?;
        Ok(Some((u32::try_from(requests).unwrap_or(0), in_force)))
    }

    /// Every override (of the limit `policy` = `(scope, label)` only, when given), ended ones
    /// included, in bucket order.
    pub async fn list_overrides(
        &self,
        policy: Option<(&str, &str)>,
    ) -> Result<Vec<ListedOverride>, StoreError> {
        self.require_initialized()?;
        let (scope, label) = policy.map_or((None, None), |(s, l)| (Some(s), Some(l)));
        let sql = format!(
            "SELECT {BUCKET_OF_ROW}, scope || ':' || label, requests, {}, \
                    coalesce(until <= now(), false), note, {} \
             FROM public.tollgate_overrides \
             WHERE ($1::text IS NULL OR scope = $1) AND ($2::text IS NULL OR label = $2) \
             ORDER BY scope, label, digest",
            rfc3339("until"),
            rfc3339("set_at"),
        );
        let params: [(&(dyn ToSql + Sync), Type); 2] = [(&scope, Type::TEXT), (&label, Type::TEXT)];
        let rows = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.run(|| conn.query_typed(&sql, &params))
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await?;
        rows.iter().map(listed).collect()
    }

    /// Runs `sql` (one row back) and the `NOTIFY` of `key`'s bucket in one transaction.
    async fn changing(
        &self,
        key: &OverrideKey,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Row, StoreError> {
        self.changing_opt(key, sql, params)
            .await?
            .ok_or_else(|| StoreError::Query("the database answered no row".into()))
    }

    /// [`PostgresStore::changing`] for a statement that may answer no row; the `NOTIFY` goes
    /// out either way (a notification that changes nothing costs a re-read).
    async fn changing_opt(
        &self,
        key: &OverrideKey,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Option<Row>, StoreError> {
        self.require_initialized()?;
        let bucket = key.bucket();
        let mut conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
        async {
            let tx = conn.begin().await?;
            let row = tx.query_typed_opt(sql, params).await?;
            let notify: [(&(dyn ToSql + Sync), Type); 2] =
                [(&OVERRIDES_CHANNEL, Type::TEXT), (&bucket, Type::TEXT)];
            tx.execute_typed("SELECT pg_notify($1, $2)", &notify)
                .await?;
            tx.commit().await?;
            Ok::<_, tokio_postgres::Error>(row)
        }
        .await
        .map_err(|e| self.fail(e))
    }
}

/// One row of [`load_sql`] as a map entry.
fn loaded(row: &Row) -> Result<(Box<str>, Override), StoreError> {
    let bucket: &str = row.try_get(0).map_err(query_error)?;
    let requests: i32 = row.try_get(1).map_err(query_error)?;
    let until_ms: Option<i64> = row.try_get(2).map_err(query_error)?;
    let requests = u32::try_from(requests)
        .map_err(|_| StoreError::Query("an override's requests is negative".into()))?;
    Ok((Box::from(bucket), Override { requests, until_ms }))
}

/// One row of [`PostgresStore::list_overrides`].
fn listed(row: &Row) -> Result<ListedOverride, StoreError> {
    let requests: i32 = row.try_get(2).map_err(query_error)?;
    Ok(ListedOverride {
        bucket: row.try_get(0).map_err(query_error)?,
        policy: row.try_get(1).map_err(query_error)?,
        requests: u32::try_from(requests).unwrap_or(0),
        until: row.try_get(3).map_err(query_error)?,
        ended: row.try_get(4).map_err(query_error)?,
        note: row.try_get(5).map_err(query_error)?,
        set_at: row.try_get(6).map_err(query_error)?,
    })
}
