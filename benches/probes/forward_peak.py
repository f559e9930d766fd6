"""What the reference model's forward holds at its allocator peak on CUDA: one prefill of
``--tokens`` tokens (then a later chunk) at the memory test's geometry, with torch's memory
history recorded; prints the peak next to `forward_peak_bytes`, the SDPA backends torch may
pick, and the allocations live at the peak, largest first, each with the frame of the model
that made it.

    PYTHONPATH=python python benches/probes/forward_peak.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from kvferry.geometry import Geometry
from kvferry.refengine.model import ModelConfig, TinyLlama, forward_peak_bytes, new_kv_pool

# The memory test's geometry (tests/test_bench_agentic_memory.py).
GEOMETRY = Geometry(layers=4, hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=2048, vocab=128)


def _frame(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in kvferry's model, else the innermost Python frame."""
    for f in frames:
        if "refengine" in f.get("filename", ""):
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    return f"{py[0]['filename'].rsplit('/', 1)[-1]}:{py[0]['line']} {py[0]['name']}" if py else "?"


def live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, list[tuple[int, str]]]:
    """Replays one device's allocator trace: the most bytes live at once after the first
    event, and the allocations live then."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: list[tuple[int, str]] = []
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _frame(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    return peak, sorted(at_peak, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    cfg = ModelConfig(GEOMETRY, dtype=torch.bfloat16)
    model = TinyLlama(cfg, "cuda")
    tpb = 32
    print(
        "sdpa backends enabled: flash",
        torch.backends.cuda.flash_sdp_enabled(),
        "mem-efficient",
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn",
        torch.backends.cuda.cudnn_sdp_enabled(),
        "math",
        torch.backends.cuda.math_sdp_enabled(),
    )
    n = args.tokens
    for start, end in [(0, n), (n - 96, n + 504)]:
        pool = new_kv_pool(cfg, -(-end // tpb), tpb, "cuda")
        table = torch.arange(pool.num_blocks, device="cuda")
        tokens = torch.randint(0, cfg.geometry.vocab, (end - start,), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=200000)  # noqa: SLF001
        model.forward(tokens, start, pool, table)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()  # noqa: SLF001
        torch.cuda.memory._record_memory_history(enabled=None)  # noqa: SLF001
        peak = torch.cuda.max_memory_allocated() - base
        bound = forward_peak_bytes(cfg, end - start, end, tpb)
        print(f"\n== tokens [{start}, {end}): peak {peak / 1e6:.1f} MB, forward_peak_bytes {bound / 1e6:.1f} MB")
        traced, live = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
        print(f"   the trace's peak {traced / 1e6:.1f} MB (allocations made inside the forward), live then:")
        for size, where in live[:24]:
            print(f"   {size / 1e6:10.2f} MB  {where}")


if __name__ == "__main__":
    main()
