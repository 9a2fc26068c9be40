# Multi-stage build: compile in the Rust image, run in a small Debian image as a non-root user.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
RUN cargo build --release --locked && strip target/release/tollgate

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home tollgate
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
USER tollgate
EXPOSE 8080 9901
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["run", "--config", "/etc/tollgate/proxy.toml"]
