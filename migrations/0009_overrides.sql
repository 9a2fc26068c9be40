-- ============================================================================
-- tollgate — per-subject overrides (SPEC 3e)
--
-- WHY
--
-- An operator gives one customer, one address or one token another `requests`
-- than the configuration file's, without editing the file or reloading:
-- `tollgate override set` writes a row here, and every running instance reads
-- the table into memory (at start, within a second of a change through
-- NOTIFY tollgate_overrides, and every few seconds anyway), so no request ever
-- costs a statement to look an override up.
--
-- WHAT
--
-- public.tollgate_overrides: one row per bucket (SPEC 3), named by its parts:
-- `scope`, `label` and `digest`, the lowercase hex of the subject's HMAC (or
-- SHA-256) as in `rate_limits.bucket`; '' for a `global` limit, which has no
-- subject. The raw subject (an address, a token, a header value) is never
-- stored: the CHECK below refuses anything but 64 hex digits in `digest`.
-- `requests` replaces the limit's `requests` (0 blocks the subject); window,
-- algorithm, cost and key stay the file's. `until` (NULL = no end) is when
-- it stops applying; an expired row is ignored and stays until removed.
-- `note` says why, for the next operator; `set_at` when it was written.
--
-- A runtime role (store.migrate = false) needs SELECT on this table; the role
-- that runs `tollgate override` needs SELECT, INSERT, UPDATE and DELETE.
--
-- Target schema: public. No system schema is read or written.
-- ============================================================================

-- SET LOCAL: tollgate runs each migration in a transaction of its own, and the
-- setting must end with it (a session SET would stay on the connection, and a
-- pooler hands that connection to other clients).
SET LOCAL search_path = public;

-- IF NOT EXISTS: a table made by hand (or by an interrupted deploy script that
-- ran this file) does not stop the migration from being recorded.
CREATE TABLE IF NOT EXISTS public.tollgate_overrides (
  scope    text        NOT NULL,
  label    text        NOT NULL,
  digest   text        NOT NULL,
  requests integer     NOT NULL CHECK (requests >= 0),
  until    timestamptz,
  note     text        NOT NULL DEFAULT '',
  set_at   timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (scope, label, digest),
  CONSTRAINT tollgate_overrides_digest_only CHECK (
    digest ~ '^[0-9a-f]{64}$' OR (label = 'global' AND digest = '')
  )
);

COMMENT ON TABLE public.tollgate_overrides IS
  'Per-subject requests that replace a limit''s (SPEC 3e), by bucket; read into '
  'memory by every instance. Written by tollgate override set/remove.';

COMMENT ON COLUMN public.tollgate_overrides.digest IS
  'The bucket''s digest (hex HMAC-SHA256 of the subject), never the subject; '
  ''''' for a global limit.';
