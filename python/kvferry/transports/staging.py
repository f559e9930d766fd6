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
sender that finds its ring full waits (bounded) for frees. CPU pools work too (no
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
import threading
from typing import AbstractSet, Any, Callable, NoReturn, Optional, Sequence

import numpy as np
import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)
import torch

from kvferry.copy import packed_ids
from kvferry.engine import CopyEngine, Pending
from kvferry.errors import InvalidArgumentError, TransferError
from kvferry.layout import PagedKV
from kvferry.transports import wire
from kvferry.transports.local import LocalEndpoint, LocalTransport, pool_hello
from kvferry.notice import Notice, NoticeTuple
from kvferry.receiver import KVReceiver
from kvferry.transports.shm import SharedPool
from kvferry.tiers import Signal, Source, source_layers, source_parts
from kvferry.transports.base import TransportFull, kept

__all__ = ["StagingEndpoint", "StagingTransport"]

# A write's two PCIe legs (device-to-host here, host-to-device at the receiver) run one after
# the other, so cutting plans into smaller writes lets the receiver take in one while the next
# is staged. Measured on one H200 shared by both processes (docs/benchmarks.md), 256 MiB writes
# made the agentic early transfer slower, not faster: each write's gather and scatter kernels
# are time-sliced between the two processes' GPU contexts and against the prefill. So by
# default a write is bounded only by half the ring; `write_bytes` sets a smaller bound for
# sender and receiver on different GPUs.


def _pin(pool: PagedKV) -> Callable[[], None]:
    """Page-locks a host pool's memory for fast, asynchronous copies; returns the undo."""
    if not torch.cuda.is_available():
        return lambda: None
    cudart = torch.cuda.cudart()
    layers = pool.layers
    start = min(t.data_ptr() for t in layers)
    size = max(t.data_ptr() + t.numel() * t.element_size() for t in layers) - start
    err = cudart.cudaHostRegister(start, size, 0)
    if int(err) != 0:
        raise TransferError(f"cudaHostRegister of {size} staging bytes failed (error {int(err)})")
    return lambda: cudart.cudaHostUnregister(start)


def _staging_shape(geometry: dict[str, Any], capacity: int) -> tuple[int, int, int]:
    return (int(geometry["segments"]), capacity, int(geometry["segment_bytes"]))


class _Ring:
    """One connection's staging ring: a shared-memory segment of ``capacity`` block slots
    (a fresh 128-bit name), page-locked on a CUDA host, and the stream its host-to-device
    copies run on. Only its connection's thread copies from it."""

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
                self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
            except BaseException:
                self._unpin()
                raise
        except BaseException:
            self.shared.close()
            raise
        self.capacity = capacity

    @property
    def name(self) -> str:
        return str(self.shared.descriptor["name"])

    def close(self) -> None:
        """Waits for copies still reading the ring (a batch that failed half way), then
        unpins, unmaps and unlinks it. A sender still mapping it keeps its own mapping."""
        try:
            if self.stream is not None:
                self.stream.synchronize()
        finally:
            try:
                self._unpin()
            finally:
                self.shared.close()


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

    def __init__(self, receiver: KVReceiver, *, authkey: bytes, capacity_blocks: int, max_senders: int = DEFAULT_MAX_SENDERS, **options: Any) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
            raise InvalidArgumentError(f"invalid capacity_blocks={capacity_blocks!r}: must be an int > 0")
        if isinstance(max_senders, bool) or not isinstance(max_senders, int) or max_senders <= 0:
            raise InvalidArgumentError(f"invalid max_senders={max_senders!r}: must be an int > 0")
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
        wire.frame("hello", self._hello_fields({"name": "kvferry-" + "0" * 32, "num_layers": pool.num_layers, "shape": list(_staging_shape(pool.geometry(), capacity_blocks)), "dtype": str(torch.uint8), "tokens_per_block": pool.tokens_per_block, "block_dim": 1}))
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
            self._refuse(peer, f"refused: the receiver could not create a staging ring of {self.ring_bytes} bytes for it: {err!r}")
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
        any more, so the ring goes first, then the sender's requests fail (`LocalEndpoint`)."""
        try:
            self._close_ring(peer)
        finally:
            super().lost(peer, reason)

    def dispatch(self, peer: Any, kind: str, value: Any) -> None:
        if kind == "staged":
            with self._rings_lock:
                ring = self._rings.get(peer)
            assert ring is not None, "a staged batch on a connection without its ring"
            self.stage(ring, *value)
        else:
            super().dispatch(peer, kind, value)

    def stage(self, staging: _Ring, wire_notices: list[Any], lo: int, freed: int, picked: Optional[np.ndarray], dst_ids: np.ndarray) -> None:
        """Slots of the sender's own ring from ``lo`` hold a batch of ``len(dst_ids)`` blocks
        (or more, of which those at ``picked`` go), the blocks of ``notices`` in order;
        ``freed`` slots are returned to the sender afterwards. The codec checked the counts
        (one destination id per block the notices cover, ``picked`` increasing); here every
        slot and id is checked against the ring and the pool before anything is copied.
        Blocks of a notice the receiver does not admit, or whose destination ids are not its
        lease's, are skipped (the latter is then refused and ends the connection)."""
        notices = self.notices(wire_notices)
        lengths = np.array([n.end - n.start for n in notices], dtype=np.int64)
        n = len(dst_ids) if picked is None else int(picked[-1]) + 1 if len(picked) else 0
        if lo + n > staging.capacity or freed > staging.capacity:
            raise wire.ProtocolError(f"invalid staging batch: slots [{lo}, {lo + n}) and {freed} freed in a ring of {staging.capacity}")
        if len(dst_ids) and int(dst_ids.max()) >= self.receiver.pool.num_blocks:
            raise wire.ProtocolError(f"invalid staging batch: destination block {int(dst_ids.max())} outside the pool's {self.receiver.pool.num_blocks}")
        source = self.current_source()
        named = dst_ids  # what the sender said it wrote, for the receiver's lease check
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        leased = [self.receiver.lease_admits(notice, dst_ids[bounds[i] : bounds[i + 1]]) for i, notice in enumerate(notices)]
        admitted = [ok and self.receiver.admits(notice, source) for ok, notice in zip(leased, notices)]
        if not all(admitted):  # stale, refused or outside the lease: their ring slots are not applied
            keep = np.repeat(np.array(admitted, dtype=bool), lengths)
            picked = (np.arange(len(dst_ids)) if picked is None else picked)[keep]
            dst_ids = dst_ids[keep]
        ring, pool = staging.shared.pool, self.receiver.pool
        assert ring is not None
        groups = {(n.group, n.groups) for n in notices}
        if len(groups) > 1:
            raise InvalidArgumentError(f"invalid staging batch: notices of several layer groups {sorted(groups)} in one write")
        if groups and not notices[0].whole:  # a layer slice: only its layers were staged
            layers = pool.group_layers(notices[0].group, notices[0].groups)
            ring, pool = ring.layer_slice(*layers), pool.layer_slice(*layers)
        if len(dst_ids):
            stream = staging.stream
            ids = torch.from_numpy(np.asarray(dst_ids, dtype=np.int64)).to(pool.device)
            pick = None if picked is None else torch.from_numpy(np.asarray(picked, dtype=np.int64)).to(pool.device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for staged, layer in zip(ring.layers, pool.segment_views(torch.uint8)):
                    batch = staged[:, lo : lo + n].to(pool.device, non_blocking=True)
                    layer.index_copy_(1, ids, batch if pick is None else batch.index_select(1, pick))
            if stream is not None:
                stream.synchronize()
        self.deliver(notices, source, dst_ids=named)
        self._reply(freed)  # these slots are free again

    def _reply(self, freed: int) -> None:
        peer = getattr(self._local, "peer", None)
        assert peer is not None, "called off a connection thread"
        try:
            peer.send("freed", int(freed))
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
    `TransportFull`; the sender then posts finished writes and waits for frees."""

    def __init__(self, address: str, *, authkey: bytes, write_bytes: Optional[int] = None, handshake_timeout: Optional[float] = None) -> None:
        if write_bytes is not None and write_bytes <= 0:
            raise InvalidArgumentError(f"invalid write_bytes={write_bytes}: must be > 0")
        self._write_bytes = write_bytes
        super().__init__(address, authkey=authkey, open_pool=self._open, handshake_timeout=handshake_timeout)
        # Staged and not yet posted: (first slot, destination ids, slots to free after it).
        self._pending: list[tuple[int, np.ndarray, int]] = []

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
        per_write = self.capacity // 2 if self._write_bytes is None else min(self.capacity // 2, self._write_bytes // block_bytes)
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
            raise InvalidArgumentError(f"invalid batch: {n} blocks exceed the staging ring's {self.capacity} (raise capacity_blocks)")
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

    def write(
        self,
        engine: CopyEngine,
        src: Source,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        notices: Sequence[Notice],
        *,
        after: Sequence[Signal] = (),
        layers: Optional[tuple[int, int]] = None,
    ) -> Pending:
        """Stages the blocks into ring slots in the write's order. A host-tier source's two
        parts are gathered into one buffer on the device pool's device (host blocks read in
        place through the tier's CUDA view on CUDA), then staged together. A layer slice
        fills those layers of its slots only (the rest of them stay unused: slots are whole
        blocks, so the ring's accounting stays one slot per block)."""
        src.check_compatible(self._geometry)
        s, d = packed_ids(src_ids, dst_ids, src.num_blocks, self._remote_blocks)
        parts = source_parts(source_layers(src, layers), s, d)
        lo, skipped = self._reserve(s.size)
        ring = self.dst if layers is None else self.dst.layer_slice(*layers)
        n = s.size

        def stage() -> None:
            device = parts[0].pool.device
            gathers = [
                (part.pool.segment_views(torch.uint8), torch.from_numpy(part.src_ids).to(device, non_blocking=True), part.positions)
                for part in parts
            ]
            whole = len(gathers) == 1 and gathers[0][2] is None
            at = [None if p is None else torch.from_numpy(p).to(device, non_blocking=True) for _, _, p in gathers]
            for i, staged in enumerate(ring.layers):
                if whole:
                    views, ids, _ = gathers[0]
                    staged[:, lo : lo + n].copy_(views[i].index_select(1, ids), non_blocking=True)
                    continue
                segments, _, width = staged.shape
                batch = torch.empty((segments, n, width), dtype=torch.uint8, device=device)
                for (views, ids, _), where in zip(gathers, at):
                    assert where is not None
                    batch.index_copy_(1, where, views[i].index_select(1, ids))
                staged[:, lo : lo + n].copy_(batch, non_blocking=True)

        self._pending.append((lo, d, s.size + skipped))
        self._collect_frees()
        return engine.submit_call(stage, after=after, nbytes=n * int(self._geometry["num_layers"]) * int(self._geometry["segments"]) * int(self._geometry["segment_bytes"]))

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        # Writes finish in order, so the oldest staged batch is this one.
        lo, d, freed = self._pending.pop(0)
        keep = kept(batch, revoked)
        if len(keep) == len(batch):
            self._send("staged", (self._as_tuples(keep), lo, freed, None, d))
        else:
            # Only the kept requests' blocks leave the ring; a cancelled request's
            # destination blocks may already belong to someone else.
            lengths = np.array([n.end - n.start for n in batch])
            mask = np.repeat([n.request_id not in revoked for n in batch], lengths)
            self._send("staged", (self._as_tuples(keep), lo, freed, np.flatnonzero(mask), d[mask]))
        self._collect_frees()

    def abandon(self, batch: Sequence[Notice]) -> None:
        lo, d, freed = self._pending.pop(0)
        self._send("staged", ([], lo, freed, np.empty(0, dtype=np.int64), d[:0]))  # only frees the slots

    @staticmethod
    def _as_tuples(notices: Sequence[Notice]) -> list[NoticeTuple]:
        return [n.as_tuple() for n in notices]

    def _collect_frees(self) -> None:
        self._conn.read_waiting()  # without waiting; cancellations are kept for check_peer
        while self._conn.replies:
            self._used -= self._conn.replies.popleft()
