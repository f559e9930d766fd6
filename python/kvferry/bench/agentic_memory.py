"""What `kvferry bench agentic` holds on the device, process by process, at its peak, and the
check that refuses (before anything is allocated) a run that would not fit.

```
context process (the bench's)                  generation process (a transport with an endpoint)
one copy of the weights                        one copy of the weights
a context pool per mode                        a generation pool per mode
staging: each mode's sender's scratch pools    staging: each mode's ring's scratch pools
the largest prefill chunk's transients         the longest decode step's transients
allocator slack, runtime                       allocator slack, runtime
```
Every mode's engine lives through the whole run (the modes take turns, each keeping its
prefix caches), so every pool is alive at the peak. The reference's weights and pool are
freed before the modes' are made, and hold less (one pool). With an in-process transport one
process holds both columns' pools, one copy of the weights and no scratch.

The largest prefill chunk is the warm-up turn's: nothing is cached yet, so the whole
``--cached`` conversation is one forward (or ``--chunk`` tokens at a time), and its causal
mask and SDPA's additive copy of it are ``cached x cached`` each
(`kvferry.refengine.model.forward_peak_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from kvferry.errors import InvalidArgumentError
from kvferry.refengine.model import forward_peak_bytes, weights_bytes
from kvferry.transports import registry
from kvferry.transports.staging import scratch_bytes

if TYPE_CHECKING:  # it imports this module
    from kvferry.bench.agentic import AgenticConfig

__all__ = [
    "ALLOCATOR_SLACK",
    "MIN_SLACK_BYTES",
    "RUNTIME_BYTES",
    "ProcessMemory",
    "check_device_memory",
    "memory_estimate",
]

# The CUDA caching allocator keeps freed blocks cached; those it cannot give back (segments
# still partly in use) come on top of the live bytes. Counted as this fraction of the
# forward's transients, the only allocations that come and go, and at least `MIN_SLACK_BYTES`:
# at Llama-8B geometry on an H100 (2026-12-07, every mode but --aware) each process reserved
# 2.2-2.4 GB more than its peak allocation, the generation process with 0.8 GB of transients.
ALLOCATOR_SLACK = 0.25
MIN_SLACK_BYTES = 5 << 29  # 2.5 GiB
# Per process: a CUDA context (about 0.5 GiB on an H100) and cuBLAS/cuDNN workspaces.
RUNTIME_BYTES = 1 << 30


@dataclass(frozen=True)
class ProcessMemory:
    """Device bytes one process of the run holds at its peak, by what holds them."""

    name: str
    weights: int
    pools: int  # its KV pools: ``pool_count`` of ``pool_blocks`` blocks
    pool_count: int
    pool_blocks: int
    scratch: int  # staging's scratch pools on the device
    transients: int  # the largest forward's (`forward_peak_bytes`)
    forward: tuple[int, int]  # that forward's (tokens, end)
    slack: int  # `ALLOCATOR_SLACK`
    runtime: int  # `RUNTIME_BYTES`

    @property
    def total(self) -> int:
        return self.weights + self.pools + self.scratch + self.transients + self.slack + self.runtime

    def terms(self) -> dict[str, int]:
        """Each term in bytes, and ``total``."""
        return {
            "weights": self.weights,
            "pools": self.pools,
            "scratch": self.scratch,
            "transients": self.transients,
            "slack": self.slack,
            "runtime": self.runtime,
            "total": self.total,
        }

    def describe(self) -> str:
        n, end = self.forward
        return (
            f"{self.name} process {self.total / 1e9:.1f} GB = weights {self.weights / 1e9:.1f} + "
            f"{self.pool_count} pools of {self.pool_blocks} blocks {self.pools / 1e9:.1f} + staging scratch "
            f"{self.scratch / 1e9:.1f} + forward transients {self.transients / 1e9:.1f} (a {n}-token forward "
            f"ending at {end}) + allocator slack {self.slack / 1e9:.1f} + runtime {self.runtime / 1e9:.1f}"
        )


def _prompt_lengths(cfg: AgenticConfig) -> list[int]:
    """Each turn's prompt, the warm-up's first: the conversation grows by the last turn's
    output and the new tokens."""
    step = cfg.new_tokens + cfg.output_tokens
    return [cfg.cached_tokens + t * step for t in range(cfg.turns + 1)]


def _prefill_forwards(cfg: AgenticConfig) -> Iterator[tuple[int, int]]:
    """(tokens, end) of every prefill forward of a session: the warm-up turn's from 0, each
    later turn's from the previous prompt, which the prefix cache holds (the pools are
    sized so that it does: `_pool_blocks`), in ``chunk_size`` pieces."""
    prompts = _prompt_lengths(cfg)
    chunk = cfg.chunk_size
    for start, end in zip([0] + prompts[:-1], prompts):
        step = chunk or (end - start)
        for s in range(start, end, step):
            yield min(step, end - s), min(s + step, end)


def memory_estimate(cfg: AgenticConfig) -> list[ProcessMemory]:
    """What each process of the run holds on ``cfg.device`` at its peak (`ProcessMemory`),
    for an `AgenticConfig`: the context process first, then the generation process when
    the transport has an endpoint (one process otherwise)."""
    from kvferry.bench.agentic import _pool_blocks

    c = cfg
    model = c.model_config()
    tpb = c.tokens_per_block
    modes = c.modes
    device = torch.device(c.device)
    blocks = _pool_blocks(c)
    pool = blocks * tpb * model.kv_bytes_per_token
    weights = weights_bytes(model)

    def largest(forwards: list[tuple[int, int]]) -> tuple[int, tuple[int, int]]:
        sized = [(forward_peak_bytes(model, n, end, tpb), (n, end)) for n, end in forwards]
        return max(sized)

    prefill = largest(list(_prefill_forwards(c)))
    last = _prompt_lengths(c)[-1]
    decode = largest([(1, last + c.output_tokens)])

    def process(name: str, pools: int, scratch: int, transients: tuple[int, tuple[int, int]]) -> ProcessMemory:
        return ProcessMemory(
            name,
            weights,
            pools * pool,
            pools,
            blocks,
            scratch,
            transients[0],
            transients[1],
            max(int(ALLOCATOR_SLACK * transients[0]), MIN_SLACK_BYTES),
            RUNTIME_BYTES,
        )

    if not registry.check(c.transport, device=device.type).has_endpoint:
        return [process("context+generation", 2 * len(modes), 0, max(prefill, decode))]
    scratch = 0
    if c.transport == "staging":
        layers = model.geometry.layers
        block_bytes = tpb * model.kv_bytes_per_token // layers
        groups = c.layer_groups
        for mode in modes:
            counts = [layers]
            if mode == "layerwise" and groups is not None:
                counts += [(g + 1) * layers // groups - g * layers // groups for g in range(groups)]
            scratch += scratch_bytes(block_bytes, counts, device)
    return [
        process("context", len(modes), scratch, prefill),
        process("generation", len(modes), scratch, decode),
    ]


def check_device_memory(cfg: AgenticConfig, free: int) -> list[ProcessMemory]:
    """Refuses a run whose processes together would hold more than ``free`` device bytes at
    their peak (`memory_estimate`), naming each process's figures and the flags that lower
    them; returns the estimate otherwise."""
    processes = memory_estimate(cfg)
    need = sum(p.total for p in processes)
    if need > free:
        raise InvalidArgumentError(
            f"invalid run: its processes need {need / 1e9:.1f} GB of device memory at their peak, more than the "
            f"device's free {free / 1e9:.1f} GB: "
            + "; ".join(p.describe() for p in processes)
            + ". Lower --sessions, --cached, --turns or --new (the pools), set --chunk (the prefill's transients), "
            "or run fewer modes (without --aware or --layerwise)"
        )
    return processes
