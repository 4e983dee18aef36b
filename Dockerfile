# Build and run callbackd. The image holds the binary and a config without secrets: tokens and
# source secrets come from the environment at run time (see docker-compose.yml).
FROM rust:1-bookworm AS build
WORKDIR /src
# Dependencies first, built against placeholder sources, so this layer is reused until
# Cargo.toml or Cargo.lock changes. benches/load.rs is declared in Cargo.toml and must exist.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && echo 'fn main() {}' > benches/load.rs \
 && cargo build --release --locked --bin callbackd \
 && rm -rf src
COPY src src
# COPY keeps the files' modification times, which may be older than the placeholder build.
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin callbackd

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /var/lib/callbackd --create-home \
      --shell /usr/sbin/nologin callbackd
COPY --from=build /src/target/release/callbackd /usr/local/bin/callbackd
COPY docker/config.toml /etc/callbackd/config.toml
ENV CALLBACKD_CONFIG=/etc/callbackd/config.toml \
    CALLBACKD__SERVER__LISTEN=0.0.0.0:8080
# Not root; numeric so runAsNonRoot-style checks can verify it.
USER 10001:10001
WORKDIR /var/lib/callbackd
VOLUME /var/lib/callbackd
EXPOSE 8080
# `callbackd healthcheck` GETs /healthz on loopback at the port of server.listen (3 s timeout).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 CMD ["callbackd", "healthcheck"]
ENTRYPOINT ["callbackd"]
CMD ["serve"]
