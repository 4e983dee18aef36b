# Build and run callbackd. The runtime image holds only the binary and its config.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin callbackd

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/callbackd /usr/local/bin/callbackd
COPY config.toml /etc/callbackd/config.toml
ENV CALLBACKD_CONFIG=/etc/callbackd/config.toml
EXPOSE 8080
ENTRYPOINT ["callbackd"]
CMD ["serve"]
