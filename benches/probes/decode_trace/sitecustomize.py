"""Decode-step tracing for `benches/probes/gpu_divergence.py`: imported at interpreter start
(this folder first on PYTHONPATH) by every process of a run, the spawned generation workers
included, it patches the reference model when ``KVFERRY_TRACE_DIR`` is set. For each
one-token forward (a decode step) it appends to ``<dir>/<pid>.jsonl`` an exact checksum of
every input and output of each layer's attention and norms, and the top two logits."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

TRACE_DIR = os.environ.get("KVFERRY_TRACE_DIR")


def _checksum(t: Any) -> Optional[int]:
    """An exact, position-weighted checksum of a tensor's bits (a changed bit changes it)."""
    import torch

    if t is None:
        return None
    flat = t.detach().contiguous().view(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(ints).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 1_000_003 + 1
    return int((bits * weights).sum().item())


def _install(trace_dir: Path) -> None:
    import torch
    from kvferry.refengine import model

    current: dict[str, Any] = {"record": None}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rms = model.TinyLlama._rms
    forward = model.TinyLlama.forward

    def traced_sdpa(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        out = sdpa(q, k, v, *args, **kwargs)
        record = current["record"]
        if record is not None:
            record["attn"].append(
                [_checksum(q), _checksum(k), _checksum(v), _checksum(kwargs.get("attn_mask")), _checksum(out)]
            )
        return out

    def traced_rms(self: Any, x: Any, weight: Any) -> Any:
        out = rms(self, x, weight)
        record = current["record"]
        if record is not None:
            record["norm"].append([_checksum(x), _checksum(out)])
        return out

    def traced_forward(self: Any, tokens: Any, start: int, kv: Any, block_table: Any, *args: Any, **kwargs: Any) -> Any:
        if tokens.numel() != 1:
            return forward(self, tokens, start, kv, block_table, *args, **kwargs)
        tpb = kv.tokens_per_block
        record: dict[str, Any] = {
            "pid": os.getpid(),
            "pool": id(kv),
            "start": int(start),
            "token": int(tokens[0]),
            "attn": [],
            "norm": [],
        }
        record["blocks"] = [int(b) for b in block_table[: -(-(start + 1) // tpb)][-2:].tolist()]
        current["record"] = record
        try:
            logits = forward(self, tokens, start, kv, block_table, *args, **kwargs)
        finally:
            current["record"] = None
        top = torch.topk(logits.float(), 2)
        record["top"] = [[int(i) for i in top.indices.tolist()], [float(v) for v in top.values.tolist()]]
        record["logits"] = _checksum(logits)
        with open(trace_dir / f"{os.getpid()}.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")
        return logits

    torch.nn.functional.scaled_dot_product_attention = traced_sdpa
    model.TinyLlama._rms = traced_rms  # type: ignore[method-assign]
    model.TinyLlama.forward = traced_forward  # type: ignore[method-assign]


if TRACE_DIR:
    _install(Path(TRACE_DIR))
