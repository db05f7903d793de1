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
USER nobody
ENTRYPOINT ["walbox"]
CMD ["run"]
