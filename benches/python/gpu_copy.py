"""Fused block copy on one GPU: correctness against torch on random data with a poisoned
destination, then bandwidth with CUDA events next to the device-to-device copy ceiling and
torch's index_select + index_copy_, all measured in the same run.

    python benches/python/gpu_copy.py [--json PATH] [--quick]

Payload bandwidth counts each copied byte once; the ceiling is a large ``dst.copy_(src)``
counting bytes read plus written, so a perfect block copy reaches half of it as payload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch

from kvferry import _triton_copy
from kvferry.copy import checked_pairs, copy_blocks, copy_blocks_torch
from kvferry.layout import PagedKV

POISON = 0x7B  # a byte pattern no random fill is likely to leave everywhere


def time_ms(fn: Callable[[], None], reps: int, warmup: int = 5) -> float:
    """Median of ``reps`` CUDA-event timings after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def random_pool(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: str, block_dim: int, tpb: int) -> PagedKV:
    layers = []
    for _ in range(num_layers):
        raw = torch.randint(-(2**31), 2**31 - 1, (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() // 4,), dtype=torch.int32, device=device)
        layers.append(raw.view(dtype).view(shape))
    return PagedKV(tuple(layers), tpb, block_dim)


def poisoned_like(pool: PagedKV, num_blocks: int) -> PagedKV:
    shape = list(pool.shape)
    shape[pool.block_dim] = num_blocks
    nbytes = torch.Size(shape).numel() * pool.layers[0].element_size()
    layers = tuple(
        torch.full((nbytes,), POISON, dtype=torch.uint8, device=pool.device).view(pool.dtype).view(shape)
        for _ in range(pool.num_layers)
    )
    return PagedKV(layers, pool.tokens_per_block, pool.block_dim)


def check_correctness(device: str) -> list[str]:
    """Every dtype, odd counts, both block dims, CPU<->GPU: fused path equals torch path bit
    for bit, and blocks not written keep their poison."""
    failures = []
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
    for dtype in dtypes:
        for block_dim, shape in ((0, (37, 2, 16, 4, 64)), (1, (2, 37, 16, 4, 64))):
            for n in (1, 7, 33):
                src = random_pool(5, shape, dtype, device, block_dim, 16)
                src_ids = torch.randperm(37, generator=gen)[:n]
                dst_ids = torch.randperm(41, generator=gen)[:n]
                got = poisoned_like(src, 41)
                want = poisoned_like(src, 41)
                copy_blocks(src, got, src_ids, dst_ids)
                copy_blocks_torch(src, want, src_ids, dst_ids)
                torch.cuda.synchronize()
                same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got.layers, want.layers))
                untouched = sorted(set(range(41)) - set(dst_ids.tolist()))
                idx = torch.tensor(untouched, device=device)
                poison_kept = all(
                    bool((layer.index_select(block_dim, idx).contiguous().view(torch.uint8) == POISON).all())
                    for layer in got.layers
                )
                # Independent check against a plain Python-indexed reference.
                ref_ok = all(
                    torch.equal(
                        g.select(block_dim, int(d)).contiguous().view(torch.uint8),
                        s.select(block_dim, int(si)).contiguous().view(torch.uint8),
                    )
                    for g, s in zip(got.layers, src.layers)
                    for si, d in zip(src_ids, dst_ids)
                )
                if not (same and poison_kept and ref_ok):
                    failures.append(f"{dtype} block_dim={block_dim} n={n}: same={same} poison={poison_kept} ref={ref_ok}")
    # Pools on different devices (host <-> device) take the torch path.
    for a, b in (("cpu", device), (device, "cpu")):
        src = random_pool(3, (9, 2, 16, 4, 64), torch.bfloat16, a, 0, 16)
        dst = poisoned_like(random_pool(3, (11, 2, 16, 4, 64), torch.bfloat16, b, 0, 16), 11)
        copy_blocks(src, dst, [8, 0, 3], [1, 10, 4])
        torch.cuda.synchronize()
        ok = all(torch.equal(d[[1, 10, 4]].cpu().view(torch.uint8), s[[8, 0, 3]].cpu().view(torch.uint8)) for s, d in zip(src.layers, dst.layers))
        if not ok:
            failures.append(f"cross-device {a}->{b}")
    return failures


def time_queued_ms(fn: Callable[[], None], reps: int, warmup: int = 5) -> float:
    """Median device time of one call, its host-side launch hidden: the GPU is kept busy with
    a sleep kernel while the host issues the call, so the events bracket only device work
    (the situation of a copy queued behind a forward on a stream)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # about 1 ms at 1.98 GHz: longer than any host launch
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_back_to_back_ms(fn: Callable[[], None], calls: int = 20, reps: int = 10) -> float:
    """Median per-call time of ``calls`` launches queued back to back (host runs ahead)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def host_overhead_us(src: PagedKV, dst: PagedKV, device: str, n: int = 8, calls: int = 200) -> dict[str, float]:
    """Where an 8-block copy spends host time: validation, moving the ids, the launch."""
    s_ids = np.arange(n, dtype=np.int64)
    d_ids = np.arange(n, dtype=np.int64) + 100
    ids = torch.from_numpy(np.stack([s_ids, d_ids])).to(device)
    steps: dict[str, Callable[[], object]] = {
        "validate": lambda: checked_pairs(src, dst, s_ids, d_ids),
        "ids_pinned_async": lambda: torch.from_numpy(np.stack([s_ids, d_ids])).pin_memory().to(device, non_blocking=True),
        "ids_pageable": lambda: torch.from_numpy(np.stack([s_ids, d_ids])).to(device),
        "launch": lambda: _triton_copy.copy_blocks(src, dst, ids),
        "copy_blocks": lambda: copy_blocks(src, dst, s_ids, d_ids),
    }
    out = {}
    for name, fn in steps.items():
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        out[name] = statistics.median(times)
    return out


def sweep_configs() -> list[_triton_copy.LaunchConfig]:
    configs = []
    for chunk in (1024, 2048, 4096, 8192, 16384):
        for block in (1024, 2048, 4096):
            for warps in (4, 8, 16):
                for hints in (True, False):
                    if block <= chunk and block // (32 * warps) >= 2:
                        configs.append(_triton_copy.LaunchConfig(chunk, block, warps, hints))
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time 80 launch configurations per size")
    args = parser.parse_args()
    device = "cuda"
    reps = 10 if args.quick else 50
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")

    failures = check_correctness(device)
    print("correctness:", "OK" if not failures else failures)

    # Ceiling: a large contiguous copy, bytes read + written.
    big = torch.empty(4 * 1024**3, dtype=torch.uint8, device=device)
    big2 = torch.empty_like(big)
    ms = time_ms(lambda: big2.copy_(big), reps)
    ceiling = 2 * big.numel() / ms / 1e9  # TB/s (read + write)
    del big, big2
    print(f"ceiling: device-to-device copy {ceiling:.2f} TB/s read+write ({ceiling / 2:.2f} TB/s payload)")

    layers, pool_blocks = 32, 4096 + 64
    shape = (pool_blocks, 2, 32, 8, 128)  # 128 KiB per block per layer, bf16
    src = random_pool(layers, shape, torch.bfloat16, device, 0, 32)
    dst = random_pool(layers, shape, torch.bfloat16, device, 0, 32)
    configs = sweep_configs() if args.sweep else [_triton_copy.SMALL, _triton_copy.LARGE]
    rows, sweep = [], []
    for n in (8, 64, 1024, 4096):
        s_ids = torch.randperm(pool_blocks)[:n].numpy()
        d_ids = torch.randperm(pool_blocks)[:n].numpy()
        ids = torch.from_numpy(np.stack([s_ids, d_ids])).to(device)
        payload = n * src.block_bytes * layers
        results = []
        for config in configs:
            t = time_ms(lambda: _triton_copy.copy_blocks(src, dst, ids, config), max(5, reps // 3))
            results.append((t, config))
            sweep.append({"blocks": n, "ms": t, **config.__dict__})
        results.sort(key=lambda r: r[0])
        best_t, best = results[0]
        best_t = time_ms(lambda: _triton_copy.copy_blocks(src, dst, ids, best), reps)
        default_t = time_ms(lambda: _triton_copy.copy_blocks(src, dst, ids), reps)
        api_t = time_ms(lambda: copy_blocks(src, dst, s_ids, d_ids), reps)
        api_b2b = time_back_to_back_ms(lambda: copy_blocks(src, dst, s_ids, d_ids))
        kernel_b2b = time_back_to_back_ms(lambda: _triton_copy.copy_blocks(src, dst, ids))
        queued_t = time_queued_ms(lambda: _triton_copy.copy_blocks(src, dst, ids), reps)
        api_queued_t = time_queued_ms(lambda: copy_blocks(src, dst, s_ids, d_ids), reps)
        torch_t = time_ms(lambda: copy_blocks_torch(src, dst, s_ids, d_ids), max(5, reps // 5))
        row = {"blocks": n, "payload_mb": payload / 1e6, "best_config": best.__dict__}
        for key, t in (("best", best_t), ("default", default_t), ("kernel_b2b", kernel_b2b), ("api", api_t), ("api_b2b", api_b2b), ("queued", queued_t), ("api_queued", api_queued_t), ("torch", torch_t)):
            row[f"{key}_ms"] = t
            row[f"{key}_tbps"] = payload / t / 1e9
        row["default_config"] = _triton_copy.pick_config(payload).__dict__
        row["default_share_of_ceiling"] = 2 * row["default_tbps"] / ceiling
        row["speedup_vs_torch"] = torch_t / default_t
        rows.append(row)
        print(f"{n} blocks: top configs", [(round(t, 4), c.__dict__) for t, c in results[:3]])
    overhead = host_overhead_us(src, dst, device)
    print("host time per call (us, median of 200):", {k: round(v, 1) for k, v in overhead.items()})
    print()
    print(f"ceiling {ceiling:.2f} TB/s read+write; payload TB/s below (share = 2 x payload / ceiling)")
    print("| blocks | payload | device time, queued (share of ceiling) | copy_blocks() queued | one call incl. host launch | kernel back-to-back | copy_blocks() one call | best of sweep | torch index ops | queued vs torch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['blocks']} | {r['payload_mb']:.0f} MB | {r['queued_tbps']:.2f} ({100 * 2 * r['queued_tbps'] / ceiling:.0f}%, {r['queued_ms']:.3f} ms) "
            f"| {r['api_queued_tbps']:.2f} | {r['default_tbps']:.2f} ({r['default_ms']:.3f} ms) | {r['kernel_b2b_tbps']:.2f} "
            f"| {r['api_tbps']:.2f} ({r['api_ms']:.3f} ms) | {r['best_tbps']:.2f} | {r['torch_tbps']:.2f} | {r['torch_ms'] / r['queued_ms']:.1f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "ceiling_tbps_rw": ceiling, "rows": rows, "host_overhead_us": overhead, "sweep": sweep, "correctness_failures": failures}, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
