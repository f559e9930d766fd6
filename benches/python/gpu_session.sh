#!/usr/bin/env bash
# One device call on an H200 (issue 21 and issue 22 part 3): the `cuda` tests (vLLM's KV
# cache layouts through copy_blocks, in-process, staging and cuda_ipc; the copies, staging,
# tiers), then `kvferry bench copy` for the GPU links and `bench agentic` at Llama-8B geometry
# (32k cached + 2k new) over cuda-ipc and staging (the default 64 MiB ring). Run from the
# repository root with the extension at python/kvferry/_core.abi3.so (a manylinux_2_28 build:
# the device image has no Rust); logs go to $OUT (or ./out).
#   bash benches/python/gpu_session.sh tests|bench
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/machine.txt"
if [ "${1:-tests}" = tests ]; then
  # Each test file with its own limit and a per-test timeout (pytest-timeout is in the image),
  # so one slow or hung test shows by name and the others still run.
  for f in ${FILES:-tests/test_kv_layouts.py tests/test_nonblocking.py tests/test_copy.py tests/test_staging.py \
      tests/test_transfer.py tests/test_tiers.py tests/test_registry.py tests/test_tp.py}; do
    [ -f "$f" ] || continue
    timeout "${LIMIT:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider --timeout 60 --durations 5 -rfE "$f" 2>&1 \
      | tee -a "$OUT/cuda-tests.txt" | tail -12
  done
else
  bench() { timeout 150 python3 -m kvferry.cli bench copy --device cuda --reps 5 "$@" 2>/dev/null | grep -v '^\[' ; }
  if [ -n "${COPY:-}" ]; then
    { echo "== copy, staging, cuda-ipc"; bench --transport copy,staging,cuda-ipc --blocks 64,1024,4096; } 2>&1 | tee "$OUT/copy.txt"
  fi
  for t in ${TRANSPORTS:-cuda-ipc staging}; do
    timeout "${LIMIT:-240}" python3 -m kvferry.cli bench agentic --device cuda --transport $t --sessions 2 --cached 32768 \
      --new 2048 --output 4 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --ffn 14336 \
      --vocab 1024 --json "$OUT/agentic-$t.json" 2>&1 | grep -v '^\[bench agentic\] \[' | tail -24 | tee "$OUT/agentic-$t.txt"
  done
fi
