"""Parking: a prefill prompt computed before its destination waits in host memory, not in
vLLM's KV pool.

A prefill request whose decode server has not admitted its half within admission_wait_s
computes anyway (kvferry.vllm.scheduler); once its prompt is computed it has no destination
yet, so its blocks would stay in vLLM's pool until the destination comes. When the decode
server is the bottleneck those late prompts fill the prefill pool: a request the prefill
engine preempted mid-transfer then finds no room to be computed again, while its decode
half holds its own blocks waiting for it, and both servers wait on each other until the
late prompts time out. Parked, a late prompt's blocks are copied into a host pool of the
same layout and vLLM frees them at once; the late send reads the host copy.

```
vLLM pool:  [ running requests ........ | late prompt P ]   P copied out, then freed
host pool:  [ P ][ free ............................... ]   the late send reads P here
ids:        device blocks [0, D), host block h is D + h (kvferry.tiers' combined ids)
```
The scheduler half owns the host pool's free list (`ParkBook`): it decides which prompt
parks and where, so every worker rank copies the same blocks to the same host ids; each rank
reports a parked request once its late send ended (or was released), and its host blocks are
free once every rank did.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any, Optional, Sequence

from kvferry.errors import InvalidArgumentError

if TYPE_CHECKING:  # the scheduler half imports this module for `ParkBook` alone
    import torch

    from kvferry.layout import PagedKV

__all__ = ["ParkBook", "park_blocks", "park_pool"]


def park_blocks(late_host_bytes: int, kv_cache_config: Any, groups: int) -> int:
    """How many blocks the host pool holds: ``late_host_bytes`` worth of this engine's
    blocks, at most its pool's block count; 0 (parking off) for 0 bytes, and with several KV
    cache groups, whose tables the late send moves group by group."""
    if late_host_bytes <= 0 or groups != 1:
        return 0
    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks <= 0:
        return 0
    block_bytes = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors) // num_blocks
    return min(num_blocks, late_host_bytes // block_bytes) if block_bytes > 0 else 0


class ParkBook:
    """The host pool's free blocks (scheduler half): `take` a prompt's worth, `give` them
    back. Lowest ids first, so a quiet server reuses the same few pages."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError(f"invalid capacity={capacity!r}: must be an int >= 0")
        self.capacity = capacity
        self._free = list(range(capacity))  # a heap

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> Optional[list[int]]:
        """``n`` host block ids, or None when fewer are free (nothing is taken then)."""
        if n <= 0 or n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def give(self, ids: Sequence[int]) -> None:
        for i in ids:
            heapq.heappush(self._free, i)


def park_pool(views: Sequence[torch.Tensor], num_blocks: int, tokens_per_block: int, *, pinned: bool) -> PagedKV:
    """A CPU pool of ``num_blocks`` blocks laid out as the engine's ``views`` (vLLM's
    ``[B, H, N, C]`` views, any physical order): each layer allocated in the same physical
    order with the block dimension resized, so its blocks (and head slices) exchange with the
    engine pool's. Page-locked when ``pinned`` (a CUDA pool's host tier must be)."""
    import torch

    from kvferry.layout import paged_kv_from_views

    layers = []
    for view in views:
        order = sorted(range(view.dim()), key=lambda d: view.stride(d), reverse=True)  # outermost first
        sizes = [num_blocks if d == 0 else view.shape[d] for d in order]
        dense = torch.empty(sizes, dtype=view.dtype, device="cpu", pin_memory=pinned)
        layers.append(dense.permute([order.index(d) for d in range(view.dim())]))
    return paged_kv_from_views(layers, num_blocks=num_blocks, tokens_per_block=tokens_per_block)
