#!/usr/bin/env bash
# make gpu-check: bench/gpu_check.py with the venv's python where it has Baton installed; else (the
# lent GPU machine: its own torch, triton and transformers, no venv, no network) with python3 over a
# link farm that maps the checkout's folders to baton.* as the install's package-dir does.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
if [ -x "$py" ] && "$py" -P -c "import baton.bench" 2>/dev/null; then
  exec "$py" -P -m baton.bench.gpu_check "$@"
fi
farm=$(mktemp -d)
trap 'rm -rf "$farm"' EXIT
mkdir "$farm/baton"
ln -s "$root/pkg/__init__.py" "$farm/baton/__init__.py"
for d in common kernels services protos bench planner; do ln -s "$root/$d" "$farm/baton/$d"; done
path=$farm
# A machine without transformers (or tokenizers, safetensors...) takes them from wheels carried in
# .wheels/, installed offline beside the farm (for its python: pip download --no-deps
# --only-binary :all: --python-version 3.X --platform manylinux2014_x86_64 -d .wheels PACKAGES).
if [ -d "$root/.wheels" ] && ! python3 -c "import transformers, tokenizers, safetensors" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$farm/site" "$root"/.wheels/*.whl
  path=$farm/site:$farm
fi
cd "$root"
PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 python3 -m baton.bench.gpu_check "$@"
