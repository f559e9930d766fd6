"""`kvferry bench fanout`: in-flight dedup. Several concurrent requests carry one shared
prefix to the same generation worker (n samples of one prompt, agent fan-out); without
dedup every request's prefix crosses the link, with it each shared block crosses once and the
other requests map and await it.

```
request 1:  [shared prefix ..............][own tail]   prefix crosses once
request 2:  [shared prefix, mapped to 1's][own tail]   waits for request 1's prefix
...
```
Both modes run disaggregated with early transfer; aggregated serving is the reference for
outputs, and every request's KV is checked block by block on both workers.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from kvferry.bench.util import emulated_link, machine, percentile, stderr_progress
from kvferry.geometry import FANOUT_MODEL, Geometry
from kvferry.refengine.model import ModelConfig, TinyLlama
from kvferry.refengine.serving import Aggregated, Disaggregated, Turn

__all__ = ["FanoutConfig", "format_fanout", "run_fanout"]


@dataclass(frozen=True)
class FanoutConfig:
    device: str = "cpu"
    requests: int = 8
    prefix_tokens: int = 8192
    suffix_tokens: int = 32  # each request's own tokens after the shared prefix
    output_tokens: int = 4
    tokens_per_block: int = 32  # as in `kvferry bench agentic`
    chunk_size: Optional[int] = 1024
    transport: str = "in-process"
    # CPU pools, in-process or shm: an emulated link rate (None: raw copies), as in
    # `kvferry bench agentic`.
    link_gbps: Optional[float] = 0.5
    model: Geometry = FANOUT_MODEL
    seed: int = 0  # the workload's (the model's weights have the geometry's own)

    def model_config(self) -> ModelConfig:
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        return ModelConfig(self.model, dtype=dtype)


def _pool_blocks(cfg: FanoutConfig) -> int:
    """Without dedup both workers hold every request's whole prompt at once."""
    return cfg.requests * -(-(cfg.prefix_tokens + cfg.suffix_tokens + cfg.output_tokens) // cfg.tokens_per_block) + 64


def run_fanout(cfg: FanoutConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    prefix = [rng.randrange(cfg.model.vocab) for _ in range(cfg.prefix_tokens)]
    turns = [
        Turn(
            i + 1, tuple(prefix + [rng.randrange(cfg.model.vocab) for _ in range(cfg.suffix_tokens)]), cfg.output_tokens
        )
        for i in range(cfg.requests)
    ]
    model = TinyLlama(cfg.model_config(), cfg.device)
    blocks = _pool_blocks(cfg)
    progress(f"reference: aggregated serving of {cfg.requests} requests sharing a {cfg.prefix_tokens}-token prefix")
    reference = Aggregated(
        model, num_blocks=blocks, tokens_per_block=cfg.tokens_per_block, chunk_size=cfg.chunk_size
    ).run(turns)
    emulated = cfg.link_gbps if emulated_link(cfg.device, cfg.transport) else None
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "machine": machine(cfg.device),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "outputs_match": True,
        "kv_mismatch_blocks": 0,
    }
    for mode in ("without_dedup", "with_dedup"):
        progress(f"{mode.replace('_', ' ')}: {cfg.requests} requests over {cfg.transport}")
        engine = Disaggregated(
            model,
            num_blocks=blocks,
            tokens_per_block=cfg.tokens_per_block,
            chunk_size=cfg.chunk_size,
            transport=cfg.transport,
            link_gbps=emulated,
            record=True,
            dedup=mode == "with_dedup",
        )
        try:
            got = engine.run(turns, check_kv=True)
            records = engine.hook.sender.records or []
        finally:
            engine.close()
        kv_ready = [(got[t.request_id].kv_ready - got[t.request_id].admitted) * 1e3 for t in turns]
        result["outputs_match"] &= all(got[t.request_id].outputs == reference[t.request_id].outputs for t in turns)
        result["kv_mismatch_blocks"] += sum(got[t.request_id].kv_mismatch_blocks for t in turns)
        result[mode] = {
            "bytes_on_wire": sum(rec.nbytes for rec in records),
            "blocks_sent": sum(n.end - n.start for t in turns for n in got[t.request_id].notices),
            "kv_ready_ms_p50": statistics.median(kv_ready),
            "kv_ready_ms_p90": percentile(kv_ready, 0.9),
            "kv_ready_ms_max": max(kv_ready),
        }
    result["bytes_ratio"] = result["with_dedup"]["bytes_on_wire"] / max(1, result["without_dedup"]["bytes_on_wire"])
    return result


def format_fanout(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"{result['machine']}, {result['date']}: {cfg['requests']} concurrent requests, "
        f"{cfg['prefix_tokens']}-token shared prefix + "
        f"{cfg['suffix_tokens']} own tokens, tpb {cfg['tokens_per_block']}, transport {cfg['transport']}",
        f"{'':<15} {'bytes on wire':>14} {'blocks sent':>12} {'KV-ready p50':>13} {'p90':>9} {'max':>9}",
    ]
    for mode in ("without_dedup", "with_dedup"):
        m = result[mode]
        lines.append(
            f"{mode.replace('_', ' '):<15} {m['bytes_on_wire'] / 1e6:>11.1f} MB {m['blocks_sent']:>12} "
            f"{m['kv_ready_ms_p50']:>10.1f} ms "
            f"{m['kv_ready_ms_p90']:>6.1f} ms {m['kv_ready_ms_max']:>6.1f} ms"
        )
    lines.append(
        f"dedup moves {100 * result['bytes_ratio']:.1f}% of the bytes; KV blocks differing between the "
        f"workers: {result['kv_mismatch_blocks']}; "
        f"outputs match aggregated: {result['outputs_match']}"
    )
    return "\n".join(lines)


progress_to_stderr = stderr_progress("bench fanout")
