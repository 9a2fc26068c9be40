# Multi-stage build: compile in the Rust image, run in a small Debian image as a non-root user.
#
#   docker build -t tollgate .
#   docker run --rm -e TOLLGATE_KEY_SECRET=... -e TOLLGATE_UPSTREAM_URL=http://app:9000 \
#     -p 127.0.0.1:8080:8080 -p 127.0.0.1:9901:9901 tollgate
#
# The builder is the minimum supported Rust (Cargo.toml's rust-version); any newer one works:
# `docker build --build-arg RUST_VERSION=1 .`
ARG RUST_VERSION=1.88

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src

# Dependencies first, against stub sources: this layer depends only on Cargo.toml and
# Cargo.lock, so a change to src/ rebuilds tollgate alone, not the ~150 crates under it.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && cargo build --release --locked \
 && rm -rf src target/release/tollgate target/release/deps/tollgate-* \
      target/release/deps/libtollgate-* target/release/.fingerprint/tollgate-*

# The real sources. (The stub's fingerprints are gone above, so cargo cannot mistake the
# copied files, whose times come from the build context, for the stub it already built.)
COPY src ./src
COPY migrations ./migrations
RUN cargo build --release --locked \
 && strip target/release/tollgate \
 && ./target/release/tollgate --version

FROM debian:bookworm-slim
# A fixed numeric uid/gid: Kubernetes' runAsNonRoot can only verify a numeric USER.
RUN groupadd --system --gid 10001 tollgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tollgate
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
# A default configuration, so the image runs as is (see the file for the variables it reads);
# mount your own over /etc/tollgate/proxy.toml, or pass --config.
COPY docker/proxy.toml /etc/tollgate/proxy.toml
USER 10001:10001
EXPOSE 8080 9901
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["run", "--config", "/etc/tollgate/proxy.toml"]
