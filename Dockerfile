# tokenbucket-rls: build with the Rust toolchain, run on a slim base as
# nobody (65534), with a read-only root filesystem if you like: nothing is
# written to disk. Rules are read from /srv/tokenbucket-rls/config (the
# default `config`, relative to the working directory; mount your own there,
# edits and ConfigMap swaps are picked up live). Configure with RLS_*
# variables or flags, or with envoyproxy/ratelimit's own environment
# (RUNTIME_ROOT, REDIS_URL, GRPC_PORT, ...): the image sets no RLS_* variable
# that would shadow it. The binary is also /bin/ratelimit, the command
# Deployments written for envoyproxy/ratelimit run.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
RUN cargo build --release --locked --bins

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/tokenbucket-rls /src/target/release/rls-bench /usr/local/bin/
RUN ln -s /usr/local/bin/tokenbucket-rls /bin/ratelimit
WORKDIR /srv/tokenbucket-rls
COPY config/ /srv/tokenbucket-rls/config/
USER 65534:65534
EXPOSE 8081 8080
ENTRYPOINT ["/usr/local/bin/tokenbucket-rls"]
