"""The fused CUDA block copy: one Triton launch for every (block, layer, segment) of a batch.

```
grid:     (pairs, layers, segments * chunks_per_segment)
program:  copies CHUNK words of one segment of one block of one layer
address:  base + layer_offset[layer] + segment * segment_stride + block_id * block_stride + w
```
Each side has its own strides (`PagedKV.segment_stride`, `block_stride`, here in words), so
a copy between a layer-outer and a block-outer pool converts the layout as it goes.
Layers are separate allocations, so each side passes its lowest-addressed layer as ``base``
and every layer's distance from it (in 8-byte words) as ``layer_offset`` (see
``PagedKV.pointer_table``); one launch then reaches all layers without a pointer table.
Imported only when a CUDA copy runs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

from kvferry import _streams
from kvferry.layout import PagedKV

WORD_BYTES = 8
ALIGN = 16


@dataclass(frozen=True)
class LaunchConfig:
    """Work per program and its shape."""

    chunk_words: int
    block_words: int
    num_warps: int
    cache_hints: bool


# Chosen from a sweep of 80 configurations on an H200 (docs/benchmarks.md): small batches
# want many short programs to fill 132 SMs quickly; large ones long programs with 16 warps.
SMALL = LaunchConfig(chunk_words=4096, block_words=1024, num_warps=4, cache_hints=True)
LARGE = LaunchConfig(chunk_words=16384, block_words=1024, num_warps=16, cache_hints=False)
LARGE_FROM_BYTES = 1 << 30


def pick_config(payload_bytes: int) -> LaunchConfig:
    """The launch shape for a copy of ``payload_bytes`` in all."""
    return LARGE if payload_bytes >= LARGE_FROM_BYTES else SMALL


@triton.jit(do_not_specialize=["n_pairs", "src_seg_stride", "dst_seg_stride", "src_block_stride", "dst_block_stride"])
def _copy_kernel(
    src_base,
    dst_base,
    src_layer_off,
    dst_layer_off,
    ids,
    n_pairs,
    src_seg_stride,
    dst_seg_stride,
    src_block_stride,
    dst_block_stride,
    SEG_WORDS: tl.constexpr,
    CHUNKS_PER_SEG: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    CACHE_HINTS: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1)
    seg = (tl.program_id(2) // CHUNKS_PER_SEG).to(tl.int64)
    chunk = tl.program_id(2) % CHUNKS_PER_SEG
    s_block = tl.load(ids + pair)
    d_block = tl.load(ids + n_pairs + pair)
    s_row = tl.load(src_layer_off + layer) + seg * src_seg_stride + s_block * src_block_stride
    d_row = tl.load(dst_layer_off + layer) + seg * dst_seg_stride + d_block * dst_block_stride
    # Every row starts 16-byte aligned (checked by `supports`), so loads can be 128 bits wide.
    s_row = tl.multiple_of(s_row, 2)
    d_row = tl.multiple_of(d_row, 2)
    src = src_base.to(tl.pointer_type(tl.int64))
    dst = dst_base.to(tl.pointer_type(tl.int64))
    for i in tl.static_range(0, CHUNK, BLOCK):
        offs = chunk * CHUNK + i + tl.arange(0, BLOCK)
        mask = offs < SEG_WORDS
        if CACHE_HINTS:
            # Streamed once: keep it out of L1 on the way in and mark it evict-first on the way out.
            v = tl.load(src + s_row + offs, mask=mask, cache_modifier=".cg")
            tl.store(dst + d_row + offs, v, mask=mask, cache_modifier=".cs")
        else:
            v = tl.load(src + s_row + offs, mask=mask)
            tl.store(dst + d_row + offs, v, mask=mask)


def supports(src: PagedKV, dst: PagedKV) -> bool:
    """The kernel needs 16-byte aligned segments, strides and layer bases."""
    return src.alignment >= ALIGN and dst.alignment >= ALIGN


def warm_up(pool: PagedKV) -> None:
    """Compiles every launch shape for ``pool``'s geometry by copying block 0 onto itself
    (the same bytes back in place), so no timed transfer pays for Triton's compilation."""
    if not supports(pool, pool):
        return
    ids = torch.zeros((2, 1), dtype=torch.int64, device=pool.device)
    for config in (SMALL, LARGE):
        copy_blocks(pool, pool, ids, config)


def copy_blocks(src: PagedKV, dst: PagedKV, ids: torch.Tensor, config: LaunchConfig | None = None) -> None:
    """Launches the kernel. ``ids`` is a validated ``(2, n)`` int64 tensor the GPU can read
    (on the pools' device, or pinned host memory): row 0 source blocks, row 1 destinations."""
    _launch(src, dst, ids.numel() // 2, ids.data_ptr(), lambda: ids, config)


def _launch(
    src: PagedKV, dst: PagedKV, n: int, ids_ptr: int, ids: Callable[[], torch.Tensor], config: LaunchConfig | None
) -> None:
    """``ids_ptr``: the address of the ``(2, n)`` ids, readable by the GPU; ``ids()`` gives
    them as a tensor, needed only when Triton compiles (a tensor argument is what tells Triton
    the pointer's type)."""
    if config is None:
        config = pick_config(n * src.num_layers * src.block_bytes)
    seg_words = src.segment_bytes // WORD_BYTES
    chunk = min(config.chunk_words, triton.next_power_of_2(seg_words))
    block = min(config.block_words, chunk)
    chunks_per_seg = triton.cdiv(seg_words, chunk)
    src_base, src_off = src.pointer_table
    dst_base, dst_off = dst.pointer_table
    grid = (n, src.num_layers, src.segments * chunks_per_seg)
    rest = (
        n,
        src.segment_stride // WORD_BYTES,
        dst.segment_stride // WORD_BYTES,
        src.block_stride // WORD_BYTES,
        dst.block_stride // WORD_BYTES,
        seg_words,
        chunks_per_seg,
        chunk,
        block,
        config.cache_hints,
    )
    # Switching devices costs microseconds a launch: only when the pool is not on the current
    # one. CPU tensors reach here only under TRITON_INTERPRET=1 (how CI runs the kernel).
    on_current = src.device.type != "cuda" or src.device.index in (None, _streams.current_device())
    where = contextlib.nullcontext() if on_current else torch.cuda.device(src.device)
    # Everything the compiled kernel was specialised on: the constexprs, the launch shape,
    # and whether the ids pointer is 16-byte aligned (the other pointers always are).
    key = (src.device, seg_words, chunks_per_seg, chunk, block, config, ids_ptr % ALIGN == 0)
    with where:
        compiled = _compiled.get(key)
        if compiled is not None:
            # Plain addresses: the launcher then skips a driver query per tensor argument.
            compiled[grid](
                src_base.data_ptr(), dst_base.data_ptr(), src_off.data_ptr(), dst_off.data_ptr(), ids_ptr, *rest
            )
            return
        kernel = _copy_kernel[grid](
            src_base,
            dst_base,
            src_off,
            dst_off,
            ids(),
            *rest[:5],
            SEG_WORDS=seg_words,
            CHUNKS_PER_SEG=chunks_per_seg,
            CHUNK=chunk,
            BLOCK=block,
            CACHE_HINTS=config.cache_hints,
            num_warps=config.num_warps,
        )
        if _FAST_LAUNCH and isinstance(kernel, CompiledKernel):
            _compiled[key] = kernel


# Triton's JIT call binds and hashes every argument on each launch (about 20 us of Python on
# the H200 host); the compiled kernel's own launcher skips that. Since Triton 3.2 it takes every
# argument, constexprs included, in signature order: older versions keep the slow path.
_FAST_LAUNCH = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 2)
_compiled: dict[tuple[object, ...], CompiledKernel] = {}


@dataclass
class _Slot:
    host: torch.Tensor  # pinned, 2 * RING_PAIRS int64
    device: torch.Tensor  # the same on the GPU, for batches too large to read over PCIe
    used: torch.cuda.Event  # recorded after the launch that reads this slot
    host_ptr: int = 0
    device_ptr: int = 0

    def __post_init__(self) -> None:
        # Under unified addressing a pinned host buffer's address is valid on the GPU too.
        self.host_ptr, self.device_ptr = self.host.data_ptr(), self.device.data_ptr()


# Ids of a small batch are read by the kernel straight from pinned host memory (a few bytes
# per program over PCIe) instead of paying a host-to-device copy first; larger batches go
# through the slot's device buffer. Slots are reused round robin once their launch finished.
RING_SLOTS = 8
RING_PAIRS = 4096
HOST_READ_MAX_PAIRS = 64


class IdRing:
    """Reused pinned buffers for the block ids of copies on one device: no pinning, no
    allocation and (for small batches) no host-to-device copy per launch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._index = _streams.device_index(device)
        self._slots = [
            _Slot(
                torch.empty(2 * RING_PAIRS, dtype=torch.int64, pin_memory=True),
                torch.empty(2 * RING_PAIRS, dtype=torch.int64, device=device),
                torch.cuda.Event(),
            )
            for _ in range(RING_SLOTS)
        ]
        self._host = [slot.host.numpy() for slot in self._slots]
        self._next = 0
        self._lock = threading.Lock()

    def copy(self, src: PagedKV, dst: PagedKV, packed: np.ndarray) -> None:
        """Copies the validated ``(2, n)`` pairs ``packed`` on the current stream."""
        n = packed.shape[1]
        if n > RING_PAIRS:
            copy_blocks(src, dst, torch.from_numpy(packed).pin_memory().to(self.device, non_blocking=True))
            return
        with self._lock:
            i = self._next
            slot = self._slots[i]
            # The launch that last read this slot may still be queued (many copies in flight on
            # the stream): never wait for it here, which would hold the caller (a transport
            # issuing a long write piece by piece) until the stream drained. Such a batch
            # takes the caching host allocator's pinned memory instead.
            if slot.used.query():
                self._next = (i + 1) % RING_SLOTS
                self._host[i][: 2 * n] = packed.reshape(-1)
                if n <= HOST_READ_MAX_PAIRS:
                    _launch(src, dst, n, slot.host_ptr, lambda: slot.host[: 2 * n], None)
                else:
                    slot.device[: 2 * n].copy_(slot.host[: 2 * n], non_blocking=True)
                    _launch(src, dst, n, slot.device_ptr, lambda: slot.device[: 2 * n], None)
                slot.used.record(_streams.current_stream(self._index))
                return
        copy_blocks(src, dst, torch.from_numpy(packed).pin_memory().to(self.device, non_blocking=True))


_rings: dict[torch.device, IdRing] = {}

# Small batches replay a captured CUDA graph of the launch instead: one driver call on the
# host instead of Triton's launcher (about 20 us). A graph is captured per pool pair and batch
# size bucket; a batch is padded to its bucket by repeating its last pair, which writes the
# same bytes to the same block again (harmless), so device time grows by at most the
# bucket's slack.
GRAPH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Pool pairs with captured graphs, least recently used dropped first: enough for a pool, each
# of its layer groups' slices (up to one per layer) and a host tier's view, to every receiver.
GRAPH_PAIR_SETS = 128


class LaunchGraphs:
    """Captured launches of the copy kernel for one (source, destination) pool pair, one per
    batch-size bucket: each uploads the ids from one pinned host buffer, then copies."""

    def __init__(self, src: PagedKV, dst: PagedKV) -> None:
        self._pools = (weakref.ref(src), weakref.ref(dst))
        self._index = _streams.device_index(src.device)
        self._host = torch.empty(2 * GRAPH_BUCKETS[-1], dtype=torch.int64, pin_memory=True)
        self._device = torch.empty(2 * GRAPH_BUCKETS[-1], dtype=torch.int64, device=src.device)
        self._ids = self._host.numpy()
        self._done = torch.cuda.Event()  # the last replay, which read the buffer
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._lock = threading.Lock()

    def copy(self, packed: np.ndarray) -> bool:
        """Replays the graph for ``packed`` on the current stream; False (nothing done) when
        the kernel is not compiled yet for this geometry, which a graph cannot do, or when the
        previous replay has not run yet (waiting for it would block the host)."""
        n = packed.shape[1]
        bucket = next(b for b in GRAPH_BUCKETS if b >= n)
        with self._lock:
            graph = self._graphs.get(bucket)
            if graph is None:
                graph = self._capture(bucket)
                if graph is None:
                    return False
            if not self._done.query():
                # The previous replay, which reads the one id buffer, is still queued: the
                # caller takes the ring instead of waiting for the stream to drain.
                return False
            ids = self._ids
            ids[:n], ids[n:bucket] = packed[0], packed[0, -1]
            ids[bucket : bucket + n], ids[bucket + n : 2 * bucket] = packed[1], packed[1, -1]
            graph.replay()
            self._done.record(_streams.current_stream(self._index))
        return True

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph | None:
        src, dst = self._pools[0](), self._pools[1]()
        if src is None or dst is None:
            return None
        config = pick_config(bucket * src.num_layers * src.block_bytes)
        seg_words = src.segment_bytes // WORD_BYTES
        chunk = min(config.chunk_words, triton.next_power_of_2(seg_words))
        key = (
            src.device,
            seg_words,
            triton.cdiv(seg_words, chunk),
            chunk,
            min(config.block_words, chunk),
            config,
            True,
        )
        if key not in _compiled:
            return None
        # Nothing may allocate or copy from pageable memory while capturing: build both pools'
        # pointer tables first.
        for pool in (src, dst):
            _ = pool.pointer_table  # cached on the pool from here on
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(src.device)
        side.wait_stream(torch.cuda.current_stream(src.device))
        # Captured with capture_begin/end rather than `torch.cuda.graph`, whose entry
        # synchronizes the whole device, collects garbage and empties the allocator's cache:
        # a first copy of a new pool pair (a layer group's slice, a host tier's view) would
        # then stall behind the running prefill and every other stream. Nothing here
        # allocates. thread_local: other threads (a sender's progress thread polling events)
        # keep working meanwhile.
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                # The ids go up in one small copy inside the graph: cheaper in device time
                # than every program reading its pair over PCIe.
                ids = self._device[: 2 * bucket]
                ids.copy_(self._host[: 2 * bucket], non_blocking=True)
                _launch(src, dst, bucket, ids.data_ptr(), lambda: ids, config)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(src.device).wait_stream(side)
        self._graphs[bucket] = graph
        return graph


# Keyed by the pools' ids; an entry dies with either pool (a graph holds their addresses, so it
# must never outlive them) and does not keep them alive.
_graphs: OrderedDict[tuple[int, int], LaunchGraphs] = OrderedDict()
_graphs_lock = threading.Lock()


def _graphs_for(src: PagedKV, dst: PagedKV) -> LaunchGraphs:
    key = (id(src), id(dst))
    with _graphs_lock:
        graphs = _graphs.get(key)
        if graphs is None:
            graphs = _graphs[key] = LaunchGraphs(src, dst)
            for pool in {id(src): src, id(dst): dst}.values():
                weakref.finalize(pool, _forget_graphs, key)
            while len(_graphs) > GRAPH_PAIR_SETS:
                _graphs.popitem(last=False)
        _graphs.move_to_end(key)
        return graphs


def _forget_graphs(key: tuple[int, int]) -> None:
    with _graphs_lock:
        _graphs.pop(key, None)


def copy_packed(src: PagedKV, dst: PagedKV, packed: np.ndarray) -> None:
    """`copy_blocks` for validated host-side pairs (see `kvferry._core.pack_pairs`)."""
    small = packed.shape[1] <= GRAPH_BUCKETS[-1] and src.device.index == _streams.current_device()
    if small and USE_GRAPHS and _graphs_for(src, dst).copy(packed):
        return
    ring = _rings.get(src.device)
    if ring is None:
        ring = _rings.setdefault(src.device, IdRing(src.device))
    ring.copy(src, dst, packed)


USE_GRAPHS = True
