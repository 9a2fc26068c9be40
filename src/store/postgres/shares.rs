//! Reserved shares in PostgreSQL (contract §3c): the grant and the give-back, each one call of
//! a function of `migrations/0006_reserved_shares.sql` (the grant as `0007_request_cost.sql`
//! replaced it, with the units a request needs at least) for any number of buckets
//! (docs/architecture.md, "Reserved shares").

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use super::errors::query_error;
use super::statements::count_from;
use super::PostgresStore;
use crate::store::{GiveBack, ShareGrant, ShareWant, StoreError};

/// Parameters: buckets, window lengths, limits, sliding, wants, needs, live instances, this
/// instance's id, asynchronous commit. The function's rows come in no particular order: the
/// join puts them in the order of the buckets asked for.
const RESERVE_SQL: &str = "SELECT g.granted, g.count, g.previous, g.window_end_ms, g.now_ms \
     FROM public.tollgate_reserve($1, $2, $3, $4, $5, $6, $7, $8, $9) g \
     JOIN unnest($1::text[]) WITH ORDINALITY AS a(bucket, o) ON a.bucket = g.bucket \
     ORDER BY a.o";

/// Parameters: buckets, window starts, unused units, this instance's id, asynchronous commit.
/// Rows in the order of the buckets given.
const GIVE_BACK_SQL: &str = "SELECT g.returned \
     FROM public.tollgate_give_back($1, $2, $3, $4, $5) g \
     JOIN unnest($1::text[]) WITH ORDINALITY AS a(bucket, o) ON a.bucket = g.bucket \
     ORDER BY a.o";

impl PostgresStore {
    /// Grants shares of `wants` (distinct buckets), answering in their order.
    pub(super) async fn run_reserve(
        &self,
        wants: &[ShareWant],
        instances: u32,
    ) -> Result<Vec<ShareGrant>, StoreError> {
        self.require_initialized()?;
        let buckets: Vec<&str> = wants.iter().map(|w| &*w.bucket).collect();
        let windows: Vec<i64> = wants.iter().map(|w| i64::from(w.window_secs)).collect();
        let limits: Vec<i64> = wants.iter().map(|w| i64::from(w.requests)).collect();
        let sliding: Vec<bool> = wants.iter().map(|w| w.sliding).collect();
        let asked: Vec<i64> = wants.iter().map(|w| i64::from(w.want.max(1))).collect();
        let needs: Vec<i64> = wants.iter().map(|w| i64::from(w.need.max(1))).collect();
        let instances = i32::try_from(instances.max(1)).unwrap_or(i32::MAX);
        let me = self.instance_id.as_str();
        let params: [(&(dyn ToSql + Sync), Type); 9] = [
            (&buckets, Type::TEXT_ARRAY),
            (&windows, Type::INT8_ARRAY),
            (&limits, Type::INT8_ARRAY),
            (&sliding, Type::BOOL_ARRAY),
            (&asked, Type::INT8_ARRAY),
            (&needs, Type::INT8_ARRAY),
            (&instances, Type::INT4),
            (&me, Type::TEXT),
            (&self.async_commit, Type::BOOL),
        ];
        // Rows come back in no particular order: each carries its bucket's position.
        let result = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.run(|| conn.query_typed(RESERVE_SQL, &params))
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await
            .and_then(|rows| grants(wants.len(), &rows));
        self.record(&result);
        result
    }

    /// Gives unused units back; answers how many each row took back, in `back` order.
    pub(super) async fn run_give_back(&self, back: &[GiveBack]) -> Result<Vec<u32>, StoreError> {
        self.require_initialized()?;
        let buckets: Vec<&str> = back.iter().map(|b| &*b.bucket).collect();
        let starts: Vec<i64> = back.iter().map(|b| b.window_start_secs).collect();
        let unused: Vec<i64> = back.iter().map(|b| i64::from(b.unused)).collect();
        let me = self.instance_id.as_str();
        let params: [(&(dyn ToSql + Sync), Type); 5] = [
            (&buckets, Type::TEXT_ARRAY),
            (&starts, Type::INT8_ARRAY),
            (&unused, Type::INT8_ARRAY),
            (&me, Type::TEXT),
            (&self.async_commit, Type::BOOL),
        ];
        let result = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.run(|| conn.query_typed(GIVE_BACK_SQL, &params))
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await
            .and_then(|rows| returned(back, &rows));
        self.record(&result);
        result
    }
}

/// The grants, in the order asked.
fn grants(asked: usize, rows: &[Row]) -> Result<Vec<ShareGrant>, StoreError> {
    if rows.len() != asked {
        return Err(StoreError::Query(
            format!(
                "the share grant returned {} rows for {asked} buckets",
                rows.len()
            )
            .into(),
        ));
    }
    rows.iter()
        .map(|row| {
            let granted: i64 = row.try_get(0).map_err(query_error)?;
            Ok(ShareGrant {
                granted: u32::try_from(granted.max(0)).unwrap_or(u32::MAX),
                count: count_from(row.try_get(1).map_err(query_error)?)?,
                previous: count_from(row.try_get(2).map_err(query_error)?)?,
                window_end_ms: row.try_get(3).map_err(query_error)?,
                now_ms: row.try_get(4).map_err(query_error)?,
            })
        })
        .collect()
}

/// The units each row took back, in the order given.
fn returned(back: &[GiveBack], rows: &[Row]) -> Result<Vec<u32>, StoreError> {
    if rows.len() != back.len() {
        return Err(StoreError::Query(
            format!(
                "the give-back returned {} rows for {} buckets",
                rows.len(),
                back.len()
            )
            .into(),
        ));
    }
    rows.iter()
        .map(|row| {
            let units: i64 = row.try_get(0).map_err(query_error)?;
            Ok(u32::try_from(units.max(0)).unwrap_or(u32::MAX))
        })
        .collect()
}
