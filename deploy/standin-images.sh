#!/usr/bin/env bash
# Stand-in base images for a host that runs dockerd but reaches no container registry.
#
# The Dockerfile and docker-compose.yml name public images (debian:bookworm-slim,
# rust:1.88-bookworm, postgres:16, python:3-slim). Where those cannot be pulled, this script
# builds look-alikes from Debian packages and `docker import`s them under the same names, so
# `docker build` and deploy/smoke.sh run unchanged:
#
#   debian:bookworm-slim   a debootstrap --variant=minbase bookworm root
#   rust:1.88-bookworm     that root + gcc, libc6-dev, the host's CA bundle, and the host's Rust
#                          toolchain (whatever version `rustc` is here: the tag is only a name)
#   postgres:16            that root + Debian's postgresql (15 on bookworm) and an entrypoint
#                          that honours POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB
#   python:3-slim          that root + Debian's python3, for examples/demo_backend.py
#
# Needs root, debootstrap and a Debian mirror (MIRROR, default deb.debian.org). Nothing here
# is used by the Dockerfile itself; on a host that can pull images, skip this script.
#
#   sudo deploy/standin-images.sh            # WORK=/tmp/tollgate-standins by default
set -euo pipefail

MIRROR="${MIRROR:-http://deb.debian.org/debian}"
WORK="${WORK:-/tmp/tollgate-standins}"
RUST_IMAGE="${RUST_IMAGE:-rust:1.88-bookworm}"
RUNTIME_IMAGE="${RUNTIME_IMAGE:-debian:bookworm-slim}"
POSTGRES_IMAGE="${POSTGRES_IMAGE:-postgres:16}"
PYTHON_IMAGE="${PYTHON_IMAGE:-python:3-slim}"

for tool in debootstrap docker; do
  command -v "$tool" >/dev/null || { echo "standin-images: $tool is required" >&2; exit 1; }
done
mkdir -p "$WORK"

base="$WORK/base"
if [ ! -x "$base/bin/bash" ]; then
  echo "== debootstrap bookworm ($MIRROR) into $base"
  debootstrap --variant=minbase bookworm "$base" "$MIRROR"
  # apt inside the root must not start services.
  printf '#!/bin/sh\nexit 101\n' > "$base/usr/sbin/policy-rc.d"
  chmod +x "$base/usr/sbin/policy-rc.d"
  chroot "$base" apt-get clean
fi

# A fresh copy of the base root for one image; $1 names it.
fresh_root() {
  local root="$WORK/$1"
  rm -rf "$root"
  cp -a "$base" "$root"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  echo "$root"
}

apt_in() {
  local root="$1"
  shift
  chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/*
}

import_root() {
  local root="$1" name="$2"
  shift 2
  echo "== docker import $name"
  tar -C "$root" -c . | docker import "$@" - "$name"
}

echo "== $RUNTIME_IMAGE"
import_root "$base" "$RUNTIME_IMAGE" --change 'CMD ["bash"]'

echo "== $RUST_IMAGE (the host's toolchain: $(rustc --version))"
root="$(fresh_root rust)"
apt_in "$root" gcc libc6-dev ca-certificates
# cargo fetches crates during `docker build`: trust what this host trusts (a host behind a
# TLS-inspecting proxy has its CA in this bundle, and nowhere else).
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
sysroot="$(rustc --print sysroot)"
mkdir -p "$root/usr/local/rust" "$root/usr/local/cargo/bin"
for dir in bin lib libexec; do
  [ -d "$sysroot/$dir" ] && cp -a "$sysroot/$dir" "$root/usr/local/rust/"
done
for tool in "$root"/usr/local/rust/bin/*; do
  ln -sf "/usr/local/rust/bin/$(basename "$tool")" "$root/usr/local/cargo/bin/"
done
import_root "$root" "$RUST_IMAGE" \
  --change 'ENV CARGO_HOME=/usr/local/cargo' \
  --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]'

echo "== $POSTGRES_IMAGE (Debian's postgresql)"
root="$(fresh_root postgres)"
apt_in "$root" postgresql-common
# The package would create and start a cluster at install time; the entrypoint makes one.
sed -i 's/^#\?\s*create_main_cluster.*/create_main_cluster = false/' \
  "$root/etc/postgresql-common/createcluster.conf"
apt_in "$root" postgresql
pgbin="$(ls -d "$root"/usr/lib/postgresql/*/bin | head -n1)"
pgbin="${pgbin#"$root"}"
cat > "$root/usr/local/bin/docker-entrypoint.sh" <<'EOF'
#!/bin/bash
# Stand-in for the official image's entrypoint: the environment variables it documents.
set -euo pipefail
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
PGDATA="${PGDATA:-/var/lib/postgresql/data}"
mkdir -p "$PGDATA" /run/postgresql
chown postgres:postgres "$PGDATA" /run/postgresql
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile="$(mktemp)"
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  chown postgres "$pwfile"
  as_postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" \
    --auth-local=trust --auth-host=scram-sha-256
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$db" != "postgres" ]; then
    as_postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
    as_postgres psql -v ON_ERROR_STOP=1 -U "$user" -d postgres -c "CREATE DATABASE \"$db\""
    as_postgres pg_ctl -D "$PGDATA" -m fast -w stop
  fi
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups \
  postgres -D "$PGDATA" -c listen_addresses='*' "$@"
EOF
chmod +x "$root/usr/local/bin/docker-entrypoint.sh"
import_root "$root" "$POSTGRES_IMAGE" \
  --change "ENV PATH=$pgbin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change 'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]' \
  --change 'EXPOSE 5432'

echo "== $PYTHON_IMAGE (Debian's python3)"
root="$(fresh_root python)"
apt_in "$root" python3
import_root "$root" "$PYTHON_IMAGE" --change 'CMD ["python3"]'

docker image ls "$RUNTIME_IMAGE" ; docker image ls "$RUST_IMAGE"
docker image ls "$POSTGRES_IMAGE"; docker image ls "$PYTHON_IMAGE"
