"""`PagedKV`: a description of an engine's paged KV cache, without owning it.

An engine keeps its KV cache as torch tensors, one per layer or one stacked over layers, with
one dimension indexing blocks. kvferry only needs to know where each block's bytes are:

```
layer tensor:  shape (*outer, num_blocks, *inner), contiguous
               outer = prod(shape[:block_dim])   e.g. 2 for a (K|V, blocks, ...) layout
               inner = prod(shape[block_dim+1:]) * itemsize bytes  ("segment")
one block:     `outer` segments of `segment_bytes`, one per outer index, in every layer
```
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence, Union

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import torch

from kvferry.errors import InvalidArgumentError, KvFerryError

__all__ = ["BlockIds", "LayoutMismatchError", "PagedKV"]

BlockIds = Union[Sequence[int], np.ndarray, torch.Tensor]


class LayoutMismatchError(KvFerryError, ValueError):
    """Sender and receiver pools cannot exchange blocks; raised before any byte moves."""


# The Rust planner takes tokens_per_block as an int64: a larger value is refused here, with
# the pool, rather than by the first book built for it.
MAX_INT64 = 2**63 - 1


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass, and a float 4.0 would pass every comparison: both are caller bugs.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def block_id_array(name: str, ids: object) -> np.ndarray:
    """``ids`` as a 1-d int64 array, refusing by name what ``np.asarray(ids, dtype=np.int64)``
    would let through silently: floats (truncated), bools (a mask), a 2-d table, a ragged
    list. A tensor is read from wherever it lives."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    try:
        array = np.asarray(ids)
    except ValueError as err:  # a ragged nested list
        raise InvalidArgumentError(f"invalid {name}: must be a 1-d sequence of block ids ({err})") from None
    if array.ndim != 1:
        raise InvalidArgumentError(f"invalid {name}=<{array.ndim}-d array>: must be a 1-d sequence of block ids")
    if array.size and (array.dtype.kind not in "iu" or not np.can_cast(array.dtype, np.int64)):
        raise TypeError(f"{name} must hold integer block ids, got dtype {array.dtype}")
    return array.astype(np.int64)


@dataclass(frozen=True, eq=False)
class PagedKV:
    """A paged KV pool: ``layers[i]`` has shape ``(*outer, num_blocks, *inner)`` with the block
    dimension at ``block_dim``. All layers share shape, dtype and device."""

    layers: tuple[torch.Tensor, ...]
    tokens_per_block: int
    block_dim: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.layers, torch.Tensor) or not isinstance(self.layers, (tuple, list)):
            raise InvalidArgumentError(
                f"invalid layers={type(self.layers).__name__}: must be a sequence of tensors "
                "(use PagedKV.stacked for one tensor over all layers)"
            )
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise InvalidArgumentError("invalid layers=(): must hold at least one layer")
        for i, t in enumerate(self.layers):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"layers[{i}] must be a torch.Tensor, got {type(t).__name__}")
        _check_int("tokens_per_block", self.tokens_per_block)
        _check_int("block_dim", self.block_dim)
        if not 0 < self.tokens_per_block <= MAX_INT64:
            raise InvalidArgumentError(f"invalid tokens_per_block={self.tokens_per_block}: must be in [1, 2**63)")
        first = self.layers[0]
        if not 0 <= self.block_dim < first.dim():
            raise InvalidArgumentError(
                f"invalid block_dim={self.block_dim}: must be in [0, {first.dim()}) for layers of shape {tuple(first.shape)}"
            )
        for i, t in enumerate(self.layers):
            for what, got, want in (
                ("shape", tuple(t.shape), tuple(first.shape)),
                ("dtype", t.dtype, first.dtype),
                ("device", t.device, first.device),
            ):
                if got != want:
                    raise InvalidArgumentError(f"invalid layers[{i}].{what}={got}: must match layers[0] ({want})")
            if not t.is_contiguous():
                raise InvalidArgumentError(f"invalid layers[{i}]: must be contiguous (stride {t.stride()})")

    @classmethod
    def stacked(cls, tensor: torch.Tensor, *, tokens_per_block: int, block_dim: int) -> PagedKV:
        """One tensor over all layers, layers on dimension 0; ``block_dim`` counts from the
        full tensor's dimensions (so ``block_dim >= 1``)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        _check_int("block_dim", block_dim)
        if block_dim < 1:
            raise InvalidArgumentError(f"invalid block_dim={block_dim}: must be >= 1 (dimension 0 is the layer)")
        return cls(tuple(tensor.unbind(0)), tokens_per_block, block_dim - 1)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.layers[0].shape)

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def segments(self) -> int:
        """Contiguous pieces of one block in one layer (the product of the outer dims)."""
        return math.prod(self.shape[: self.block_dim])

    @property
    def segment_bytes(self) -> int:
        return math.prod(self.shape[self.block_dim + 1 :]) * self.layers[0].element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer."""
        return self.segments * self.segment_bytes

    @functools.cached_property
    def _geometry(self) -> dict[str, object]:
        return self.geometry()

    def geometry(self) -> dict[str, object]:
        """What must match between a sender's and a receiver's pool, as plain values (it
        crosses process boundaries in transports' handshakes)."""
        return {
            "num_layers": self.num_layers,
            "tokens_per_block": self.tokens_per_block,
            "dtype": str(self.dtype),
            "segments": self.segments,
            "segment_bytes": self.segment_bytes,
        }

    def check_compatible(self, other: PagedKV | dict[str, object]) -> None:
        """Raises :class:`LayoutMismatchError` naming the first field that differs from
        ``other`` (a pool, or a remote pool's ``geometry()``)."""
        if not isinstance(other, (PagedKV, dict)):
            raise TypeError(f"other must be a PagedKV or a geometry() dict, got {type(other).__name__}")
        theirs = other._geometry if isinstance(other, PagedKV) else other
        for key, value in self._geometry.items():
            if theirs.get(key) != value:
                raise LayoutMismatchError(
                    f"layout mismatch: {key} is {value} on the source and {theirs.get(key)} on the destination"
                )

    def group_layers(self, group: int, groups: int) -> tuple[int, int]:
        """The layers ``[lo, hi)`` of layer group ``group`` of ``groups``: consecutive
        layers, as even as the count allows (layer-wise streaming sends a group's layers of
        a block once that group's forward finished). Sender and receiver agree on this
        split, so a notice names only ``(group, groups)``."""
        _check_int("groups", groups)
        _check_int("group", group)
        if not 1 <= groups <= self.num_layers:
            raise InvalidArgumentError(
                f"invalid groups={groups}: must be in [1, {self.num_layers}] (the pool's layers)"
            )
        if not 0 <= group < groups:
            raise InvalidArgumentError(f"invalid group={group}: must be in [0, {groups})")
        return group * self.num_layers // groups, (group + 1) * self.num_layers // groups

    def layer_slice(self, lo: int, hi: int) -> PagedKV:
        """The pool restricted to layers ``[lo, hi)`` (the same tensors, no copy); the whole
        pool for ``(0, num_layers)``. Cached, so that a copy kernel's pointer tables and
        captured graphs are built once per slice."""
        if (lo, hi) == (0, self.num_layers):
            return self
        if not 0 <= lo < hi <= self.num_layers:
            raise InvalidArgumentError(
                f"invalid layers=[{lo}, {hi}): must be a non-empty range within [0, {self.num_layers})"
            )
        slices = self._slices
        view = slices.get((lo, hi))
        if view is None:
            view = slices[(lo, hi)] = PagedKV(self.layers[lo:hi], self.tokens_per_block, self.block_dim)
        return view

    @functools.cached_property
    def _slices(self) -> dict[tuple[int, int], PagedKV]:
        return {}

    def segment_views(self, word: torch.dtype) -> list[torch.Tensor]:
        """Each layer as ``(segments, num_blocks, segment_bytes / word_size)`` of ``word``."""
        words = self.segment_bytes // torch.empty((), dtype=word).element_size()
        return [t.view(-1).view(word).view(self.segments, self.num_blocks, words) for t in self.layers]

    @functools.cached_property
    def pointer_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(base, offsets)``: the lowest-addressed layer as a flat int64 tensor, and each
        layer's distance from it in 8-byte words, on the pool's device. Lets one kernel launch
        reach every layer; cached because the engine's tensors do not move."""
        ptrs = [t.data_ptr() for t in self.layers]
        first = min(range(len(ptrs)), key=ptrs.__getitem__)
        base = self.layers[first].view(-1).view(torch.uint8)
        offsets = torch.tensor([(p - ptrs[first]) // 8 for p in ptrs], dtype=torch.int64)
        return base, offsets.to(self.device)

    def __repr__(self) -> str:
        return (
            f"PagedKV(<{self.num_layers} layers of {self.shape} {self.dtype} on {self.device}>, "
            f"tokens_per_block={self.tokens_per_block}, block_dim={self.block_dim})"
        )
