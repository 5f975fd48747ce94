# Redis from the distribution's packages, for hosts that reach no image registry: the container
# tests put it in place of compose.yaml's `redis:7-alpine` (tests/containers/compose.override.yaml).
ARG BASE_IMAGE=baton-test/base:bookworm
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/*
# hadolint ignore=DL3066
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
