#!/usr/bin/env bash
# The pieced staging path on one H200 (docs/benchmarks.md, its first round), in one device
# call: the `cuda` tests of the files it touched, then `kvferry bench copy` for staging (this tree, and the tree of OLD, when given,
# as the before figure of the same run), the copy kernel's sweep, and `bench agentic` at
# Llama-8B geometry with every mode. Run from a folder holding python/, tests/, benches/,
# pyproject.toml; logs go to $OUT (or ./out).
#   bash benches/probes/gpu_staging_ab.sh tests|agentic [OLD_TREE]
# (two parts, each well inside one device command's 10 minutes).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
PART=${1:-tests}; OLD=${2:-}
export PYTHONPATH=python PYTHONUNBUFFERED=1
if [ "$PART" = tests ]; then
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/tests.log"
timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_staging.py tests/test_transfer.py tests/test_copy.py tests/test_tiers.py -k "staging or copy or tier" 2>&1 | tail -25 | tee -a "$OUT/tests.log"
bench() { timeout 200 python3 -m kvferry.cli bench copy --device cuda --reps 5 "$@" 2>/dev/null | grep -v '^\[' ; }
{
  echo "== after (this tree): staging, default writes (half the ring)"
  bench --transport copy,staging --blocks 64,1024,4096
  for mib in 512 128; do echo "== after: staging, --write-mib $mib"; bench --transport staging --blocks 1024,4096 --write-mib $mib; done
  if [ -n "$OLD" ]; then echo "== before ($OLD): staging, default writes"; PYTHONPATH=$OLD/python bench --transport staging --blocks 64,1024,4096; fi
} 2>&1 | tee "$OUT/staging.txt"
else
timeout 330 python3 -m kvferry.cli bench agentic --device cuda --sessions 2 --cached 32768 --new 2048 --output 4 \
  --aware --layerwise 8 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --ffn 14336 --vocab 1024 \
  --json "$OUT/agentic.json" 2>&1 | grep -v '^\[bench agentic\] \[' | tail -30 | tee "$OUT/agentic.txt"
timeout 150 python3 benches/python/gpu_copy.py --sweep --json "$OUT/gpu_copy.json" 2>&1 | tail -14 | tee "$OUT/gpu_copy.txt"
fi
