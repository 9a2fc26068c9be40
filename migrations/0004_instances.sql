-- ============================================================================
-- tollgate — the registry of live instances (SPEC section 5b)
--
-- One row per running tollgate instance that uses this database. Each instance
-- inserts its row at start and refreshes `seen_at` every few seconds, always
-- from the database's clock (`now()`), so instances whose clocks disagree
-- still agree on who is live. An instance whose row has not been refreshed for
-- 30 seconds is not live. The count of live instances is what the local
-- fallback (`on_error = "local"`) divides each limit by while the database is
-- unreachable: each instance then admits `ceil(requests / instances)` alone.
--
-- `id` is a random identifier each process makes at start (128 bits, hex):
-- never a host name, an address or anything else about the machine. Rows of
-- instances that stopped refreshing are deleted by the live instances' own
-- refresh statement once they are well past the liveness bound; nothing else
-- ever writes here.
--
-- A runtime role (store.migrate = false) needs SELECT, INSERT, UPDATE and
-- DELETE on this table.
--
-- Target schema: public. No system schema is read or written.
-- ============================================================================

-- SET LOCAL: tollgate runs each migration in a transaction of its own, and the
-- setting must end with it (a session SET would stay on the connection, and a
-- pooler hands that connection to other clients).
SET LOCAL search_path = public;

-- IF NOT EXISTS: a table made by hand (or by an interrupted deploy script that
-- ran this file) does not stop the migration from being recorded.
CREATE TABLE IF NOT EXISTS public.tollgate_instances (
  id         text        PRIMARY KEY,
  started_at timestamptz NOT NULL DEFAULT now(),
  seen_at    timestamptz NOT NULL DEFAULT now()
);

-- Counting live instances and deleting dead ones are range scans on it.
CREATE INDEX IF NOT EXISTS tollgate_instances_seen_idx
  ON public.tollgate_instances (seen_at);

COMMENT ON TABLE public.tollgate_instances IS
  'Running tollgate instances, refreshed every few seconds; live = refreshed '
  'within 30 s. The local store-failure policy divides limits by the count.';

COMMENT ON COLUMN public.tollgate_instances.id IS
  'A random identifier per process; nothing about the host.';
