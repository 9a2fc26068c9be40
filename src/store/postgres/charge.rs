//! Charges after the response in PostgreSQL (contract §3d): one call of `tollgate_charge`
//! (`migrations/0007_request_cost.sql`) for any number of buckets.

use tokio_postgres::types::{ToSql, Type};

use super::statements::columns_of;
use super::PostgresStore;
use crate::store::{Charge, StoreError};

/// Parameters: buckets, window lengths, sliding, units, limits, asynchronous commit.
const CHARGE_SQL: &str = "SELECT count(*) FROM public.tollgate_charge($1, $2, $3, $4, $5, $6)";

impl PostgresStore {
    /// Adds `charges` (distinct buckets) in one statement.
    pub(super) async fn run_charge(&self, charges: &[Charge]) -> Result<(), StoreError> {
        self.require_initialized()?;
        let (buckets, windows) = columns_of(charges.iter().map(|c| (&c.bucket, c.window_secs)))?;
        let sliding: Vec<bool> = charges.iter().map(|c| c.sliding).collect();
        let units: Vec<i64> = charges.iter().map(|c| i64::from(c.units)).collect();
        let limits: Vec<i64> = charges.iter().map(|c| i64::from(c.requests)).collect();
        let params: [(&(dyn ToSql + Sync), Type); 6] = [
            (&buckets, Type::TEXT_ARRAY),
            (&windows, Type::INT8_ARRAY),
            (&sliding, Type::BOOL_ARRAY),
            (&units, Type::INT8_ARRAY),
            (&limits, Type::INT8_ARRAY),
            (&self.async_commit, Type::BOOL),
        ];
        let result = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.run(|| conn.query_typed(CHARGE_SQL, &params))
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await
            .map(drop);
        self.record(&result);
        result
    }
}
