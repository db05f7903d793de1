# walbox container image. Not built in walbox's CI (no Docker engine there):
# build with `docker build -t walbox .`.
FROM rust:1-bookworm AS build
WORKDIR /src
# librdkafka (built in) is compiled with cmake.
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cargo build --release --locked -p walbox

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/walbox /usr/local/bin/walbox
# Numeric, so Kubernetes' runAsNonRoot can verify it is not root (a name
# like `nobody` is refused); no home, no shell needed.
USER 65532:65532
# walbox's metrics port (postgres_exporter has 9187): /metrics, /healthz, /readyz.
ENV WALBOX_METRICS_ADDR=0.0.0.0:9756
EXPOSE 9756
ENTRYPOINT ["walbox"]
CMD ["run"]
