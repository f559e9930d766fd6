# kvferry developer tasks. `make help` lists them.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help setup build demo test test-rust test-python stubtest lint fmt bench bench-rust bench-python wheel clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	time $(PY) -m pip install -r requirements-dev.txt
	touch $(STAMP)

setup: $(STAMP) ## create .venv and install the Python dependencies (torch, numpy, maturin, pytest, ...)

build: $(STAMP) ## build the Rust extension (release) into .venv as an editable install
	maturin develop --release --quiet

demo: build ## set everything up and run the main job: the agentic benchmark, early versus baseline (CPU)
	kvferry bench agentic --json agentic.json --png agentic-timeline.png

test: build test-rust test-python stubtest ## run every test: cargo test, pytest, stubtest

test-rust: ## cargo unit, property and doc tests of the pure core (no Python needed)
	cargo test --all-targets
	cargo test --doc

test-python: build ## pytest over tests/
	$(PY) -m pytest tests

stubtest: build ## check the hand-written _core.pyi against the compiled module
	$(PY) -m mypy.stubtest kvferry._core

lint: ## rustfmt and clippy checks
	cargo fmt --all --check
	cargo clippy --all-targets --features python -- -D warnings

fmt: ## format the Rust code
	cargo fmt --all

bench: bench-rust bench-python ## run every benchmark

bench-rust: ## criterion benches of the core
	cargo bench --bench planner

bench-python: build ## pytest-benchmark of one scheduler step through Python, and the figures table
	$(PY) -m pytest benches/python --benchmark-only -p no:cacheprovider
	$(PY) benches/python/step_report.py

wheel: $(STAMP) ## build the abi3 wheel into dist/
	maturin build --release --out dist

clean: ## remove build outputs (keeps .venv)
	cargo clean
	rm -rf dist python/kvferry/_core*.so
