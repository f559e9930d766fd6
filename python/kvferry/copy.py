"""`copy_blocks`: move listed blocks of every layer from one paged pool to another.

CUDA pools on one device: one Triton kernel launch for all layers and blocks. Anything else
(CPU pools, pools on different devices): torch index ops over 8-byte words, one gather and
one scatter per layer (index_copy_ on uint8 is about 5x slower than on int64).

Both paths address each pool through its own segment and block strides (`PagedKV`), so two
pools whose blocks hold the same elements in the same order but lie differently (one vLLM
engine's layer-outer layout, the other's block-outer one) are converted by the copy itself.
"""

from __future__ import annotations

from typing import Sequence

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import torch

from kvferry._core import pack_pairs
from kvferry.layout import BlockIds, PagedKV, common_word

__all__ = ["BlockCopies", "checked_pairs", "copy_blocks", "copy_blocks_torch", "packed_ids"]


def checked_pairs(src: PagedKV, dst: PagedKV, src_ids: BlockIds, dst_ids: BlockIds) -> tuple[np.ndarray, np.ndarray]:
    """Validates a copy before any byte moves: compatible layouts, ids in range, as many
    sources as destinations, and no destination written twice. Returns the two id rows of
    one contiguous ``(2, n)`` int64 array (see `kvferry._core.pack_pairs`)."""
    packed = _packed_pairs(src, dst, src_ids, dst_ids)
    return packed[0], packed[1]


def _packed_pairs(src: PagedKV, dst: PagedKV, src_ids: BlockIds, dst_ids: BlockIds) -> np.ndarray:
    src.check_compatible(dst)
    return packed_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks)


def packed_ids(src_ids: BlockIds, dst_ids: BlockIds, src_blocks: int, dst_blocks: int) -> np.ndarray:
    """The ``(2, n)`` validated ids of a copy into a pool of ``dst_blocks`` blocks that this
    process may not address (a remote receiver's)."""
    return pack_pairs(_host_ids(src_ids), _host_ids(dst_ids), src_blocks, dst_blocks)


def _host_ids(ids: BlockIds) -> BlockIds:
    return ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else ids


def copy_blocks_torch(src: PagedKV, dst: PagedKV, src_ids: BlockIds, dst_ids: BlockIds) -> None:
    """The torch reference path: ``index_select`` + ``index_copy_`` per layer."""
    s, d = checked_pairs(src, dst, src_ids, dst_ids)
    if s.size:
        _copy_torch(src, dst, s, d)


# CPU gathers go through a reused buffer of about this size: small enough to stay in cache
# and to be faulted in once, which made 1024-block copies 3x faster than one gather per layer.
GATHER_BYTES = 4 << 20


def _copy_torch(src: PagedKV, dst: PagedKV, s: np.ndarray, d: np.ndarray) -> None:
    word = common_word(src, dst)
    src_views, dst_views = src.segment_views(word), dst.segment_views(word)
    if src.device.type == dst.device.type == "cpu":
        _copy_cpu_chunked(src_views, dst_views, s, d)
        return
    s_dev = torch.from_numpy(s).to(src.device, non_blocking=True)
    d_dev = torch.from_numpy(d).to(dst.device, non_blocking=True)
    for sv, dv in zip(src_views, dst_views):
        gathered = sv.index_select(1, s_dev)
        if gathered.device != dv.device:
            # Host<->device: the gathered batch crosses in one copy per layer.
            gathered = gathered.to(dv.device)
        dv.index_copy_(1, d_dev, gathered)


def _run_start(ids: np.ndarray) -> int | None:
    """``ids[0]`` when ``ids`` are consecutive and ascending (a staging ring's slots), else None.
    Asked of the host's ids: on torch tensors each of these element reads is an operator call."""
    n = ids.size
    if n == 0:
        return None
    first = int(ids[0])
    if int(ids[-1]) - first != n - 1 or (n > 2 and not bool((np.diff(ids) == 1).all())):
        return None
    return first


def _copy_cpu_chunked(
    src_views: list[torch.Tensor], dst_views: list[torch.Tensor], s_ids: np.ndarray, d_ids: np.ndarray
) -> None:
    """One pass over the bytes where one side's blocks are a consecutive run (a staging ring's
    slots: gathered straight into them, or scattered straight from them); else two, through a
    reused buffer."""
    n = s_ids.size
    s, d = torch.from_numpy(s_ids), torch.from_numpy(d_ids)
    apart = all(
        sv.untyped_storage().data_ptr() != dv.untyped_storage().data_ptr() for sv, dv in zip(src_views, dst_views)
    )
    at = _run_start(d_ids) if apart else None  # within one pool, only the buffer keeps reads before writes
    first = dst_views[0]  # every layer has its strides
    if at is not None and all(first[seg, at : at + n].is_contiguous() for seg in range(first.shape[0])):
        for sv, dv in zip(src_views, dst_views):
            for seg in range(sv.shape[0]):
                torch.index_select(sv[seg], 0, s, out=dv[seg, at : at + n])
        return
    at = _run_start(s_ids) if apart else None
    if at is not None:
        for sv, dv in zip(src_views, dst_views):
            dv.index_copy_(1, d, sv[:, at : at + n])
        return
    segments, _, words = src_views[0].shape
    per_block = segments * words * src_views[0].element_size()
    step = max(1, min(s.numel(), GATHER_BYTES // per_block))
    buf = torch.empty((segments, step, words), dtype=src_views[0].dtype)
    for sv, dv in zip(src_views, dst_views):
        for i in range(0, s.numel(), step):
            k = min(step, s.numel() - i)
            torch.index_select(sv, 1, s[i : i + k], out=buf[:, :k])
            dv.index_copy_(1, d[i : i + k], buf[:, :k])


def copy_blocks(src: PagedKV, dst: PagedKV, src_ids: BlockIds, dst_ids: BlockIds) -> None:
    """Copies block ``src_ids[i]`` of every layer of ``src`` into block ``dst_ids[i]`` of
    ``dst``. Layouts must be compatible and ids in range; ``dst_ids`` must not repeat. On CUDA
    the copy is queued on the current stream and returns at once."""
    packed = _packed_pairs(src, dst, src_ids, dst_ids)
    s, d = packed[0], packed[1]
    if not s.size:
        return
    if src.device.type == "cuda" and src.device == dst.device:
        from kvferry import _triton_copy

        if _triton_copy.supports(src, dst):
            _triton_copy.copy_packed(src, dst, packed)
            return
    _copy_torch(src, dst, s, d)


class BlockCopies:
    """Several block copies planned together and queued one at a time (`issue`): a pipelined
    transfer's pieces, each copy between its own pair of pools (a scratch buffer of two that
    take turns). Every copy is validated here, before any byte moves. On CUDA, when every
    copy can take the fused kernel, all their ids go to the device in one upload on the current
    stream (no pinned buffer, id ring slot or graph per copy: a piece issued behind queued
    work never waits on the host for an id slot), so `issue` must run on that stream or one
    ordered after it (a stream that waited on an event recorded after this constructor)."""

    def __init__(self, copies: Sequence[tuple[PagedKV, PagedKV, BlockIds, BlockIds]]) -> None:
        self._copies = [(src, dst, _packed_pairs(src, dst, s, d)) for src, dst, s, d in copies]
        self._ids: torch.Tensor | None = None
        self._offsets: list[int] = []
        fused = bool(self._copies) and all(
            src.device.type == "cuda" and src.device == dst.device for src, dst, _ in self._copies
        )
        if fused:
            from kvferry import _triton_copy

            fused = all(_triton_copy.supports(src, dst) for src, dst, _ in self._copies)
        if fused:
            flat = np.concatenate([p.reshape(-1) for _, _, p in self._copies])
            self._offsets = np.concatenate([[0], np.cumsum([p.size for _, _, p in self._copies])]).tolist()
            device = self._copies[0][0].device
            self._ids = torch.from_numpy(flat).pin_memory().to(device, non_blocking=True)

    def __len__(self) -> int:
        return len(self._copies)

    def issue(self, i: int) -> None:
        """Queues copy ``i`` (on the current stream on CUDA; done on return on CPU)."""
        src, dst, packed = self._copies[i]
        if not packed.shape[1]:
            return
        if self._ids is None:
            _copy_torch(src, dst, packed[0], packed[1])
            return
        from kvferry import _triton_copy

        _triton_copy.copy_blocks(src, dst, self._ids[self._offsets[i] : self._offsets[i + 1]])
