-- ============================================================================
-- tollgate — a denied request adds nothing, on fixed windows too (SPEC 3d)
--
-- WHY
--
-- SPEC 3d: "A denied request's units are not added, on either algorithm", and a
-- request's limits are decided together: a request that one limit denies takes
-- nothing from the others. Until now a fixed window counted a one-unit request
-- whether it was allowed or not (the seed's unconditional upsert), and a
-- request denied by one limit was still counted in its other fixed rows. That
-- was harmless for the limit that denied (its row was full anyway) but not for
-- the others, nor for a limit raised within the window (a reload, an override:
-- every denial counted before the change would eat into the new headroom).
--
-- WHAT CHANGES
--
-- 1. public.tollgate_increment(...), a new overload with `caps int8[]` after
--    `limits`: per fixed row the enforced limit of its requests (NULL: no cap,
--    a shadow limit, whose requests are never denied by it). A fixed row with a
--    cap counts only the units that fit under it, in arrival order, as a sliding
--    row does with its estimate: unit k is counted when old + k <= cap. First
--    ONE upsert takes every fixed row in bucket order, as before, counting a
--    capped row's units only when LEAST(amount, cap) of them fit (a row whose
--    ON CONFLICT ... WHERE is false is locked and left as it is); a capped row
--    that it did not count is then walked like a sliding row (already locked
--    by this transaction, read, and its admitted prefix written). So a row far
--    from its limit still costs one upsert, and only a row at its limit costs
--    the read and second write. Rows are locked fixed rows first, then sliding
--    ones, each in bucket order, as in 0005: no new lock order. The overload of
--    0005 stays, unchanged, for instances of the previous release during a
--    rolling upgrade.
--
-- 2. public.tollgate_decide(...) of 0007 is replaced (same parameters, same
--    answer): a fixed row counts an entry only when its request is allowed
--    (before, a one-unit entry was counted in any case), and every row answers
--    per entry. It is now what every request with several limits takes, so its
--    common case must stay one upsert: every written fixed row goes through ONE
--    upsert in bucket order that counts the row whole when all its units fit
--    under the least enforced limit of its entries (then each entry fits at its
--    position) and locks the others; only when some row was not counted (at its
--    limit, sliding, or with a check) are the rest locked and read and the
--    requests walked, and a row counted whole gives back, before the commit,
--    the units of requests that another row denied. A previous-release instance
--    already reads per-entry answers (0007 walked fixed rows with several-unit
--    entries), so it keeps working and gets the stricter counting.
--
-- Both keep the guarantees of 0005 and 0007 (docs/architecture.md): the window
-- from now(), counts that never pass a limit that denies, synchronous_commit
-- set for the calling transaction only, a fixed search_path, the generic plan,
-- SECURITY INVOKER.
--
-- Target schema: public. No system schema is read or written.
-- ============================================================================

SET LOCAL search_path = public;

CREATE OR REPLACE FUNCTION public.tollgate_increment(
    buckets      text[],
    windows      int8[],
    amounts      int8[],
    limits       int8[],   -- per row: the sliding limit, NULL for a fixed window
    caps         int8[],   -- per row: a fixed window's enforced limit, NULL for none
    async_commit boolean
)
RETURNS TABLE (
    bucket        text,    -- the row's bucket (rows come back in no particular order)
    count         int4,    -- the row's count after this call
    added         int8,    -- units this call counted; NULL = all of them (an uncapped row)
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
    now_s   float8 := extract(epoch FROM now());
    -- The fixed rows the upsert counted, and their counts after it.
    v_done  text[];
    v_count int4[];
BEGIN
    IF async_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    -- 1: every fixed row, in bucket order. A capped row is inserted with LEAST(amount, cap)
    -- units and updated only when that many fit under its cap: when amount <= cap, all of
    -- its units or none; when amount > cap, cap units of an empty row (its admitted prefix).
    -- Either way a row counted here counted LEAST(amount, cap) units.
    WITH up AS (
        INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
        SELECT b.bucket,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win),
               LEAST(b.amount, COALESCE(b.cap, 2147483647), 2147483647)::int4,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win + b.win)
        FROM unnest(buckets, windows, amounts, limits, caps) AS b(bucket, win, amount, lim, cap)
        WHERE b.lim IS NULL
        ORDER BY b.bucket
        ON CONFLICT (bucket, window_start) DO UPDATE
            SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
            WHERE COALESCE(r.count::int8 + EXCLUDED.count
                           <= (SELECT c.cap FROM unnest(buckets, caps) AS c(bucket, cap)
                               WHERE c.bucket = r.bucket),
                           true)
        RETURNING r.bucket, r.count
    )
    SELECT array_agg(up.bucket), array_agg(up.count)
    INTO v_done, v_count
    FROM up;

    RETURN QUERY
    SELECT d.bucket,
           d.count,
           CASE WHEN b.cap IS NULL THEN NULL ELSE LEAST(b.amount, b.cap) END,
           0,
           ((floor(now_s)::int8 / b.win) * b.win + b.win) * 1000,
           floor(now_s * 1000)::int8
    FROM unnest(v_done, v_count) AS d(bucket, count)
    JOIN unnest(buckets, windows, amounts, caps) AS b(bucket, win, amount, cap)
      ON b.bucket = d.bucket;

    -- 2: the rows decided unit by unit: sliding rows, and capped fixed rows the upsert left
    -- (locked by it already). Each exists and is locked by this transaction when this
    -- returns (DO UPDATE ... WHERE false locks the row it conflicts with; a row deleted
    -- meanwhile by a reset makes the insertion run again). expires_at: a sliding row is
    -- read as "previous" for a window more.
    INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
    SELECT b.bucket,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win),
           0,
           to_timestamp((floor(now_s)::int8 / b.win) * b.win
                        + CASE WHEN b.lim IS NULL THEN 1 ELSE 2 END * b.win)
    FROM unnest(buckets, windows, limits, caps) AS b(bucket, win, lim, cap)
    WHERE b.lim IS NOT NULL
       OR (b.cap IS NOT NULL AND NOT b.bucket = ANY (COALESCE(v_done, '{}')))
    ORDER BY b.lim IS NOT NULL, b.bucket
    ON CONFLICT (bucket, window_start) DO UPDATE SET count = r.count WHERE false;

    -- 3: read them (this statement's snapshot is younger than the locks, so it sees their
    -- latest counts), admit the prefix of each row's units that its limit allows, write
    -- them and answer:
    --   unit k is admitted when weighted previous + old + k <= limit,
    -- the weighted previous being previous * (window - elapsed) / window for a sliding row
    -- (SPEC 3a) and 0 for a fixed one.
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
            SELECT b.bucket, b.win, b.amount, COALESCE(b.lim, b.cap) AS lim,
                   b.lim IS NOT NULL AS sl,
                   (floor(now_s)::int8 / b.win) * b.win AS start_secs
            FROM unnest(buckets, windows, amounts, limits, caps)
                 AS b(bucket, win, amount, lim, cap)
            WHERE b.lim IS NOT NULL
               OR (b.cap IS NOT NULL AND NOT b.bucket = ANY (COALESCE(v_done, '{}')))
        ) i
        JOIN public.rate_limits cur
          ON cur.bucket = i.bucket AND cur.window_start = to_timestamp(i.start_secs)
        LEFT JOIN public.rate_limits prev
          ON i.sl AND prev.bucket = i.bucket AND prev.window_start = to_timestamp(i.start_secs - i.win)
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

COMMENT ON FUNCTION public.tollgate_increment(text[], int8[], int8[], int8[], int8[], boolean) IS
  'tollgate''s batch increment (fixed and sliding windows), one call per batch, each row '
  'counted on its own and never past the limit that denies: a denied unit is not added. '
  'Parameters: buckets, window lengths (s), amounts, sliding limits (NULL = fixed), fixed '
  'windows'' enforced limits (NULL = none), whether to commit with synchronous_commit = off.';

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
    added         int8[],  -- per entry of this row, in arrival order: the units counted
    fits          int8[]   -- per entry: the units its own limit admitted (all of them or 0)
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
    -- Per row: written (some entry is not a check); has a check entry; the least enforced
    -- limit of its entries (NULL: none).
    v_writes boolean[] := array_fill(false, ARRAY[n_rows]);
    v_checks boolean[] := array_fill(false, ARRAY[n_rows]);
    v_cap    int8[] := array_fill(NULL::int8, ARRAY[n_rows]);
    -- Per row. v_before: a row the upsert counted whole, its count before it (NULL: not
    -- counted, walked). v_old: a walked row's count read; v_room: a sliding row's room,
    -- floor(limit - weighted previous) - current count (may be negative).
    v_before int8[];
    v_room   int8[];
    v_old    int8[];
    v_prev   int4[];
    v_used   int8[] := array_fill(0::int8, ARRAY[n_rows]);
    v_delta  int8[];
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
        IF e_check[k] THEN
            v_checks[r_] := true;
        ELSE
            v_writes[r_] := true;
        END IF;
        IF e_limit[k] IS NOT NULL THEN
            v_cap[r_] := LEAST(COALESCE(v_cap[r_], e_limit[k]), e_limit[k]);
        END IF;
    END LOOP;

    -- 1: every written fixed row, in bucket order, in one upsert. A row without checks whose
    -- units all fit under its least enforced limit is counted whole: each of its entries then
    -- fits at its position, so what its requests' other rows decide can only take units back
    -- (step 4). Every other written fixed row is locked (ON CONFLICT ... WHERE false), or
    -- created at 0, and walked. So a batch far from its limits costs this one statement.
    WITH up AS (
        INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
        SELECT b.bucket,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win),
               b.take,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win + b.win)
        FROM (
            SELECT c.bucket, c.win,
                   CASE WHEN c.checks OR c.amount > COALESCE(c.cap, 2147483647) THEN 0
                        ELSE c.amount
                   END::int4 AS take
            FROM unnest(buckets, windows, amounts, limits, v_writes, v_checks, v_cap)
                 AS c(bucket, win, amount, lim, writes, checks, cap)
            WHERE c.lim IS NULL AND c.writes
        ) b
        ORDER BY b.bucket
        ON CONFLICT (bucket, window_start) DO UPDATE
            SET count = LEAST(r.count::int8 + EXCLUDED.count, 2147483647)::int4
            WHERE EXCLUDED.count > 0
              AND COALESCE(r.count::int8 + EXCLUDED.count
                           <= (SELECT c.cap FROM unnest(buckets, v_cap) AS c(bucket, cap)
                               WHERE c.bucket = r.bucket),
                           true)
        RETURNING r.bucket, r.count
    )
    SELECT array_agg(CASE WHEN b.amount > 0 AND NOT b.checks
                               AND b.amount <= COALESCE(b.cap, 2147483647)
                          THEN up.count::int8 - b.amount
                     END
                     ORDER BY b.ord)
    INTO v_before
    FROM unnest(buckets, amounts, v_checks, v_cap) WITH ORDINALITY AS b(bucket, amount, checks, cap, ord)
    LEFT JOIN up ON up.bucket = b.bucket;

    -- 2: the walked rows: sliding rows and the fixed rows the upsert did not count. The
    -- written ones are created or locked (fixed ones are already, by step 1), sliding rows in
    -- bucket order after the fixed ones (the lock order of tollgate_increment); then every
    -- walked row is read (a row of checks only as it is; no row: count 0), with a sliding
    -- row's previous window.
    IF array_position(v_before, NULL) IS NOT NULL THEN
        INSERT INTO public.rate_limits AS r (bucket, window_start, count, expires_at)
        SELECT b.bucket,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win),
               0,
               to_timestamp((floor(now_s)::int8 / b.win) * b.win + 2 * b.win)
        FROM unnest(buckets, windows, limits, v_writes) AS b(bucket, win, lim, writes)
        WHERE b.lim IS NOT NULL AND b.writes
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
            SELECT b.bucket, b.win, b.lim, b.ord, b.before IS NULL AS walked,
                   (floor(now_s)::int8 / b.win) * b.win AS start_secs
            FROM unnest(buckets, windows, limits, v_before)
                 WITH ORDINALITY AS b(bucket, win, lim, before, ord)
        ) i
        LEFT JOIN public.rate_limits cur
          ON i.walked
         AND cur.bucket = i.bucket AND cur.window_start = to_timestamp(i.start_secs)
        LEFT JOIN public.rate_limits prev
          ON i.walked AND i.lim IS NOT NULL
         AND prev.bucket = i.bucket AND prev.window_start = to_timestamp(i.start_secs - i.win);
    END IF;

    -- 3: the requests in arrival order. Each enforced limit admits all of the request's units
    -- or none (a fixed one while the count, with what earlier requests of the batch added,
    -- leaves room for them; a sliding one while its room lasts); the request is allowed when
    -- every enforced limit admits it. Only an allowed request is counted (a sliding row: the
    -- units its own estimate admits), never a check.
    v_first := 1;
    WHILE v_first <= n LOOP
        v_last := v_first;
        WHILE v_last < n AND e_req[v_last + 1] = e_req[v_first] LOOP
            v_last := v_last + 1;
        END LOOP;
        v_allow := true;
        FOR k IN v_first .. v_last LOOP
            r_ := e_row[k];
            IF limits[r_] IS NULL THEN
                v_ok := e_limit[k] IS NULL
                        OR COALESCE(v_before[r_], v_old[r_]) + v_used[r_] + e_by[k] <= e_limit[k];
                v_fits[k] := CASE WHEN v_ok THEN e_by[k] ELSE 0 END;
            ELSE
                v_fits[k] := CASE WHEN v_room[r_] - v_used[r_] >= e_by[k] THEN e_by[k] ELSE 0 END;
                v_ok := e_limit[k] IS NULL OR v_fits[k] > 0;
            END IF;
            v_allow := v_allow AND v_ok;
        END LOOP;
        FOR k IN v_first .. v_last LOOP
            r_ := e_row[k];
            v_added[k] := CASE
                WHEN e_check[k] OR NOT v_allow THEN 0
                WHEN limits[r_] IS NULL THEN e_by[k]
                ELSE v_fits[k]
            END;
            v_used[r_] := v_used[r_] + v_added[k];
        END LOOP;
        v_first := v_last + 1;
    END LOOP;

    -- 4: what each row must move by: a walked row by the units counted; a row the upsert
    -- counted whole by those it counted for requests that another row then denied (taken
    -- back; the row is locked by this transaction since step 1, so nobody saw them).
    SELECT array_agg(CASE WHEN b.before IS NULL THEN b.used ELSE b.used - b.amount END
                     ORDER BY b.ord)
    INTO v_delta
    FROM unnest(v_before, v_used, amounts) WITH ORDINALITY AS b(before, used, amount, ord);
    IF EXISTS (SELECT 1 FROM unnest(v_delta) AS d(delta) WHERE d.delta <> 0) THEN
        UPDATE public.rate_limits AS r
        SET count = LEAST(r.count::int8 + u.delta, 2147483647)::int4
        FROM unnest(buckets, windows, v_delta) AS u(bucket, win, delta)
        WHERE u.delta <> 0
          AND r.bucket = u.bucket
          AND r.window_start = to_timestamp((floor(now_s)::int8 / u.win) * u.win);
    END IF;

    RETURN QUERY
    SELECT b.bucket,
           LEAST(COALESCE(v_before[b.ord], v_old[b.ord]) + v_used[b.ord], 2147483647)::int4,
           COALESCE(v_prev[b.ord], 0),
           ((floor(now_s)::int8 / b.win) * b.win + b.win) * 1000,
           floor(now_s * 1000)::int8,
           e.added,
           e.fits
    FROM unnest(buckets, windows) WITH ORDINALITY AS b(bucket, win, ord)
    JOIN (
        SELECT e_row[s] AS row_, array_agg(v_added[s] ORDER BY s) AS added,
               array_agg(v_fits[s] ORDER BY s) AS fits
        FROM generate_subscripts(e_row, 1) AS s
        GROUP BY e_row[s]
    ) e ON e.row_ = b.ord;
END
$fn$;

COMMENT ON FUNCTION public.tollgate_decide(text[], int8[], int8[], int8[], int4[], int4[], int8[], int8[], boolean[], boolean) IS
  'tollgate''s batch increment for requests decided one by one, in arrival order: a request '
  'with several limits (one that denies takes nothing from the others), a request of several '
  'units (they fit all together or it is denied), or a check of a limit charged after the '
  'response (adds nothing). Only an allowed request is counted. Parameters: per row buckets, '
  'window lengths (s), amounts, sliding limits (NULL = fixed); per entry its row, its request, '
  'its units, its enforced limit (NULL = shadow), whether it is a check; whether to commit with '
  'synchronous_commit = off.';
