"""What the per-block checksum (kvferry.checksum) costs next to the transfer it guards, at
Llama-8B geometry: 32 layers of 8 KV heads, head dim 128, 16-token blocks, bf16 (K and V:
2 MiB a block over all layers).

For each ``--blocks`` count: the sums of that many scattered blocks alone (one side; CPU:
the Rust core, wall time; CUDA: the Triton kernel, CUDA events after a warm-up), then per
``--transports`` the transfer end to end (`kvferry bench copy`'s rows: a KVSender's send,
flush and the receiver's completion, median of ``--reps`` after a warm-up) with checksums
off and on. Prints the medians and two ratios: both sides' sums over the transfer
(``2*sum/xfer``), and what turning them on added to the transfer (``(on-off)/off``).

    python benches/probes/checksum_cost.py                                   # CPU
    python benches/probes/checksum_cost.py --device cuda --blocks 64,1024 --transports cuda-ipc,staging
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

LAYERS, HEADS, HEAD_DIM, TOKENS = 32, 8, 128, 16
BLOCK_BYTES = LAYERS * 2 * TOKENS * HEADS * HEAD_DIM * 2  # 2 MiB


def llama8b_pool(num_blocks: int, device: str):  # type: ignore[no-untyped-def]
    """vLLM's layer-outer cache at Llama-8B geometry: per layer (K|V, blocks, tokens, heads, dim)."""
    from kvferry.layout import PagedKV

    layers = []
    for _ in range(LAYERS):
        t = torch.empty((2, num_blocks, TOKENS, HEADS, HEAD_DIM), dtype=torch.int16, device=device)
        t.random_(-(2**15), 2**15)
        layers.append(t.view(torch.bfloat16))
    return PagedKV(tuple(layers), TOKENS, block_dim=1)


def sum_ms(pool, ids: np.ndarray, device: str, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of summing blocks ``ids`` of ``pool`` (one side's cost)."""
    from kvferry.checksum import block_checksums, device_checksums

    times = []
    for i in range(reps + 1):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            device_checksums(pool, ids)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            block_checksums(pool, ids)
            elapsed = (time.perf_counter() - t0) * 1e3
        if i:  # the first call compiles the kernel and warms the caches
            times.append(elapsed)
    return statistics.median(times)


def transfer_ms(device: str, transports: tuple[str, ...], blocks: tuple[int, ...], reps: int, on: bool) -> dict:  # type: ignore[type-arg]
    """``{(transport, blocks): median ms}`` of `kvferry bench copy`'s end-to-end rows, at
    2 MiB blocks (32 layers of 64 KiB), checksums ``on`` or off."""
    from kvferry.bench.copy import CopyBenchConfig, run_copy_bench

    cfg = CopyBenchConfig(
        device=device, transports=transports, blocks=blocks, layers=LAYERS, block_kib=64, reps=reps, checksum=on
    )
    rows = run_copy_bench(cfg)["rows"]
    return {(r["transport"], r["blocks"]): r["seconds"] * 1e3 for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--blocks", default=None, help="comma-separated counts (default: 64,256 on cpu, 64,1024 on cuda)"
    )
    parser.add_argument("--transports", default=None, help="default: in-process,shm on cpu, cuda-ipc,staging on cuda")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    cpu = args.device == "cpu"
    blocks = tuple(int(b) for b in (args.blocks or ("64,256" if cpu else "64,1024")).split(","))
    transports = tuple((args.transports or ("in-process,shm" if cpu else "cuda-ipc,staging")).split(","))
    pool = llama8b_pool(max(blocks) + 64, args.device)
    rng = np.random.default_rng(0)
    sums = {n: sum_ms(pool, rng.permutation(pool.num_blocks)[:n], args.device, args.reps) for n in blocks}
    del pool
    off = transfer_ms(args.device, transports, blocks, args.reps, False)
    on = transfer_ms(args.device, transports, blocks, args.reps, True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"checksum cost at Llama-8B geometry (2 MiB blocks), {name}, median of {args.reps}")
    print(f"{'blocks':>6} {'sum ms':>8} {'sum GB/s':>8}  {'transport':<10} {'off ms':>8} {'on ms':>8} "
          f"{'2*sum/xfer':>10} {'(on-off)/off':>12}")  # fmt: skip
    for n in blocks:
        gbps = n * BLOCK_BYTES / sums[n] / 1e6
        for t in transports:
            if (t, n) not in off:
                continue
            a, b = off[(t, n)], on[(t, n)]
            print(f"{n:>6} {sums[n]:>8.3f} {gbps:>8.1f}  {t:<10} {a:>8.2f} {b:>8.2f} "
                  f"{2 * sums[n] / a:>10.1%} {(b - a) / a:>12.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
