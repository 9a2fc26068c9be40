-- ============================================================================
-- tollgate — reserved shares (SPEC 3c; docs/architecture.md, "Reserved shares")
--
-- With `reserve = true` an instance takes a share of a bucket's remaining budget
-- in one statement and admits from it in memory. The share is counted in the
-- row (`count = count + granted`) at once, so the row never admits more than
-- `requests` however many instances hold shares, one that dies included.
--
-- 1. public.tollgate_shares, new: what each instance holds of each row, as
--    granted and not yet given back. A give-back subtracts at most what this
--    table says the instance holds, in the same transaction that deletes the
--    entry. So:
--      - the row's CHECK (count >= 0) holds by construction: every unit given
--        back was added by a grant to this very row;
--      - a give-back that arrives after `tollgate reset` deleted the row (and,
--        by the foreign key's ON DELETE CASCADE, its entries here) subtracts
--        nothing: it cannot take back counts that another instance made in the
--        fresh row, which would admit past the limit;
--      - the sweep's delete of an expired row deletes its entries with it.
--    An entry whose units were all used stays until its row goes; the grant
--    function reads the entries only to know whether another instance may
--    hold units of an exhausted row (then it asks them, 3 below).
--
-- 2. public.tollgate_reserve(...): grants shares of several rows in one call.
--    Per row, in bucket order (so concurrent calls lock rows in one order and
--    cannot deadlock), it creates or locks the current window's row, computes
--    what is left (`requests - count`; for a sliding limit
--    `floor(requests - previous * (window - elapsed) / window) - count`, the
--    estimate of 3a), and grants
--        LEAST(want, GREATEST(1, floor(left / (2 * instances))))   while left > 0
--        0                                                          otherwise
--    adding the grant to the row's count and to this instance's entry. The
--    count never passes `requests` (the grant is at most what is left), so a
--    denied request is never counted, on either algorithm.
--
-- 3. When a row is exhausted (nothing granted) while another instance's entry
--    for it exists, the call sends `NOTIFY tollgate_shares, 'reclaim <bucket>'`:
--    instances that hear it give that bucket's unused units back.
--
-- 4. public.tollgate_give_back(...): gives unused units back, several rows in
--    one call. Locks the rows in bucket order first (the same order as the
--    grant, so a grant and a give-back of one instance cannot deadlock), then
--    deletes this instance's entries and subtracts LEAST(unused, held). A row
--    that got units back sends `NOTIFY tollgate_shares, 'returned <bucket>'`,
--    so that every instance forgets a denial it cached from the exhausted row.
--
-- Both functions take the window from now() and the instance's id as an
-- argument (the id of its row in tollgate_instances: random, nothing about the
-- host). Like 0005's, they set synchronous_commit for the calling transaction
-- only, a fixed search_path, and the generic plan.
--
-- A runtime role (store.migrate = false) needs SELECT, INSERT, UPDATE and
-- DELETE on public.tollgate_shares, and EXECUTE on both functions.
--
-- Target schema: public. No system schema is read or written.
-- ============================================================================

SET LOCAL search_path = public;

CREATE TABLE IF NOT EXISTS public.tollgate_shares (
  bucket       text        NOT NULL,
  window_start timestamptz NOT NULL,
  instance     text        NOT NULL,
  units        int8        NOT NULL,
  PRIMARY KEY (bucket, window_start, instance),
  CONSTRAINT tollgate_shares_units_non_negative CHECK (units >= 0),
  CONSTRAINT tollgate_shares_row FOREIGN KEY (bucket, window_start)
    REFERENCES public.rate_limits (bucket, window_start) ON DELETE CASCADE
);

CREATE OR REPLACE FUNCTION public.tollgate_reserve(
    buckets      text[],   -- per row (distinct buckets)
    windows      int8[],   -- window length in seconds
    limits       int8[],   -- the limit's requests
    sliding      boolean[],-- algorithm = "sliding"
    wants        int8[],   -- the units this instance would like
    instances    int4,     -- live instances (at least 1)
    me           text,     -- this instance's id
    async_commit boolean
)
RETURNS TABLE (
    bucket        text,
    granted       int8,    -- units granted now (0: exhausted)
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

    -- Every current row exists and is locked by this transaction, in bucket order (as in
    -- 0005's functions: a row deleted meanwhile by a reset makes the insertion run again).
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
               cur.count AS old,
               COALESCE(prev.count, 0) AS previous,
               CASE WHEN i.sl
                    THEN floor(i.lim - COALESCE(prev.count, 0)::float8
                                       * ((i.start_secs + i.win)::float8 - now_s) / i.win)::int8
                    ELSE i.lim
               END - cur.count AS left_
        FROM (
            SELECT b.bucket, b.win, b.lim, b.sl, (floor(now_s)::int8 / b.win) * b.win AS start_secs
            FROM unnest(buckets, windows, limits, sliding) AS b(bucket, win, lim, sl)
        ) i
        JOIN public.rate_limits cur
          ON cur.bucket = i.bucket AND cur.window_start = to_timestamp(i.start_secs)
        LEFT JOIN public.rate_limits prev
          ON i.sl AND prev.bucket = i.bucket AND prev.window_start = to_timestamp(i.start_secs - i.win)
    ), g AS (
        SELECT d.*,
               CASE WHEN d.left_ <= 0 THEN 0
                    ELSE LEAST(GREATEST(w.want, 1), GREATEST(1, d.left_ / shares))
               END AS granted
        FROM d
        JOIN unnest(buckets, wants) AS w(bucket, want) ON w.bucket = d.bucket
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
        -- An exhausted row another instance may hold units of: ask for them back.
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

COMMENT ON FUNCTION public.tollgate_reserve(text[], int8[], int8[], boolean[], int8[], int4, text, boolean) IS
  'tollgate''s reserved shares (SPEC 3c): grants each row a share of what is left, at most '
  'left / (2 * instances) and at least 1 while anything is left, counted in the row at once. '
  'Parameters: per row buckets, window lengths (s), limits, sliding, wanted units; live '
  'instances, this instance''s id, whether to commit with synchronous_commit = off.';

CREATE OR REPLACE FUNCTION public.tollgate_give_back(
    buckets      text[],   -- per row (distinct buckets)
    starts       int8[],   -- the share's window start, unix seconds
    unused       int8[],   -- units this instance did not use
    me           text,     -- this instance's id
    async_commit boolean
)
RETURNS TABLE (
    bucket   text,
    returned int8          -- units subtracted from the row (0: the row or the entry was gone)
)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    IF async_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    -- The rows first, in bucket order: the grant locks them in that order too.
    PERFORM 1
    FROM public.rate_limits r
    JOIN unnest(buckets, starts) AS b(bucket, start_secs)
      ON r.bucket = b.bucket AND r.window_start = to_timestamp(b.start_secs)
    ORDER BY r.bucket
    FOR NO KEY UPDATE OF r;

    RETURN QUERY
    WITH held AS (
        DELETE FROM public.tollgate_shares AS s
        USING unnest(buckets, starts, unused) AS b(bucket, start_secs, units)
        WHERE s.bucket = b.bucket
          AND s.window_start = to_timestamp(b.start_secs)
          AND s.instance = me
        RETURNING s.bucket, s.window_start, LEAST(s.units, GREATEST(b.units, 0)) AS back
    ), counted AS (
        UPDATE public.rate_limits AS r
        SET count = r.count - h.back
        FROM held h
        WHERE h.back > 0
          AND r.bucket = h.bucket
          AND r.window_start = h.window_start
        RETURNING r.bucket, pg_notify('tollgate_shares', 'returned ' || r.bucket)
    )
    -- An entry implies its row (the foreign key), which is locked above: `counted` updates
    -- every row that `held` gives units back to.
    SELECT b.bucket, COALESCE(h.back, 0)::int8
    FROM unnest(buckets) AS b(bucket)
    LEFT JOIN held h ON h.bucket = b.bucket
    WHERE (SELECT count(*) FROM counted) >= 0;
END
$fn$;

COMMENT ON FUNCTION public.tollgate_give_back(text[], int8[], int8[], text, boolean) IS
  'tollgate''s give-back of reserved units (SPEC 3c): subtracts at most what this instance '
  'holds of each row by public.tollgate_shares, and deletes its entries. Parameters: buckets, '
  'window starts (unix s), unused units, this instance''s id, whether to commit with '
  'synchronous_commit = off.';
