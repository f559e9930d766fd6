"""Pinned host staging: the path of a machine without GPUDirect (and a NIC-class link).

```
sender (CUDA pool)                    shared pinned host ring              receiver (CUDA pool)
gather blocks, device-to-host  --->   slots [lo, lo+n) of every layer ---> host-to-device, scatter
on the copy stream                    notice + slots + dst ids (socket)    then deliver; free slots
```
Every connected sender has a ring of its own: the endpoint creates it when the sender's
handshake succeeds, names it (128 random bits) in that sender's hello only, and removes it
when the connection ends; the sender's slot accounting is then the whole truth about its
ring, and two senders can never write the same slots. A ring lives in POSIX shared memory
(kvferry.transports.shm) and is page-locked in both processes, so both copies run at PCIe
speed. Slots are freed in order by the receiver once its host-to-device copy finished; a
sender that finds its ring full keeps the write in its backlog (`KVSender`) until frees come. CPU pools work too (no
pinning): that is how CI exercises the protocol.

The cost is memory per connection: ``capacity_blocks`` blocks of every layer for each
connected sender (``StagingEndpoint.ring_bytes``), so ``max_senders`` bounds how many are
served at once and one more is refused by name.

Here the receiver applies every write itself, so it also checks each one: the blocks of a
notice the receiver would not take (a stale epoch, a request cancelled here or revoked by
its sender, another sender's request) stay in the ring and never reach the pool, whatever
the sender knew when it posted them.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, ClassVar, Iterable, Mapping, NoReturn, Optional, Sequence

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import torch

from kvferry.checksum import summed
from kvferry.copy import BlockCopies, copy_blocks, packed_ids
from kvferry.engine import SPIN_WAIT_BYTES, CopyEngine, Pending
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver, Landing
from kvferry.tiers import source_layers, source_parts
from kvferry.transports import wire
from kvferry.transports.base import TransportFull, Write, kept
from kvferry.transports.control import Handler, LocalEndpoint, LocalTransport, pool_hello
from kvferry.transports.frames import Announce, Frame, Freed, Hello, Staged
from kvferry.transports.registry import STAGING_RING_BYTES
from kvferry.transports.shm import SharedPool

__all__ = ["StagingEndpoint", "StagingTransport", "scratch_bytes"]

# A write's two PCIe legs (device-to-host here, host-to-device at the receiver) run one after
# the other, so a plan is cut into writes of at most `WRITE_BYTES` (half the ring if that is
# less): the receiver takes in one write while the next is staged. Measured on one H200
# shared by both processes (docs/benchmarks.md, 2026-12-01), 512 MiB writes moved 1024
# blocks at 70% of the host link against 46% for one write, once issuing a write no longer
# waited on the stream (and each write is one piece); 128 MiB writes were slower (more
# copies to issue, each write's notice round trip; that was through a ring as large as the
# pool, before `split_write_blocks` below). `write_bytes` sets another bound.
WRITE_BYTES = 512 << 20
# With dma legs a plan goes in equal writes of at most a RING_DEPTH-th of the ring and about
# sqrt(plan x WRITE_OVERHEAD_BYTES), each a whole fraction of the ring (`split_write_blocks`).
# A write's two legs run one after the other, and each write costs about WRITE_OVERHEAD_BYTES'
# worth of link time of its own (its frame, the receiver's events and deliveries); smaller
# writes overlap more of a plan's legs, and more of them fit in the ring at once. Measured on
# one H100 through a 1 GiB ring (docs/benchmarks.md): 256 MiB to 16 GiB 1.12-1.23x as fast as
# half-ring writes. Direct legs (CPU pools) share the host's memory and pay more per write in
# Python: smaller writes moved 0.86-0.93x as fast there (2-core AMD EPYC).
RING_DEPTH = 4
WRITE_OVERHEAD_BYTES = 64 << 20


def split_write_blocks(total: int, limit: int, overhead: int, capacity: int) -> int:
    """The most blocks each write of a ``total``-block plan carries through a ring of
    ``capacity`` slots, with dma legs: about sqrt(total x overhead) (``overhead``: a write's
    own cost in blocks' worth of link time), since two legs in a row end a plan after its
    total plus its largest write plus every write's own cost; at most a `RING_DEPTH`-th of the
    ring, so that many writes are in it at once; never under ``overhead`` (a smaller write
    costs more than it overlaps: a 64 MiB ring keeps its half-ring writes); at most ``limit``;
    rounded down to a whole fraction of the ring, so no write skips the ring's tail
    (`StagingTransport._reserve`); then the plan in equal writes. 128 blocks through a
    256-slot ring with an overhead of 16 go as 4 writes of 32."""
    size = min(limit, max(overhead, min(capacity // RING_DEPTH, math.isqrt(total * overhead))))
    size = capacity // -(-capacity // size)
    writes = -(-total // size)
    return -(-total // writes)


# A batch crosses the ring in pieces of about this many bytes (all its layers). Each piece is
# gathered by one fused copy (`kvferry.copy.BlockCopies`) into a scratch pool of the same
# layout on the pool's device, then moved to its ring slots as contiguous runs: one DMA per
# layer and segment, no kernel between them. The receiver does the reverse (one DMA per layer
# and segment into its scratch pool, then one fused scatter). A per-layer gather kernel before
# every per-layer copy (the code before) put 32 kernels per batch in each process; on one GPU
# two processes' kernels are time-sliced, and every copy waited behind the other side's
# kernels.
#
# On CUDA each side keeps two scratch pools that take turns, and its two kinds of work run on
# two streams ordered by CUDA events, never by the host:
#
# ```
# sender:   gather (copy stream)  [g0][g1]      [g2]      [g3] ...   g_k waits for d2h_{k-2}
#           device-to-host stream     [ d2h0  ][ d2h1  ][ d2h2  ]    d2h_k waits for g_k
# receiver: host-to-device stream [ h2d0  ][ h2d1  ][ h2d2  ] ...    h2d_k waits for s_{k-2}
#           scatter stream                 [s0]     [s1]     [s2]    s_k waits for h2d_k
# ```
# so the copy engines move piece k+1 while piece k's kernel runs, and the link never waits for
# a kernel. The receiver also does not wait for a write's copies before reading the next
# write's frame: it queues them behind the first (`StagingEndpoint.stage`), so the host-to-
# device leg runs back to back across writes while the sender's device-to-host leg fills the
# next slots.
STAGE_CHUNK_BYTES = 256 << 20

# How each leg moves its blocks (`KVFERRY_STAGING_LEGS`; each side chooses for itself, the ring
# is the same either way):
# - "dma" (CUDA pools' default): the pipeline above: a fused gather into a scratch pool, then
#   the copy engine into the slots (the sender); the reverse at the receiver.
# - "direct" (CPU pools' default): one `copy_blocks` between the pool and the slots, no scratch
#   pool: on CPU one pass over the bytes each way instead of two (the slots are a consecutive
#   run, see `kvferry.copy`): 1024 blocks of 512 KiB in 44-57 ms against 91-110 ms, `bench
#   copy --transport staging` on 2 cores (docs/benchmarks.md). On CUDA the
#   fused copy kernel stores into the ring (the sender) or loads from it (the receiver) over
#   PCIe: page-locked host memory is addressable by kernels (unified addressing), so a leg is
#   one kernel and no DMA. Its kernels hold SMs while they wait on PCIe. Measured on one H100
#   (docs/benchmarks.md, "The H100 run of 2026-12-05"): each leg alone moves 92-95% of the
#   link either way, as the dma leg does; but a sender's and a receiver's kernels on one GPU
#   take each other's SMs (1024 blocks: 23.8 GB/s against dma's 40.4) and a forward beside
#   them ran 1.82x slower (`bench agentic`), so CUDA pools keep "dma" for large writes.
# - "auto" (CUDA pools' default): "direct" for a write of at most `DIRECT_WRITE_BYTES`, "dma"
#   above. A small write's dma legs cost far more than its bytes: one copy call per layer and
#   segment on each side (64 for Llama-8B's 32 layers), each a few microseconds of Python and
#   driver, and a lone write of 8 blocks of 4 MiB took 4.3-6.6 ms where the link moves its
#   32 MiB in 0.6 ms (docs/benchmarks.md, "Where a lone small write's time goes"). One kernel a
#   side is one launch; a small write's kernels hold the SMs for about its link time only.
#   Each side decides for its own copies of each write, by the write's bytes.
DIRECT_WRITE_BYTES = 64 << 20
LEGS_ENV = "KVFERRY_STAGING_LEGS"
LEGS = ("dma", "direct", "auto")

# A ring's size where its user does not choose one (`default_ring_bytes`): the registry's
# `STAGING_RING_BYTES` (kept there, without torch, for `kvferry doctor`), which says why.
RING_BYTES = STAGING_RING_BYTES


def default_ring_bytes(device: torch.device) -> int:
    """The staging ring's size for pools on ``device`` (`RING_BYTES`)."""
    return RING_BYTES["cuda" if device.type == "cuda" else "cpu"]


def staging_legs(device: Optional[torch.device] = None) -> str:
    """The legs this process's staging copies of a pool on ``device`` take: `LEGS_ENV` if
    set, else "direct" for CPU pools and "auto" for CUDA pools (`write_legs` picks a
    write's)."""
    default = "auto" if device is not None and device.type == "cuda" else "direct"
    legs = os.environ.get(LEGS_ENV, default)
    if legs not in LEGS:
        raise InvalidArgumentError(f"invalid {LEGS_ENV}={legs!r}: must be one of {', '.join(LEGS)}")
    return legs


def write_legs(legs: str, nbytes: int) -> str:
    """The legs one write of ``nbytes`` (all its layers) takes under setting ``legs``:
    "auto" is "direct" up to `DIRECT_WRITE_BYTES`, "dma" above."""
    if legs == "auto":
        return "direct" if nbytes <= DIRECT_WRITE_BYTES else "dma"
    return legs


class _CudaBytes:
    """A host byte tensor's memory as a CUDA array (``torch.as_tensor`` reads this interface)."""

    def __init__(self, t: torch.Tensor) -> None:
        assert t.dtype == torch.uint8, "rings are bytes"
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "strides": tuple(t.stride()),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
        }


def device_view(ring: PagedKV, device: torch.device) -> PagedKV:
    """A page-locked host ring as ``device``'s kernels address it: the same memory, the
    same pointers (unified addressing), tensors on ``device``."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    layers = []
    for t in ring.layers:
        seen = torch.as_tensor(_CudaBytes(t))
        # torch places such an array on the device the pointer belongs to; anything but the
        # same bytes on ``device`` would make the kernel write somewhere the peer never reads.
        if seen.device != device or seen.data_ptr() != t.data_ptr():
            raise TransferError(
                f"the staging ring is not addressable from {device} (CUDA reports it on {seen.device}): "
                f"unset {LEGS_ENV} or set it to dma"
            )
        layers.append(seen)
    return ring.with_layers(layers)


def ring_as_pool(ring: PagedKV, like: PagedKV) -> PagedKV:
    """A ring's slots as a pool of ``like``'s dtype and block layout on ``like``'s device,
    over the same memory (on CUDA through `device_view`): `copy_blocks` then moves blocks
    between ``like`` and the slots directly, the direct legs (`LEGS_ENV`)."""
    if like.device.type == "cuda":
        ring = device_view(ring, like.device)
    layers = tuple(t.view(like.dtype) for t in ring.layers)  # (segments, slots, segment) each
    return PagedKV(layers, like.tokens_per_block, 1, like.block_layout)


# How often the receiver looks at its connection while a write's copies are still running
# (each look is one poll(2) and one event query).
APPLY_POLL_SECONDS = 50e-6


def _scratch_blocks(block_bytes: int, num_layers: int) -> int:
    """Blocks of one scratch pool: `STAGE_CHUNK_BYTES` of whole blocks, at least one."""
    return max(1, STAGE_CHUNK_BYTES // (block_bytes * num_layers))


def scratch_bytes(block_bytes: int, layer_counts: Iterable[int], device: torch.device) -> int:
    """Bytes on ``device`` that one side of a staging connection keeps in scratch pools
    (`_Scratch`) once it moved writes of each of ``layer_counts`` layers (a pool's whole
    blocks, and any layer slices of it), for a pool of ``block_bytes`` per block and layer:
    two pools per count on CUDA (`_Pipe`), one on CPU, none with direct legs (`LEGS_ENV`)."""
    if staging_legs(device) == "direct":
        return 0
    per_count = 2 if device.type == "cuda" else 1
    return sum(per_count * _scratch_blocks(block_bytes, n) * block_bytes * n for n in set(layer_counts))


class _Scratch:
    """Scratch pools of `STAGE_CHUNK_BYTES`, two per pool layout (a layer slice has fewer
    layers; on CUDA two pieces are in flight, each in its own pool), made on first use and
    reused: the caller orders their uses (`_Pipe`)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[object, ...], PagedKV] = {}

    def like(self, pool: PagedKV, turn: int = 0) -> PagedKV:
        dim = pool.block_dim
        key = (
            turn,
            pool.num_layers,
            pool.shape[:dim],
            pool.shape[dim + 1 :],
            dim,
            pool.dtype,
            pool.device,
            pool.tokens_per_block,
            pool.block_layout,
        )
        scratch = self._pools.get(key)
        if scratch is None:
            shape = list(pool.shape)
            shape[pool.block_dim] = _scratch_blocks(pool.block_bytes, pool.num_layers)
            layers = tuple(torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(pool.num_layers))
            scratch = self._pools[key] = pool.with_layers(layers)
        return scratch


class _Pipe:
    """One side's two streams and two scratch pools (see `STAGE_CHUNK_BYTES`): piece ``k``
    uses scratch ``k % 2``; its kernel and its copies are ordered by events. On CPU there is
    one scratch pool and everything runs in order on the caller's thread."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.legs = staging_legs(device)
        self.scratch = _Scratch()
        # The DMA stream (device-to-host at the sender, host-to-device at the receiver) and
        # the kernel stream (the receiver's scatter; the sender gathers on its engine's stream).
        self.dma = torch.cuda.Stream(device) if self.cuda else None
        self.kernel = torch.cuda.Stream(device) if self.cuda else None
        # Recorded once a scratch pool's last reader finished: the next piece that writes it
        # waits for it on the stream.
        self.free = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []

    def direct(self, ring: PagedKV, blocks: int) -> bool:
        """Whether a write of ``blocks`` slots of ``ring`` (or of the layer slice it was
        given) takes the direct leg here (`write_legs`)."""
        return write_legs(self.legs, blocks * ring.block_bytes * ring.num_layers) == "direct"

    def pieces(self, pool: PagedKV) -> list[PagedKV]:
        """The scratch pools pieces take turns in (two on CUDA), like ``pool``."""
        return [self.scratch.like(pool, t) for t in range(2 if self.cuda else 1)]

    def synchronize(self) -> None:
        for stream in (self.dma, self.kernel):
            if stream is not None:
                stream.synchronize()


def _ring_runs(ring: PagedKV, scratch: PagedKV, lo: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(ring slots [lo, lo + k), scratch blocks [0, k))`` of every layer and segment, each a
    contiguous run of ``k`` segments (the ring's layers are ``(segments, slots, bytes)``)."""
    runs = []
    for staged, view in zip(ring.layers, scratch.segment_views(torch.uint8)):
        for seg in range(staged.shape[0]):
            runs.append((staged[seg, lo : lo + k], view[seg, :k]))
    return runs


# cudaHostRegisterPortable: the ring is page-locked for every device's context, not only the
# current one's (a process whose pools are on another GPU than its current device, or on
# several, copies it as pinned memory too).
_HOST_REGISTER_PORTABLE = 1


def _pin(pool: PagedKV) -> Callable[[], None]:
    """Page-locks a host pool's memory for fast, asynchronous copies; returns the undo."""
    if not torch.cuda.is_available():
        return lambda: None
    cudart = torch.cuda.cudart()
    layers = pool.layers
    start = min(t.data_ptr() for t in layers)
    size = max(t.data_ptr() + t.numel() * t.element_size() for t in layers) - start
    err = cudart.cudaHostRegister(start, size, _HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        raise TransferError(f"cudaHostRegister of {size} staging bytes failed (error {int(err)})")
    return lambda: cudart.cudaHostUnregister(start)


def _staging_shape(geometry: dict[str, Any], capacity: int) -> tuple[int, int, int]:
    return (int(geometry["segments"]), capacity, int(geometry["segment_bytes"]))


class _Ring:
    """One connection's staging ring: a shared-memory segment of ``capacity`` block slots
    (a fresh 128-bit name), page-locked on a CUDA host, and the streams and scratch pools its
    copies into the pool use (`_Pipe`). Only its connection's thread copies from it."""

    def __init__(self, pool: PagedKV, capacity: int) -> None:
        self.shared = SharedPool.create(
            num_layers=pool.num_layers,
            shape=_staging_shape(pool.geometry(), capacity),
            dtype=torch.uint8,
            tokens_per_block=pool.tokens_per_block,
            block_dim=1,
        )
        try:
            assert self.shared.pool is not None
            self._unpin = _pin(self.shared.pool)
            try:
                self.pipe = _Pipe(pool.device)  # used by the connection's thread alone
                # The direct leg's view of the ring (its scatter reads the slots over PCIe).
                self.seen = _direct_view(self.shared.pool, pool, self.pipe.legs)
            except BaseException:
                self._unpin()
                raise
        except BaseException:
            self.shared.close()
            raise
        self.capacity = capacity
        # Writes whose copies are queued and whose notices are not delivered yet, oldest
        # first (`StagingEndpoint.stage`).
        self.applying: deque[_Applying] = deque()

    @property
    def name(self) -> str:
        return str(self.shared.descriptor["name"])

    def close(self) -> None:
        """Waits for copies still reading the ring (a batch that failed half way), then
        unpins, unmaps and unlinks it. A sender still mapping it keeps its own mapping."""
        try:
            self.pipe.synchronize()
        finally:
            try:
                self._unpin()
            finally:
                self.shared.close()


def _direct_view(ring: PagedKV, pool: PagedKV, legs: str) -> Optional[PagedKV]:
    """The ring as ``pool``'s copies address it for the direct leg (`ring_as_pool`); None
    with dma legs, or with "auto" legs where this device cannot address the ring (every write
    then takes the dma legs). Set to "direct", that is an error naming the setting."""
    if legs == "dma":
        return None
    try:
        return ring_as_pool(ring, pool)
    except TransferError:
        if legs == "direct":
            raise
        return None


@dataclass
class _Applying:
    """A write the receiver queued: its copies end at ``done`` (None: already done, CPU)."""

    done: Optional[torch.cuda.Event]
    notices: Sequence[Notice]
    source: Any
    named: np.ndarray  # the destination ids the sender named (for the lease check)
    freed: int
    short: bool = False  # at most `engine.SPIN_WAIT_BYTES`: waited for in one spin (`_settle`)


def _unstage(
    ring: PagedKV,
    pool: PagedKV,
    pipe: _Pipe,
    lo: int,
    positions: np.ndarray,
    dst_ids: np.ndarray,
    seen: Optional[PagedKV] = None,
) -> Optional[torch.cuda.Event]:
    """Ring slot ``lo + positions[i]`` into pool block ``dst_ids[i]``, piece by piece: each
    piece's slots copied to a scratch pool as contiguous runs, then scattered by one fused
    copy. On CUDA the copies are only queued (see `STAGE_CHUNK_BYTES`) and the event returned
    is recorded after the last; on CPU they are done on return (None). ``positions``
    increase (the codec checks ``picked``). ``seen``: the ring as the pool's device addresses
    it (`ring_as_pool`), for the direct leg: one copy from the slots (on CUDA one fused scatter
    reading them over PCIe), where this write takes that leg (`_Pipe.direct`)."""
    try:
        packed_ids(positions, dst_ids, int(positions[-1]) + 1, pool.num_blocks)  # range, no block written twice
    except InvalidArgumentError as err:
        raise wire.ProtocolError(f"invalid staging batch: {err}") from None
    if seen is not None and pipe.direct(ring, len(dst_ids)):
        if pipe.kernel is None:
            copy_blocks(seen, pool, lo + positions, dst_ids)
            return None
        with torch.cuda.stream(pipe.kernel):
            copy_blocks(seen, pool, lo + positions, dst_ids)
        return pipe.kernel.record_event()
    scratches = pipe.pieces(pool)
    step = scratches[0].num_blocks
    pieces = []  # (first position, slots, index range) of each piece
    start = 0
    while start < len(positions):
        first = int(positions[start])
        end = int(np.searchsorted(positions, first + step, side="left"))
        pieces.append((first, int(positions[end - 1]) - first + 1, start, end))
        start = end
    with torch.cuda.stream(pipe.kernel) if pipe.kernel is not None else contextlib.nullcontext():
        scatters = BlockCopies(
            [
                (scratches[j % len(scratches)], pool, positions[a:b] - first, dst_ids[a:b])
                for j, (first, _, a, b) in enumerate(pieces)
            ]
        )
    for j, (first, k, _, _) in enumerate(pieces):
        runs = _ring_runs(ring, scratches[j % len(scratches)], lo + first, k)
        if pipe.dma is None or pipe.kernel is None:
            for staged, held in runs:
                held.copy_(staged)
            scatters.issue(j)
            continue
        free = pipe.free[j % 2]
        pipe.dma.wait_event(free)  # the scatter that last read this scratch pool
        with torch.cuda.stream(pipe.dma):
            for staged, held in runs:
                held.copy_(staged, non_blocking=True)
        pipe.kernel.wait_event(pipe.dma.record_event())
        with torch.cuda.stream(pipe.kernel):
            scatters.issue(j)
        free.record(pipe.kernel)
    # Every piece's scatter waited for its own loads: the last scatter ends the write.
    return pipe.kernel.record_event() if pipe.kernel is not None else None


class _Refused(EOFError):
    """Ends a connection the endpoint turned away after its goodbye (not a protocol error)."""


# How many senders one staging endpoint serves at once unless told otherwise: each holds its
# own ring of ``capacity_blocks`` blocks (see `StagingEndpoint`).
DEFAULT_MAX_SENDERS = 16


class StagingEndpoint(LocalEndpoint):
    """The receiver's side: gives every authenticated sender its own ring, moves each
    arriving batch from that sender's ring into the pool, then delivers the batch's notices
    and frees its slots.

    A ring is created when a sender's handshake succeeds (its descriptor goes in that
    sender's hello only); the sender removes its name as soon as it mapped it, and the
    connection's own thread unmaps it when the connection ends, after every batch it posted
    was applied or dropped: no two senders ever share slots, and nothing is left behind
    however either side ends (a SIGKILL of both process groups included). Memory: each connected sender
    costs ``capacity_blocks`` x the pool's block bytes (every layer) of shared memory, page-
    locked on a CUDA host. ``max_senders`` bounds the connections served at once (default
    `DEFAULT_MAX_SENDERS`); one more is refused after its handshake with a goodbye naming
    the bound, and changes nothing."""

    def __init__(
        self,
        receiver: KVReceiver,
        *,
        authkey: bytes,
        capacity_blocks: int,
        max_senders: int = DEFAULT_MAX_SENDERS,
        **options: Any,
    ) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
            raise InvalidArgumentError(f"invalid capacity_blocks={capacity_blocks!r}: must be an int > 0")
        if isinstance(max_senders, bool) or not isinstance(max_senders, int) or max_senders <= 0:
            raise InvalidArgumentError(f"invalid max_senders={max_senders!r}: must be an int > 0")
        staging_legs()  # a bad setting is refused here, not at a sender's handshake
        pool = self._pool = receiver.pool
        self.capacity = capacity_blocks
        self.max_senders = max_senders
        self.ring_bytes = pool.num_layers * pool.segments * pool.segment_bytes * capacity_blocks  # per connected sender
        self._rings: dict[Any, _Ring] = {}  # by connection
        self._opening = 0  # rings being created (they count against max_senders)
        self._rings_lock = threading.Lock()
        self._rings_closed = False
        # The hello is checked by the codec here, with a stand-in ring name, so a pool the
        # codec cannot describe is refused now rather than at the first connection.
        wire.encode(
            Hello(
                self._hello_fields(
                    {
                        "name": "kvferry-" + "0" * 32,
                        "num_layers": pool.num_layers,
                        "shape": list(_staging_shape(pool.geometry(), capacity_blocks)),
                        "dtype": str(torch.uint8),
                        "tokens_per_block": pool.tokens_per_block,
                        "block_dim": 1,
                    }
                )
            )
        )
        super().__init__(receiver, self._open_ring, authkey=authkey, **options)

    def _hello_fields(self, segment: dict[str, Any]) -> dict[str, Any]:
        return pool_hello(self._pool, "staging", segment=segment, capacity=self.capacity)

    def _open_ring(self) -> dict[str, Any]:
        """The hello of the connection whose thread runs this: creates its ring."""
        peer = getattr(self._local, "peer", None)
        assert peer is not None, "called off a connection thread"
        for attempt in range(2):  # full: an idle sender's ring may be reclaimed (make_room), once
            with self._rings_lock:
                if self._rings_closed:
                    raise _Refused("the endpoint is closing")
                full = len(self._rings) + self._opening >= self.max_senders
                if not full:
                    self._opening += 1
            if not full or attempt or not self.make_room(peer):
                break
        if full:
            self._refuse(
                peer,
                f"refused: this staging endpoint serves at most {self.max_senders} senders at once (max_senders),"
                f" each with its own ring of {self.capacity} blocks ({self.ring_bytes} bytes),"
                f" none idle for {self.idle_reclaim_s:g} s",
            )
        try:
            ring = _Ring(self._pool, self.capacity)
        except Exception as err:  # no memory for it (shared memory, page-locking): this peer only
            with self._rings_lock:
                self._opening -= 1
            self._refuse(
                peer,
                f"refused: the receiver could not create a staging ring of {self.ring_bytes} bytes for it: {err!r}",
            )
        except BaseException:
            with self._rings_lock:
                self._opening -= 1
            raise
        with self._rings_lock:
            self._opening -= 1
            closed = self._rings_closed
            if not closed:
                self._rings[peer] = ring
        if closed:
            ring.close()
            raise _Refused("the endpoint is closing")
        return self._hello_fields(ring.shared.descriptor)

    def _refuse(self, peer: Any, reason: str) -> NoReturn:
        """Turns an authenticated peer away before its hello: recorded, said in a goodbye
        (the sender's constructor raises it), and its connection ends owning nothing."""
        self._record(TransferError(f"{peer}: {reason}", peer=str(peer)))
        if peer.channel is not None:
            peer.channel.goodbye(reason)
        raise _Refused(reason)

    def ring_names(self) -> list[str]:
        """The shared-memory names of the rings of the senders connected now."""
        with self._rings_lock:
            return [ring.name for ring in self._rings.values()]

    def _close_ring(self, peer: Any) -> None:
        with self._rings_lock:
            ring = self._rings.pop(peer, None)
        if ring is not None:
            ring.close()

    def lost(self, peer: Any, reason: str) -> None:
        """The connection's thread has returned from its last batch: nothing reads its ring
        any more, so the ring goes first, then the sender's requests fail (`LocalEndpoint`).
        Writes read before the end are delivered first, as they were read (`_settle`)."""
        try:
            with self._rings_lock:
                ring = self._rings.get(peer)
            if ring is not None:
                try:
                    self._settle(ring, everything=True)
                except KvFerryError as err:  # the connection ends anyway: recorded
                    self._record(err)
        finally:
            try:
                self._close_ring(peer)
            finally:
                super().lost(peer, reason)

    def _on_staged(self, peer: Any, frame: Staged) -> None:
        with self._rings_lock:
            ring = self._rings.get(peer)
        assert ring is not None, "a staged batch on a connection without its ring"
        self.stage(ring, frame.notices, frame.lo, frame.freed, frame.picked, frame.dst_ids)

    HANDLERS: ClassVar[Mapping[type[Frame], Handler]] = {**LocalEndpoint.HANDLERS, Staged: _on_staged}

    def stage(
        self,
        staging: _Ring,
        notices: Sequence[Notice],
        lo: int,
        freed: int,
        picked: Optional[np.ndarray],
        dst_ids: np.ndarray,
    ) -> None:
        """Slots of the sender's own ring from ``lo`` hold a batch of ``len(dst_ids)`` blocks
        (or more, of which those at ``picked`` go), the blocks of ``notices`` in order;
        ``freed`` slots are returned to the sender afterwards. The codec checked the counts
        (one destination id per block the notices cover, ``picked`` increasing); here every
        slot and id is checked against the ring and the pool before anything is copied.
        Blocks of a notice the receiver does not admit, or whose destination ids are not its
        lease's, are skipped (the latter is then refused and ends the connection)."""
        lengths = np.array([n.end - n.start for n in notices], dtype=np.int64)
        n = len(dst_ids) if picked is None else int(picked[-1]) + 1 if len(picked) else 0
        if lo + n > staging.capacity or freed > staging.capacity:
            raise wire.ProtocolError(
                f"invalid staging batch: slots [{lo}, {lo + n}) and {freed} freed in a ring of {staging.capacity}"
            )
        if len(dst_ids) and int(dst_ids.max()) >= self.receiver.pool.num_blocks:
            raise wire.ProtocolError(
                f"invalid staging batch: destination block {int(dst_ids.max())} outside the pool's "
                f"{self.receiver.pool.num_blocks}"
            )
        source = self.current_source()
        named = dst_ids  # what the sender said it wrote, for the receiver's lease check
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        groups = {(n.group, n.groups) for n in notices}
        if len(groups) > 1:
            raise InvalidArgumentError(
                f"invalid staging batch: notices of several layer groups {sorted(groups)} in one write"
            )
        # Each notice's whole range is checked against its request and its lease before any
        # byte moves: a range past the lease must not reach another request's blocks. The
        # requests admitted are not released until these copies landed (`Landing`): a cancel
        # and release on the engine's thread between this check and the copy would otherwise
        # hand on blocks this write still lands in.
        landing = Landing()
        done = None
        short = False
        try:
            admitted = [
                self.receiver.admits(n, source, dst_ids=dst_ids[bounds[i] : bounds[i + 1]], landing=landing)
                for i, n in enumerate(notices)
            ]
            if not all(admitted):  # stale, refused or outside the lease: their ring slots are not applied
                keep = np.repeat(np.array(admitted, dtype=bool), lengths)
                picked = (np.arange(len(dst_ids)) if picked is None else picked)[keep]
                dst_ids = dst_ids[keep]
            ring, pool, seen = staging.shared.pool, self.receiver.pool, staging.seen
            assert ring is not None
            if groups and not notices[0].whole:  # a layer slice: only its layers were staged
                layers = pool.group_layers(notices[0].group, notices[0].groups)
                ring, pool = ring.layer_slice(*layers), pool.layer_slice(*layers)
                seen = None if seen is None else seen.layer_slice(*layers)
            if len(dst_ids):
                at = np.arange(len(dst_ids), dtype=np.int64) if picked is None else np.asarray(picked, dtype=np.int64)
                done = _unstage(ring, pool, staging.pipe, lo, at, np.asarray(dst_ids, dtype=np.int64), seen)
            short = len(dst_ids) * pool.block_bytes * pool.num_layers <= SPIN_WAIT_BYTES
        except BaseException:
            staging.pipe.synchronize()  # whatever was queued has ended
            done = None
            raise
        finally:
            landing.copied(done)
        staging.applying.append(_Applying(done, notices, source, named, int(freed), short))
        self._settle(staging, everything=False)

    def _settle(self, staging: _Ring, *, everything: bool) -> None:
        """Delivers the queued writes whose copies finished, oldest first, each followed by
        the frame that frees its slots. ``everything``: waits for all of them. Otherwise it
        waits for the oldest only until the sender's next frame is there: that frame's
        copies are then queued behind it (the host-to-device leg never idles between two
        writes for the host's round trip) and the wait goes on after it; a short write
        (`engine.SPIN_WAIT_BYTES`: a request's tail) is waited for in one wait on its event,
        which spins without the GIL, so it is delivered as its copy ends rather than at the
        next look (every ``APPLY_POLL_SECONDS``, which sleeps longer). A write read after
        one whose delivery broke the protocol is dropped, as if never read (it was not, in
        the order frames are read); its copies only touched blocks its notices were admitted
        for."""
        peer = getattr(self._local, "peer", None)
        while staging.applying:
            entry = staging.applying[0]
            if entry.done is not None and not entry.done.query():
                if everything or peer is None or peer.channel is None or entry.short:
                    entry.done.synchronize()
                else:
                    while not entry.done.query():
                        if peer.channel.poll(0):
                            return
                        time.sleep(APPLY_POLL_SECONDS)
            staging.applying.popleft()
            try:
                self.deliver(entry.notices, entry.source, dst_ids=entry.named)
            except BaseException:
                staging.applying.clear()
                raise
            self._reply(entry.freed)  # these slots are free again

    def dispatch(self, peer: Any, frame: Frame) -> None:
        """As `LocalEndpoint.dispatch`, but every queued write is delivered first, so a fence,
        plain notices or the end of the connection act after the writes read before them,
        as when each write was delivered before the next frame was read. An announcement
        changes no request's data and passes queued writes (their copies keep running)."""
        if not isinstance(frame, (Staged, Announce)):
            with self._rings_lock:
                ring = self._rings.get(peer)
            if ring is not None:
                self._settle(ring, everything=True)
        super().dispatch(peer, frame)

    def _reply(self, freed: int) -> None:
        peer = getattr(self._local, "peer", None)
        assert peer is not None, "called off a connection thread"
        try:
            peer.send(Freed(int(freed)))
        except OSError:
            # The sender closed its end after posting (KVSender.close after a flush): it
            # needs no frees, and the batches it posted before closing are still read and
            # applied here; the end of the stream then ends the connection.
            pass

    def close(self) -> None:
        """Stops serving (`LocalEndpoint.close`), then removes the rings of connections
        whose threads ended; a thread that outlived the join removes its own on its way out."""
        with self._rings_lock:
            self._rings_closed = True  # no ring is created from here on
        super().close()
        with self._rings_lock:
            done = [peer for peer in self._rings if peer.thread is None or not peer.thread.is_alive()]
        for peer in done:
            self._close_ring(peer)


class StagingTransport(LocalTransport):
    """The sender's side: copies blocks device-to-host into free ring slots on the copy
    engine's stream, then posts notices with their slots. A full ring raises
    `TransportFull`; the sender then keeps the write (and every later one) in its backlog,
    which its announcer thread submits as frees come."""

    def __init__(
        self,
        address: str,
        *,
        authkey: bytes,
        write_bytes: Optional[int] = None,
        handshake_timeout: Optional[float] = None,
    ) -> None:
        if write_bytes is not None and write_bytes <= 0:
            raise InvalidArgumentError(f"invalid write_bytes={write_bytes}: must be > 0")
        staging_legs()  # a bad setting is refused before connecting
        self._write_bytes = write_bytes
        super().__init__(address, authkey=authkey, open_pool=self._open, handshake_timeout=handshake_timeout)
        # Staged and not yet posted: (first slot, destination ids, slots to free after it).
        self._pending: list[tuple[int, np.ndarray, int]] = []
        self._pipes: dict[torch.device, _Pipe] = {}  # by pool device; used in write order only
        # The ring as each kind of pool sees it (direct legs; None: not addressable there).
        self._seen: dict[tuple[object, ...], Optional[PagedKV]] = {}

    def _open(self, hello: dict[str, Any]) -> tuple[PagedKV, Callable[[], None]]:
        if hello["kind"] != "staging":
            raise TransferError(f"the receiver serves a {hello['kind']} pool, not a staging ring")
        ring = SharedPool.attach(hello["segment"], unlink=True)  # this connection's alone: nameless once mapped
        assert ring.pool is not None
        self.ring_name = str(hello["segment"]["name"])  # this connection's own ring
        self._geometry = hello["geometry"]
        self.capacity = int(hello["capacity"])
        self._remote_blocks = int(hello["num_blocks"])
        geometry = self._geometry
        block_bytes = int(geometry["num_layers"]) * int(geometry["segments"]) * int(geometry["segment_bytes"])
        self._block_bytes = block_bytes
        bound = WRITE_BYTES if self._write_bytes is None else self._write_bytes
        per_write = min(self.capacity // 2, bound // block_bytes)
        self.max_write_blocks = max(1, per_write)
        self._head = 0  # next slot to fill
        self._used = 0  # filled and not yet freed by the receiver
        unpin = _pin(ring.pool)

        def release() -> None:
            unpin()
            ring.close()

        return ring.pool, release

    @property
    def num_blocks(self) -> int:
        return self._remote_blocks

    def geometry(self) -> dict[str, object]:
        return dict(self._geometry)

    def _reserve(self, n: int) -> tuple[int, int]:
        """First slot of ``n`` contiguous free slots, and how many tail slots were skipped to
        keep them contiguous (freed by the receiver together with this batch). Raises
        `TransportFull` (changing nothing) when the receiver has not freed enough yet."""
        if n > self.capacity:
            raise InvalidArgumentError(
                f"invalid batch: {n} blocks exceed the staging ring's {self.capacity} (raise capacity_blocks)"
            )
        self._collect_frees()
        if self._used == 0:
            self._head = 0  # an empty ring starts over: the whole ring is one free run
        wraps = self._head + n > self.capacity
        skipped = self.capacity - self._head if wraps else 0
        if self.capacity - self._used - skipped < n:
            raise TransportFull(f"staging ring: {n} blocks wanted, {self.capacity - self._used - skipped} free")
        lo = 0 if wraps else self._head
        self._head = lo + n
        self._used += skipped + n
        return lo, skipped

    def wait_for_room(self, timeout: float) -> bool:
        if not self._conn.poll(timeout):
            return False
        self._collect_frees()  # a cancellation may have come instead: the caller retries
        return True

    def write_blocks(self, total: int, device: torch.device) -> int:
        limit = super().write_blocks(total, device)
        if not WRITE_OVERHEAD_BYTES or write_legs(staging_legs(device), total * self._block_bytes) == "direct":
            return limit
        return split_write_blocks(total, limit, max(1, WRITE_OVERHEAD_BYTES // self._block_bytes), self.capacity)

    def write(self, engine: CopyEngine, job: Write) -> Pending:
        """Stages the blocks into ring slots in the write's order, piece by piece
        (`STAGE_CHUNK_BYTES`): a fused gather into a scratch pool on the device, then one copy
        per layer and segment into the piece's slots. A host-tier source's two parts are
        gathered into the same scratch pool (host blocks read in place through the tier's CUDA
        view on CUDA), then staged together. A layer slice
        fills those layers of its slots only (the rest of them stay unused: slots are whole
        blocks, so the ring's accounting stays one slot per block)."""
        src, layers = job.src, job.layers
        src.check_compatible(self._geometry)
        s, d = packed_ids(job.src_ids, job.dst_ids, src.num_blocks, self._remote_blocks)
        parts = source_parts(source_layers(src, layers), s, d)
        lo, skipped = self._reserve(s.size)
        ring = self.dst if layers is None else self.dst.layer_slice(*layers)
        n = s.size

        def stage() -> None:
            device = parts[0].pool.device
            pipe = self._pipes.get(device)
            if pipe is None:
                pipe = self._pipes[device] = _Pipe(device)
            at = [  # each part's blocks' places in the write (its ring slots from ``lo``)
                np.arange(len(p.src_ids), dtype=np.int64)
                if p.positions is None
                else np.asarray(p.positions, dtype=np.int64)
                for p in parts
            ]
            if pipe.direct(ring, n) and self._stage_direct(layers, parts, [lo + where for where in at], pipe.legs):
                return
            scratches = pipe.pieces(parts[0].pool)
            step = scratches[0].num_blocks
            copies: list[tuple[PagedKV, PagedKV, np.ndarray, np.ndarray]] = []
            pieces: list[tuple[int, int, list[int]]] = []  # (first, blocks, its gathers)
            for j, first in enumerate(range(0, n, step)):
                k = min(step, n - first)
                gathers = []
                for part, where in zip(parts, at):
                    sel = (where >= first) & (where < first + k)
                    if sel.any():
                        gathers.append(len(copies))
                        copies.append((part.pool, scratches[j % len(scratches)], part.src_ids[sel], where[sel] - first))
                pieces.append((first, k, gathers))
            gather = BlockCopies(copies)  # its ids go up once, on the engine's stream
            current = torch.cuda.current_stream(device) if pipe.dma is not None else None
            for j, (first, k, gathers) in enumerate(pieces):
                runs = _ring_runs(ring, scratches[j % len(scratches)], lo + first, k)
                if current is None or pipe.dma is None:
                    for i in gathers:
                        gather.issue(i)
                    for staged, held in runs:
                        staged.copy_(held)
                    continue
                free = pipe.free[j % 2]
                current.wait_event(free)  # the device-to-host copies that last read this scratch pool
                for i in gathers:
                    gather.issue(i)
                pipe.dma.wait_event(current.record_event())
                with torch.cuda.stream(pipe.dma):
                    for staged, held in runs:
                        staged.copy_(held, non_blocking=True)
                free.record(pipe.dma)
            if current is not None and pipe.dma is not None:
                current.wait_stream(pipe.dma)  # the write is done (its Pending) once its slots are

        self._pending.append((lo, d, s.size + skipped))
        self._collect_frees()
        return engine.submit_call(
            summed(job, stage),
            after=job.after,
            nbytes=n
            * int(self._geometry["num_layers"])
            * int(self._geometry["segments"])
            * int(self._geometry["segment_bytes"]),
        )

    def _stage_direct(
        self, layers: Optional[tuple[int, int]], parts: Sequence[Any], slots: Sequence[np.ndarray], legs: str
    ) -> bool:
        """The direct leg (`LEGS_ENV`): each part's blocks copied straight into their ring
        ``slots`` (on CUDA one fused copy storing over PCIe, on the current stream). False,
        copying nothing, where "auto" legs find the ring not addressable from the pool's
        device (the write then takes the dma legs)."""
        like = parts[0].pool
        key = (like.device, like.dtype, like.tokens_per_block, like.block_layout)
        if key not in self._seen:
            self._seen[key] = _direct_view(self.dst, like, legs)
        seen = self._seen[key]
        if seen is None:
            return False
        if layers is not None:
            seen = seen.layer_slice(*layers)
        for p, ids in zip(parts, slots):
            copy_blocks(p.pool, seen, p.src_ids, ids)
        return True

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        # Writes finish in order, so the oldest staged batch is this one; taken once sent (a
        # post `try_post` could not make now changes nothing).
        lo, d, freed = self._pending[0]
        keep = kept(batch, revoked)
        if len(keep) == len(batch):
            self._send(Staged(keep, lo, freed, None, d))
        else:
            # Only the kept requests' blocks leave the ring; a cancelled request's
            # destination blocks may already belong to someone else.
            lengths = np.array([n.end - n.start for n in batch])
            mask = np.repeat([n.request_id not in revoked for n in batch], lengths)
            self._send(Staged(keep, lo, freed, np.flatnonzero(mask), d[mask]))
        self._pending.pop(0)
        self._collect_frees()

    def abandon(self, batch: Sequence[Notice]) -> None:
        lo, d, freed = self._pending.pop(0)
        self._send(Staged([], lo, freed, np.empty(0, dtype=np.int64), d[:0]))  # only frees the slots

    def _collect_frees(self) -> None:
        self._conn.read_waiting()  # without waiting; cancellations are kept for check_peer
        while self._conn.replies:
            self._used -= self._conn.replies.popleft()
