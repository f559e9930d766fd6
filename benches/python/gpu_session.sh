#!/usr/bin/env bash
# GPU work, one device call per mode (each inside 10 minutes). Run from the repository root
# with the extension at python/kvferry/_core.abi3.so (a manylinux_2_28 build, CONTRIBUTING.md:
# the device image has no Rust); logs go to $OUT (or ./out). The one-off probes some modes run
# live in benches/probes/ (its README says what each answered).
#   bash benches/python/gpu_session.sh MODE
# tests (the default): every `cuda` test of FILES (vLLM's KV cache layouts through copy_blocks,
# in-process, staging and cuda_ipc; the copies, staging, tiers, TP, the worker replay, the
# connector's direct GPU path, the NIXL receiver hub's one registration of a CUDA pool's head
# slices), each file under LIMIT seconds.
# bench: `bench agentic` at Llama-8B geometry (32k cached + 2k new) over TRANSPORTS (cuda-ipc
# and staging), and with COPY=1 `bench copy` of copy, staging and cuda-ipc first.
# staging-legs (about 7 minutes): the `cuda` tests of HMA x TP and
# pipeline stages in test_tp.py, the connector's worker half replaying a real engine pair's
# steps on CUDA caches in test_worker_replay.py, the NIXL handoff default in test_affinity.py,
# the both-ways link in test_cli.py), test_tiers.py, and every staging test again with
# KVFERRY_STAGING_LEGS=direct; whether the ring's kind of page-locked memory sets the PCIe rate
# (pinned_kinds.py); whether the legs can skip their DMA, the copy kernel loading and storing
# the registered ring over PCIe, and what each leg costs a matmul beside it (zero_copy.py);
# `bench copy` of staging with each kind of legs, beside the one-way and both-ways ceilings.
# agentic8b-legs (about 7 minutes): NIXL's own cost per descriptor (nixl_floor.py)
# beside kvferry's nixl rows, and `bench agentic` at Llama-8B geometry over nixl (the writes
# handed to the announcer by default now) and over staging with direct, then dma, legs.
# links (about 6 minutes): the `cuda` tests of the pipelined
# staging path, BlockCopies and the copies; `bench copy` at 8/64/1024/4096 blocks for copy,
# staging and cuda-ipc (and nixl, random and --contiguous blocks, when it imports); then
# `bench agentic` at Llama-8B geometry with every mode (--aware --layerwise 8) over
# ${TRANSPORT:-staging}, the generation workers of all modes in one process.
# links-extra (about 4 minutes): staging at 256 and 1024 MiB writes, the staging timeline at
# 512 and 256 MiB writes, the copy kernel's 80-configuration sweep.
# gpupath (about 5 minutes): the connector's direct GPU path (transport auto): the `cuda` tests of
# tests/test_gpupath.py (a decode server's ranks in a spawned process, a prefill server's here,
# on one GPU: every TP pair of {1, 2} in three layouts over cuda-ipc, explicit staging, the
# one-process fallback), then `bench copy` of copy, staging and cuda-ipc (each receiver in a
# process of its own) at 8, 64 and 1024 blocks, twice, the copy row being the same run's ceiling,
# and staging through the connector's 1 GiB ring.
# checksum (about 4 minutes): the `cuda` tests of test_checksum.py (the Triton kernel against
# the torch reference on poisoned pools; a byte flipped in flight over cuda-ipc, staging and
# in-process), then benches/probes/checksum_cost.py at Llama-8B geometry (2 MiB blocks): the
# kernel alone (CUDA events) against the transfer over cuda-ipc and staging at 64 and 1024
# blocks, checksums off and on; it prints 2*sum/xfer and (on-off)/off per row.
# agentic-memory (about 4 minutes): `bench agentic`'s memory check against what each process
# holds: the `cuda` tests of test_bench_agentic_memory.py (the forward's allocator peak within
# its estimate), then at Llama-8B geometry over staging with every mode, --sessions 1 and 2
# (refused on an 80 GB H100, naming each process's figures; both run on an H200), then
# without --aware (runs on an H100): per process, the allocator's max_allocated and
# max_reserved at the end beside the check's estimate.
# smallwrites (about 3 minutes): the `cuda` test of tests/test_prefill_batch.py (a step's writes
# to one peer as one write, on CUDA pools), `bench copy` of copy, staging and cuda-ipc at 8 and
# 64 blocks, then benches/probes/small_writes.py: one step's chunks of 1, 8 and 32 requests of 8
# blocks (4 MiB each) to one receiver over cuda-ipc, staging (and nixl where it imports), as one
# hook call against one call per request, to the sender's completion signal (median of 15 steps
# after warm-up); it prints ms/step, us/write, the writes and posts per step and batched / per
# request, then the prefill worker's after_forward over in-process CUDA pools.
# stages (about 3 minutes, 5 with BASE): where a lone small write's fixed cost goes
# (benches/probes/write_stages.py: one request of 1, 8 and 64 blocks of 4 MiB over cuda-ipc and
# staging to a receiver process, each stage's time from the send call, median of 25 writes;
# `bench copy` of copy, staging and cuda-ipc at 8 and 64 blocks; with BASE=DIR both first for
# that tree's python/, then for this one; then cProfile of the send calls at 8 blocks), then
# what the reference model's forward holds at its allocator peak (benches/probes/forward_peak.py)
# and the `cuda` tests of test_bench_agentic_memory.py.
# tail (about 6 minutes, with BASE): the small-write path before and after a change, in one
# call: the `cuda` tests of the files a write's path runs through, then for BASE's tree and
# this one, taking turns (ROUNDS, default 2; the second turn cuda-ipc and staging only): write_stages.py over cuda-ipc and staging at 8 and 64 blocks
# (median of 25), its --parts (time inside each step of the send call) at 8 blocks, and `bench
# copy` of copy, staging and cuda-ipc at 8 and 64 blocks (the copy row is the same run's ceiling;
# PARTS_NEW_ONLY=1: --parts and `bench copy` for this tree only; PARTS=0, COPY=0: without them;
# LINKS, BLOCKS: other transports and write sizes);
# nixl too where its wheels are carried in .gpu/nixl.
# ring-sizes, agentic8b-rings, copy-wide, split, split-check, two-gpus: see each one's comment.
MODES="tests bench staging-legs agentic8b-legs links links-extra checksum ring-sizes agentic8b-rings copy-wide split split-check two-gpus gpupath agentic-memory smallwrites stages tail"
set -u
case " $MODES " in
  *" ${1:-tests} "*) ;;
  *) echo "gpu_session.sh: unknown mode '${1}': choose from ${MODES// /, }" >&2; exit 2 ;;
esac
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/machine.txt"
if [ "${1:-tests}" = tests ]; then
  # Each test file with its own limit and a per-test timeout (pytest-timeout is in the image),
  # so one slow or hung test shows by name and the others still run.
  for f in ${FILES:-tests/test_kv_layouts.py tests/test_nonblocking.py tests/test_copy.py tests/test_staging.py \
      tests/test_transfer.py tests/test_tiers.py tests/test_registry.py tests/test_tp.py tests/test_worker_replay.py \
      tests/test_gpupath.py tests/test_park.py tests/test_nixl_hub.py tests/test_checksum.py}; do
    [ -f "$f" ] || continue
    timeout "${LIMIT:-150}" python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 --durations 5 -rfE "$f" 2>&1 \
      | tee -a "$OUT/cuda-tests.txt" | tail -12
  done
elif [ "$1" = links ]; then
  timeout 150 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 --durations 5 -rfE tests/test_staging.py \
    tests/test_copy.py tests/test_transfer.py -k "staging or copies or copy or pieces" 2>&1 | tee "$OUT/links-tests.txt" | tail -15
  bench() { timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 5 "$@" 2>/dev/null | grep -v '^\[' ; }
  {
    echo "== copy, staging, cuda-ipc"; bench --transport copy,staging,cuda-ipc --blocks 8,64,1024,4096
    if python3 -c "import nixl" 2>/dev/null; then
      echo "== nixl, random blocks"; bench --transport copy,nixl --blocks 8,64,1024,4096
      echo "== nixl, --contiguous"; bench --transport copy,nixl --blocks 8,64,1024,4096 --contiguous
    else echo "== nixl: not importable here, skipped"; fi
  } 2>&1 | tee "$OUT/links-copy.txt"
  t=${TRANSPORT:-staging}
  timeout "${LIMIT:-300}" python3 -m kvferry.cli bench agentic --device cuda --transport $t --sessions 2 --cached 32768 \
    --new 2048 --output 4 --aware --layerwise 8 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 \
    --ffn 14336 --vocab 1024 --json "$OUT/agentic8b-$t.json" 2>&1 | grep -v '^\[bench agentic\] \[' | tail -30 \
    | tee "$OUT/agentic8b-$t.txt"
elif [ "$1" = gpupath ]; then
  timeout 240 python3 -m pytest -m cuda -p no:cacheprovider --timeout 90 --durations 8 -rfE tests/test_gpupath.py 2>&1 \
    | tee "$OUT/gpupath-tests.txt" | tail -20
  for round in 1 2; do
    { echo "== round $round: copy, staging, cuda-ipc"
      timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 5 --transport copy,staging,cuda-ipc \
        --blocks 8,64,1024 --json "$OUT/gpupath-copy-$round.json" 2>/dev/null | grep -v '^\[' ; } 2>&1 | tee -a "$OUT/gpupath-copy.txt"
  done
  { echo "== staging through the connector's 1 GiB ring"
    timeout 60 python3 -m kvferry.cli bench copy --device cuda --reps 5 --transport staging --blocks 64,1024 \
      --ring-mib 1024 2>/dev/null | grep -v '^\[' ; } 2>&1 | tee -a "$OUT/gpupath-copy.txt"
elif [ "$1" = smallwrites ]; then
  timeout 90 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 -rfE tests/test_prefill_batch.py 2>&1 \
    | tee "$OUT/smallwrites-tests.txt" | tail -4
  { echo "== copy, staging, cuda-ipc"
    timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 9 --transport copy,staging,cuda-ipc \
      --blocks 8,64 2>/dev/null | grep -v '^\[' ; } 2>&1 | tee "$OUT/smallwrites-copy.txt"
  t=cuda-ipc,staging; python3 -c "import nixl" 2>/dev/null && t=$t,nixl
  timeout 300 python3 benches/probes/small_writes.py --device cuda --transports $t --requests 1,8,32 \
    --reps 15 2>&1 | grep -v '^\[' | tee "$OUT/smallwrites.txt"
elif [ "$1" = stages ]; then
  # BASE=DIR (a tree of an earlier commit's python/, with the extension in it): its rows first,
  # then this tree's, taking turns in the same call, so the ratio is measured on one machine.
  for tree in ${BASE:+"$BASE"} python; do
    for t in cuda-ipc staging; do
      { echo "== $tree"; PYTHONPATH=$tree timeout 100 python3 benches/probes/write_stages.py --device cuda --transport $t \
          --blocks 1,8,64 --reps 25 2>&1 | grep -v '^\['; } | tee -a "$OUT/stages.txt"
    done
    { echo "== $tree: copy, staging, cuda-ipc"
      PYTHONPATH=$tree timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 9 \
        --transport copy,staging,cuda-ipc --blocks 8,64 2>/dev/null | grep -v '^\[' ; } 2>&1 | tee -a "$OUT/stages-copy.txt"
  done
  timeout 60 python3 benches/probes/write_stages.py --device cuda --transport cuda-ipc --blocks 8 --reps 25 --profile \
    2>&1 | grep -v '^\[' | tee -a "$OUT/stages-profile.txt" | head -30
  timeout 90 python3 benches/probes/forward_peak.py 2>&1 | tee "$OUT/forward-peak.txt"
  timeout 150 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 -rfE tests/test_bench_agentic_memory.py 2>&1 \
    | tee "$OUT/memory-tests.txt" | tail -6
elif [ "$1" = tail ]; then
  # NIXL where its wheels were carried (.gpu/nixl: nixl and the nixl-cu* of the image's CUDA).
  ls .gpu/nixl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .gpu/nixl/*.whl 2>&1 | tail -2
  links=${LINKS:-cuda-ipc staging}; [ -z "${LINKS:-}" ] && python3 -c "import nixl" 2>/dev/null && links="$links nixl"
  timeout 180 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 -rfE ${FILES:-tests/test_staging.py \
    tests/test_engine.py tests/test_copy.py tests/test_transfer.py tests/test_prefill_batch.py} 2>&1 \
    | tee "$OUT/tail-tests.txt" | tail -8
  for round in $(seq 1 ${ROUNDS:-2}); do
    for tree in ${BASE:+"$BASE"} python; do
      for t in $([ $round = 1 ] && echo $links || echo cuda-ipc staging); do
        { echo "== round $round, $tree"; PYTHONPATH=$tree timeout 100 python3 benches/probes/write_stages.py \
            --device cuda --transport $t --blocks ${BLOCKS:-8,64} --reps 25 2>&1 | grep -v '^\['; } | tee -a "$OUT/tail-stages.txt"
      done
      if [ $round = 1 ] && [ "${PARTS:-1}" = 1 ] && { [ $tree = python ] || [ -z "${PARTS_NEW_ONLY:-}" ]; }; then
        { echo "== $tree"; PYTHONPATH=$tree timeout 100 python3 benches/probes/write_stages.py --device cuda \
            --transport ${links// /,} --blocks 8 --reps 25 --parts 2>&1 | grep -v '^\['; } | tee -a "$OUT/tail-parts.txt"
      fi
      [ $round = 1 ] && [ "${COPY:-1}" = 1 ] && { [ $tree = python ] || [ -z "${PARTS_NEW_ONLY:-}" ]; } && { echo "== $tree: copy, staging, cuda-ipc"
        PYTHONPATH=$tree timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 9 \
          --transport copy,${links// /,} --blocks 8,64 2>/dev/null | grep -v '^\[' ; } 2>&1 | tee -a "$OUT/tail-copy.txt"
    done
  done
elif [ "$1" = checksum ]; then
  timeout 150 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 --durations 5 -rfE tests/test_checksum.py 2>&1 \
    | tee "$OUT/checksum-tests.txt" | tail -10
  timeout 400 python3 benches/probes/checksum_cost.py --device cuda --blocks 64,1024 --transports cuda-ipc,staging \
    --reps 9 2>&1 | grep -v '^\[' | tee "$OUT/checksum-cost.txt"
elif [ "$1" = links-extra ]; then
  bench() { timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 5 "$@" 2>/dev/null | grep -v '^\[' ; }
  for mib in 256 1024; do
    { echo "== staging, --write-mib $mib"; bench --transport staging --blocks 1024,4096 --write-mib $mib; } 2>&1 \
      | tee -a "$OUT/links-extra.txt"
  done
  for mib in 512 256; do
    timeout 60 python3 benches/probes/gpu_staging_timeline.py --write-mib $mib 2>&1 | tail -14 | tee -a "$OUT/links-timeline.txt"
  done
  timeout 150 python3 benches/python/gpu_copy.py --sweep --json "$OUT/gpu_copy.json" 2>&1 | tail -14 | tee "$OUT/gpu_copy.txt"
elif [ "$1" = staging-legs ]; then
  # The cuda tests, the two probes, and `bench copy` of staging with each kind of legs.
  run_tests() { timeout "$1" python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 --durations 5 -rfE "${@:2}" 2>&1 \
    | tee -a "$OUT/staging-legs-tests.txt" | tail -12 ; }
  run_tests 240 tests/test_tp.py tests/test_worker_replay.py -k "hma or pp or replay"
  # The staging legs as one kernel each (KVFERRY_STAGING_LEGS=direct): the staging tests again.
  KVFERRY_STAGING_LEGS=direct run_tests 90 tests/test_staging.py
  timeout 120 python3 benches/probes/zero_copy.py 2>&1 | tail -24 | tee "$OUT/zero-copy.txt"
  for legs in dma direct; do
    { echo "== copy, staging with $legs legs (one-way and both-ways ceilings)"
      KVFERRY_STAGING_LEGS=$legs timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 5 \
        --transport copy,staging --blocks 64,1024,4096 2>/dev/null | grep -v '^\[' ; } 2>&1 | tee -a "$OUT/staging-legs-copy.txt"
  done
  run_tests 150 tests/test_tiers.py tests/test_affinity.py tests/test_cli.py
  KVFERRY_STAGING_LEGS=direct run_tests 120 tests/test_transfer.py tests/test_kv_layouts.py tests/test_tiers.py -k staging
  timeout 90 python3 benches/probes/pinned_kinds.py 2>&1 | tail -7 | tee "$OUT/pinned-kinds.txt"
elif [ "$1" = agentic8b-legs ]; then
  # NIXL's floor and the 8B agentic runs (nixl; staging with each kind of legs).
  agentic() { timeout "${LIMIT:-200}" python3 -m kvferry.cli bench agentic --device cuda --sessions 2 --cached 32768 \
      --new 2048 --output 4 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --ffn 14336 \
      --vocab 1024 --json "$OUT/agentic8b-$1.json" "${@:2}" 2>&1 | grep -v '^\[bench agentic\] \[' | tail -24 \
      | tee "$OUT/agentic8b-$1.txt" ; }
  if python3 -c "import nixl" 2>/dev/null; then
    # NIXL's own floor per descriptor (no kvferry), beside kvferry's nixl rows at the same sizes.
    { timeout 120 python3 benches/probes/nixl_floor.py --device cuda --counts 1024,32768 2>&1 | tail -8
      timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 5 --transport copy,nixl --blocks 32,1024 \
        2>/dev/null | grep -v '^\[' ; } 2>&1 | tee "$OUT/nixl-floor.txt"
    agentic nixl --transport nixl
  else echo "== nixl: not importable here, skipped"; fi
  KVFERRY_STAGING_LEGS=direct agentic staging-direct --transport staging
  KVFERRY_STAGING_LEGS=dma agentic staging-dma --transport staging
elif [ "$1" = ring-sizes ]; then
  # Most decisive first (what comes back if it runs out of time): whether the
  # ring's size sets staging's rate (the bench's default ring is the receiver's whole pool, 16
  # GiB at 4096 blocks; vLLM's connector uses 64 MiB); the legs beside a matmul (zero_copy.py,
  # its byte check mended); the other links on this card; a second round of ring sizes; the
  # copy kernel; the direct-leg staging tests that ran out of time in `staging-legs`.
  bench() { timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 5 "$@" 2>/dev/null | grep -v '^\[' ; }
  rings() {
    for ring in pool 64 1024; do
      { echo "== round $1, staging (dma legs), ring $ring"
        if [ $ring = pool ]; then bench --transport staging --blocks 1024,4096
        else bench --transport staging --blocks 1024,4096 --ring-mib $ring; fi ; } 2>&1 | tee -a "$OUT/ring.txt"
    done
  }
  rings 1
  timeout 150 python3 benches/probes/zero_copy.py 2>&1 | tail -30 | tee "$OUT/zero-copy.txt"
  { if python3 -c "import nixl" 2>/dev/null; then
      echo "== nixl, --contiguous"; bench --transport copy,nixl --blocks 64,1024 --contiguous
    fi
    echo "== copy, cuda-ipc"; bench --transport copy,cuda-ipc --blocks 8,64,1024,4096 ; } 2>&1 | tee "$OUT/links.txt"
  rings 2
  timeout 120 python3 benches/python/gpu_copy.py 2>&1 | tail -14 | tee "$OUT/gpu_copy.txt"
  # staging-legs' last test group ran out of time after 17 of its 36 tests: the rest, last.
  KVFERRY_STAGING_LEGS=direct timeout 170 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 -rfE \
    tests/test_kv_layouts.py tests/test_tiers.py -k staging 2>&1 | tail -8 | tee "$OUT/direct-tests.txt"
elif [ "$1" = agentic8b-rings ]; then
  # `bench agentic` at Llama-8B geometry over staging through a 64 MiB ring (the connector's
  # first default; `bench agentic` used a ring of its whole pool before --ring-mib), then
  # through 1 GiB (the connector's default ring for CUDA caches now).
  for ring in 64 1024; do
    timeout "${LIMIT:-100}" python3 -m kvferry.cli bench agentic --device cuda --sessions 2 --turns 2 --cached 32768 \
      --new 2048 --output 4 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --ffn 14336 \
      --vocab 1024 --transport staging --ring-mib $ring --json "$OUT/agentic8b-ring$ring.json" 2>&1 \
      | grep -v '^\[bench agentic\] \[' | tail -12 | tee "$OUT/agentic8b-ring$ring.txt"
  done
elif [ "$1" = copy-wide ]; then
  # copy_blocks at 1024 blocks reached 95% of the payload ceiling on the H100 and 93% on the
  # H200 (goal 95%): the sweep again with shapes that keep more bytes in flight per SM (whole
  # chunks loaded before they are stored, 32 warps), each size's best against the default in
  # the same run; then the staging tests (the ring now pinned with cudaHostRegisterPortable).
  timeout 330 python3 benches/python/gpu_copy.py --sweep --json "$OUT/gpu_copy_wide.json" 2>&1 | tail -16 \
    | tee "$OUT/gpu_copy_wide.txt"
  python3 - "$OUT/gpu_copy_wide.json" <<'PY' 2>&1 | tee -a "$OUT/gpu_copy_wide.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for n in sorted({r["blocks"] for r in d["sweep"]}):
    rows = sorted((r for r in d["sweep"] if r["blocks"] == n), key=lambda r: r["ms"])
    print(n, "blocks, fastest five:", [(round(r["ms"], 4), r["chunk_words"], r["block_words"], r["num_warps"], r["cache_hints"]) for r in rows[:5]])
PY
  timeout 150 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 -rfE tests/test_staging.py 2>&1 | tail -6 \
    | tee "$OUT/staging-tests.txt"
elif [ "$1" = split ]; then
  # Staging with dma legs' plans in equal writes of at most a quarter of the ring and about
  # sqrt(plan x a write's own cost) (64 MiB: the default now; 32 MiB beside it) against full
  # writes of half the ring (0), taking turns in one process (write_split.py): through the
  # connector's 1 GiB ring (plans of one write, 16-128 blocks of 4 MiB, to 4096), a 64 MiB ring
  # and the pool-sized one.
  split() { timeout "$1" python3 benches/probes/write_split.py --device cuda "${@:2}" 2>/dev/null | grep '^|\|^round' ; }
  { echo "== staging, ring 1 GiB"; split 250 --rounds 3 --overhead-mib 0,64,32 --blocks 16,64,128,256,1024,4096 \
      --ring-mib 1024 --reps 7
    echo "== staging, ring 64 MiB"; split 100 --rounds 3 --overhead-mib 0,64 --blocks 64,1024 --ring-mib 64 --reps 5
    echo "== staging, the pool-sized ring"; split 150 --rounds 2 --overhead-mib 0,64 --blocks 1024 --reps 5
  } 2>&1 | tee -a "$OUT/split.txt"
elif [ "$1" = split-check ]; then
  # The split writes as shipped: `bench copy` of staging through 1 GiB and 64 MiB rings beside
  # the same run's one-way and both-ways link, then `bench agentic` at Llama-8B geometry through
  # 1 GiB (as agentic8b-rings).
  for ring in 1024 64; do
    { echo "== staging, ring $ring MiB"
      timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 5 --transport staging --blocks 64,1024,4096 \
        --ring-mib $ring --json "$OUT/split-check-$ring.json" 2>/dev/null | grep -v '^\[' ; } 2>&1 | tee -a "$OUT/split-check.txt"
  done
  timeout "${LIMIT:-120}" python3 -m kvferry.cli bench agentic --device cuda --sessions 2 --turns 2 --cached 32768 \
    --new 2048 --output 4 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --ffn 14336 \
    --vocab 1024 --transport staging --ring-mib 1024 --json "$OUT/agentic8b-split.json" > "$OUT/agentic8b-split.txt" 2>&1
  tail -14 "$OUT/agentic8b-split.txt"
elif [ "$1" = two-gpus ]; then
  # On a machine of two GPUs (nvidia-h100-x2): the staging receiver on cuda:1, so each leg
  # crosses its own GPU's link (90% of the host link is a two-link goal: on one GPU both legs
  # share the link both ways), the two-GPU staging test first.
  timeout 120 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 -rfE tests/test_staging.py \
    -k second_gpu 2>&1 | tail -4 | tee "$OUT/two-gpus-test.txt"
  # The direct GPU path between two GPUs: servers with disjoint CUDA_VISIBLE_DEVICES (the
  # connector's worker half, two processes), then `bench copy` of cuda-ipc into cuda:1 beside
  # the same run's one-GPU copy, twice.
  timeout 120 python3 -m pytest -m cuda -p no:cacheprovider --timeout 90 -rfE tests/test_gpupath.py \
    -k disjoint 2>&1 | tail -4 | tee -a "$OUT/two-gpus-test.txt"
  for round in 1 2; do
    { echo "== round $round, cuda-ipc into cuda:1 (copy: the one-GPU ceiling)"
      timeout 120 python3 -m kvferry.cli bench copy --device cuda --reps 5 --transport copy,cuda-ipc --blocks 64,1024,4096 \
        --receiver-device cuda:1 2>/dev/null | grep -v '^\[' ; } 2>&1 | tee -a "$OUT/two-gpus.txt"
  done
  bench() { timeout 150 python3 -m kvferry.cli bench copy --device cuda --reps 5 "$@" 2>/dev/null | grep -v '^\[' ; }
  for round in 1 2; do
    for ring in pool 1024; do
      { echo "== round $round, staging to cuda:1, ring $ring"
        if [ $ring = pool ]; then bench --transport staging --blocks 1024,4096 --receiver-device cuda:1
        else bench --transport staging --blocks 1024,4096 --receiver-device cuda:1 --ring-mib $ring; fi
        echo "== round $round, staging on one GPU, ring $ring (the same call's baseline)"
        if [ $ring = pool ]; then bench --transport staging --blocks 1024,4096
        else bench --transport staging --blocks 1024,4096 --ring-mib $ring; fi ; } 2>&1 | tee -a "$OUT/two-gpus.txt"
    done
  done
elif [ "$1" = agentic-memory ]; then
  timeout 120 python3 -m pytest -m cuda -p no:cacheprovider --timeout 60 -rfE tests/test_bench_agentic_memory.py 2>&1 \
    | tail -4 | tee "$OUT/agentic-memory-tests.txt"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$OUT/agentic-memory.txt"
  for run in "--sessions 1 --aware" "--sessions 2 --aware" "--sessions 1"; do
    name=$(echo "$run" | tr -d ' -')
    { echo "== $run --layerwise 8 (free before: $(python3 -c 'import torch; print(torch.cuda.mem_get_info()[0])') bytes)"
      timeout "${LIMIT:-240}" python3 -m kvferry.cli bench agentic --device cuda --transport staging $run --cached 32768 \
        --new 2048 --layerwise 8 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --ffn 14336 \
        --vocab 1024 --png '' --json "$OUT/agentic-memory-$name.json" 2>&1 \
        | grep -E 'invalid run|device memory|OutOfMemory|outputs match|Error'
      echo "exit ${PIPESTATUS[0]}"; } 2>&1 | tee -a "$OUT/agentic-memory.txt"
  done
else  # bench
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
