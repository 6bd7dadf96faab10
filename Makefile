# kvgpu — see README.md. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

##@ Main

.PHONY: help
help: ## show this help
	@awk 'BEGIN{FS=":.*##"} /^##@/{printf "\n%s\n",substr($$0,5)} /^[a-zA-Z_-]+:.*##/{printf "  %-14s %s\n",$$1,$$2}' $(MAKEFILE_LIST)

.PHONY: install
install: $(STAMP) shim ktp helm realnode ## venv + Python deps + the shim + the control-plane binary + helm + the node runtime

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	$(VPY) hack/gen_proto.py
	touch $(STAMP)

.PHONY: test
test: install lint check-sanitize ## lint, the shim under the sanitizers, then every test (unit, shim, the real control plane and the real node)
	KVGPU_REQUIRE_REAL_NODE=$${KVGPU_REQUIRE_REAL_NODE:-1} $(VPY) -m pytest -q tests

.PHONY: unit
unit: $(STAMP) ## unit and shim tests: no control plane, no Go build (< 2 min)
	$(VPY) -m pytest -q -m "not cluster and not realnode" tests/unit tests/shim

.PHONY: check
check: lint unit check-sanitize ## lint, the unit and shim tests, the shim under ASan and TSan: the loop before a commit

.PHONY: check-sanitize
check-sanitize: $(STAMP) ## the shim's preload tests against ASan and TSan builds of libvgpu.so
	tests/shim/sanitize.sh address thread

.PHONY: test-random
test-random: install ## unit, shim and cluster tests in a random order (SEED=N to repeat one)
	$(VPY) -m pytest -q --random-order-bucket=global $(if $(SEED),--random-order-seed=$(SEED)) \
	  tests/unit tests/shim tests/cluster

.PHONY: demo
demo: install ## the main job: the local control plane, the operator, fake GPU nodes, the shim
	$(VPY) -m kvgpu.demo

.PHONY: lint
lint: $(STAMP) ## ruff, mypy and the import contracts (.importlinter)
	$(VENV)/bin/ruff check operator tests bench shim hack
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

##@ Builds

.PHONY: shim
shim: $(STAMP) ## build shim/libvgpu.so and the cffi test module
	$(VPY) shim/build.py

.PHONY: ktp
ktp: ## build (or reuse from cache) the etcd/kube-apiserver/kube-scheduler/kubectl binary
	@hack/ktp/build.sh >/dev/null

.PHONY: helm
helm: ## build (or reuse from cache) the Helm CLI (hack/helm/build.sh): the chart's tests and install
	@hack/helm/build.sh >/dev/null

.PHONY: realnode
realnode: ## the real node's runtime: containerd (hack/realnode/build.sh) + runc, CNI plugins, busybox (apt)
	@hack/realnode/build.sh >/dev/null
	@missing=""; \
	command -v runc >/dev/null || missing="$$missing runc"; \
	test -x /usr/lib/cni/bridge || missing="$$missing containernetworking-plugins"; \
	test -x /bin/busybox || missing="$$missing busybox-static"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "realnode: installing$$missing"; \
	    apt-get install -y -q --no-install-recommends$$missing >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends$$missing >/dev/null; } || \
	      { echo "realnode: apt-get install$$missing failed" >&2; exit 1; }; \
	  else \
	    echo "realnode: missing$$missing; install them as root (apt-get install$$missing), or the real-node tests skip" >&2; \
	  fi; \
	fi

.PHONY: crds
crds: $(STAMP) ## regenerate charts/kvgpu/crds/, docs/api.md and docs/configuration.md from the code
	$(VPY) -m kvgpu.api.crdgen
	$(VPY) -m kvgpu.cli.configdoc

.PHONY: generate
generate: crds ## run every generator of committed files (chart templates, doc sections, plots); tests fail on drift
	$(VPY) hack/gen_manifests.py
	$(VPY) hack/gen_importgraph.py
	$(VPY) hack/gen_proto.py
	$(VPY) bench/allocator_bench.py --render
	$(VPY) bench/scale/report.py

.PHONY: bench
bench: install ## run the CPU benchmarks in bench/
	$(VPY) bench/allocator_bench.py

.PHONY: clean
clean: ## remove build outputs (not the cached control-plane build)
	rm -rf $(VENV) shim/_build build dist
