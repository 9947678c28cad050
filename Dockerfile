# idemflow: build with the Rust toolchain, run on a small Debian image as a non-root user.
# The Kafka client is built with TLS and SASL/SCRAM against the system OpenSSL (libssl-dev and pkg-config come
# with the rust image; the runtime image gets libssl3 with ca-certificates).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY migrations migrations
COPY pipelines pipelines
COPY schemas schemas
COPY examples examples
# scripts/release: the binary without debug info, and its line tables in target/install/idemflow.debug, which
# stays in the build stage (`docker build --target build`, then copy it out and put it beside the binary for
# file:line in backtraces).
COPY scripts/release scripts/release
RUN scripts/release

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home idemflow
COPY --from=build /src/target/install/idemflow /usr/local/bin/idemflow
COPY idemflow.toml /etc/idemflow/idemflow.toml
COPY pipelines /etc/idemflow/pipelines
USER idemflow
ENV IDEMFLOW_METRICS__LISTEN=0.0.0.0:9464
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD curl -fsS http://127.0.0.1:9464/healthz || exit 1
CMD ["idemflow", "run", "--config", "/etc/idemflow/idemflow.toml"]
