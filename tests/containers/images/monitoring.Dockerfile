# Prometheus and the Redis exporter from the distribution's packages, for hosts that reach no image
# registry: compose.override.yaml puts them in place of compose.yaml's monitoring images, whose
# entrypoints they copy (`--target prometheus`, `--target redis-exporter`).
ARG BASE_IMAGE=baton-test/base:bookworm
FROM ${BASE_IMAGE} AS packages
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus prometheus-redis-exporter \
    && rm -rf /var/lib/apt/lists/*

FROM packages AS prometheus
RUN install -d -o 65534 -g 65534 /prometheus
WORKDIR /prometheus
USER 65534
ENTRYPOINT ["/usr/bin/prometheus"]

FROM packages AS redis-exporter
RUN ln -s /usr/bin/prometheus-redis-exporter /usr/local/bin/redis_exporter
USER 65534
ENTRYPOINT ["/usr/local/bin/redis_exporter"]
