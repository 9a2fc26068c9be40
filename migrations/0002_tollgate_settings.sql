-- ============================================================================
-- tollgate — settings shared by every instance (SPEC section 3)
--
-- One row per setting. Today there is one: 'key_fingerprint', a fingerprint of
-- keys.secret (never the secret itself). Every instance must turn a subject
-- into the same bucket; an instance whose secret differs from the one recorded
-- here would count the same clients in different rows and silently multiply
-- every limit, so it refuses to start. `tollgate migrate --accept-new-key`
-- replaces the row when the secret is rotated on purpose.
--
-- Target schema: public. No system schema is read or written.
-- ============================================================================

-- SET LOCAL: tollgate runs each migration in a transaction of its own, and the
-- setting must end with it (a session SET would stay on the connection, and a
-- pooler hands that connection to other clients).
SET LOCAL search_path = public;

CREATE TABLE public.tollgate_settings (
  name       text        PRIMARY KEY,
  value      text        NOT NULL,
  updated_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE public.tollgate_settings IS
  'Settings every tollgate instance must agree on, e.g. the key fingerprint.';

COMMENT ON COLUMN public.tollgate_settings.value IS
  'For key_fingerprint: a fingerprint of keys.secret, never the secret.';
