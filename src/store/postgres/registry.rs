//! The instance registry (contract §5b; docs/operations.md, "The instance registry"): this
//! instance's row in `public.tollgate_instances`, refreshed by one statement on the database
//! clock that also counts the live instances (nothing kept on the session, so it works through
//! any pooler), and deleted on a clean stop. The local fallback divides each limit by that
//! count while the store fails.

use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};

use super::errors::query_error;
use super::PostgresStore;
use crate::store::{InstanceRegistry, StoreError, StoreFuture};

/// How long a row of `tollgate_instances` counts as live without a refresh (contract §5b).
pub const INSTANCE_LIVE_FOR: Duration = Duration::from_secs(30);
/// Rows older than this are deleted by the live instances' refreshes: an instance that died
/// without saying so. Well past [`INSTANCE_LIVE_FOR`], so a long pause (a stopped VM, a
/// debugger) comes back to its own row rather than a new one, which changes nothing anyway.
pub const INSTANCE_EXPIRES_AFTER: Duration = Duration::from_secs(600);

/// The registry refresh (contract §5b): one statement, the database clock, nothing kept on the
/// session, so it works through any pooler. `$1` this instance's id, `$2` the liveness bound
/// and `$3` the expiry in seconds.
///
/// The three parts see one snapshot: the count does not see this statement's own upsert, so
/// it counts the *other* live rows and adds one. The delete skips this instance's row (one
/// statement must not touch a row twice) and rows another instance is deleting right now
/// (`SKIP LOCKED`: two refreshes never wait on each other or deadlock).
const REFRESH_INSTANCE_SQL: &str = "\
WITH refreshed AS (
    INSERT INTO public.tollgate_instances AS i (id) VALUES ($1)
    ON CONFLICT (id) DO UPDATE SET seen_at = now()
    RETURNING 1
), expired AS (
    DELETE FROM public.tollgate_instances
    WHERE id IN (
        SELECT id FROM public.tollgate_instances
        WHERE seen_at < now() - make_interval(secs => $3) AND id <> $1
        ORDER BY id
        LIMIT 100
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT 1 + (SELECT count(*) FROM public.tollgate_instances
            WHERE seen_at >= now() - make_interval(secs => $2) AND id <> $1)";

/// Deregistration on a clean stop (contract §5b): this instance's row goes at once, so the others
/// count one instance fewer at their next refresh instead of 30 s later. `$1` this id.
const DEREGISTER_INSTANCE_SQL: &str = "DELETE FROM public.tollgate_instances WHERE id = $1";

impl PostgresStore {
    /// This instance's id in `tollgate_instances` (random per process).
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// Refreshes this instance's row in `tollgate_instances` and answers how many instances
    /// are live (this one included), within `store.timeout` (contract §5b).
    async fn refresh_row(&self) -> Result<u32, StoreError> {
        self.require_initialized()?;
        let live = INSTANCE_LIVE_FOR.as_secs_f64();
        let expires = INSTANCE_EXPIRES_AFTER.as_secs_f64();
        let id = self.instance_id.as_str();
        let params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&id, Type::TEXT),
            (&live, Type::FLOAT8),
            (&expires, Type::FLOAT8),
        ];
        let row = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.run(|| conn.query_typed_one(REFRESH_INSTANCE_SQL, &params))
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await?;
        let live: i64 = row.try_get(0).map_err(query_error)?;
        Ok(u32::try_from(live.max(1)).unwrap_or(u32::MAX))
    }

    /// Deletes this instance's row from `tollgate_instances` (a clean stop, contract §5b), within
    /// `store.timeout`. Answers whether there was a row to delete.
    async fn delete_row(&self) -> Result<bool, StoreError> {
        self.require_initialized()?;
        let id = self.instance_id.as_str();
        let params: [(&(dyn ToSql + Sync), Type); 1] = [(&id, Type::TEXT)];
        let deleted = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.run(|| conn.execute_typed(DEREGISTER_INSTANCE_SQL, &params))
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await?;
        Ok(deleted > 0)
    }
}

impl InstanceRegistry for PostgresStore {
    fn registry_ready(&self) -> bool {
        self.is_initialized()
    }

    fn refresh_instance(&self) -> StoreFuture<'_, u32> {
        Box::pin(self.refresh_row())
    }

    fn deregister_instance(&self) -> StoreFuture<'_, bool> {
        Box::pin(self.delete_row())
    }
}
