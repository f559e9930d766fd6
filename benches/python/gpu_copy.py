"""Fused block copy on one GPU: bandwidth with CUDA events next to the device-to-device copy
ceiling and torch's index_select + index_copy_, all measured in the same run, each size
verified byte for byte on a poisoned destination (the full correctness matrix is the `cuda`
tests of tests/test_copy.py: run them in the same call).

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


def _median_event_ms(
    fn: Callable[[], None], reps: int, *, calls: int = 1, queued: bool = False, warmup: int = 5
) -> float:
    """Median CUDA-event time of ``calls`` back-to-back calls of ``fn``, divided by ``calls``.
    ``queued``: a sleep kernel keeps the GPU busy while the host issues the calls, so the
    events bracket device work only (a copy queued behind a forward on its stream)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(2_000_000)  # about 1 ms at 1.98 GHz: longer than any host launch
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def time_ms(fn: Callable[[], None], reps: int) -> float:
    """One call on an idle GPU: host launch overhead included."""
    return _median_event_ms(fn, reps)


def time_queued_ms(fn: Callable[[], None], reps: int) -> float:
    """One call's device time, its host launch hidden behind queued work."""
    return _median_event_ms(fn, reps, queued=True)


def time_back_to_back_ms(fn: Callable[[], None], reps: int = 10) -> float:
    """Per-call time of 20 calls queued back to back (the host runs ahead of the GPU)."""
    return _median_event_ms(fn, reps, calls=20)


def bench_pool(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, block_dim: int, tpb: int) -> PagedKV:
    """A pool of random bits filled on the device (gigabytes: too slow to fill on the host)."""
    words = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() // 4
    layers = tuple(
        torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device="cuda").view(dtype).view(shape)
        for _ in range(num_layers)
    )
    return PagedKV(layers, tpb, block_dim)


def verify(src: PagedKV, dst: PagedKV, s_ids: np.ndarray, d_ids: np.ndarray) -> bool:
    """Poisons the destination blocks, copies once more, and compares byte for byte with the
    source blocks (the full dtype/layout matrix is tests/test_copy.py's `cuda` tests)."""
    s, d = torch.from_numpy(s_ids).cuda(), torch.from_numpy(d_ids).cuda()
    for layer in dst.layers:
        layer.view(torch.uint8).view(dst.num_blocks, -1).index_fill_(0, d, POISON)
    copy_blocks(src, dst, s_ids, d_ids)
    torch.cuda.synchronize()
    return all(
        torch.equal(dl.view(torch.uint8).view(dst.num_blocks, -1)[d], sl.view(torch.uint8).view(src.num_blocks, -1)[s])
        for sl, dl in zip(src.layers, dst.layers)
    )


def host_overhead_us(src: PagedKV, dst: PagedKV, device: str, n: int = 8, calls: int = 200) -> dict[str, float]:
    """Where an 8-block copy spends host time: validation, moving the ids, the launch."""
    s_ids = np.arange(n, dtype=np.int64)
    d_ids = np.arange(n, dtype=np.int64) + 100
    ids = torch.from_numpy(np.stack([s_ids, d_ids])).to(device)
    steps: dict[str, Callable[[], object]] = {
        "validate": lambda: checked_pairs(src, dst, s_ids, d_ids),
        "ids_pinned_async": lambda: (
            torch.from_numpy(np.stack([s_ids, d_ids])).pin_memory().to(device, non_blocking=True)
        ),
        "ids_pageable": lambda: torch.from_numpy(np.stack([s_ids, d_ids])).to(device),
        "launch": lambda: _triton_copy.copy_blocks(src, dst, ids),
        "launch_triton_jit": lambda: _jit_launch(src, dst, ids),
        "ring_stage_and_launch": _no_graphs(lambda: _triton_copy.copy_packed(src, dst, np.stack([s_ids, d_ids]))),
        "graph_stage_and_replay": lambda: _triton_copy.copy_packed(src, dst, np.stack([s_ids, d_ids])),
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


def _jit_launch(src: PagedKV, dst: PagedKV, ids: torch.Tensor) -> None:
    """A launch through Triton's JIT call (what `_triton_copy` does before its fast path)."""
    saved = dict(_triton_copy._compiled)
    _triton_copy._compiled.clear()
    try:
        _triton_copy.copy_blocks(src, dst, ids)
    finally:
        _triton_copy._compiled.update(saved)


def _device_ids(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with every batch's ids copied to the GPU first (no reads over PCIe)."""

    def run() -> None:
        limit = _triton_copy.HOST_READ_MAX_PAIRS
        _triton_copy.HOST_READ_MAX_PAIRS = 0
        try:
            fn()
        finally:
            _triton_copy.HOST_READ_MAX_PAIRS = limit

    return run


def _no_graphs(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with small batches launched directly instead of replaying captured graphs."""

    def run() -> None:
        _triton_copy.USE_GRAPHS = False
        try:
            fn()
        finally:
            _triton_copy.USE_GRAPHS = True

    return run


def sweep_configs() -> list[_triton_copy.LaunchConfig]:
    """110 launch shapes. Blocks of 8192 and 16384 words (one load of a whole chunk per
    program before its store) and 32 warps keep more bytes in flight per SM than the first
    sweep's 80 shapes did, which is what a faster memory (the H200's) may need."""
    configs = []
    for chunk in (1024, 2048, 4096, 8192, 16384):
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16, 32):
                for hints in (True, False):
                    if block <= chunk and block // (32 * warps) >= 2:
                        configs.append(_triton_copy.LaunchConfig(chunk, block, warps, hints))
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time 110 launch configurations per size")
    args = parser.parse_args()
    device = "cuda"
    reps = 10 if args.quick else 50
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")

    failures: list[str] = []

    # Ceiling: a large contiguous copy, bytes read + written.
    big = torch.empty(4 * 1024**3, dtype=torch.uint8, device=device)
    big2 = torch.empty_like(big)
    ms = time_ms(lambda: big2.copy_(big), reps)  # noqa: F821 (deleted below, after its last call)
    ceiling = 2 * big.numel() / ms / 1e9  # TB/s (read + write)
    del big, big2
    print(f"ceiling: device-to-device copy {ceiling:.2f} TB/s read+write ({ceiling / 2:.2f} TB/s payload)")

    layers, pool_blocks = 32, 4096 + 64
    shape = (pool_blocks, 2, 32, 8, 128)  # 128 KiB per block per layer, bf16
    src = bench_pool(layers, shape, torch.bfloat16, 0, 32)
    dst = bench_pool(layers, shape, torch.bfloat16, 0, 32)
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
        api_devids_t = time_ms(_no_graphs(_device_ids(lambda: copy_blocks(src, dst, s_ids, d_ids))), reps)
        api_nographs_t = time_ms(_no_graphs(lambda: copy_blocks(src, dst, s_ids, d_ids)), reps)
        api_devids_queued_t = time_queued_ms(_no_graphs(_device_ids(lambda: copy_blocks(src, dst, s_ids, d_ids))), reps)
        api_b2b = time_back_to_back_ms(lambda: copy_blocks(src, dst, s_ids, d_ids))
        kernel_b2b = time_back_to_back_ms(lambda: _triton_copy.copy_blocks(src, dst, ids))
        queued_t = time_queued_ms(lambda: _triton_copy.copy_blocks(src, dst, ids), reps)
        api_queued_t = time_queued_ms(lambda: copy_blocks(src, dst, s_ids, d_ids), reps)
        torch_t = time_ms(lambda: copy_blocks_torch(src, dst, s_ids, d_ids), max(5, reps // 5))
        if not verify(src, dst, s_ids, d_ids):
            failures.append(f"{n} blocks: copied bytes differ from the source")
        row = {"blocks": n, "payload_mb": payload / 1e6, "best_config": best.__dict__}
        for key, t in (
            ("best", best_t),
            ("default", default_t),
            ("kernel_b2b", kernel_b2b),
            ("api", api_t),
            ("api_device_ids", api_devids_t),
            ("api_no_graphs", api_nographs_t),
            ("api_device_ids_queued", api_devids_queued_t),
            ("api_b2b", api_b2b),
            ("queued", queued_t),
            ("api_queued", api_queued_t),
            ("torch", torch_t),
        ):
            row[f"{key}_ms"] = t
            row[f"{key}_tbps"] = payload / t / 1e9
        row["default_config"] = _triton_copy.pick_config(payload).__dict__
        row["default_share_of_ceiling"] = 2 * row["default_tbps"] / ceiling
        row["speedup_vs_torch"] = torch_t / default_t
        rows.append(row)
        print(f"{n} blocks: top configs", [(round(t, 4), c.__dict__) for t, c in results[:3]])
    print("correctness:", "OK" if not failures else failures)
    overhead = host_overhead_us(src, dst, device)
    print("host time per call (us, median of 200):", {k: round(v, 1) for k, v in overhead.items()})
    print()
    print(f"ceiling {ceiling:.2f} TB/s read+write; payload TB/s below (share = 2 x payload / ceiling)")
    print(
        (
            "| blocks | payload | device time, queued (share of ceiling) | copy_blocks() queued | one call incl. "
            "host launch | kernel back-to-back | copy_blocks() one call | best of sweep | torch index ops | queued "
            "vs torch | one call, ids copied to the GPU | queued, ids copied to the GPU | one call, no graph |"
        )
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['blocks']} | {r['payload_mb']:.0f} MB | {r['queued_tbps']:.2f} "
            f"({100 * 2 * r['queued_tbps'] / ceiling:.0f}%, {r['queued_ms']:.3f} ms) "
            f"| {r['api_queued_tbps']:.2f} | {r['default_tbps']:.2f} ({r['default_ms']:.3f} ms) | "
            f"{r['kernel_b2b_tbps']:.2f} "
            f"| {r['api_tbps']:.2f} ({r['api_ms']:.3f} ms) | {r['best_tbps']:.2f} | {r['torch_tbps']:.2f} | "
            f"{r['torch_ms'] / r['queued_ms']:.1f}x | {r['api_device_ids_tbps']:.2f} | "
            f"{r['api_device_ids_queued_tbps']:.2f} | {r['api_no_graphs_tbps']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": props.name,
                    "ceiling_tbps_rw": ceiling,
                    "rows": rows,
                    "host_overhead_us": overhead,
                    "sweep": sweep,
                    "correctness_failures": failures,
                },
                f,
                indent=2,
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
