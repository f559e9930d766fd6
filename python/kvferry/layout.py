"""`PagedKV`: a description of an engine's paged KV cache, without owning it.

An engine keeps its KV cache as torch tensors, one per layer or one stacked over layers, with
one dimension indexing blocks. kvferry only needs to know where each block's bytes are:

```
layer tensor:  shape (*outer, num_blocks, *inner)
               outer = prod(shape[:block_dim])   e.g. 2 for a (K|V, blocks, ...) layout
               inner = prod(shape[block_dim+1:]) * itemsize bytes  ("segment"), dense
one block:     `outer` segments of `segment_bytes`, one per outer index, in every layer
address:       data_ptr + segment * segment_stride + block * block_stride   (bytes)
```
A contiguous layer has ``segment_stride = num_blocks * segment_bytes`` and ``block_stride =
segment_bytes`` (`PagedKV.packed`). Engines that interleave layers or heads inside a block
(vLLM's block-outer layouts, one allocation for every layer) give other strides: each
layer's blocks are then read and written where they lie, with no copy of the cache.

`paged_kv_from_views` turns an engine's logical per-layer views (vLLM's ``[B, H, N, C]``, in
any of its physical orders) into a `PagedKV`; ``block_layout`` names the order of one
block's elements, so two pools exchange blocks only when their blocks hold the same
elements in the same order.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import torch

from kvferry.errors import InvalidArgumentError, KvFerryError

__all__ = ["BlockIds", "LayoutMismatchError", "PagedKV", "common_word", "paged_kv_from_views", "writable"]

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


# A block layout label crosses the wire in the hello (rust/src/wire/transport.rs, `Geometry`).
_LABEL = re.compile(r"[A-Za-z0-9._-]{1,128}")
# The label of a pool that says nothing about its blocks' elements (built by kvferry itself,
# or by an engine whose two sides allocate the same shapes): it matches only itself.
ANY_LAYOUT = "any"


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, stride {t.stride()}, dtype {t.dtype}"


def _block_strides(t: torch.Tensor, block_dim: int) -> tuple[int, int] | str:
    """``(segment_stride, block_stride)`` in bytes of a layer ``(*outer, blocks, *inner)``, or
    why it has none: the inner dimensions must be dense (one run of bytes per segment), the
    outer ones must fold into one strided axis, and no two segments may overlap."""
    size = t.element_size()
    shape, stride = t.shape, t.stride()
    expect = 1
    for d in reversed(range(block_dim + 1, t.dim())):
        if shape[d] == 1:
            continue
        if stride[d] != expect:
            return "its dimensions after the block dimension are not dense"
        expect *= shape[d]
    outer = [d for d in range(block_dim) if shape[d] > 1]
    for a, b in zip(outer, outer[1:]):
        if stride[a] != stride[b] * shape[b]:
            return "its dimensions before the block dimension do not fold into one"
    segments, blocks = math.prod(shape[:block_dim]), shape[block_dim]
    seg_bytes = expect * size
    block_stride = stride[block_dim] * size if blocks > 1 else seg_bytes
    seg_stride = stride[outer[-1]] * size if outer else blocks * block_stride
    if seg_stride <= 0 or block_stride <= 0:
        return "it has a zero or negative stride"
    if segments == 1:
        disjoint = block_stride >= seg_bytes
    else:
        disjoint = (block_stride >= seg_bytes and seg_stride >= blocks * block_stride) or (
            seg_stride >= seg_bytes and block_stride >= segments * seg_stride
        )
    if not disjoint:
        return "its segments overlap"
    return seg_stride, block_stride


# The widest alignment `PagedKV.alignment` reports (a page: nothing copies wider words).
MAX_ALIGNMENT = 4096


@dataclass(frozen=True, eq=False)
class PagedKV:
    """A paged KV pool: ``layers[i]`` has shape ``(*outer, num_blocks, *inner)`` with the block
    dimension at ``block_dim``, dense inner dimensions and the same strides in every layer
    (see the module doc). All layers share shape, strides, dtype and device. ``block_layout``
    names the order of one block's elements (`paged_kv_from_views`); pools exchange blocks
    only with a pool of the same label."""

    layers: tuple[torch.Tensor, ...]
    tokens_per_block: int
    block_dim: int = 0
    block_layout: str = ANY_LAYOUT
    # (segment_stride, block_stride) in bytes, derived from the layers.
    _strides: tuple[int, int] = field(init=False, repr=False)

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
                f"invalid block_dim={self.block_dim}: must be in [0, {first.dim()}) for layers of shape "
                f"{tuple(first.shape)}"
            )
        for i, t in enumerate(self.layers):
            for what, got, want in (
                ("shape", tuple(t.shape), tuple(first.shape)),
                ("dtype", t.dtype, first.dtype),
                ("device", t.device, first.device),
            ):
                if got != want:
                    raise InvalidArgumentError(f"invalid layers[{i}].{what}={got}: must match layers[0] ({want})")
            strides = _block_strides(t, self.block_dim)
            if isinstance(strides, str):
                raise InvalidArgumentError(
                    f"invalid layers[{i}]: must be contiguous within each block segment ({_describe(t)}): {strides}"
                )
            if t.stride() != first.stride():
                raise InvalidArgumentError(
                    f"invalid layers[{i}].stride={t.stride()}: must match layers[0] ({first.stride()})"
                )
        object.__setattr__(self, "_strides", strides)
        if not isinstance(self.block_layout, str) or not _LABEL.fullmatch(self.block_layout):
            raise InvalidArgumentError(
                f"invalid block_layout={self.block_layout!r}: must be 1 to 128 characters of [A-Za-z0-9._-]"
            )

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

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.layers[0].shape)

    @functools.cached_property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @functools.cached_property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @functools.cached_property
    def device(self) -> torch.device:
        return self.layers[0].device

    @functools.cached_property
    def segments(self) -> int:
        """Contiguous pieces of one block in one layer (the product of the outer dims)."""
        return math.prod(self.shape[: self.block_dim])

    @functools.cached_property
    def segment_bytes(self) -> int:
        return math.prod(self.shape[self.block_dim + 1 :]) * self.layers[0].element_size()

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer."""
        return self.segments * self.segment_bytes

    @property
    def segment_stride(self) -> int:
        """Bytes from one segment of a block to the next (see the module doc)."""
        return self._strides[0]

    @property
    def block_stride(self) -> int:
        """Bytes from one block of a segment to the next."""
        return self._strides[1]

    @property
    def packed(self) -> bool:
        """Whether every layer is contiguous ``(segments, num_blocks, segment)`` bytes, the
        only arrangement a remote writer that knows only the geometry can address."""
        seg, block = self._strides
        return block == self.segment_bytes and (self.segments == 1 or seg == self.num_blocks * self.segment_bytes)

    @functools.cached_property
    def alignment(self) -> int:
        """The largest power of two, up to `MAX_ALIGNMENT`, that divides every layer's base
        address and the pool's segment bytes and strides: the widest word a copy of whole
        segments may move. Worked out once per pool (a copy kernel asks on every launch)."""
        value = MAX_ALIGNMENT
        for n in (self.segment_bytes, *self._strides, *(t.data_ptr() for t in self.layers)):
            while n % value:
                value //= 2
        return value

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
            "block_layout": self.block_layout,
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
            view = slices[(lo, hi)] = self.with_layers(self.layers[lo:hi])
        return view

    def with_layers(self, layers: Sequence[torch.Tensor]) -> PagedKV:
        """A pool of the same tokens per block, block dimension and block layout over other
        tensors (a layer slice, a host copy, a peer's mapping of this pool)."""
        return PagedKV(tuple(layers), self.tokens_per_block, self.block_dim, self.block_layout)

    @functools.cached_property
    def _slices(self) -> dict[tuple[int, int], PagedKV]:
        return {}

    def heads(self, lo: int, hi: int) -> PagedKV:
        """The pool of KV heads ``[lo, hi)`` of every block (the same memory, no copy), for
        a pool made by `paged_kv_from_views`: its segments are cut where the heads start
        (``paged_kv_from_views(..., heads=)`` draws the picture), so the slice of one pool
        exchanges blocks with a slice of the same width of another pool of the same physical
        order, whatever their full head counts. Cached per range."""
        source = self.__dict__.get("_views")
        if source is None:
            raise InvalidArgumentError(
                "invalid pool for heads(): only a pool made by paged_kv_from_views knows its heads"
            )
        cache = self._head_slices
        view = cache.get((lo, hi))
        if view is None:
            views, dims = source
            view = cache[(lo, hi)] = paged_kv_from_views(
                views, num_blocks=self.num_blocks, tokens_per_block=self.tokens_per_block, dims=dims, heads=(lo, hi)
            )
        return view

    @property
    def num_heads(self) -> int:
        """The KV heads of a pool made by `paged_kv_from_views` (1 for MLA's latent head)."""
        source = self.__dict__.get("_views")
        if source is None or "H" not in source[1]:
            raise InvalidArgumentError("invalid pool for num_heads: only a pool made by paged_kv_from_views knows it")
        views, dims = source
        return int(views[0].shape[dims.index("H")])

    @functools.cached_property
    def _head_slices(self) -> dict[tuple[int, int], PagedKV]:
        return {}

    def segment_views(self, word: torch.dtype) -> list[torch.Tensor]:
        """Each layer as ``(segments, num_blocks, segment_bytes / word_size)`` of ``word``,
        strided where the layer's blocks lie (no copy). ``word`` must divide the segment,
        the strides and every layer's offset (`common_word`)."""
        size = self.layers[0].element_size()
        seg, block = self._strides
        shape = (self.segments, self.num_blocks, self.segment_bytes // size)
        strides = (seg // size, block // size, 1)
        return [t.as_strided(shape, strides).view(word) for t in self.layers]

    @functools.cached_property
    def pointer_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(base, offsets)``: the lowest-addressed layer as a flat int64 tensor, and each
        layer's distance from it in 8-byte words, on the pool's device. Lets one kernel launch
        reach every layer; cached because the engine's tensors do not move."""
        ptrs = [t.data_ptr() for t in self.layers]
        first = min(range(len(ptrs)), key=ptrs.__getitem__)
        # One element at the layer's first byte: only its address and type reach the kernel.
        base = self.layers[first].as_strided((1,), (1,)).view(torch.uint8)
        offsets = torch.tensor([(p - ptrs[first]) // 8 for p in ptrs], dtype=torch.int64)
        return base, offsets.to(self.device)

    def __repr__(self) -> str:
        return (
            f"PagedKV(<{self.num_layers} layers of {self.shape} {self.dtype} on {self.device}>, "
            f"tokens_per_block={self.tokens_per_block}, block_dim={self.block_dim}, "
            f"block_layout={self.block_layout!r})"
        )


def common_word(*pools: PagedKV) -> torch.dtype:
    """The widest word (int64, else uint8) that divides every pool's segment, strides and
    layer offsets: the element the copies move (index_copy_ on uint8 is about 5x slower)."""
    for word, size in ((torch.int64, 8), (torch.uint8, 1)):
        if all(
            p.segment_bytes % size == 0
            and p.segment_stride % size == 0
            and p.block_stride % size == 0
            and all(t.storage_offset() * t.element_size() % size == 0 for t in p.layers)
            for p in pools
        ):
            return word
    return torch.uint8


def writable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor kvferry's copy threads may write: an engine that allocates its
    KV cache under ``torch.inference_mode`` (vLLM) hands inference tensors, into which an
    in-place write outside that mode is refused. The same view of the same storage, on any
    device, with no copy: ``set_`` shares the storage, alive while either tensor is."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        alias = torch.empty(0, dtype=t.dtype, device=t.device)
        return alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def paged_kv_from_views(
    layers: Sequence[torch.Tensor],
    *,
    num_blocks: int,
    tokens_per_block: int,
    dims: str = "BHNC",
    heads: Optional[tuple[int, int]] = None,
) -> PagedKV:
    """The pool of an engine's per-layer views, whatever their physical order: ``dims`` names
    each dimension of the views (``B`` the blocks; vLLM 0.32's ``[B, H, N, C]`` by default:
    KV heads, tokens, K|V content), and the views are read where they lie (no copy; an
    inference tensor is taken as a `writable` alias).

    ```
    view:      [B, H, N, C], strides in any order (vLLM's KVCacheLayout)
    physical:  the dimensions other than B by decreasing stride, e.g. N, H, C (LBNHC)
    segment:   the longest dense run at the end (H, N, C);  outer: the rest (none, or H)
    pool:      layers permuted to (*outer, B, *segment);  block_layout "N16.H8.C256"
    ```
    Dimensions of size 1 (MLA's single latent head) place nothing and are left out of the
    label, so two pools whose blocks hold the same bytes in the same order get the same one.
    Refuses, naming the shape, strides and dtype, views it cannot read block by block.

    ``heads=(lo, hi)``: the pool of KV heads ``[lo, hi)`` only (tensor parallelism: a rank
    moves a slice of its heads to a rank of another split; kvferry.ranks). Its segments
    are cut where the heads start, whether the slice is all of them or not, and the label
    names ``H`` even for one head, so that two head slices of the same width and physical
    order agree, whatever each side's full head count:

    ```
    head-major (H, N, C):   block = [h0 N C][h1 N C]...   slice [1, 2): one run inside each block
    token-major (N, H, C):  block = [t0: h0 C, h1 C][t1: h0 C, h1 C]...
                            slice [1, 2): one segment per token, outer N, inner (h, C)
    ```
    A head dimension of size 1 has no stride of its own in memory; vLLM gives it (as any
    allocation does) the product of the sizes inside it, which places it just inside the
    dimension whose stride it shares."""
    layers = tuple(layers)
    if not layers:
        raise InvalidArgumentError("invalid layers=(): must hold at least one layer")
    _check_int("num_blocks", num_blocks)
    first = layers[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"layers[0] must be a torch.Tensor, got {type(first).__name__}")
    if not isinstance(dims, str) or len(set(dims)) != len(dims) or dims.count("B") != 1:
        raise InvalidArgumentError(f"invalid dims={dims!r}: must name each dimension once, with one 'B' (the blocks)")
    if first.dim() != len(dims):
        raise InvalidArgumentError(
            f"invalid layers[0] ({_describe(first)}): {first.dim()} dimensions, dims={dims!r} names {len(dims)}"
        )
    b = dims.index("B")
    if first.shape[b] != num_blocks:
        raise InvalidArgumentError(
            f"invalid layers[0] ({_describe(first)}): dimension {b} (B) holds {first.shape[b]} blocks, "
            f"the engine has num_blocks={num_blocks}"
        )
    stride = first.stride()
    h = -1
    if heads is not None:
        if "H" not in dims:
            raise InvalidArgumentError(f"invalid heads={heads!r}: dims={dims!r} names no 'H' (the KV heads)")
        h = dims.index("H")
        lo, hi = heads
        _check_int("heads[0]", lo)
        _check_int("heads[1]", hi)
        if not 0 <= lo < hi <= first.shape[h]:
            raise InvalidArgumentError(
                f"invalid heads=({lo}, {hi}): must be a non-empty range within [0, {first.shape[h]}) (the views' heads)"
            )
        layers = tuple(t.narrow(h, lo, hi - lo) if isinstance(t, torch.Tensor) else t for t in layers)
        first = layers[0]
    placed = [d for d in range(first.dim()) if d != b and (first.shape[d] > 1 or d == h)]
    ones = [d for d in range(first.dim()) if d != b and d not in placed]
    # A size-1 dimension ties, by stride, with the one just outside it: it goes inside.
    physical = sorted(placed, key=lambda d: (-stride[d], first.shape[d] == 1))
    inner: list[int] = []
    expect = 1
    for d in reversed(physical):
        if stride[d] != expect and first.shape[d] > 1:
            break
        inner.insert(0, d)
        expect *= first.shape[d]
    if h in inner:  # a head slice's segments start at its heads (see the doc)
        inner = inner[inner.index(h) :]
    outer = physical[: len(physical) - len(inner)]
    if not inner and physical:
        raise InvalidArgumentError(
            f"invalid layers[0] ({_describe(first)}): kvferry reads a block as dense runs of bytes, "
            "and these views have none it can address"
        )
    perm = [*outer, b, *inner, *ones]
    label = ".".join(f"{dims[d]}{first.shape[d]}" for d in physical)
    views = []
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"layers[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != first.shape or t.stride() != first.stride():
            raise InvalidArgumentError(
                f"invalid layers[{i}] ({_describe(t)}): must have the shape and strides of layers[0] "
                f"({_describe(first)})"
            )
        view = writable(t).permute(perm)
        for _ in ones:  # the trailing size-1 dimensions go
            view = view.select(-1, 0)
        views.append(view)
    try:
        pool = PagedKV(tuple(views), tokens_per_block, len(outer), label)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"invalid layers[0] ({_describe(first)}): {err}") from None
    if heads is None:
        # What `PagedKV.heads` slices: the engine's own views (a pool of it reads them again).
        object.__setattr__(pool, "_views", (layers, dims))
    return pool
