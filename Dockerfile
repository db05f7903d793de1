# walbox container image. Not built in walbox's CI (no Docker engine there;
# deploy/check checks this file's rules): build with `docker build -t walbox .`.
#
# - The builder is pinned (Rust 1.95.0 on Debian 12), as the toolchain the
#   tests ran on; pin its digest too where your registry policy asks.
# - Dependencies are built in their own layer (cargo-chef: the manifests and
#   Cargo.lock only), so a change of walbox's code rebuilds walbox, not
#   librdkafka and the rest.
# - The runtime image is distroless (glibc, libgcc, CA certificates, no
#   shell, no package manager), run as UID/GID 65532, its `nonroot` user:
#   what the Helm chart's runAsUser expects. walbox needs nothing else:
#   librdkafka, OpenSSL, zstd and curl are linked in.

FROM rust:1.95.0-bookworm AS chef
# librdkafka (built in) is compiled with cmake.
RUN apt-get update && apt-get install -y --no-install-recommends cmake \
    && rm -rf /var/lib/apt/lists/* \
    && cargo install cargo-chef --version 0.1.67 --locked
WORKDIR /src

FROM chef AS plan
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS build
COPY --from=plan /src/recipe.json recipe.json
# The dependency layer: cached until Cargo.lock or a manifest changes.
RUN cargo chef cook --release --locked -p walbox --recipe-path recipe.json
COPY . .
RUN cargo build --release --locked -p walbox

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/walbox /usr/local/bin/walbox
# Numeric, so Kubernetes' runAsNonRoot can verify it is not root (a name
# like `nonroot` is refused).
USER 65532:65532
# walbox's metrics port (postgres_exporter has 9187): /metrics, /healthz, /readyz.
ENV WALBOX_METRICS_ADDR=0.0.0.0:9756
EXPOSE 9756
ENTRYPOINT ["/usr/local/bin/walbox"]
CMD ["run"]
