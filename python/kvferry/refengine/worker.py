"""One worker of the reference engine: a model, its paged KV pool, an allocator and a prefix
cache, and the per-request state a scheduler drives (admit, prefill chunks, decode, finish).

Source leases. On a context worker a request's blocks, the prefix-cache blocks it reuses
included, are read by its transfer until the hook lets go of them (`TransferHook.leased`).
`finish` of a request whose blocks are still leased (an abort, say, while an early copy is
queued) parks them: they keep their references, so neither a prefix-cache eviction nor an
allocation can take them, and `reap` (run by every `admit`) releases them once the lease
ended.

```
admit: ref(reused) + allocate --> copies queued --finish--> parked (refs held) --lease ends--> released
                                                                               (reap)          cached blocks idle
```
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kvferry.copy import copy_blocks
from kvferry.layout import PagedKV
from kvferry.refengine.cache import BlockAllocator, PrefixCache
from kvferry.refengine.model import ModelConfig, TinyLlama, new_kv_pool

__all__ = ["Worker", "RequestState"]


@dataclass
class RequestState:
    request_id: int
    tokens: list[int]  # prompt, then generated tokens as they come
    prompt_len: int
    reused_len: int
    blocks: list[int]
    computed: int  # tokens whose KV is in the pool
    shared: int = 0  # leading blocks shared with the prefix cache (read-only)
    outputs: list[int] = field(default_factory=list)

    def table(self) -> np.ndarray:
        return np.asarray(self.blocks, dtype=np.int64)


class Worker:
    def __init__(
        self,
        model: TinyLlama,
        *,
        num_blocks: int,
        tokens_per_block: int,
        prefix_cache: bool = True,
        pool: Optional[PagedKV] = None,
    ) -> None:
        """``pool``: a KV pool made elsewhere (in shared memory, say); a fresh one if omitted."""
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.tpb = tokens_per_block
        self.pool: PagedKV = (
            pool if pool is not None else new_kv_pool(model.cfg, num_blocks, tokens_per_block, model.device)
        )
        self.alloc = BlockAllocator(num_blocks)
        self.cache: Optional[PrefixCache] = PrefixCache(tokens_per_block, self.alloc) if prefix_cache else None
        self.requests: dict[int, RequestState] = {}
        # Whether a request's blocks are still read by its transfer (`TransferHook.leased`
        # on a context worker); none are by default.
        self.leased: Callable[[int], bool] = lambda request_id: False
        self._parked: dict[int, list[int]] = {}  # finished, blocks still leased

    def admit(self, request_id: int, prompt: Sequence[int]) -> RequestState:
        """Finds the cached prefix, allocates the rest, and copies a partially reused block."""
        self.reap()
        prompt = list(prompt)
        hit = self.cache.lookup(prompt, len(prompt) - 1) if self.cache is not None else None
        shared = hit.blocks if hit is not None else []
        self.alloc.ref(shared)
        fresh = self.alloc.allocate(-(-len(prompt) // self.tpb) - len(shared))
        reused = len(shared) * self.tpb
        if hit is not None and hit.partial_block is not None:
            copy_blocks(self.pool, self.pool, [hit.partial_block], [fresh[0]])  # copy on write
            reused += hit.partial_tokens
        state = RequestState(request_id, prompt, len(prompt), reused, shared + fresh, reused, shared=len(shared))
        self.requests[request_id] = state
        return state

    def admit_with_blocks(
        self, request_id: int, prompt: Sequence[int], blocks: Sequence[int], computed: int
    ) -> RequestState:
        """A request whose KV arrives from elsewhere (the generation side of disaggregation)."""
        state = RequestState(request_id, list(prompt), len(prompt), 0, list(blocks), computed)
        self.requests[request_id] = state
        return state

    def forward(self, request_id: int, end: int, on_layer: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Computes tokens ``[computed, end)`` of the request; returns the last logits.
        ``on_layer``: see `TinyLlama.forward` (called as each layer's KV is in the pool)."""
        state = self.requests[request_id]
        tokens = torch.tensor(state.tokens[state.computed : end], device=self.model.device)
        table = torch.as_tensor(state.table(), device=self.model.device)
        logits = self.model.forward(tokens, state.computed, self.pool, table, on_layer=on_layer)
        state.computed = end
        return logits

    def decode(self, request_id: int, max_new_tokens: int, first_token: int) -> list[int]:
        """Greedy decoding from ``first_token`` (already produced by prefill)."""
        outputs = [first_token]
        while len(outputs) < max_new_tokens:
            outputs.append(self.step(request_id, outputs[-1]))
        return outputs

    def step(self, request_id: int, token: int) -> int:
        """One decode step: feeds ``token`` and returns the greedy next token."""
        state = self.requests[request_id]
        state.tokens.append(token)
        if len(state.tokens) > len(state.blocks) * self.tpb:
            state.blocks += self.alloc.allocate(1)
        logits = self.forward(request_id, len(state.tokens))
        state.outputs.append(int(logits.argmax()))
        return state.outputs[-1]

    def block_digests(self, blocks: Sequence[int], tokens: int) -> list[str]:
        """One hash per block over the slots that hold ``tokens`` tokens, in every layer:
        two pools hold the same KV exactly when these agree."""
        digests = []
        for i, block in enumerate(blocks):
            used = min(self.tpb, tokens - i * self.tpb)
            h = hashlib.sha256()
            for layer in self.pool.layers:
                h.update(layer[block, :, :used].contiguous().view(torch.uint8).cpu().numpy().tobytes())
            digests.append(h.hexdigest())
        return digests

    def finish(self, request_id: int, *, cache_tokens: Optional[int] = None) -> RequestState:
        """Releases the request's blocks, keeping those that hold ``cache_tokens`` tokens in
        the prefix cache (default: every computed token). Blocks still leased to a transfer
        are parked instead, with their references, until `reap` finds the lease ended."""
        state = self.requests.pop(request_id)
        keep = state.computed if cache_tokens is None else cache_tokens
        if self.cache is not None:
            self.cache.insert(state.tokens[:keep], state.blocks[: -(-keep // self.tpb)])
        if self.leased(request_id):
            self._parked[request_id] = state.blocks
        else:
            self._release(state.blocks)
        return state

    def _release(self, blocks: list[int]) -> None:
        cached = [self.cache is not None and self.cache.is_cached(b) for b in blocks]
        self.alloc.release(blocks, cached)

    def reap(self) -> list[int]:
        """Releases the blocks of finished requests whose lease has ended; returns those
        requests' ids."""
        done = [rid for rid in self._parked if not self.leased(rid)]
        for rid in done:
            self._release(self._parked.pop(rid))
        return done

    @property
    def parked(self) -> dict[int, list[int]]:
        """Finished requests whose blocks are still leased, with those blocks."""
        return dict(self._parked)
