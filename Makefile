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
install: $(STAMP) shim ktp ## venv + Python deps + the shim + the control-plane binary

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	$(VPY) hack/gen_proto.py
	touch $(STAMP)

.PHONY: test
test: install ## run every test (unit, shim, and the real control plane)
	$(VPY) -m pytest -q tests

.PHONY: demo
demo: install ## the main job: the local control plane, the operator, fake GPU nodes, the shim
	$(VPY) -m kvgpu.demo

.PHONY: lint
lint: $(STAMP) ## ruff and mypy
	$(VENV)/bin/ruff check operator tests bench shim hack
	$(VENV)/bin/mypy

##@ Builds

.PHONY: shim
shim: $(STAMP) ## build shim/libvgpu.so and the cffi test module
	$(VPY) shim/build.py

.PHONY: ktp
ktp: ## build (or reuse from cache) the etcd/kube-apiserver/kube-scheduler/kubectl binary
	@hack/ktp/build.sh >/dev/null

.PHONY: crds
crds: $(STAMP) ## regenerate crds/, docs/api.md and docs/configuration.md from the code
	$(VPY) -m kvgpu.api.crdgen
	$(VPY) -m kvgpu.cli.configdoc

.PHONY: bench
bench: install ## run the CPU benchmarks in bench/
	$(VPY) bench/allocator_bench.py

.PHONY: clean
clean: ## remove build outputs (not the cached control-plane build)
	rm -rf $(VENV) shim/_build build dist
