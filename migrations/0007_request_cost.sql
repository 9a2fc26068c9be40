-- ============================================================================
-- tollgate — requests of several units (SPEC 3d, `cost`)
--
-- WHAT CHANGES
--
-- 1. public.tollgate_decide(...), a new overload with `e_check boolean[]` after
--    `e_limit`. The overload of 0005 stays, unchanged, for instances of the
--    previous release during a rolling upgrade. What is new:
--    - An entry's units (`e_by`, a request's `cost`) are admitted all together
--      or not at all: a request of cost 3 with 2 units left is denied and its
--      units are not added, so those 2 stay for a cheaper request. Sliding rows
--      admit an entry when the room left holds all its units (0005 admitted the
--      prefix that fitted: with one unit per request the same thing).
--    - Fixed rows with an entry of more than one unit are walked: like sliding
--      rows they are created or locked first (count 0, expires_at =
--      window_start + window), read, and only the units of allowed requests are
--      added; a one-unit entry on such a row is still counted whether allowed or
--      not (SPEC 3: a fixed count may include denied requests; the seed's upsert
--      does so), so a row counts the same whichever path a batch took. Walked
--      rows answer per entry what was added and what fitted.
--    - A check entry (`e_check`, a limit charged after the response) is decided
--      like any other (its units must fit) and adds nothing. A row with only
--      check entries is read, not created or locked: a check writes nothing.
--    Fixed rows whose entries are all of one unit and none a check keep the
--    seed's unconditional upsert.
--
-- 2. public.tollgate_reserve(...), a new overload with `needs int8[]` after
--    `wants`: the units this instance needs at least for the request that asks
--    (its cost minus the units it already holds). A row grants
--        LEAST(GREATEST(want, need), GREATEST(need, floor(left / (2 * instances))))
--    while `left >= need`, and nothing otherwise (SPEC 3c's "at least 1 while
--    any unit is left" with a request's units instead of one). The overload of
--    0006 stays for instances of the previous release.
--
-- 3. public.tollgate_charge(...), new: the charges made after a response
--    (`count`, `cost_header`): units added to each bucket's current window in
--    one upsert, the count saturating at the limit's `requests`.
--
-- The functions keep the guarantees of 0005 and 0006 (docs/architecture.md):
-- rows locked in bucket order, the window from now(), counts that never pass a
-- sliding limit nor a limit a share is taken of, synchronous_commit set for the
-- calling transaction only, a fixed search_path, the generic plan, SECURITY
-- INVOKER.
--
-- Target schema: public. No system schema is read or written.
-- ============================================================================

SET LOCAL search_path = public;

CREATE OR REPLACE FUNCTION public.tollgate_decide(
    buckets      text[],   -- per row (distinct buckets)
    windows      int8[],   -- per row: window length in seconds
    amounts      int8[],   -- per row: the units of all its entries
    limits       int8[],   -- per row: the sliding limit, NULL for a fixed window
    e_row        int4[],   -- per entry (arrival order): its row, 1-based
    e_req        int4[],   -- per entry: its request, 1-based, ascending
    e_by         int8[],   -- per entry: its units
    e_limit      int8[],   -- per entry: its enforced limit, NULL for a shadow limit
    e_check      boolean[],-- per entry: decide whether its units fit, add nothing
    async_commit boolean
)
RETURNS TABLE (
    bucket        text,    -- the row's bucket (rows come back in no particular order)
    count         int4,    -- the row's count after this call
    previous      int4,    -- sliding: the previous window's count (0 without a row)
    window_end_ms int8,    -- unix milliseconds at which the current window ends
    now_ms        int8,    -- the database clock of this call, unix milliseconds
    added         int8[],  -- sliding and conditional fixed rows: per entry, in arrival
                           -- order, the units counted
    fits          int8[]   -- the same rows: per entry, the units its own limit admitted
                           -- (all of them or 0)
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
    -- Per row: decided entry by entry (sliding, or fixed with an entry of several units or a
    -- check), and written (some entry is not a check).
    v_walked boolean[] := array_fill(false, ARRAY[n_rows]);
    v_writes boolean[] := array_fill(false, ARRAY[n_rows]);
    -- Per row. Plain fixed: the count before this call (positions follow from it); walked
    -- fixed: the count read; sliding: the room left, floor(limit - weighted previous) -
    -- current count (may be negative).
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
    v_allow  boolean;
    v_ok     boolean;
    k        int;
    r_       int;
BEGIN
    IF async_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    FOR k IN 1 .. n LOOP
        r_ := e_row[k];
        IF limits[r_] IS NOT NULL OR e_by[k] > 1 OR e_check[k] THEN
            v_walked[r_] := true;
        END IF;
        IF NOT e_check[k] THEN
            v_writes[r_] := true;
        END IF;
    END LOOP;

    -- Plain fixed rows: the seed's upsert of every unit (SPEC 3: a fixed count may include
    -- denied requests); the count before is the count after minus the row's units.
    WITH up AS (
        INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
        SELECT b.bucket,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win),
               LEAST(b.amount, 2147483647)::int4,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win + b.win)
        FROM unnest(buckets, windows, amounts, v_walked) AS b(bucket, win, amount, walked)
        WHERE NOT b.walked
        ORDER BY b.bucket
        ON CONFLICT (bucket, window_start) DO UPDATE
            SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
        RETURNING r.bucket, r.count
    )
    SELECT array_agg(up.count::int8 - b.amount ORDER BY b.ord)
    INTO v_before
    FROM unnest(buckets, amounts) WITH ORDINALITY AS b(bucket, amount, ord)
    LEFT JOIN up ON up.bucket = b.bucket;

    -- Walked rows that are written: created or locked, in bucket order (as in
    -- tollgate_increment), then read. expires_at: a sliding row is read as "previous" for a
    -- window more. A row of checks only is read as it is (no row: count 0).
    INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
    SELECT b.bucket,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win),
           0,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win
                        + CASE WHEN b.lim IS NULL THEN 1 ELSE 2 END * b.win)
    FROM unnest(buckets, windows, limits, v_walked, v_writes)
         AS b(bucket, win, lim, walked, writes)
    WHERE b.walked AND b.writes
    ORDER BY b.bucket
    ON CONFLICT (bucket, window_start) DO UPDATE SET count = r.count WHERE false;

    SELECT array_agg(
               CASE WHEN i.lim IS NULL THEN NULL
                    ELSE floor(i.lim
                               - COALESCE(prev.count, 0)::float8
                                 * ((i.start_secs + i.win)::float8 - now_s) / i.win)::int8
                         - COALESCE(cur.count, 0)
               END
               ORDER BY i.ord),
           array_agg(COALESCE(cur.count, 0)::int8 ORDER BY i.ord),
           array_agg(COALESCE(prev.count, 0) ORDER BY i.ord)
    INTO v_room, v_old, v_prev
    FROM (
        SELECT b.bucket, b.win, b.lim, b.walked, b.ord,
               (floor(now_s)::int8 / b.win) * b.win AS start_secs
        FROM unnest(buckets, windows, limits, v_walked)
             WITH ORDINALITY AS b(bucket, win, lim, walked, ord)
    ) i
    LEFT JOIN public.rate_limits cur
      ON i.walked
     AND cur.bucket = i.bucket AND cur.window_start = to_timestamp(i.start_secs)
    LEFT JOIN public.rate_limits prev
      ON i.lim IS NOT NULL
     AND prev.bucket = i.bucket AND prev.window_start = to_timestamp(i.start_secs - i.win);

    -- The requests in arrival order. Each enforced limit admits all of the request's units
    -- or none (a plain fixed one while their positions stay within it, a walked fixed one
    -- while the count leaves room for them, a sliding one while its room lasts); the request
    -- is allowed when every enforced limit admits it. A walked row counts an allowed
    -- request's units (a sliding row: when its own estimate admits them) and, on a fixed
    -- row, a one-unit entry in any case; never a check's.
    v_first := 1;
    WHILE v_first <= n LOOP
        v_last := v_first;
        WHILE v_last < n AND e_req[v_last + 1] = e_req[v_first] LOOP
            v_last := v_last + 1;
        END LOOP;
        v_allow := true;
        FOR k IN v_first .. v_last LOOP
            r_ := e_row[k];
            IF NOT v_walked[r_] THEN
                v_ok := e_limit[k] IS NULL
                        OR v_before[r_] + v_used[r_] + e_by[k] <= e_limit[k];
                v_used[r_] := v_used[r_] + e_by[k];
            ELSIF limits[r_] IS NULL THEN
                v_ok := e_limit[k] IS NULL
                        OR v_old[r_] + v_used[r_] + e_by[k] <= e_limit[k];
                v_fits[k] := CASE WHEN v_ok THEN e_by[k] ELSE 0 END;
            ELSE
                v_fits[k] := CASE WHEN v_room[r_] - v_used[r_] >= e_by[k] THEN e_by[k] ELSE 0 END;
                v_ok := e_limit[k] IS NULL OR v_fits[k] > 0;
            END IF;
            v_allow := v_allow AND v_ok;
        END LOOP;
        FOR k IN v_first .. v_last LOOP
            r_ := e_row[k];
            IF v_walked[r_] THEN
                v_added[k] := CASE
                    WHEN e_check[k] THEN 0
                    WHEN limits[r_] IS NULL AND (v_allow OR e_by[k] = 1) THEN e_by[k]
                    WHEN limits[r_] IS NOT NULL AND v_allow THEN v_fits[k]
                    ELSE 0
                END;
                v_used[r_] := v_used[r_] + v_added[k];
            END IF;
        END LOOP;
        v_first := v_last + 1;
    END LOOP;

    UPDATE public.rate_limits AS r
    SET count = LEAST(r.count::int8 + u.used, 2147483647)::int4
    FROM unnest(buckets, windows, v_walked, v_used) AS u(bucket, win, walked, used)
    WHERE u.walked
      AND u.used > 0
      AND r.bucket = u.bucket
      AND r.window_start = to_timestamp((floor(now_s)::int8 / u.win) * u.win);

    RETURN QUERY
    SELECT b.bucket,
           CASE WHEN NOT b.walked
                THEN LEAST(v_before[b.ord] + b.amount, 2147483647)
                ELSE LEAST(v_old[b.ord] + v_used[b.ord], 2147483647)
           END::int4,
           COALESCE(v_prev[b.ord], 0),
           ((floor(now_s)::int8 / b.win) * b.win + b.win) * 1000,
           floor(now_s * 1000)::int8,
           e.added,
           e.fits
    FROM unnest(buckets, windows, amounts, v_walked)
         WITH ORDINALITY AS b(bucket, win, amount, walked, ord)
    LEFT JOIN (
        SELECT e_row[s] AS row_, array_agg(v_added[s] ORDER BY s) AS added,
               array_agg(v_fits[s] ORDER BY s) AS fits
        FROM generate_subscripts(e_row, 1) AS s
        GROUP BY e_row[s]
    ) e ON b.walked AND e.row_ = b.ord;
END
$fn$;

COMMENT ON FUNCTION public.tollgate_decide(text[], int8[], int8[], int8[], int4[], int4[], int8[], int8[], boolean[], boolean) IS
  'tollgate''s batch increment for requests decided one by one, in arrival order: a sliding '
  'limit next to another enforced limit, a request of several units (its units fit all '
  'together or it is denied and they are not added), or a check of a limit charged after the '
  'response (adds nothing). Parameters: per row buckets, window lengths (s), amounts, sliding '
  'limits (NULL = fixed); per entry its row, its request, its units, its enforced limit (NULL '
  '= shadow), whether it is a check; whether to commit with synchronous_commit = off.';

CREATE OR REPLACE FUNCTION public.tollgate_reserve(
    buckets      text[],   -- per row (distinct buckets)
    windows      int8[],   -- window length in seconds
    limits       int8[],   -- the limit's requests
    sliding      boolean[],-- algorithm = "sliding"
    wants        int8[],   -- the units this instance would like
    needs        int8[],   -- the units it needs at least (else nothing is granted)
    instances    int4,     -- live instances (at least 1)
    me           text,     -- this instance's id
    async_commit boolean
)
RETURNS TABLE (
    bucket        text,
    granted       int8,    -- units granted now (0: fewer than `need` left)
    count         int4,    -- the row's count after the grant
    previous      int4,    -- sliding: the previous window's count (0 without a row)
    window_end_ms int8,    -- unix milliseconds at which the current window ends
    now_ms        int8     -- the database clock of this call, unix milliseconds
)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    now_s  float8 := extract(epoch FROM now());
    shares int8 := 2 * GREATEST(instances, 1);
BEGIN
    IF async_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    -- Every current row exists and is locked by this transaction, in bucket order.
    INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
    SELECT b.bucket,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win),
           0,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win
                        + CASE WHEN b.sl THEN 2 ELSE 1 END * b.win)
    FROM unnest(buckets, windows, sliding) AS b(bucket, win, sl)
    ORDER BY b.bucket
    ON CONFLICT (bucket, window_start) DO UPDATE SET count = r.count WHERE false;

    RETURN QUERY
    WITH d AS (
        SELECT i.bucket,
               i.start_secs,
               i.win,
               i.want,
               i.need,
               cur.count AS old,
               COALESCE(prev.count, 0) AS previous,
               CASE WHEN i.sl
                    THEN floor(i.lim - COALESCE(prev.count, 0)::float8
                                       * ((i.start_secs + i.win)::float8 - now_s) / i.win)::int8
                    ELSE i.lim
               END - cur.count AS left_
        FROM (
            SELECT b.bucket, b.win, b.lim, b.sl,
                   GREATEST(b.want, 1) AS want, GREATEST(b.need, 1) AS need,
                   (floor(now_s)::int8 / b.win) * b.win AS start_secs
            FROM unnest(buckets, windows, limits, sliding, wants, needs)
                 AS b(bucket, win, lim, sl, want, need)
        ) i
        JOIN public.rate_limits cur
          ON cur.bucket = i.bucket AND cur.window_start = to_timestamp(i.start_secs)
        LEFT JOIN public.rate_limits prev
          ON i.sl AND prev.bucket = i.bucket AND prev.window_start = to_timestamp(i.start_secs - i.win)
    ), g AS (
        SELECT d.*,
               CASE WHEN d.left_ < d.need THEN 0
                    ELSE LEAST(GREATEST(d.want, d.need), GREATEST(d.need, d.left_ / shares))
               END AS granted
        FROM d
    ), counted AS (
        UPDATE public.rate_limits AS r
        SET count = r.count + g.granted
        FROM g
        WHERE g.granted > 0
          AND r.bucket = g.bucket
          AND r.window_start = to_timestamp(g.start_secs)
    ), held AS (
        INSERT INTO public.tollgate_shares AS s (bucket, window_start, instance, units)
        SELECT g.bucket, to_timestamp(g.start_secs), me, g.granted
        FROM g
        WHERE g.granted > 0
        ORDER BY g.bucket
        ON CONFLICT (bucket, window_start, instance) DO UPDATE SET units = s.units + EXCLUDED.units
    ), asked AS (
        -- A row that cannot grant what is needed while another instance may hold units of
        -- it: ask for them back.
        SELECT pg_notify('tollgate_shares', 'reclaim ' || g.bucket)
        FROM g
        WHERE g.granted = 0
          AND EXISTS (SELECT 1 FROM public.tollgate_shares o
                      WHERE o.bucket = g.bucket
                        AND o.window_start = to_timestamp(g.start_secs)
                        AND o.instance <> me)
    )
    SELECT g.bucket,
           g.granted,
           (g.old + g.granted)::int4,
           g.previous,
           (g.start_secs + g.win) * 1000,
           floor(now_s * 1000)::int8
    FROM g
    -- The notifications are sent only if the CTE is read.
    WHERE (SELECT count(*) FROM asked) >= 0;
END
$fn$;

COMMENT ON FUNCTION public.tollgate_reserve(text[], int8[], int8[], boolean[], int8[], int8[], int4, text, boolean) IS
  'tollgate''s reserved shares (SPEC 3c, 3d): grants each row a share of what is left, at most '
  'left / (2 * instances) and at least the units needed while that many are left, counted in '
  'the row at once. Parameters: per row buckets, window lengths (s), limits, sliding, wanted '
  'units, needed units; live instances, this instance''s id, whether to commit with '
  'synchronous_commit = off.';

CREATE OR REPLACE FUNCTION public.tollgate_charge(
    buckets      text[],   -- per row (distinct buckets)
    windows      int8[],   -- window length in seconds
    sliding      boolean[],-- algorithm = "sliding" (the row lives a window more)
    units        int8[],   -- the units charged
    limits       int8[],   -- the limit's requests: the count saturates there
    async_commit boolean
)
RETURNS TABLE (
    bucket text,
    count  int4            -- the row's count after the charge
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

    -- The seed's upsert, in bucket order (the lock order of every statement here), the count
    -- saturating at the limit: a charge never takes a row past `requests`, and never lowers
    -- one that is already past it (one-unit requests counted while denied, SPEC 3).
    RETURN QUERY
    INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
    SELECT b.bucket,
           to_timestamp(b.start_secs),
           LEAST(b.amount, b.lim, 2147483647)::int4,
           to_timestamp(b.start_secs + CASE WHEN b.sl THEN 2 ELSE 1 END * b.win)
    FROM (
        SELECT c.bucket, c.win, c.sl, c.amount, c.lim,
               (floor(now_s)::int8 / c.win) * c.win AS start_secs
        FROM unnest(buckets, windows, sliding, units, limits) AS c(bucket, win, sl, amount, lim)
    ) b
    ORDER BY b.bucket
    ON CONFLICT (bucket, window_start) DO UPDATE
        SET count = GREATEST(
                r.count,
                LEAST(r.count::int8 + EXCLUDED.count,
                      (SELECT l.lim FROM unnest(buckets, limits) AS l(bucket, lim)
                       WHERE l.bucket = r.bucket),
                      2147483647))::int4
    RETURNING r.bucket, r.count;
END
$fn$;

COMMENT ON FUNCTION public.tollgate_charge(text[], int8[], boolean[], int8[], int8[], boolean) IS
  'tollgate''s charges after the response (SPEC 3d): units added to the current window of '
  'each bucket, the count saturating at the limit. Parameters: per row buckets, window '
  'lengths (s), sliding, units, limits; whether to commit with synchronous_commit = off.';
