# specserve: `make test` and `make serve` work on a fresh machine (they install first).
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# Long checks have a short form in `make test`; set PYTEST_ARGS to pass more.
PYTEST_ARGS ?=

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: arctic image-cpu image-gpu prometheus install test test-cluster test-fast soak test-suffix-serve serve bench bench-quick proto clean browser helm-schema gpu-check gpu-check-tiny gpu-wheels

install: $(STAMP)

# The same script installs the images (Dockerfile.cpu, Dockerfile.gpu).
$(STAMP): pyproject.toml Makefile scripts/install.sh
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	scripts/install.sh $(PY) cpu models,test,bench editable
	touch $(STAMP)

# The images the Helm chart runs by default (helm/specserve/values.yaml: image);
# both install with scripts/install.sh, like `make install`.
image-cpu:
	docker build -f Dockerfile.cpu -t specserve:$(VERSION)-cpu .
image-gpu:
	docker build -f Dockerfile.gpu -t specserve:$(VERSION)-gpu .

# The loopback multi-node placement test (tests/deployments/test_cluster_placement.py,
# about 4 minutes) is part of `make test`; `make test-cluster` runs it alone.
CLUSTER_TEST := tests/deployments/test_cluster_placement.py

test: install browser prometheus
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

test-cluster: install
	$(PY) -m pytest -q -ra $(CLUSTER_TEST) $(PYTEST_ARGS)

# Debian's chromium and chromedriver, which the /dashboard test drives
# (installed only when missing; sudo when not root).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -q && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
			chromium chromium-driver; \
	fi

# Debian's Prometheus (prometheus, promtool), which the live Prometheus test
# runs against the router's /metrics (installed only when missing).
prometheus:
	@if [ ! -x /usr/bin/prometheus ] || [ ! -x /usr/bin/promtool ]; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -q && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
			prometheus; \
	fi

# Pure-logic tests only (seconds): no engines, no processes.
test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# A suffix draft pool (no model) in the Serve app: greedy equals target-only
# and its drafts are accepted (a Serve app of its own, ~2 min; not in `make test`).
test-suffix-serve: install
	SPECSERVE_SERVE_SUFFIX=1 $(PY) -m pytest -q -ra tests/deployments/test_serve_suffix.py $(PYTEST_ARGS)

# The long soak: 16 streaming clients for 2 minutes against a Serve app on
# loopback; prints each process's memory at start and end (`make test` runs a
# 20 s, 8-client form).
soak: install
	SPECSERVE_SOAK_SECONDS=120 SPECSERVE_SOAK_CLIENTS=16 $(PY) -m pytest -s -q tests/deployments/test_reliability.py -k soak $(PYTEST_ARGS)

# The Ray Serve app on the embedded CPU default (cluster/default.yaml), on
# http://127.0.0.1:8000 until Ctrl-C. Pass a config: make serve CONFIG=my.yaml
CONFIG ?=
serve: install
	$(VENV)/bin/specserve models default
	$(VENV)/bin/specserve serve $(CONFIG)

# Benchmarks (README "Benchmarks"): target-only, vLLM's draft_model and specserve
# side by side on the default pair; a Markdown table on stdout, JSON and a PNG in
# bench/. `bench` is the README's full run, `bench-quick` the short one (<10 min).
bench: install
	mkdir -p bench
	$(VENV)/bin/specserve bench --json bench/bench.json

bench-quick: install
	mkdir -p bench
	$(VENV)/bin/specserve bench --quick --json bench/bench-quick.json

# Arctic Inference's suffix trees, which vLLM's speculative method "suffix" imports:
# built from source for this CPU (about 20 s; cmake and a C++ compiler). Only the
# bench's vllm_suffix system needs them (docs/benchmarks.md).
arctic: install
	scripts/install_arctic.sh $(PY)

# Regenerate the checked-in protobuf code (tests check it matches proto/).
proto: install
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/specserve/v1/spec.proto

# Regenerate the Helm chart's values schema from the config model (a test
# checks the checked-in helm/specserve/values.schema.json matches).
helm-schema: install
	$(PY) -m specserve.tools.chart

# One-shot GPU check (docs/gpu-check.md): on a GPU box with vllm==0.32.0 (GPU build)
# preinstalled, no network. Installs nothing from the internet: wheels carried in
# under gpu-wheels/ (make gpu-wheels, here) go into .gpu-site/ only if the image
# lacks them. GPU_PYTHON: the interpreter that has vLLM.
GPU_PYTHON    ?= python3
GPU_CHECK_OUT ?= gpu-check-results
gpu-check:
	@$(GPU_PYTHON) -c "import grpc, google.protobuf; import sys; sys.path.insert(0, '.'); import specserve.v1.spec_pb2_grpc" 2>/dev/null \
	  || { test -d gpu-wheels || { echo "gpu-check: grpcio/protobuf missing or too old and no gpu-wheels/ here; run 'make gpu-wheels' on a networked machine and carry the folder in" >&2; exit 3; }; \
	       $(GPU_PYTHON) -m pip install --no-index --find-links gpu-wheels --target .gpu-site grpcio protobuf; }
	PYTHONPATH=$(CURDIR):$(CURDIR)/.gpu-site timeout 840 $(GPU_PYTHON) -m specserve.tools.gpucheck --preset gpu --out $(GPU_CHECK_OUT)

# The same check in a CPU-sized form (what tests/test_gpucheck.py runs in `make test`).
gpu-check-tiny: install
	PYTHONPATH=$(CURDIR) $(PY) -m specserve.tools.gpucheck --preset tiny --out $(GPU_CHECK_OUT)-tiny

# Wheels to carry to an offline GPU box (GPU_PY_VERSION: its Python, e.g. 3.12).
GPU_PY_VERSION ?= 3.12
gpu-wheels: install
	$(PIP) download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
	  --python-version $(GPU_PY_VERSION) -d gpu-wheels grpcio==1.85.3 protobuf==7.36.2

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
