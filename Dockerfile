# tokenbucket-rls: build with the Rust toolchain, run on a slim base as a
# non-root user. Rules are read from /etc/tokenbucket-rls (mount your own
# there; edits are picked up live). Configure with RLS_* environment variables.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
RUN cargo build --release --locked --bins

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin rls
COPY --from=build /src/target/release/tokenbucket-rls /src/target/release/rls-bench /usr/local/bin/
COPY config/ /etc/tokenbucket-rls/
ENV RLS_CONFIG=/etc/tokenbucket-rls \
    RLS_GRPC_ADDR=0.0.0.0:8081 \
    RLS_ADMIN_ADDR=0.0.0.0:8080
USER 10001:10001
EXPOSE 8081 8080
ENTRYPOINT ["/usr/local/bin/tokenbucket-rls"]
