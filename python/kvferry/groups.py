"""vLLM's KV cache groups in kvferry's terms (the hybrid KV cache manager, ``SupportsHMA``).

vLLM gives each KV cache group (layers of one attention type: full attention, a sliding
window, ...) its own block table, drawn from one block pool: a block id is owned by one group
at a time, and group ``g``'s table addresses only group ``g``'s layers. The groups' layers
overlay one allocation from byte 0 (vllm/v1/core/kv_cache_utils.py,
``get_kv_cache_config_from_groups``): layer ``j`` of every group is the same memory.

```
allocation:  | region 0 [blk 0 | blk 1 | ...] | region 1 [blk 0 | blk 1 | ...] |
group 0 (SW):  layers.0                          layers.2
group 1 (FA):  layers.1                          layers.3
block 5 of group 1 = block 5 of region 0 and region 1 (group 0 never holds block 5 meanwhile)
```
So kvferry keeps one pool over the regions (one representative layer each), and moves each
group of a request as its own kvferry request (kv id ``base + g``) with that group's block
table and window: a block id of group ``g`` moves exactly group ``g``'s layers' bytes of that
block (a region that group ``g`` has no layer on carries bytes no one reads, on both sides).
Under tensor parallelism the same holds per link (kvferry.ranks): each decode rank's receiver
of a prefill rank expects every group, and that prefill rank sends every group from its head
slice of every region (tests/test_tp.py, ``test_tp_with_hma_moves_each_groups_head_slices_once``).

Per group, what moves (the Rust planner, rust/src/plan.rs):
```
full attention:   every prompt block not held by the decode side, once; early prefix before
                  the first forward, each chunk's completed blocks after its forward
sliding window W: only the live window at the end of the prompt, with the last chunk:
tokens:  |0 ........ P+1-W |<---- W-1 tokens ---->|P
blocks:  [null (id 0) ......)[ live .. ceil(P/tpb))     (both sides hold null blocks before it)
```
vLLM replaces a sliding-window group's blocks that left the window by its null block (id 0):
the live window never holds one, and a table whose live window does is refused
(`check_live`) rather than read or written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from kvferry._core import BlockRange
from kvferry.errors import KvFerryError

__all__ = ["NULL_BLOCK", "Group", "GroupSet", "add_groups", "expect_groups", "groups_of", "live_blocks", "pool_layers"]

# vLLM's BlockPool hands out block 0 as its null block (never allocated to a request): the
# placeholder of a sliding-window group's blocks outside the window.
NULL_BLOCK = 0

# The specs whose blocks kvferry moves: attention KV, one page per (block, layer). Named, not
# imported, so this module (and its tests) runs without vLLM; exact names, since a subclass
# (e.g. DeepSeek's SlidingWindowMLASpec, with its own replay rules) changes what a block means.
_FULL = ("FullAttentionSpec", "MLAAttentionSpec")
_WINDOWED = ("SlidingWindowSpec",)


@dataclass(frozen=True)
class Group:
    """One KV cache group: its index in vLLM's list, its layers in vLLM's order (the order of
    their regions), and its sliding window in tokens (``None``: full attention)."""

    index: int
    layers: tuple[str, ...]
    window: Optional[int]
    spec: str  # the spec's class name, for messages and the trace


def _describe(index: int, layers: Sequence[str], spec: Any) -> str:
    shown = ", ".join(list(layers)[:3]) + (", ..." if len(layers) > 3 else "")
    return f"KV cache group {index} ({type(spec).__name__}, layers {shown}): {spec!r}"


def groups_of(kv_cache_config: Any) -> tuple[Group, ...]:
    """The groups of vLLM's ``KVCacheConfig``; refuses, at startup, a group kvferry cannot move
    block by block (Mamba/SSM state, chunked local attention, cross attention, ...), naming the
    group and its spec."""
    out = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        if not getattr(group, "enable_kv_transfer", True):
            # An accelerator-side replica vLLM rebuilds from its source group after a load.
            continue
        if name in _FULL and getattr(spec, "sliding_window", None) is None:
            window = None
        elif name in _FULL:
            # HMA off: vLLM put windowed layers in the full-attention group and allocates
            # every block for them, so every block moves.
            window = None
        elif name in _WINDOWED:
            # Blocks of the extra trailing tokens stay allocated too (vLLM's
            # get_num_skipped_tokens): they are part of what the decode side keeps.
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))
        else:
            raise KvFerryError(
                f"kvferry cannot transfer {_describe(index, group.layer_names, spec)}: KvferryConnector moves "
                "attention KV block by block (full attention and sliding-window groups); state groups such as "
                "Mamba/SSM, and other cache kinds, are not supported (docs/vllm.md, 'Hybrid models (HMA)')"
            )
        out.append(Group(index, tuple(group.layer_names), window, name))
    if not out:
        raise KvFerryError("kvferry: the model has no KV cache group to transfer")
    return tuple(out)


def live_blocks(prompt_len: int, tokens_per_block: int, window: Optional[int]) -> tuple[int, int]:
    """The blocks ``[lo, hi)`` of a prompt the decode side needs: all of them under full
    attention, the live window under a sliding window (the planner's ``Prompt::needed``)."""
    hi = -(-prompt_len // tokens_per_block)
    if window is None or window >= prompt_len:
        return 0, hi
    return (prompt_len + 1 - window) // tokens_per_block, hi


class GroupSet:
    """The groups one engine moves, and what they mean for one request."""

    def __init__(self, groups: Sequence[Group], tokens_per_block: int) -> None:
        self.groups = tuple(groups)
        self.tokens_per_block = tokens_per_block

    @classmethod
    def single(cls, tokens_per_block: int) -> GroupSet:
        """One full-attention group holding every layer (a model without hybrid attention)."""
        return cls((Group(0, (), None, "FullAttentionSpec"),), tokens_per_block)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> list[Optional[int]]:
        return [g.window for g in self.groups]

    def kv_ids(self, base: int) -> list[int]:
        """Each group's kvferry request id: the request's ``base`` (the scheduler half steps its
        counter by the number of groups) plus the group's position."""
        return [base + i for i in range(len(self.groups))]

    def tables(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """This engine's block tables of a request, one per group kvferry moves, from vLLM's
        tuple of every group's table (``KVCacheBlocks.get_block_ids()``)."""
        if len(block_ids) <= max(g.index for g in self.groups):
            raise KvFerryError(
                f"vLLM gave {len(block_ids)} block tables, the KV cache config has groups "
                f"{[g.index for g in self.groups]}"
            )
        return [list(block_ids[g.index]) for g in self.groups]

    def live(self, prompt_len: int) -> list[tuple[int, int]]:
        return [live_blocks(prompt_len, self.tokens_per_block, g.window) for g in self.groups]

    def live_count(self, prompt_len: int, held_blocks: int) -> int:
        """The blocks that cross for a request, all groups together."""
        return sum(max(0, hi - max(lo, held_blocks)) for lo, hi in self.live(prompt_len))

    def check_live(self, tables: Sequence[Sequence[int]], prompt_len: int, side: str) -> None:
        """Refuses tables that run short, or whose live range of a sliding-window group names
        vLLM's null block: a transfer must never read or write it (it stands for blocks outside
        the window)."""
        if len(tables) != len(self.groups):
            raise KvFerryError(f"{side}: {len(tables)} block tables, this engine moves {len(self.groups)} groups")
        for group, table, (lo, hi) in zip(self.groups, tables, self.live(prompt_len)):
            if len(table) < hi:
                raise KvFerryError(
                    f"{side}: group {group.index} ({group.spec}) has {len(table)} blocks, the prompt needs {hi}"
                )
            # Only a windowed group's table holds null blocks (those that left the window);
            # vLLM never puts one in a full-attention table, where block 0 is checked no further.
            if group.window is not None and NULL_BLOCK in table[lo:hi]:
                raise KvFerryError(
                    f"{side}: group {group.index} ({group.spec}) holds vLLM's null block inside its live blocks "
                    f"[{lo}, {hi}): {list(table[lo:hi])}"
                )

    def describe(self) -> str:
        return ", ".join(
            f"{g.index}: {g.spec} ({len(g.layers)} layers" + (")" if g.window is None else f", window {g.window})")
            for g in self.groups
        )


def pool_layers(
    kv_caches: Mapping[str, Any], groups: Sequence[Group], layer_index: Callable[[str], int]
) -> tuple[list[str], dict[str, int]]:
    """The layers kvferry's pool reads (one per region: the group with the most layers names
    them), and, for layer-wise streaming, the layer after whose ``save_kv_layer`` each pool
    layer is complete (its last overlaying layer in the forward's order).

    With one group this is every layer in the forward's order, as before HMA. Refuses views
    that do not overlay region by region (same address, shape, strides and dtype)."""
    known = [name for g in groups for name in g.layers]
    missing = [name for name in known if name not in kv_caches]
    if missing:
        raise KvFerryError(f"kvferry: vLLM registered no KV cache for layers {missing[:3]}")
    if len(groups) == 1:  # as before HMA: every registered layer, in the forward's order
        names = sorted(kv_caches, key=layer_index)
        return names, {n: i for i, n in enumerate(names)}
    widest = max(groups, key=lambda g: len(g.layers))
    regions = list(widest.layers)

    def key(name: str) -> tuple[Any, ...]:
        t = kv_caches[name]
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)

    completes: list[str] = list(regions)
    for g in groups:
        for j, name in enumerate(g.layers):
            if key(name) != key(regions[j]):
                raise KvFerryError(
                    f"kvferry: layer {name} (KV cache group {g.index}) does not overlay layer {regions[j]} "
                    f"(group {widest.index}): kvferry moves every group through one set of regions, so the groups' "
                    "layers must share their views region by region (vLLM's uniform page size layout)"
                )
            if layer_index(name) > layer_index(completes[j]):
                completes[j] = name
    # Layer-wise streaming sends a layer group once its last layer is saved; that holds only
    # if the regions complete in their order (they do for repeating patterns).
    order = [layer_index(n) for n in completes]
    streamable = all(a < b for a, b in zip(order, order[1:]))
    return regions, ({n: j for j, n in enumerate(completes)} if streamable else {})


def expect_groups(
    receiver: Any, groups: GroupSet, base: int, prompt_len: int, held_blocks: int, tables: Sequence[Sequence[int]]
) -> int:
    """Decode side: expects each group of a request on ``receiver`` (`KVReceiver.expect`, with
    the group's window and destination table; the decode side's own prefix hit ``held_blocks``
    is the same in every group) and returns the first group's epoch; group ``g``'s is that
    plus ``g``. All or nothing."""
    groups.check_live(tables, prompt_len, "the decode request")
    blocks = -(-prompt_len // groups.tokens_per_block)
    held = [BlockRange(0, held_blocks)] if held_blocks else []
    kv_ids = groups.kv_ids(base)
    epochs: list[int] = []
    try:
        for kv, group, table in zip(kv_ids, groups.groups, tables):
            epochs.append(receiver.expect(kv, prompt_len, window=group.window, held=held, dst_blocks=table[:blocks]))
        # Only the engine's thread expects requests, so a request's epochs follow one another;
        # the destination carries the first.
        if epochs != list(range(epochs[0], epochs[0] + len(epochs))):
            raise KvFerryError(f"the receiver issued epochs {epochs} to one request's groups, not consecutive")
    except BaseException:
        for kv in kv_ids[: len(epochs)]:
            receiver.release_unfenced(kv)  # never published: nothing writes them
        raise
    return epochs[0]


def add_groups(
    hook: Any, groups: GroupSet, base: int, prompt_len: int, reused_len: int, destination: Mapping[str, Any]
) -> None:
    """Prefill side: registers each group of a request with ``hook`` (`TransferHook.add_request`),
    its source table to come chunk by chunk (`TransferHook.update_src_blocks`), its destination
    table cut out of the destination's ``dst_blocks`` (the groups' tables back to back), its
    window and its lease. All or nothing."""
    blocks = -(-prompt_len // groups.tokens_per_block)
    dst, held_blocks, epoch = destination["dst_blocks"], int(destination["held_blocks"]), int(destination["epoch"])
    held = [BlockRange(0, held_blocks)] if held_blocks else []
    added: list[int] = []
    try:
        for g, (kv, group) in enumerate(zip(groups.kv_ids(base), groups.groups)):
            hook.add_request(
                kv,
                prompt_len,
                reused_len=reused_len,
                window=group.window,
                src_blocks=np.full(blocks, -1, dtype=np.int64),
                dst_blocks=dst[g * blocks : (g + 1) * blocks],
                held=held,
                epoch=epoch + g,
            )
            added.append(kv)
    except BaseException:
        for kv in added:
            hook.cancel(kv, timeout=0.0)  # nothing was sent yet: returns at once
        raise
