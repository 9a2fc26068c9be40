-- ============================================================================
-- tollgate — the increment as a function (SPEC sections 3, 3a and 6)
--
-- WHY A FUNCTION
--
-- The increment must be the unnamed statement: behind a transaction-mode pooler
-- a named prepared statement is not there on the next server connection (issue
-- 15). The unnamed statement is parsed and planned on every call, and the batch
-- upsert is big enough for that to cost more than running it (pgbench on this
-- machine: about 5.2k/s unnamed against 12.2k/s prepared; docs/performance.md).
-- PL/pgSQL caches the plans of the statements inside a function for the life of
-- the server session, and a server session is what a pooler hands out: so the
-- call `SELECT * FROM public.tollgate_increment($1, $2, $3, $4, $5)` is tiny to
-- parse, and the upsert inside is planned once per server connection. Nothing is
-- kept on tollgate's side, and nothing a pooler could mix up.
--
-- SAME STATEMENT, SAME GUARANTEES
--
-- Fixed windows (limits[i] IS NULL) are the seed's single atomic
-- INSERT ... ON CONFLICT (bucket, window_start) DO UPDATE ... RETURNING count,
-- generalised to several rows with unnest, rows taken in bucket order so that
-- two batches sharing buckets wait for each other instead of deadlocking, the
-- sum saturating at the column's range. The window comes from now(): the
-- database's clock, the same for every instance.
--
-- Sliding windows (limits[i] = the limit's requests, SPEC 3a) count only what
-- they admit, so the count after the increment depends on the count before it:
-- the row is locked first, then read, then updated (docs/architecture.md,
-- "Sliding windows", has the argument). All inside this one call: one round
-- trip, one statement for tollgate.
--
-- synchronous_commit: set_config(..., true) is SET LOCAL, for the calling
-- transaction (the implicit one of the call). It must NOT be a SET clause of the
-- function: a function's SET clause is undone when the function returns, before
-- the commit that it was meant for. The SET search_path clause below is undone
-- on return too, which is what it is for; it does not undo the set_config of
-- another setting made inside.
--
-- search_path: fixed for the function's own body (pg_catalog first, pg_temp
-- last), and the table is named with its schema, so a role with an odd
-- search_path (or a schema of look-alike functions) changes nothing here.
--
-- SECURITY INVOKER (the default): the caller's own privileges on rate_limits
-- apply, so a role without INSERT fails here as it did before, and EXECUTE on a
-- new function is granted to PUBLIC by default, so a runtime role that a deploy
-- job migrated for (migrate = false) can call it.
--
-- Target schema: public. No system schema is read or written.
-- ============================================================================

SET LOCAL search_path = public;

CREATE OR REPLACE FUNCTION public.tollgate_increment(
    buckets      text[],
    windows      int8[],
    amounts      int8[],
    limits       int8[],
    async_commit boolean
)
RETURNS TABLE (
    bucket        text,    -- the row's bucket (rows come back in no particular order)
    count         int4,    -- the row's count after this call
    added         int8,    -- units this call counted; NULL = all of them (fixed windows)
    previous      int4,    -- sliding: the previous window's count (0 without a row)
    window_end_ms int8,    -- unix milliseconds at which the current window ends
    now_ms        int8     -- the database clock of this call, unix milliseconds
)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    -- now() is the transaction's start: one instant for every row of the call.
    now_s  float8 := extract(epoch FROM now());
    s_bucket   text[];
    s_start    int8[];
    s_win      int8[];
    s_old      int4[];
    s_added    int8[];
    s_previous int4[];
BEGIN
    IF async_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    -- Fixed windows: the seed's upsert. limits IS NULL when the batch is all fixed.
    IF limits IS NULL OR array_position(limits, NULL) IS NOT NULL THEN
        RETURN QUERY
        WITH input AS (
            SELECT b.bucket,
                   b.amount,
                   b.win,
                   (floor(now_s)::int8 / b.win) * b.win AS start_secs
            FROM unnest(buckets, windows, amounts, limits) AS b(bucket, win, amount, lim)
            WHERE b.lim IS NULL
        )
        INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
        SELECT i.bucket,
               to_timestamp(i.start_secs),
               LEAST(i.amount, 2147483647)::int4,
               to_timestamp(i.start_secs + i.win)
        FROM input i
        ORDER BY i.bucket
        ON CONFLICT (bucket, window_start) DO UPDATE
            SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
        RETURNING r.bucket,
                  r.count,
                  NULL::int8,
                  0,
                  floor(extract(epoch FROM r.expires_at) * 1000)::int8,
                  floor(now_s * 1000)::int8;
    END IF;

    IF limits IS NULL OR cardinality(array_remove(limits, NULL)) = 0 THEN
        RETURN;
    END IF;

    -- Sliding windows (SPEC 3a). 1: every current row exists, at 0 if it is new. A row
    -- another call is inserting right now is waited for (ON CONFLICT does), not doubled.
    -- expires_at = window_start + 2 * window: the row is read as "previous" for a window more.
    INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
    SELECT b.bucket,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win),
           0,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win + 2 * b.win)
    FROM unnest(buckets, windows, limits) AS b(bucket, win, lim)
    WHERE b.lim IS NOT NULL
    ORDER BY b.bucket
    ON CONFLICT (bucket, window_start) DO NOTHING;

    -- 2: lock the current rows in bucket order (READ COMMITTED: a row updated meanwhile is
    -- re-read at its latest version once its lock is ours), read the previous windows, and
    -- admit the prefix of each row's units that the estimate allows:
    --   unit k is admitted when previous * (window - elapsed) / window + old + k <= limit.
    SELECT array_agg(d.bucket), array_agg(d.start_secs), array_agg(d.win), array_agg(d.old),
           array_agg(d.added), array_agg(d.previous)
    INTO s_bucket, s_start, s_win, s_old, s_added, s_previous
    FROM (
        SELECT i.bucket,
               i.start_secs,
               i.win,
               cur.count AS old,
               COALESCE(prev.count, 0) AS previous,
               LEAST(i.amount,
                     GREATEST(0::float8,
                              floor(i.lim
                                    - COALESCE(prev.count, 0)::float8
                                      * ((i.start_secs + i.win)::float8 - now_s) / i.win)
                              - cur.count))::int8 AS added
        FROM (
            SELECT b.bucket, b.win, b.amount, b.lim,
                   (floor(now_s)::int8 / b.win) * b.win AS start_secs
            FROM unnest(buckets, windows, amounts, limits) AS b(bucket, win, amount, lim)
            WHERE b.lim IS NOT NULL
        ) i
        JOIN public.rate_limits cur
          ON cur.bucket = i.bucket AND cur.window_start = to_timestamp(i.start_secs)
        LEFT JOIN public.rate_limits prev
          ON prev.bucket = i.bucket AND prev.window_start = to_timestamp(i.start_secs - i.win)
        ORDER BY i.bucket
        FOR NO KEY UPDATE OF cur
    ) d;

    -- 3: count what was admitted; a row whose units were all denied is not written again.
    UPDATE public.rate_limits AS r
    SET count = r.count + a.added
    FROM unnest(s_bucket, s_start, s_added) AS a(bucket, start_secs, added)
    WHERE a.added > 0
      AND r.bucket = a.bucket
      AND r.window_start = to_timestamp(a.start_secs);

    RETURN QUERY
    SELECT a.bucket,
           (a.old + a.added)::int4,
           a.added,
           a.previous,
           (a.start_secs + a.win) * 1000,
           floor(now_s * 1000)::int8
    FROM unnest(s_bucket, s_old, s_added, s_previous, s_start, s_win)
         AS a(bucket, old, added, previous, start_secs, win);
END
$fn$;

COMMENT ON FUNCTION public.tollgate_increment(text[], int8[], int8[], int8[], boolean) IS
  'tollgate''s batch increment (fixed and sliding windows), one call per batch. '
  'Parameters: buckets, window lengths (s), amounts, sliding limits (NULL = fixed), '
  'whether to commit with synchronous_commit = off.';
