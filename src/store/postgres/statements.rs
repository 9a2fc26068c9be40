//! The statements that count (contract §3, §3a, 6): their texts, a batch as their parameters
//! ([`IncrementArgs`]), which statement a batch is sent as on which connection (the function's
//! call as the unnamed statement on any connection; the plain statements, prepared once, on a
//! connection that reaches its backend directly: [`PooledClient::increment`]), and the rows
//! that come back read into each request's answers ([`decided`], [`count_from`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio_postgres::types::{ToSql, Type};

use super::errors::query_error;
use super::pool::PooledClient;
use crate::store::coalesce::{position, Folded};
use crate::store::{Counted, Increment, StoreError};

/// Maps and sets over bucket names: names made by tollgate (policy labels and digests), never
/// text a client chose, so foldhash (a fraction of SipHash's time on an 80-byte name) leaves
/// an attacker no collisions to aim at.
pub(super) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
pub(super) type FastSet<K> = HashSet<K, foldhash::fast::RandomState>;

/// The bucket of the readiness probe: not of the form `<scope>:<label>:<digest>` nor
/// `<scope>:global` that client buckets have, and rolled back anyway.
const PROBE_BUCKET: &str = "tollgate readiness probe";

/// The batch increment (contract §3, §3a, §3d, 6): a call of `public.tollgate_increment`, the
/// overload of `migrations/0008_denied_adds_nothing.sql` (it holds the seed's atomic
/// `INSERT ... ON CONFLICT ... DO UPDATE ... RETURNING`, which counts a fixed row's units only
/// while they fit under its cap, and the sliding-window variant; a row at its limit is walked
/// unit by unit, so a denied unit is never added).
/// Parameters: `$1 text[]` buckets, `$2 int8[]` window lengths in seconds, `$3 int8[]`
/// amounts (`int8`, so a `u32` never overflows on the way in), `$4 int8[]` sliding limits
/// (`NULL` for a fixed window; the whole array `NULL` when the batch has no sliding limit),
/// `$5 int8[]` per fixed row the enforced limit (`NULL`: none, a shadow limit), `$6 boolean` =
/// commit with `synchronous_commit = off` (`store.synchronous_commit = false`).
///
/// It is sent as the unnamed statement (`query_typed`: Parse, Bind, Describe, Execute and
/// Sync in one round trip) unless the connection provably reaches its backend directly
/// ([`direct`](super::direct); then it is prepared once per connection, see `PooledClient::increment`):
/// behind a transaction-mode pooler the next statement may run on another server connection,
/// where a named statement does not exist, or another client's of the same name does (issue
/// 15). PL/pgSQL plans the upsert inside once per server session; the call itself still costs
/// the server a parse and plan each time it is sent unnamed (docs/performance.md, row "Prepared
/// on direct connections"). `synchronous_commit` is set inside with `set_config(..., true)`, i.e.
/// `SET LOCAL` for the call's own implicit transaction: PostgreSQL reads it when it writes the
/// commit record and only then resets transaction-local settings, so the commit of this very
/// statement is asynchronous, and nothing outlives it (the test
/// `increment_turns_synchronous_commit_off_for_its_own_transaction_only` reads it back).
pub(super) const INCREMENT_SQL: &str =
    "SELECT bucket, count, added, previous, window_end_ms, now_ms \
     FROM public.tollgate_increment($1, $2, $3, $4, $5, $6)";

/// The text of the increment statement (for tests and for operators who want to `EXPLAIN`
/// it); parameters as documented on [`INCREMENT_SQL`].
pub fn increment_sql() -> &'static str {
    INCREMENT_SQL
}

/// The text of the joint decision's call, for tests; as documented on [`DECIDE_SQL`].
pub fn decide_sql() -> &'static str {
    DECIDE_SQL
}

/// The fixed-window part of `public.tollgate_increment` (`migrations/0008_denied_adds_nothing.sql`)
/// as a statement of its own: the seed's atomic upsert, with [`INCREMENT_SQL`]'s first three
/// parameters, `$4 int8[]` its fixed rows' caps (its `$5`), and the four columns `bucket,
/// count, window_end_ms, now_ms`. Only for a batch without a sliding limit (its parameters
/// come only from [`IncrementArgs::fixed`]), and only prepared on a connection that reaches
/// its backend directly (`PooledClient::increment`).
///
/// A row with a cap (its requests' enforced limit) is inserted with `LEAST(amount, cap)` units
/// and updated only when that many fit under it (`old + amount <= cap`, on the latest count,
/// the row `ON CONFLICT` locked), so a denied unit is never added (contract §3d): a row it
/// answers for counted `LEAST(amount, cap)` units, its first ones in arrival order. A row left
/// out is one at its limit, and `PooledClient::increment` sends it to the function, which
/// counts the prefix that fits. The cap is found by the row's place in the arrays
/// (`array_position`), not by a sub-plan per row: 263k PostgreSQL instructions per execution
/// on a hot bucket against 237k for the uncapped upsert and 296k with a correlated sub-select
/// (`bench/statement_instructions.sh`).
///
/// Why a second text: prepared once, the plain upsert costs the server less than the prepared
/// call of the function (PL/pgSQL's call and the tuplestore that `RETURN QUERY` fills; about
/// 25 % of the database's CPU per request on a hot bucket, docs/performance.md, row "The
/// plain fixed-window upsert"). It is what `f1d8ece` had before issue 15, and nothing more:
/// every extra in it costs each execution (counted by `bench/pg_instructions.sh`). A `set_config` in the input kept PostgreSQL from inlining the CTE (a volatile
/// function) and added a CTE scan and an InitPlan; a `$4 IS NULL` guard added a gating
/// `Result` node; the two constant columns a wider projection.
///
/// - `synchronous_commit`: on a direct connection the session is tollgate's own, so the
///   connection sets it once with a session `SET` before this statement is first used
///   ([`SESSION_ASYNC_COMMIT_SQL`]), as `f1d8ece`'s start-up parameter did. Behind a pooler a
///   session `SET` would leak to other clients; there the function, which sets it for its
///   own transaction, stays the statement.
/// - The window from `now()`, rows in bucket order, the sum saturating: as the function.
pub(super) const FIXED_UPSERT_SQL: &str = "\
WITH input AS (
    SELECT b.bucket,
           b.amount,
           b.win,
           b.cap,
           (floor(extract(epoch FROM now()))::int8 / b.win) * b.win AS start_secs
    FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int8[]) AS b(bucket, win, amount, cap)
)
INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
SELECT i.bucket,
       to_timestamp(i.start_secs),
       LEAST(i.amount, COALESCE(i.cap, 2147483647), 2147483647)::int4,
       to_timestamp(i.start_secs + i.win)
FROM input i
ORDER BY i.bucket
ON CONFLICT (bucket, window_start) DO UPDATE
    SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
    WHERE r.count::int8 + EXCLUDED.count
          <= COALESCE(($4::int8[])[array_position($1::text[], r.bucket)], 9223372036854775807)
RETURNING r.bucket,
          r.count,
          floor(extract(epoch FROM r.expires_at) * 1000)::int8,
          floor(extract(epoch FROM now()) * 1000)::int8";

/// A batch with a sliding limit (and no joint decision), on a direct connection: one plain
/// statement instead of the function's three (a locking insert, then the read of the current
/// and previous rows and an update). Parameters: [`INCREMENT_SQL`]'s `$1`..`$5` (`$4` per row
/// the sliding limit, `NULL` for a fixed window; `$5` a fixed row's cap). Columns: `bucket, count, previous,
/// window_end_ms, now_ms`, for the rows it counted.
///
/// Each row is counted whole or not at all. A sliding row's `cap` is what its estimate leaves
/// for the current window, `floor(limit - previous * (window_end - now) / window)` (contract §3a:
/// unit `k` is admitted while `previous * weight + old + k <= limit`, so all `amount` units fit
/// exactly when `old + amount <= cap`). A new row is inserted when `amount <= cap`; a row that
/// exists is updated when its latest count (the locked version `ON CONFLICT` sees, not this
/// statement's snapshot) plus `amount` is within `cap`. A fixed row's cap is `$5`, its enforced
/// limit (`NULL`: none, always counted, saturating as in [`FIXED_UPSERT_SQL`]), so a denied
/// unit is never added on either algorithm (contract §3d). A row left out is one whose units do not
/// all fit: only near the limit. `PooledClient::increment` sends those rows to the function,
/// which counts the admitted prefix of them; the answer is the same as the function's for the
/// whole batch, at the cost of a second statement for the rows at their limit.
///
/// The previous window's row is read from the statement's snapshot, as in the function: that
/// window has ended, so only an increment begun before its end can still change it.
/// `expires_at = window_start + 2 * window` for sliding rows (contract §3a), `+ window` for fixed
/// ones; rows in bucket order (lock order, as everywhere). On a direct connection only, for
/// the same reason as [`FIXED_UPSERT_SQL`]: `synchronous_commit` comes from the session.
/// Measured against the function and the fixed upsert in docs/performance.md (row "The
/// plain sliding upsert").
pub(super) const SLIDING_UPSERT_SQL: &str = "\
WITH input AS (
    SELECT b.bucket,
           b.win,
           b.amount,
           b.lim,
           b.fixed_cap,
           (floor(extract(epoch FROM now()))::int8 / b.win) * b.win AS start_secs
    FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int8[], $5::int8[])
         AS b(bucket, win, amount, lim, fixed_cap)
), caps AS (
    SELECT i.bucket,
           i.win,
           i.amount,
           i.lim,
           i.start_secs,
           COALESCE(p.count, 0) AS previous,
           CASE WHEN i.lim IS NOT NULL THEN
               LEAST(floor(i.lim - COALESCE(p.count, 0)::float8
                                  * ((i.start_secs + i.win)::float8 - extract(epoch FROM now()))
                                  / i.win),
                     2147483647)
               ELSE i.fixed_cap
           END AS cap
    FROM input i
    LEFT JOIN public.rate_limits p
           ON i.lim IS NOT NULL
          AND p.bucket = i.bucket
          AND p.window_start = to_timestamp(i.start_secs - i.win)
), counted AS (
    INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
    SELECT c.bucket,
           to_timestamp(c.start_secs),
           LEAST(c.amount, 2147483647)::int4,
           to_timestamp(c.start_secs + CASE WHEN c.lim IS NULL THEN 1 ELSE 2 END * c.win)
    FROM caps c
    WHERE c.cap IS NULL OR c.amount <= c.cap
    ORDER BY c.bucket
    ON CONFLICT (bucket, window_start) DO UPDATE
        SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
        WHERE r.count::int8 + EXCLUDED.count
              <= COALESCE((SELECT c.cap FROM caps c WHERE c.bucket = EXCLUDED.bucket), 'Infinity')
    RETURNING r.bucket, r.count
)
SELECT k.bucket,
       k.count,
       c.previous,
       (c.start_secs + c.win) * 1000,
       floor(extract(epoch FROM now()) * 1000)::int8
FROM counted k
JOIN caps c ON c.bucket = k.bucket";

/// [`SLIDING_UPSERT_SQL`] for a batch of one sliding row, the shape of every hot bucket's
/// batch: the same decision (the row counted whole when `amount <= cap`, else left to the
/// function), written for one row so that PostgreSQL sets up no `unnest`, sort, join or
/// correlated sub-plan for it; the cap is read by `ON CONFLICT`'s `WHERE` through an
/// uncorrelated sub-select, evaluated once. Parameters: `$1 text` bucket, `$2 int8` window
/// length (s), `$3 int8` amount, `$4 int8` sliding limit. Columns as [`SLIDING_UPSERT_SQL`]'s,
/// one row when it counted, none when it did not. About 1.15 × the fixed upsert's database CPU
/// on a hot bucket against 1.27 × for the batch statement (docs/performance.md, row "A
/// single-row sliding statement").
pub(super) const SLIDING_ONE_SQL: &str = "\
WITH c AS (
    SELECT w.start_secs,
           COALESCE(p.count, 0) AS previous,
           LEAST(floor($4::int8 - COALESCE(p.count, 0)::float8
                                  * ((w.start_secs + $2::int8)::float8 - extract(epoch FROM now()))
                                  / $2::int8),
                 2147483647) AS cap
    FROM (SELECT (floor(extract(epoch FROM now()))::int8 / $2::int8) * $2::int8 AS start_secs) w
    LEFT JOIN public.rate_limits p
           ON p.bucket = $1::text
          AND p.window_start = to_timestamp(w.start_secs - $2::int8)
)
INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
SELECT $1::text,
       to_timestamp(c.start_secs),
       LEAST($3::int8, 2147483647)::int4,
       to_timestamp(c.start_secs + 2 * $2::int8)
FROM c
WHERE $3::int8 <= c.cap
ON CONFLICT (bucket, window_start) DO UPDATE
    SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
    WHERE r.count::int8 + EXCLUDED.count <= (SELECT c.cap FROM c)
RETURNING r.bucket,
          r.count,
          (SELECT c.previous FROM c),
          (SELECT (c.start_secs + $2::int8) * 1000 FROM c),
          floor(extract(epoch FROM now()) * 1000)::int8";

/// Sent once on a direct connection, before a plain statement ([`FIXED_UPSERT_SQL`],
/// [`SLIDING_UPSERT_SQL`], [`SLIDING_ONE_SQL`]) is first executed there, when
/// `store.synchronous_commit = "off"`: the contract's "tollgate's own sessions" (docs/configuration.md, `[store]`).
pub(super) const SESSION_ASYNC_COMMIT_SQL: &str = "SET synchronous_commit = off";

/// The text of the direct connections' fixed-window statement, for tests; parameters and
/// columns as documented on [`FIXED_UPSERT_SQL`].
pub fn fixed_upsert_sql() -> &'static str {
    FIXED_UPSERT_SQL
}

/// The text of the direct connections' statement for batches with a sliding limit, for tests;
/// parameters and columns as documented on [`SLIDING_UPSERT_SQL`].
pub fn sliding_upsert_sql() -> &'static str {
    SLIDING_UPSERT_SQL
}

/// The text of the direct connections' statement for a batch of one sliding row, for tests;
/// as documented on [`SLIDING_ONE_SQL`].
pub fn sliding_one_sql() -> &'static str {
    SLIDING_ONE_SQL
}

/// The statements an increment batch is sent as ([`INCREMENT_SQL`], [`FIXED_UPSERT_SQL`],
/// [`SLIDING_UPSERT_SQL`], [`SLIDING_ONE_SQL`]), each prepared at most once per direct
/// connection.
#[derive(Debug, Clone, Copy)]
pub(super) enum IncrementStatement {
    /// The call of `public.tollgate_increment`: any batch, any connection.
    Function,
    /// The plain upsert: a batch without a sliding limit, on a direct connection.
    FixedUpsert,
    /// The plain sliding statement: a batch with a sliding limit, on a direct connection.
    SlidingUpsert,
    /// The same for a batch of one sliding row.
    SlidingOne,
    /// The joint decision's call ([`DECIDE_SQL`]), prepared on a direct connection: the
    /// parse and plan of the call cost the database on every request with several limits.
    Decide,
}

impl IncrementStatement {
    fn sql(self) -> &'static str {
        match self {
            IncrementStatement::Function => INCREMENT_SQL,
            IncrementStatement::FixedUpsert => FIXED_UPSERT_SQL,
            IncrementStatement::SlidingUpsert => SLIDING_UPSERT_SQL,
            IncrementStatement::SlidingOne => SLIDING_ONE_SQL,
            IncrementStatement::Decide => DECIDE_SQL,
        }
    }

    /// The unnamed statement that stands in for it, with the same parameters as `fallback`
    /// of [`PooledClient::increment_prepared`]: the function's call.
    fn unnamed_sql(self) -> &'static str {
        match self {
            IncrementStatement::Decide => DECIDE_SQL,
            _ => INCREMENT_SQL,
        }
    }

    /// Whether the statement relies on the session's `synchronous_commit` (the function sets
    /// it for its own transaction).
    fn needs_session_setting(self) -> bool {
        !matches!(
            self,
            IncrementStatement::Function | IncrementStatement::Decide
        )
    }

    /// Its slot in `PooledClient::prepared`.
    fn slot(self) -> usize {
        self as usize
    }
}

/// One increment batch as its statements take it: [`INCREMENT_SQL`]'s five parameters, the
/// first three of which are [`FIXED_UPSERT_SQL`]'s.
pub(super) struct IncrementArgs<'a> {
    pub(super) buckets: Vec<&'a str>,
    pub(super) windows: Vec<i64>,
    pub(super) amounts: Vec<i64>,
    /// Per row its sliding limit (`None`: a fixed window); `None` as a whole when no limit of
    /// the batch is sliding (the function then runs only its fixed-window upsert).
    pub(super) limits: Option<Vec<Option<i64>>>,
    /// Per row, a fixed window's cap: the enforced limit of its requests, past which a unit
    /// is denied and not added (`None`: no enforced limit, or a sliding row).
    pub(super) caps: Vec<Option<i64>>,
    pub(super) async_commit: bool,
}

impl IncrementArgs<'_> {
    /// The function's parameters. Typed, so that the unnamed statement needs no Describe
    /// round trip first: the batch is ONE round trip and leaves nothing on the server
    /// connection.
    pub(super) fn function(&self) -> [(&(dyn ToSql + Sync), Type); 6] {
        [
            (&self.buckets, Type::TEXT_ARRAY),
            (&self.windows, Type::INT8_ARRAY),
            (&self.amounts, Type::INT8_ARRAY),
            (&self.limits, Type::INT8_ARRAY),
            (&self.caps, Type::INT8_ARRAY),
            (&self.async_commit, Type::BOOL),
        ]
    }

    /// The plain upsert's parameters: `None` for a batch with a sliding limit, which only
    /// the function counts right. The one way to reach [`FIXED_UPSERT_SQL`], so a sliding
    /// batch can never be counted as a fixed one.
    pub(super) fn fixed(&self) -> Option<[(&(dyn ToSql + Sync), Type); 4]> {
        self.limits.is_none().then_some([
            (&self.buckets as &(dyn ToSql + Sync), Type::TEXT_ARRAY),
            (&self.windows, Type::INT8_ARRAY),
            (&self.amounts, Type::INT8_ARRAY),
            (&self.caps, Type::INT8_ARRAY),
        ])
    }

    /// [`SLIDING_UPSERT_SQL`]'s parameters: the function's first five, for a batch with a
    /// sliding limit (`None` otherwise: the plain upsert is cheaper).
    pub(super) fn sliding(&self) -> Option<[(&(dyn ToSql + Sync), Type); 5]> {
        self.limits.is_some().then(|| {
            let [buckets, windows, amounts, limits, caps, _] = self.function();
            [buckets, windows, amounts, limits, caps]
        })
    }

    /// [`SLIDING_ONE_SQL`]'s parameters: for a batch of exactly one row, a sliding one.
    pub(super) fn sliding_one(&self) -> Option<[(&(dyn ToSql + Sync), Type); 4]> {
        let limits = self.limits.as_deref()?;
        match (
            &self.buckets[..],
            &self.windows[..],
            &self.amounts[..],
            limits,
        ) {
            ([bucket], [window], [amount], [Some(limit)]) => Some([
                (bucket as &(dyn ToSql + Sync), Type::TEXT),
                (window, Type::INT8),
                (amount, Type::INT8),
                (limit, Type::INT8),
            ]),
            _ => None,
        }
    }

    /// The same batch without the rows whose buckets are in `counted`: what is left for the
    /// function after [`SLIDING_UPSERT_SQL`] counted the rest.
    fn without(&self, counted: &[tokio_postgres::Row]) -> Result<Self, tokio_postgres::Error> {
        let mut done: FastSet<&str> =
            FastSet::with_capacity_and_hasher(counted.len(), Default::default());
        for row in counted {
            done.insert(row.try_get(0)?);
        }
        let keep: Vec<usize> = (0..self.buckets.len())
            .filter(|&i| !done.contains(self.buckets[i]))
            .collect();
        Ok(IncrementArgs {
            buckets: keep.iter().map(|&i| self.buckets[i]).collect(),
            windows: keep.iter().map(|&i| self.windows[i]).collect(),
            amounts: keep.iter().map(|&i| self.amounts[i]).collect(),
            limits: self
                .limits
                .as_ref()
                .map(|limits| keep.iter().map(|&i| limits[i]).collect()),
            caps: keep.iter().map(|&i| self.caps[i]).collect(),
            async_commit: self.async_commit,
        })
    }
}

/// The joint decision: a call of `public.tollgate_decide` (the overload of
/// `migrations/0007_request_cost.sql`), for a batch in which some request has a sliding limit
/// next to another enforced limit (contract §3a), takes several units of a limit, or checks a
/// limit charged after the response (§3d). Rows as for [`INCREMENT_SQL`] (`$1`..`$4`, `$3` the
/// rows' summed units), then one entry per increment of every request, in arrival order:
/// `$5 int4[]` its row (1-based), `$6 int4[]` its request (1-based, ascending), `$7 int8[]` its
/// units, `$8 int8[]` its enforced limit (`NULL`: shadow), `$9 boolean[]` whether it is a check,
/// `$10 boolean` as `$5` above. The function walks the requests in order: a request is allowed
/// when every enforced limit admits all of its units, and only then are they counted in its
/// walked rows. Same protocol and plan caching as [`INCREMENT_SQL`].
pub(super) const DECIDE_SQL: &str =
    "SELECT bucket, count, previous, window_end_ms, now_ms, added, fits \
     FROM public.tollgate_decide($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

/// The read-only twin of [`INCREMENT_SQL`] for `tollgate explain`: same window arithmetic,
/// no write, 0 for a bucket without a row. `WITH ORDINALITY` keeps the batch order.
pub(super) const PEEK_SQL: &str = "\
WITH input AS (
    SELECT b.ord,
           b.bucket,
           b.win,
           (floor(extract(epoch FROM now()))::int8 / b.win) * b.win AS start_secs
    FROM unnest($1::text[], $2::int8[]) WITH ORDINALITY AS b(bucket, win, ord)
)
SELECT COALESCE(r.count, 0),
       (i.start_secs + i.win) * 1000,
       floor(extract(epoch FROM now()) * 1000)::int8,
       COALESCE(p.count, 0)
FROM input i
LEFT JOIN public.rate_limits r
       ON r.bucket = i.bucket AND r.window_start = to_timestamp(i.start_secs)
LEFT JOIN public.rate_limits p
       ON p.bucket = i.bucket AND p.window_start = to_timestamp(i.start_secs - i.win)
ORDER BY i.ord";

impl PooledClient {
    /// The increment statement `sql` on [`PROBE_BUCKET`] in a transaction that is rolled back.
    /// A probe cut off midway leaves the connection marked in flight, so it is not reused with
    /// a transaction open.
    pub(super) async fn probe_increment(
        &mut self,
        async_commit: bool,
    ) -> Result<(), tokio_postgres::Error> {
        self.in_flight.store(true, Ordering::Release);
        let result = async {
            let tx = self.begin().await?;
            let buckets = [PROBE_BUCKET];
            let windows = [1i64];
            let amounts = [1i64];
            let limits: Option<Vec<i64>> = None;
            let caps = [None::<i64>];
            tx.query_typed(
                INCREMENT_SQL,
                &[
                    (&&buckets[..], Type::TEXT_ARRAY),
                    (&&windows[..], Type::INT8_ARRAY),
                    (&&amounts[..], Type::INT8_ARRAY),
                    (&limits, Type::INT8_ARRAY),
                    (&&caps[..], Type::INT8_ARRAY),
                    (&async_commit, Type::BOOL),
                ],
            )
            .await?;
            tx.rollback().await
        }
        .await;
        self.in_flight.store(false, Ordering::Release);
        if let Err(err) = &result {
            self.note_read_only(err);
        }
        result
    }

    /// The increment on this connection. Known to be direct: prepared once and then bound and
    /// executed, the plain upsert for a batch without a sliding limit, the plain sliding
    /// statement otherwise, followed by the function's call for the rows they left (those at
    /// their limit). Else the function's call as the unnamed statement.
    pub(super) async fn increment(
        &self,
        args: &IncrementArgs<'_>,
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        let function = args.function();
        if !self.direct.is_direct() {
            return self
                .run(|| self.client.query_typed(INCREMENT_SQL, &function))
                .await;
        }
        let async_commit = args.async_commit;
        let mut rows = match (args.fixed(), args.sliding_one(), args.sliding()) {
            (Some(fixed), _, _) => {
                let which = IncrementStatement::FixedUpsert;
                self.increment_prepared(which, &fixed, &function, async_commit)
                    .await?
            }
            (None, Some(one), _) => {
                let which = IncrementStatement::SlidingOne;
                self.increment_prepared(which, &one, &function, async_commit)
                    .await?
            }
            (None, None, Some(batch)) => {
                let which = IncrementStatement::SlidingUpsert;
                self.increment_prepared(which, &batch, &function, async_commit)
                    .await?
            }
            (None, None, None) => {
                let which = IncrementStatement::Function;
                return self
                    .increment_prepared(which, &function, &function, async_commit)
                    .await;
            }
        };
        if rows.len() < args.buckets.len() {
            // Rare (a row at its limit), so boxed: the common future stays small.
            let rest = args.without(&rows)?;
            rows.extend(Box::pin(self.increment_rest(&rest)).await?);
        }
        Ok(rows)
    }

    /// The function's call for the rows [`FIXED_UPSERT_SQL`] or [`SLIDING_UPSERT_SQL`] did not
    /// count whole: it counts the prefix of their units that each limit admits.
    async fn increment_rest(
        &self,
        rest: &IncrementArgs<'_>,
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        let function = rest.function();
        let which = IncrementStatement::Function;
        self.increment_prepared(which, &function, &function, rest.async_commit)
            .await
    }

    /// The joint decision ([`DECIDE_SQL`]) on this connection: prepared once on a direct one,
    /// the unnamed statement otherwise (behind a pooler a named statement may not be there).
    pub(super) async fn decide(
        &self,
        params: &[(&(dyn ToSql + Sync), Type); 10],
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        if !self.direct.is_direct() {
            return self
                .run(|| self.client.query_typed(DECIDE_SQL, params))
                .await;
        }
        // The function sets `synchronous_commit` for its own transaction: no session setting.
        self.increment_prepared(IncrementStatement::Decide, params, params, false)
            .await
    }

    /// `which` with its `params`, prepared on this direct connection (the first time, see
    /// [`PooledClient::increment_and_prepare`]). `fallback`: the same batch as the parameters
    /// of `which`'s unnamed stand-in ([`IncrementStatement::unnamed_sql`]), for when the
    /// prepared statement is not (or no longer) there.
    async fn increment_prepared<const N: usize>(
        &self,
        which: IncrementStatement,
        params: &[(&(dyn ToSql + Sync), Type); N],
        fallback: &[(&(dyn ToSql + Sync), Type)],
        async_commit: bool,
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        let Some(statement) = self.prepared[which.slot()].get() else {
            let types = params.iter().map(|(_, ty)| ty.clone()).collect();
            // Boxed: once per connection and statement, and its three pipelined futures
            // would otherwise make every increment's future (moved into a box per call by
            // `Store::increment_each`) several kilobytes larger.
            return Box::pin(self.increment_and_prepare(fallback, which, types, async_commit))
                .await;
        };
        let values: [&(dyn ToSql + Sync); N] = std::array::from_fn(|i| params[i].0);
        let result = self.run(|| self.client.query(statement, &values)).await;
        match &result {
            // 0A000: "cached plan must not change result type" (a migration replaced the
            // function or the table with another answer); 26000: the statement is gone.
            // Neither executed anything, so the batch runs once more as the unnamed
            // statement, and the connection is replaced rather than reused.
            Err(err)
                if matches!(
                    err.code(),
                    Some(&tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED)
                        | Some(&tokio_postgres::error::SqlState::INVALID_SQL_STATEMENT_NAME)
                ) =>
            {
                tracing::debug!(error = %err, "the prepared increment no longer applies");
                self.stale.store(true, Ordering::Release);
                self.run(|| self.client.query_typed(which.unnamed_sql(), fallback))
                    .await
            }
            _ => result,
        }
    }

    /// The first batch of its kind on a direct connection: it runs as the unnamed stand-in of
    /// `which` (a function's call), and the prepare of `which` (parameter `types`) is pipelined right behind it (sent
    /// in the same flush, answered after it), so this decision waits for no extra round trip.
    /// For the plain upsert with `async_commit`, the session's `synchronous_commit = off`
    /// goes in the same flush: the statement relies on it. A failure of either leaves the
    /// connection on unnamed statements for good rather than retrying on every call.
    async fn increment_and_prepare(
        &self,
        fallback: &[(&(dyn ToSql + Sync), Type)],
        which: IncrementStatement,
        types: Vec<Type>,
        async_commit: bool,
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        let set_session = which.needs_session_setting() && async_commit;
        let (rows, prepared, session) = self
            .tracked(|| async {
                tokio::join!(
                    self.client.query_typed(which.unnamed_sql(), fallback),
                    self.client.prepare_typed(which.sql(), &types),
                    async {
                        if set_session {
                            self.client.batch_execute(SESSION_ASYNC_COMMIT_SQL).await
                        } else {
                            Ok(())
                        }
                    }
                )
            })
            .await;
        match session.and(prepared) {
            Ok(statement) => {
                // `&self` on a connection bb8 lends to one caller at a time: nobody else set it.
                let _ = self.prepared[which.slot()].set(statement);
            }
            Err(err) => {
                tracing::debug!(
                    error = %err,
                    "preparing the increment failed: unnamed statements only on this connection"
                );
                self.direct.demote();
            }
        }
        if let Err(err) = &rows {
            self.note_read_only(err);
        }
        rows
    }
}

/// Splits a batch into the statement's array parameters, refusing what the statement cannot
/// take: a zero window (division by zero) and a bucket twice (ON CONFLICT cannot update one
/// row twice in a statement; the trait promises distinct buckets).
pub(super) fn columns(batch: &[Increment]) -> Result<(Vec<&str>, Vec<i64>), StoreError> {
    columns_of(batch.iter().map(|inc| (&inc.bucket, inc.window_secs)))
}

/// A row's cap for [`INCREMENT_SQL`]'s `$5`: a fixed window's enforced limit, past which its
/// units are denied and not added (contract §3d). A folded row carries its requests' common
/// enforced limit ([`Folded::new`]).
pub(super) fn fixed_cap(row: &Increment) -> Option<i64> {
    match row.sliding {
        None => row.enforce.map(i64::from),
        Some(_) => None,
    }
}

/// [`columns`] of any rows given as (bucket, window length).
pub(super) fn columns_of<'a>(
    rows: impl ExactSizeIterator<Item = (&'a Arc<str>, u32)>,
) -> Result<(Vec<&'a str>, Vec<i64>), StoreError> {
    let mut seen = FastSet::with_capacity_and_hasher(rows.len(), Default::default());
    let mut buckets = Vec::with_capacity(rows.len());
    let mut windows = Vec::with_capacity(rows.len());
    for (bucket, window_secs) in rows {
        if window_secs == 0 {
            return Err(StoreError::Query("a window of 0 seconds".into()));
        }
        if !seen.insert(&**bucket) {
            return Err(StoreError::Query(
                "the same bucket twice in one batch".into(),
            ));
        }
        buckets.push(&**bucket);
        windows.push(i64::from(window_secs));
    }
    Ok((buckets, windows))
}

/// Each request's answers from `tollgate_decide`'s rows ([`DECIDE_SQL`]). When the function
/// counted every row whole (every request allowed, the common case) the rows carry no entries
/// and a request's count is its position, as for [`Folded::share`]. Otherwise every row lists,
/// per entry in arrival order, the units counted and the units its own limit admitted; its
/// count before the statement is the count after minus everything counted, and an entry's
/// count is that plus what was counted up to and including it.
pub(super) fn decided(
    requests: &[&[Increment]],
    folded: &Folded,
    rows: &[tokio_postgres::Row],
) -> Result<Vec<Vec<Counted>>, StoreError> {
    struct RowAnswer {
        after: Counted,
        /// Per entry of this row: (added, fits); `None`: every entry counted whole.
        entries: Option<(Vec<i64>, Vec<i64>)>,
    }
    let mut by_bucket: FastMap<&str, RowAnswer> =
        FastMap::with_capacity_and_hasher(rows.len(), Default::default());
    for row in rows {
        let bucket: &str = row.try_get(0).map_err(query_error)?;
        let added: Option<Vec<i64>> = row.try_get(5).map_err(query_error)?;
        let fits: Option<Vec<i64>> = row.try_get(6).map_err(query_error)?;
        let after = Counted {
            count: count_from(row.try_get(1).map_err(query_error)?)?,
            previous: count_from(row.try_get(2).map_err(query_error)?)?,
            window_end_ms: row.try_get(3).map_err(query_error)?,
            now_ms: row.try_get(4).map_err(query_error)?,
            added: 0,
            fits: 0,
        };
        let entries = match (added, fits) {
            (Some(a), Some(f)) if a.len() == f.len() => Some((a, f)),
            (None, None) => None,
            _ => {
                return Err(StoreError::Query(
                    "a walked row's entries do not match".into(),
                ))
            }
        };
        by_bucket.insert(bucket, RowAnswer { after, entries });
    }
    let answers: Vec<&RowAnswer> = folded
        .rows
        .iter()
        .map(|row| {
            by_bucket.get(&*row.bucket).ok_or_else(|| {
                StoreError::Query("the increment returned no row for a bucket".into())
            })
        })
        .collect::<Result<_, _>>()?;
    // Per row: the count before, and how far its entries have been walked.
    let mut walked: Vec<(u32, usize)> = answers
        .iter()
        .map(|a| {
            let counted: i64 = a
                .entries
                .as_ref()
                .map_or(0, |(added, _)| added.iter().sum());
            let counted = u32::try_from(counted.max(0)).unwrap_or(u32::MAX);
            (a.after.count.saturating_sub(counted), 0)
        })
        .collect();
    let unit = |v: i64, by: u32| u32::try_from(v.clamp(0, i64::from(by))).unwrap_or(0);
    requests
        .iter()
        .zip(&folded.places)
        .map(|(request, place)| {
            request
                .iter()
                .zip(place)
                .map(|(inc, &(row, offset))| {
                    let answer = answers[row];
                    let Some((added, fits)) = &answer.entries else {
                        let total = folded.rows[row].by;
                        return Ok(Counted {
                            count: position(answer.after.count, total, offset, inc.by),
                            added: inc.by,
                            fits: inc.by,
                            ..answer.after
                        });
                    };
                    let (count, next) = &mut walked[row];
                    let (Some(&a), Some(&f)) = (added.get(*next), fits.get(*next)) else {
                        return Err(StoreError::Query("a walked row lacks an entry".into()));
                    };
                    *next += 1;
                    let a = unit(a, inc.by);
                    // A row that saturated counted less than its entries' units.
                    *count = count.saturating_add(a).min(answer.after.count);
                    Ok(Counted {
                        count: *count,
                        added: a,
                        fits: unit(f, inc.by),
                        ..answer.after
                    })
                })
                .collect()
        })
        .collect()
}

/// The column is `integer` with `CHECK (count >= 0)`; anything else is a broken table.
pub(super) fn count_from(count: i32) -> Result<u32, StoreError> {
    u32::try_from(count)
        .map_err(|_| StoreError::Query(format!("negative count {count} in rate_limits").into()))
}
