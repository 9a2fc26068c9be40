-- ============================================================================
-- tollgate — sliding windows decided with every limit of a request, and a
-- sliding increment that a concurrent reset cannot break (SPEC 3a, 3b, 6)
--
-- WHAT CHANGES
--
-- 1. public.tollgate_decide(...), new: for a batch in which some request has a
--    sliding limit next to another enforced limit. SPEC 3a says a sliding
--    limit's count is exactly the number of allowed requests; a request that
--    another limit denies must therefore not be counted in the sliding row,
--    which tollgate_increment (one row at a time) cannot know. This function
--    takes the rows AND the requests (one entry per increment, in arrival
--    order) and walks the requests one by one: a request is allowed for the
--    units that every enforced limit admits, and only those units are added to
--    its sliding rows. A shadow sliding limit never denies; it counts the
--    allowed units that its own estimate admits (what its row would hold if it
--    were enforced and the request allowed anyway), so its count stays within
--    its limit too and `shadow_limited` keeps meaning "would have denied".
--
-- 2. public.tollgate_increment(...), replaced (same parameters, same answer, so
--    an instance of the previous release keeps working during a rolling
--    upgrade): its sliding part is two statements instead of three, and a
--    `tollgate reset` that deletes a row while the function runs can no longer
--    make the call fail. Before, the function inserted missing rows, then
--    locked them with SELECT ... FOR NO KEY UPDATE: a reset committing in
--    between deleted the row, the locking read skipped it, the call answered
--    no row for that bucket and the decision became a store error (fail-open
--    under on_error = "allow"). Now the first statement is
--        INSERT ... ON CONFLICT (bucket, window_start) DO UPDATE ... WHERE false
--    which, per row, either inserts it or locks the existing one (a conflicting
--    row deleted meanwhile makes PostgreSQL retry the insertion, so every row
--    exists and is ours when it returns), and the second statement reads the
--    rows (its snapshot is taken after the locks, so it sees their latest
--    counts), writes the admitted units and answers, in one statement.
--
-- 3. Both functions plan their statements once per server session. PL/pgSQL
--    hands its statements to the plan cache with the arguments as parameters;
--    with a custom plan for an unnest() of an array the planner knows the
--    array's length, with the generic one it guesses 10 rows, so the generic
--    plan always looks costlier, and the plan cache kept re-planning the
--    sliding statements on every call (pg_stat_statements: about 0.5 ms of
--    planning per call against 0.1 ms of execution; docs/performance.md). The
--    generic plan is the right one for any batch (index lookups on the primary
--    key in a nested loop), so `SET plan_cache_mode = force_generic_plan` on
--    the function (undone on return, like its search_path) makes it stick.
--
-- Both functions keep the guarantees of 0003 (docs/architecture.md, "Sliding
-- windows"): rows locked in bucket order, the window from now(), counts that
-- never pass a sliding limit, synchronous_commit set for the calling
-- transaction only, a fixed search_path, SECURITY INVOKER.
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
    bucket        text,
    count         int4,
    added         int8,
    previous      int4,
    window_end_ms int8,
    now_ms        int8
)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    now_s float8 := extract(epoch FROM now());
BEGIN
    IF async_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    -- Fixed windows: the seed's upsert, unchanged.
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

    -- Sliding windows, 1: every current row exists and is locked by this transaction, in
    -- bucket order. DO UPDATE ... WHERE false writes nothing but locks the row it conflicts
    -- with; a conflicting row deleted meanwhile (a reset) makes the insertion run again.
    -- expires_at = window_start + 2 * window: the row is read as "previous" for a window more.
    INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
    SELECT b.bucket,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win),
           0,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win + 2 * b.win)
    FROM unnest(buckets, windows, limits) AS b(bucket, win, lim)
    WHERE b.lim IS NOT NULL
    ORDER BY b.bucket
    ON CONFLICT (bucket, window_start) DO UPDATE SET count = r.count WHERE false;

    -- 2: read the locked rows (this statement's snapshot is younger than the locks, so it
    -- sees their latest counts) with the previous windows, admit the prefix of each row's
    -- units that the estimate allows, write them, and answer:
    --   unit k is admitted when previous * (window - elapsed) / window + old + k <= limit.
    RETURN QUERY
    WITH d AS (
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
    ), counted AS (
        -- A row whose units were all denied is not written again.
        UPDATE public.rate_limits AS r
        SET count = r.count + d.added
        FROM d
        WHERE d.added > 0
          AND r.bucket = d.bucket
          AND r.window_start = to_timestamp(d.start_secs)
    )
    SELECT d.bucket,
           (d.old + d.added)::int4,
           d.added,
           d.previous,
           (d.start_secs + d.win) * 1000,
           floor(now_s * 1000)::int8
    FROM d;
END
$fn$;

COMMENT ON FUNCTION public.tollgate_increment(text[], int8[], int8[], int8[], boolean) IS
  'tollgate''s batch increment (fixed and sliding windows), one call per batch, each row '
  'counted on its own. Parameters: buckets, window lengths (s), amounts, sliding limits '
  '(NULL = fixed), whether to commit with synchronous_commit = off.';

CREATE OR REPLACE FUNCTION public.tollgate_decide(
    buckets      text[],   -- per row (distinct buckets)
    windows      int8[],   -- per row: window length in seconds
    amounts      int8[],   -- per row: the units of all its entries
    limits       int8[],   -- per row: the sliding limit, NULL for a fixed window
    e_row        int4[],   -- per entry (arrival order): its row, 1-based
    e_req        int4[],   -- per entry: its request, 1-based, ascending
    e_by         int8[],   -- per entry: its units
    e_limit      int8[],   -- per entry: its enforced limit, NULL for a shadow limit
    async_commit boolean
)
RETURNS TABLE (
    bucket        text,    -- the row's bucket (rows come back in no particular order)
    count         int4,    -- the row's count after this call
    previous      int4,    -- sliding: the previous window's count (0 without a row)
    window_end_ms int8,    -- unix milliseconds at which the current window ends
    now_ms        int8,    -- the database clock of this call, unix milliseconds
    added         int8[],  -- sliding: per entry of this row, in arrival order: units counted
    fits          int8[]   -- sliding: per entry of this row: units its estimate admitted
)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    now_s    float8 := extract(epoch FROM now());
    n_rows   int := cardinality(buckets);
    n        int := cardinality(e_row);
    -- Per row. Fixed: the count before this call (positions follow from it); sliding: the
    -- room left, floor(limit - weighted previous) - current count (may be negative).
    v_before int8[];
    v_room   int8[];
    v_old    int8[];
    v_prev   int4[];
    v_used   int8[] := array_fill(0::int8, ARRAY[n_rows]);
    -- Per entry.
    v_added  int8[] := array_fill(NULL::int8, ARRAY[n]);
    v_fits   int8[] := array_fill(NULL::int8, ARRAY[n]);
    v_first  int;
    v_last   int;
    v_allow  int8;
    v_fit    int8;
    k        int;
    r_       int;
BEGIN
    IF async_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    -- Fixed rows: the seed's upsert of every unit (SPEC 3: a fixed count may include
    -- denied requests); the count before is the count after minus the row's units.
    WITH up AS (
        INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
        SELECT b.bucket,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win),
               LEAST(b.amount, 2147483647)::int4,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win + b.win)
        FROM unnest(buckets, windows, amounts, limits) AS b(bucket, win, amount, lim)
        WHERE b.lim IS NULL
        ORDER BY b.bucket
        ON CONFLICT (bucket, window_start) DO UPDATE
            SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
        RETURNING r.bucket, r.count
    )
    SELECT array_agg(up.count::int8 - b.amount ORDER BY b.ord)
    INTO v_before
    FROM unnest(buckets, amounts) WITH ORDINALITY AS b(bucket, amount, ord)
    LEFT JOIN up ON up.bucket = b.bucket;

    -- Sliding rows: created or locked, in bucket order (as in tollgate_increment), then read.
    INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
    SELECT b.bucket,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win),
           0,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win + 2 * b.win)
    FROM unnest(buckets, windows, limits) AS b(bucket, win, lim)
    WHERE b.lim IS NOT NULL
    ORDER BY b.bucket
    ON CONFLICT (bucket, window_start) DO UPDATE SET count = r.count WHERE false;

    SELECT array_agg(
               floor(i.lim
                     - COALESCE(prev.count, 0)::float8
                       * ((i.start_secs + i.win)::float8 - now_s) / i.win)::int8
               - cur.count
               ORDER BY i.ord),
           array_agg(cur.count::int8 ORDER BY i.ord),
           array_agg(COALESCE(prev.count, 0) ORDER BY i.ord)
    INTO v_room, v_old, v_prev
    FROM (
        SELECT b.bucket, b.win, b.lim, b.ord,
               (floor(now_s)::int8 / b.win) * b.win AS start_secs
        FROM unnest(buckets, windows, limits) WITH ORDINALITY AS b(bucket, win, lim, ord)
    ) i
    LEFT JOIN public.rate_limits cur
      ON i.lim IS NOT NULL
     AND cur.bucket = i.bucket AND cur.window_start = to_timestamp(i.start_secs)
    LEFT JOIN public.rate_limits prev
      ON i.lim IS NOT NULL
     AND prev.bucket = i.bucket AND prev.window_start = to_timestamp(i.start_secs - i.win);

    -- The requests in arrival order. Each enforced limit admits a prefix of the request's
    -- units (a fixed one while the units' positions stay within it, a sliding one while its
    -- room lasts); the request is allowed for the shortest prefix; a sliding row counts the
    -- allowed units its own estimate admits (all of them when it is enforced).
    v_first := 1;
    WHILE v_first <= n LOOP
        v_last := v_first;
        WHILE v_last < n AND e_req[v_last + 1] = e_req[v_first] LOOP
            v_last := v_last + 1;
        END LOOP;
        v_allow := NULL;
        FOR k IN v_first .. v_last LOOP
            r_ := e_row[k];
            IF limits[r_] IS NULL THEN
                v_fit := LEAST(e_by[k], GREATEST(0, e_limit[k] - v_before[r_] - v_used[r_]));
                v_used[r_] := v_used[r_] + e_by[k];
            ELSE
                v_fit := LEAST(e_by[k], GREATEST(0, v_room[r_] - v_used[r_]));
                v_fits[k] := v_fit;
            END IF;
            IF e_limit[k] IS NOT NULL THEN
                v_allow := LEAST(v_allow, v_fit);
            END IF;
        END LOOP;
        FOR k IN v_first .. v_last LOOP
            r_ := e_row[k];
            IF limits[r_] IS NOT NULL THEN
                v_added[k] := LEAST(COALESCE(v_allow, e_by[k]), v_fits[k]);
                v_used[r_] := v_used[r_] + v_added[k];
            END IF;
        END LOOP;
        v_first := v_last + 1;
    END LOOP;

    UPDATE public.rate_limits AS r
    SET count = r.count + u.used
    FROM unnest(buckets, windows, limits, v_used) AS u(bucket, win, lim, used)
    WHERE u.lim IS NOT NULL
      AND u.used > 0
      AND r.bucket = u.bucket
      AND r.window_start = to_timestamp((floor(now_s)::int8 / u.win) * u.win);

    RETURN QUERY
    SELECT b.bucket,
           CASE WHEN b.lim IS NULL
                THEN LEAST(v_before[b.ord] + b.amount, 2147483647)
                ELSE v_old[b.ord] + v_used[b.ord]
           END::int4,
           COALESCE(v_prev[b.ord], 0),
           ((floor(now_s)::int8 / b.win) * b.win + b.win) * 1000,
           floor(now_s * 1000)::int8,
           e.added,
           e.fits
    FROM unnest(buckets, windows, amounts, limits) WITH ORDINALITY AS b(bucket, win, amount, lim, ord)
    LEFT JOIN (
        SELECT e_row[s] AS row_, array_agg(v_added[s] ORDER BY s) AS added,
               array_agg(v_fits[s] ORDER BY s) AS fits
        FROM generate_subscripts(e_row, 1) AS s
        GROUP BY e_row[s]
    ) e ON b.lim IS NOT NULL AND e.row_ = b.ord;
END
$fn$;

COMMENT ON FUNCTION public.tollgate_decide(text[], int8[], int8[], int8[], int4[], int4[], int8[], int8[], boolean) IS
  'tollgate''s batch increment for requests with a sliding limit next to another enforced '
  'limit: the requests are decided one by one, in arrival order, and a sliding row counts '
  'only allowed requests. Parameters: per row buckets, window lengths (s), amounts, sliding '
  'limits (NULL = fixed); per entry its row, its request, its units, its enforced limit '
  '(NULL = shadow); whether to commit with synchronous_commit = off.';
