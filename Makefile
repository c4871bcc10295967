# The two commands a new user needs: `make demo` and `make test`. Both do every set-up step first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-pyc-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)
UV_VERSION := 0.13.9

.PHONY: setup demo cluster test test-faults test-cluster test-hosts bench chaos lint typecheck unit integration e2e stop status lock clean images test-containers

# A virtualenv with the pinned dependencies of requirements.lock (re-installed when it changes),
# compiled to bytecode: uv installs none, and a service run with PYTHONDONTWRITEBYTECODE would compile
# every module it imports on every start.
$(STAMP): requirements.lock pyproject.toml
	@echo "==> creating the virtualenv in $(VENV) with the pinned dependencies"
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found: install Python 3.11"; exit 1; }
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	@$(BIN)/uv pip install -q --python $(BIN)/python -r requirements.lock
	@$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -e .
	@$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') >/dev/null
	@rm -f $(VENV)/.installed-*; touch $@

# Everything a fresh machine needs: the venv, Java check, Kafka and Spark-Kafka jars, redis-server.
setup: $(STAMP)
	@$(BIN)/python -m shared.proto.build
	@$(BIN)/python -m compileall -q -j 0 services shared infra client >/dev/null
	@$(BIN)/python -m infra setup

demo: setup
	@$(BIN)/python -m infra.demo

# The multi-node topology on this machine (README "Past one machine"): three Kafka nodes, a Spark
# master and two workers, Redis, control, two ingest, two sink and two processor replicas.
cluster: setup
	@$(BIN)/python -m infra cluster up

# The container tests (podman, minutes) run in `make test-containers`, the services killed under load
# in `make test-faults`, the cluster's in `make test-cluster`, the hosts' in `make test-hosts`.
test: setup lint typecheck
	@$(BIN)/pytest -q -ra -m "not containers and not faults" --ignore=tests/cluster --ignore=tests/hosts

# Each service SIGKILLed (or its leader cut off) under load on the one-machine stack, and the short
# chaos run: every result judged by an oracle.
test-faults: setup
	@$(BIN)/pytest -q -ra -m faults tests/e2e

# Faults in the cluster topology (SIGKILL of a broker, a Spark worker, a processor, an ingest and a
# sink replica under load), judged by the chaos oracle; its own target: it starts ~15 processes.
test-cluster: setup
	@$(BIN)/pytest -q -ra tests/cluster

# Whole hosts lost or cut off under load: nine network namespaces on a bridge (root), nothing shared
# but the network (infra/hosts/), judged by the chaos oracle.
test-hosts: setup
	@$(BIN)/pytest -q -ra tests/hosts

# The four service images and HDFS's (podman; Debian base from mmdebstrap, no registry), rebuilt only
# when their inputs change: infra/images/build.py. Installs podman, runc and mmdebstrap when missing (root).
images: setup
	@$(BIN)/python -m infra.images

# The pipeline through the images: `podman run` of each service, then `podman kube play` of infra/images/k8s.
test-containers: images
	@$(BIN)/pytest -q -ra -m containers tests/containers

# Speed and memory targets: measured here, never by timed unit tests.
bench: setup
	@$(BIN)/python -m tests.bench $(BENCH)

# The whole platform under faults (kills, broker and Redis restarts), judged by an oracle; exit 1 on a mismatch.
chaos: setup
	@$(BIN)/python -m tests.chaos $(CHAOS)

lint: $(STAMP)
	@echo "==> ruff"
	@$(BIN)/ruff check .
	@$(BIN)/ruff format --check .

typecheck: setup
	@echo "==> mypy"
	@$(BIN)/mypy

unit: setup
	@$(BIN)/pytest -q tests/unit

integration: setup
	@$(BIN)/pytest -q tests/integration

e2e: setup
	@$(BIN)/pytest -q tests/e2e

# Stops everything `make demo` or the tests started, by pid file.
stop:
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m infra down --all; else echo "nothing to stop"; fi

status: $(STAMP)
	@$(BIN)/python -m infra status

# Re-pin the dependencies after editing pyproject.toml.
lock: $(STAMP)
	@$(BIN)/uv pip compile -q pyproject.toml --extra dev -o requirements.lock --python $(BIN)/python

clean: stop
	rm -rf .run .cache $(VENV)
