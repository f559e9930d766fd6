"""NIXL transport (UCX backend): the engine production stacks use across nodes.

```
receiver: NixlEndpoint   its pool registered with the process's receiving agent, hello =
                         agent metadata + the layers' addresses, its segment and block
                         strides and the spans
sender:   NixlTransport  its pool registered with the process's sending agent, the remote
                         agent added, both block descriptor lists prepared once; each write
                         is one prepared WRITE of (layer, segment, block) descriptors chosen
                         by index, notices riding along as the transfer's notification
receiver: the process's one poller thread hands each notification to the endpoint whose
                         connection its agent is bound to, which delivers the notices (and
                         the fences, which the sender posts as notifications of their own,
                         after its writes)
```
One agent per process and role (kvferry.transports.nixl_hub): every endpoint of a process
shares its receiving agent, every transport its sending agent, and each pool's memory is
registered once however many peers read or write it. Agent metadata (opaque bytes, bounded)
is exchanged in-band over the authenticated control
channel of kvferry.transports.control, a Unix socket or TCP (NIXL's own listener would bind
every interface), with the pool's layer addresses, strides and registered spans: the sender
builds the receiver's block descriptors itself, at the receiver's strides, after checking that
every one lies inside a registered span (`_remote_pool`), so any pool (layer- or block-outer,
a head slice) is served on either side. Needs the `nixl` package
(`pip install kvferry[nixl]`); the receiving agent's UCX progress thread stays on (without it
the target never progresses), the sending agent has none (`SENDER_PROGRESS_THREAD`).

Faults. The sender learns that its receiver died from the socket (EOF), from NIXL (a post or a
transfer that ends in error), or, where neither says anything (a hung peer), from the sender's
timeout, which aborts the transfer (`_XferPending.abort`) and fails its requests. The receiver
cannot tell from the socket which requests a dead sender still owed: notifications travel
apart from it, and its EOF may overtake those of writes that completed. So the receiver fails
a NIXL request by its wait's timeout only; the EOF only fences the agent's requests (a dead
process writes nothing more), so that they can be released at once.

Wire: a notification is one frame of the core's codec (kvferry.transports.wire): a
``notices`` frame with the destination ids the write used (checked against each request's
lease before a notice counts), or a ``revoke`` frame, a fence. The sender names its agent on
the control channel first (an ``agent`` frame), so that the receiver can tie the agent's
requests to the connection (announces, cancellations back, its end). The name is bound to
the connection once: a second ``agent`` frame, one naming an agent another open connection
to any endpoint of the process holds, or an announce or fence before it, breaks the protocol
and ends that connection (a sender cannot take over another's requests by naming its agent,
nor have its notifications reach another endpoint's receiver). A notification that does not
decode, or names blocks outside a lease, is refused and ends that agent's control
connection.
"""

from __future__ import annotations

import time
from typing import AbstractSet, Any, Callable, ClassVar, Mapping, Optional, Sequence

import numpy as np

from kvferry.checksum import WriteChecksums
from kvferry.copy import packed_ids
from kvferry.engine import CopyEngine, Pending
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.tiers import Signal, Source, TieredSource, signal_done, signal_error, source_parts
from kvferry.transports import wire
from kvferry.transports.base import Transport, Write
from kvferry.transports.control import Handler, LocalEndpoint, PeerConnection, pool_hello
from kvferry.transports.frames import TRANSPORT, Agent, Announce, Frame, Notices, Revoke
from kvferry.transports.nixl_hub import AgentHub, Lane, ReceiverHub, _mem_type, receivers, senders

__all__ = ["NixlEndpoint", "NixlTransport", "block_descriptors", "descriptor_indices"]

POLL_SECONDS = 100e-6
# A write's state is asked of NIXL at most this often. Asking takes the UCX worker the agent's
# progress thread is driving: a caller that asks in a tight loop (the announcer, an engine
# stepping while its sends finish) starves that thread and with it the transfer. Measured
# across two network namespaces over UCX's TCP transport, one core per side: 18 MiB in 32 KiB
# descriptors took 94 ms asked without pause, 29 ms asked every 0.5 ms (docs/benchmarks.md).
CHECK_SECONDS = 1e-3
# A write is asked about first this soon after the previous look, then at twice the interval
# each time up to CHECK_SECONDS, so a write UCX ends early is not left unseen for a whole
# CHECK_SECONDS, and a long one is asked only a few more times in all. On one H100 a lone
# tail write of 8 or 64 blocks took 1.1-1.4 ms either way (docs/benchmarks.md, "Small writes
# on the GPU node"): that time is UCX's own.
FIRST_CHECK_SECONDS = 50e-6

# Writes with blocks contiguous on both sides go as one descriptor per run (`block_runs`);
# False: always the prepared per-block descriptors (for measuring the difference).
COALESCE = True


# Whether the sender's agent has a progress thread of its own. It has not: that thread polls
# without pause, so on a CPU engine it took half of the forward's core (a prefill overlapping
# an early send ran at about half speed; docs/benchmarks.md, 2026-12-05), and on a GPU host it
# burns a core beside the engine's. The sender's transfers progress instead when their
# state is asked (`_XferPending.done`, at most every CHECK_SECONDS, from the announcer) and
# when the announcer looks at the receiver (`NixlTransport.check_peer`). The receiver keeps
# its thread: it is the target of the writes, and nothing else would progress it.
SENDER_PROGRESS_THREAD = False


def _remote_pool(hello: Mapping[str, Any], peer: str) -> np.ndarray:
    """The receiver's block descriptors (`layer_descriptors`' rows) from its hello: its
    layers' bases, its segment and block strides and the spans it registered. A hello that
    would have the sender write outside those spans, or two blocks over one another, is
    refused by name (`wire.ProtocolError`), before any descriptor reaches NIXL:

    ```
    block (l, s, b) at  bases[l] + s * segment_stride + b * block_stride, segment_bytes long
    each one:           inside one region of `regions` (sorted, disjoint)
    all of them:        pairwise disjoint (a block-outer pool's layers interleave)
    ```"""
    geometry = hello["geometry"]
    segments, seg = int(geometry["segments"]), int(geometry["segment_bytes"])
    blocks = int(hello["num_blocks"])
    seg_stride, block_stride = int(hello["segment_stride"]), int(hello["block_stride"])
    bases = [int(b) for b in hello["bases"]]

    def refuse(why: str) -> wire.ProtocolError:
        return wire.ProtocolError(f"{peer}: invalid NIXL hello: {why}", peer=peer)

    if seg <= 0 or blocks <= 0:
        raise refuse(f"segment_bytes={seg}, num_blocks={blocks}: must be > 0")
    # The pool's own rule (kvferry.layout): segments apart, blocks apart.
    if segments == 1:
        disjoint = block_stride >= seg
    else:
        disjoint = (block_stride >= seg and seg_stride >= blocks * block_stride) or (
            seg_stride >= seg and block_stride >= segments * seg_stride
        )
    if not disjoint:
        raise refuse(
            f"segment_stride={seg_stride}, block_stride={block_stride}: {segments} segments of {seg} bytes in "
            f"{blocks} blocks at these strides overlap"
        )
    extent = (segments - 1) * seg_stride + (blocks - 1) * block_stride + seg
    if max(bases) + extent >= 2**64:
        raise refuse(f"bases up to {max(bases)} with blocks {extent} bytes long pass the 64-bit address space")
    regions = sorted((int(r["start"]), int(r["length"])) for r in hello["regions"])
    starts = np.array([a for a, _ in regions], dtype=np.uint64)
    ends = np.array([a + n for a, n in regions], dtype=np.uint64)
    if len(regions) > 1 and bool((starts[1:] < ends[:-1]).any()):
        raise refuse(f"regions={regions}: they overlap")
    rows = layer_descriptors(
        bases, segments, seg, blocks, int(hello["device"]), segment_stride=seg_stride, block_stride=block_stride
    )
    addresses = rows[:, 0]
    # The region each block starts in: the last that starts at or before it.
    at = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
    inside = at >= 0
    inside[inside] &= addresses[inside] + np.uint64(seg) <= ends[at[inside]]
    if not bool(inside.all()):
        row = int(np.flatnonzero(~inside)[0])
        layer, rest = divmod(row, segments * blocks)
        raise refuse(
            f"block {rest % blocks} of segment {rest // blocks} of layer {layer} at address {int(addresses[row])} "
            f"({seg} bytes) lies outside every registered region ({len(regions)})"
        )
    ordered = np.sort(addresses)
    if len(ordered) > 1 and bool((np.diff(ordered) < np.uint64(seg)).any()):
        raise refuse(f"bases={bases}, segment_stride={seg_stride}, block_stride={block_stride}: two blocks overlap")
    return rows


def block_descriptors(pool: PagedKV) -> np.ndarray:
    """One ``(address, length, device)`` uint64 row per (layer, segment, block), in that
    order: row ``(layer * segments + segment) * num_blocks + block``, where the pool's own
    strides put each block (a block-outer pool's included)."""
    return layer_descriptors(
        [t.data_ptr() for t in pool.layers],
        pool.segments,
        pool.segment_bytes,
        pool.num_blocks,
        pool.device.index or 0,
        segment_stride=pool.segment_stride,
        block_stride=pool.block_stride,
    )


def layer_descriptors(
    bases: Sequence[int],
    segments: int,
    segment_bytes: int,
    num_blocks: int,
    device: int,
    *,
    segment_stride: Optional[int] = None,
    block_stride: Optional[int] = None,
) -> np.ndarray:
    """`block_descriptors` of a pool known by its layers' addresses and strides (a packed
    pool's by default)."""
    seg = segment_bytes
    segment_stride = num_blocks * seg if segment_stride is None else segment_stride
    block_stride = seg if block_stride is None else block_stride
    base = np.array(bases, dtype=np.uint64)
    segment_offsets = np.arange(segments, dtype=np.uint64) * np.uint64(segment_stride)
    block_offsets = np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_stride)
    addresses = (base[:, None, None] + segment_offsets[None, :, None] + block_offsets[None, None, :]).ravel()
    return np.stack([addresses, np.full_like(addresses, seg), np.full_like(addresses, device)], axis=1)


# The most descriptor rows NIXL's prepared transfers can index (they take int32 indices).
INT32_ROWS = 2**31 - 1


def descriptor_indices(ids: np.ndarray, layers: tuple[int, int], segments: int, num_blocks: int) -> np.ndarray:
    """Rows of `block_descriptors` for blocks ``ids`` in every segment of layers
    ``[lo, hi)`` (int32, the type NIXL's prepared transfers take): a layer slice is a
    subset of the same prepared descriptor lists."""
    lo, hi = layers
    if hi * segments * num_blocks > INT32_ROWS:  # a row past int32 would wrap to another block's
        raise InvalidArgumentError(
            f"invalid pool for NIXL: {hi} layers x {segments} segments x {num_blocks} blocks"
            f" = {hi * segments * num_blocks} descriptors, more than NIXL's int32 indices reach ({INT32_ROWS})"
        )
    rows = np.arange(lo * segments, hi * segments, dtype=np.int64)[:, None] * num_blocks + ids[None, :]
    return rows.ravel().astype(np.int32)


def block_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairs ``(src_ids[i], dst_ids[i])`` as maximal runs in which both ids step by one:
    ``(source starts, destination starts, lengths)``, in the pairs' order."""
    src_ids, dst_ids = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    if not len(src_ids):
        return src_ids, dst_ids, np.empty(0, dtype=np.int64)
    cuts = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)) + 1
    starts = np.concatenate([[0], cuts])
    return src_ids[starts], dst_ids[starts], np.diff(np.concatenate([starts, [len(src_ids)]]))


def run_descriptors(
    bases: Sequence[int],
    layers: tuple[int, int],
    segments: int,
    segment_bytes: int,
    num_blocks: int,
    device: int,
    starts: np.ndarray,
    lengths: np.ndarray,
    segment_stride: Optional[int] = None,
) -> np.ndarray:
    """One ``(address, length, device)`` uint64 row per (layer of ``[lo, hi)``, segment, run):
    run ``i`` covers blocks ``[starts[i], starts[i] + lengths[i])`` of a pool whose layers
    start at ``bases`` (`layer_descriptors`' layout; consecutive blocks adjacent, see
    `_runs_fit`), in one descriptor."""
    lo, hi = layers
    seg = np.uint64(segment_bytes)
    base = np.array(bases[lo:hi], dtype=np.uint64)
    stride = np.uint64(num_blocks * segment_bytes if segment_stride is None else segment_stride)
    segment_offsets = np.arange(segments, dtype=np.uint64) * stride
    run_offsets = starts.astype(np.uint64)[None, None, :] * seg
    addresses = (base[:, None, None] + segment_offsets[None, :, None] + run_offsets).ravel()
    sizes = np.broadcast_to(lengths.astype(np.uint64) * seg, (hi - lo, segments, len(starts))).ravel()
    return np.stack([addresses, sizes, np.full_like(addresses, device)], axis=1)


def _runs_fit(pool: PagedKV) -> bool:
    """Whether a run of consecutive blocks of one layer and segment is one span of memory
    (the block stride is the segment: layer-outer pools), so one descriptor covers it."""
    return pool.block_stride == pool.segment_bytes


def block_addresses(
    bases: Sequence[int],
    layers: tuple[int, int],
    segments: int,
    segment_stride: int,
    block_stride: int,
    ids: np.ndarray,
) -> np.ndarray:
    """The first byte of each (layer of ``[lo, hi)``, segment, block of ``ids``), in that
    order (uint64), of a pool whose layers start at ``bases``."""
    lo, hi = layers
    base = np.array(bases[lo:hi], dtype=np.uint64)
    segment_offsets = np.arange(segments, dtype=np.uint64) * np.uint64(segment_stride)
    block_offsets = np.asarray(ids).astype(np.uint64) * np.uint64(block_stride)
    return (base[:, None, None] + segment_offsets[None, :, None] + block_offsets[None, None, :]).ravel()


def joined_spans(
    local: np.ndarray, remote: np.ndarray, seg: int, local_regions: np.ndarray, remote_regions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of ``seg`` bytes, ``local[i]`` to ``remote[i]``, joined where the next piece
    (by local address) continues both sides' spans within one registered region of each
    (``*_regions``: the regions' sorted first bytes; a descriptor may not cross two NIXL
    registrations): ``(local starts, remote starts, sizes)``.

    ```
    block-outer, one layout on both sides (BLHNC):  block b = [l0 | l1 | ... ]  b+1 = [l0 | ...
    a run of blocks, every layer:                    one span on each side, one descriptor
    ```"""
    order = np.argsort(local, kind="stable")  # mostly sorted runs already: timsort merges them
    lo, ro = local[order], remote[order]
    step = np.uint64(seg)
    lreg = np.searchsorted(local_regions, lo, side="right")
    rreg = np.searchsorted(remote_regions, ro, side="right")
    join = (lo[1:] == lo[:-1] + step) & (ro[1:] == ro[:-1] + step) & (lreg[1:] == lreg[:-1]) & (rreg[1:] == rreg[:-1])
    starts = np.concatenate([[0], np.flatnonzero(~join) + 1])
    sizes = np.diff(np.concatenate([starts, [len(lo)]])).astype(np.uint64) * step
    return lo[starts], ro[starts], sizes


def registered_spans(pool: PagedKV) -> list[dict[str, int]]:
    """`registered_regions` as the hello's ``regions`` (``start``, ``length``)."""
    return [{"start": int(a), "length": int(n)} for a, n, _ in registered_regions(pool)]


def registered_regions(pool: PagedKV) -> np.ndarray:
    """The ``(address, length, device)`` uint64 rows NIXL registers for ``pool``: each
    layer's span, from its first byte to its last block's end, spans that overlap merged
    (the layers of a block-outer pool are views into one allocation, interleaved)."""
    spans = []
    for t in pool.layers:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size)
        spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()))
    spans.sort()
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    device = pool.device.index or 0
    return np.array([(a, b - a, device) for a, b in merged], dtype=np.uint64)


def offset_rows(rows: np.ndarray, offset: int) -> np.ndarray:
    """``rows`` moved by ``offset`` (the host pool's rows after the device pool's), refused
    when any would pass int32."""
    moved = rows.astype(np.int64) + offset
    if moved.size and int(moved.max()) >= INT32_ROWS:
        raise InvalidArgumentError(
            f"invalid descriptor row {int(moved.max())}: more than NIXL's int32 indices reach ({INT32_ROWS})"
        )
    return moved.astype(np.int32)


def _encode(notices: Sequence[Notice], dst_ids: Optional[np.ndarray] = None) -> bytes:
    """A write's notification: its notices and the destination ids it wrote, in order
    (``None``: names none, which a request whose lease records its blocks refuses)."""
    return wire.encode(Notices(list(notices), dst_ids))


def _encode_revoke(request_id: int, epoch: int) -> bytes:
    return wire.encode(Revoke(int(request_id), int(epoch)))


def _decode(message: bytes) -> list[Notice]:
    """The notices of a write's notification (`ProtocolError` for anything else)."""
    frame = _decode_notification(message)
    if not isinstance(frame, Notices):
        raise wire.ProtocolError(f"not a kvferry notification of notices: a {frame.kind} frame")
    return list(frame.notices)


def _decode_notification(message: bytes) -> Frame:
    """A notification: a `Notices` or a `Revoke` (`NixlEndpoint.NOTIFICATIONS`); anything
    else raises `ProtocolError`."""
    try:
        frame = TRANSPORT.decode(message, wire.MAX_FRAME_BYTES)
    except InvalidArgumentError as err:
        raise wire.ProtocolError(f"not a kvferry notification: {err}") from None
    if type(frame) not in NixlEndpoint.NOTIFICATIONS:
        raise wire.ProtocolError(f"a {frame.kind} frame as a NIXL notification: only notices and fences travel there")
    return frame


def _after_agent(handler: Handler) -> Handler:
    """``handler`` for a frame that needs the connection bound to its agent first
    (`NixlEndpoint._on_agent`): requests announced before it would belong to no agent."""

    def bound(endpoint: Any, peer: Any, frame: Frame) -> None:
        if peer.source is peer:
            raise wire.ProtocolError(f"{peer}: a {frame.kind} frame before its agent frame", peer=str(peer))
        handler(endpoint, peer, frame)

    return bound


class NixlEndpoint(LocalEndpoint):
    """The receiver's side: registers the pool with a NIXL agent, hands its metadata and block
    descriptors to senders that present the key, and delivers notices from notifications.
    ``hub``: the agents it shares (default: this process's receiving one,
    `nixl_hub.receivers`; a hub of its own stands for another process in tests)."""

    def __init__(
        self, receiver: KVReceiver, *, authkey: bytes, hub: Optional[ReceiverHub] = None, **options: Any
    ) -> None:
        pool = receiver.pool
        # The process's one receiving agent (kvferry.transports.nixl_hub): its pool's
        # allocations registered once for every endpoint over them, one poller for all.
        self._hub = receivers() if hub is None else hub
        self._lane: Optional[Lane] = self._hub.attach(self)
        self._registered: list[Any] = []
        try:
            self._registered = self._lane.register(pool)
            self.agent = self._lane.agent
            hello = pool_hello(
                pool,
                "nixl",
                agent_name=self.agent.name,
                agent_metadata=bytes(self.agent.get_agent_metadata()),
                mem_type=_mem_type(pool),
                device=pool.device.index or 0,
                bases=[t.data_ptr() for t in pool.layers],
                segment_stride=pool.segment_stride,
                block_stride=pool.block_stride,
                # Inside the registered allocations: what a sender checks its blocks against,
                # and where its descriptors may be joined (`joined_spans`).
                regions=registered_spans(pool),
            )
            super().__init__(receiver, hello, authkey=authkey, **options)
        except BaseException:
            lane, self._lane = self._lane, None
            self._hub.detach(self)
            try:
                lane.deregister(self._registered)
            finally:
                self._hub.release(lane)
            raise

    def on_notification(self, agent: str, message: bytes) -> None:
        """One notification of ``agent``, bound to a connection of this endpoint (the
        hub's poller calls this): a request belongs to the first agent that announced it,
        as a connection does on the socket."""
        source = _agent_source(agent)
        try:
            frame = _decode_notification(message)
            self.NOTIFICATIONS[type(frame)](self, source, frame)
        except wire.ProtocolError as err:  # a bad frame or a write outside a lease
            self._record(err)
            self._drop(source, err)
        except KvFerryError as err:  # recorded on the request; its wait raises
            self._record(err)

    def _drop(self, source: str, err: BaseException) -> None:
        """Ends the control connection of the agent that sent a notification breaking the
        protocol (its end fences what it owned); nothing more of it is trusted."""
        with self._lock:
            peers = [p for p in self._peers if p.source == source]
        for peer in peers:
            if peer.channel is not None:
                peer.channel.goodbye(f"disconnected: {err}")
            peer.shutdown()

    def _on_agent(self, peer: Any, frame: Agent) -> None:
        """Binds the connection to the NIXL agent it writes with: its requests are the
        agent's (the notifications name it). Once per connection, and only to an agent no
        other open connection to any endpoint of this process holds (a name is all a
        notification's sender has to go by, and the hub routes it by that name alone)."""
        source = _agent_source(frame.agent_name)
        if peer.source is not peer:
            why = f"a second agent frame (NIXL agent {frame.agent_name!r}): the connection is bound to {peer.source}"
            raise wire.ProtocolError(f"{peer}: {why}", peer=str(peer))
        with self._lock:  # check and bind at once: two connections cannot both take a name
            holder: Any = next((p for p in self._peers if p is not peer and p.source == source), None)
            if holder is None:
                elsewhere = self._hub.bind(frame.agent_name, self)
                if elsewhere is not None:
                    holder = f"a connection to the endpoint at {getattr(elsewhere, 'address', elsewhere)}"
                else:
                    peer.source = source
        if holder is not None:
            raise wire.ProtocolError(f"{peer}: claims {source}, which {holder} holds", peer=str(peer))

    def _on_notices(self, peer: Any, frame: Notices) -> None:
        """Notices never come this way: they ride the writes."""
        why = "notices on the control channel; a NIXL sender sends them as notifications"
        raise wire.ProtocolError(f"{peer}: {why}", peer=str(peer))

    HANDLERS: ClassVar[Mapping[type[Frame], Handler]] = {
        **LocalEndpoint.HANDLERS,
        Agent: _on_agent,
        Announce: _after_agent(LocalEndpoint.HANDLERS[Announce]),
        Revoke: _after_agent(LocalEndpoint.HANDLERS[Revoke]),
        Notices: _on_notices,
    }

    def _deliver_notification(self, source: str, frame: Notices) -> None:
        self.deliver(frame.notices, source, dst_ids=frame.dst_ids)

    def _revoke_notification(self, source: str, frame: Revoke) -> None:
        self.receiver.revoked(frame.request_id, frame.epoch, source)

    # What a NIXL notification may carry, by frame class: ``handler(endpoint, agent, frame)``.
    NOTIFICATIONS: ClassVar[Mapping[type[Frame], Callable[[Any, str, Any], None]]] = {
        Notices: _deliver_notification,
        Revoke: _revoke_notification,
    }

    def lost(self, peer: Any, reason: str) -> None:
        """Fails nothing (see the module doc: the receiver's timeout decides), but fences
        the agent's requests unless the endpoint itself is closing."""
        if isinstance(peer.source, str):
            self._hub.unbind(_agent_name(peer.source), self)
        if not self._closing.is_set():
            self.receiver.fence_source(peer.source)

    def close(self) -> None:
        lane, self._lane = self._lane, None
        if lane is None:  # closed already
            return
        self._hub.detach(self)
        super().close()
        try:
            lane.deregister(self._registered)
        finally:
            self._hub.release(lane)
            self.agent = None  # see _agent: the last user's release ends its progress thread
            self._registered = []


def _agent_source(name: str) -> str:
    """How the receiver names a NIXL sender: by its agent."""
    return f"NIXL agent {name}"


def _agent_name(source: str) -> str:
    """The agent `_agent_source` named."""
    return source[len(_agent_source("")) :]


class _XferPending(Pending):
    """One write: its prepared WRITEs (one, or one per memory type when a host-tier source
    spans VRAM and DRAM), posted once the blocks they read are final: at once for host
    pools, after the producing stream's work for CUDA pools and after every tier signal it
    is ordered after (NIXL follows neither CUDA streams nor host signals, and waiting here
    would block the executor, so the post is deferred to the next poll). With ``notify``
    (a write of several transfers) the notices go as a notification of their own once every
    transfer is done, so they never overtake a part of the write. With ``stamped`` (the
    write's checksums, its notices and destination ids) that notification carries the
    notices' checksums, and waits for the engine's job summing the blocks too. NIXL raising
    (a peer that disconnected, say) ends it in error rather than in the caller."""

    def __init__(
        self,
        agent: Any,
        handles: Sequence[Any],
        ready: Sequence[Any],
        peer: str,
        failure: Optional[BaseException] = None,
        notify: Optional[tuple[str, bytes]] = None,
        stamped: Optional[tuple[WriteChecksums, list[Notice], np.ndarray]] = None,
    ) -> None:
        self._agent = agent
        self._stamped = stamped
        self._handles = list(handles)  # transfers not known to be finished
        self._ready = list(ready)
        self._peer = peer
        self._failure = failure
        self._notify = notify
        self._state = "NEW"
        self._checked = 0.0  # when NIXL was last asked
        self._interval = FIRST_CHECK_SECONDS  # until it may be asked again (CHECK_SECONDS)
        if failure is not None:
            self._fail(failure)
        self._maybe_post()

    def _call(self, op: Any, handle: Any) -> str:
        try:
            return str(op(handle))
        except Exception as err:  # nixl's own error classes, e.g. NIXL_ERR_REMOTE_DISCONNECT
            self._failure = self._failure or err
            return "ERR"

    def _maybe_post(self) -> None:
        if self._state != "NEW" or not all(signal_done(s) for s in self._ready):
            return
        error = next((e for e in map(signal_error, self._ready) if e is not None), None)
        if error is not None:  # a tier copy of its blocks failed: nothing is posted
            self._fail(TransferError(f"the tier copy this write was ordered after failed: {error!r}"))
            return
        self._state = "PROC"
        for handle in list(self._handles):
            state = self._call(self._agent.transfer, handle)
            if state == "ERR":
                self._fail(None)
                return
            if state == "DONE":
                self._finished(handle)
        self._complete()

    def _finished(self, handle: Any) -> None:
        self._handles.remove(handle)
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as err:  # reported by error(); NIXL keeps the handle
            self._failure = self._failure or err

    def _fail(self, error: Optional[BaseException]) -> None:
        self._failure = self._failure or error
        self._state = "ERR"
        self._release()

    def _release(self) -> bool:
        """Releases (cancelling) every transfer not finished; returns whether none is left.
        One NIXL cannot cancel stays, and the write is not done until it ends."""
        for handle in list(self._handles):
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as err:  # still in flight
                self._failure = self._failure or err
                continue
            self._handles.remove(handle)
        if not self._handles:
            self._agent = None  # see _agent
        return not self._handles

    def _complete(self) -> None:
        if self._state != "PROC" or self._handles:
            return
        if self._notify is not None:
            notify = self._notify
            if self._stamped is not None:
                sums, notices, dst = self._stamped
                if not sums.done():
                    return  # looked at again by the next `done`
                if sums.error() is not None:
                    self._fail(TransferError(f"summing the write's blocks failed: {sums.error()!r}"))
                    return
                notify = (notify[0], _encode(sums.stamp(notices), dst))
            try:
                self._agent.send_notif(*notify)
            except Exception as err:  # a receiver already gone
                self._failure = self._failure or err
                self._state = "ERR"
                self._agent = None
                return
        self._state = "DONE"
        self._agent = None  # see _agent

    def done(self) -> bool:
        self._maybe_post()
        if self._state == "PROC":
            now = time.monotonic()
            if now - self._checked < self._interval:
                return False
            self._checked = now
            self._interval = min(CHECK_SECONDS, 2 * self._interval)
            for handle in list(self._handles):
                state = self._call(self._agent.check_xfer_state, handle)
                if state == "ERR":
                    self._fail(None)
                    break
                if state == "DONE":
                    self._finished(handle)
            self._complete()
        elif self._state == "ERR" and self._handles:
            self._release()
        return self._state in ("DONE", "ABORTED") or (self._state == "ERR" and not self._handles)

    def wait(self, timeout: Optional[float]) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    def abort(self) -> bool:
        """Cancels the transfers that have not finished (a hung peer): returns whether none
        touches either pool any more. NIXL refuses to release a transfer it cannot cancel."""
        if self.done():
            return True
        if not self._release():
            return False
        self._state = "ABORTED"
        return True

    def error(self) -> Optional[BaseException]:
        if self._state == "ABORTED":
            return TransferError(f"NIXL transfer to {self._peer} aborted", peer=self._peer)
        if self._state == "ERR":
            why = "state ERR" if self._failure is None else repr(self._failure)
            return TransferError(f"NIXL transfer to {self._peer} failed: {why}", peer=self._peer)
        return None


# A host-tier write whose two pools are of one memory type (DRAM and DRAM) is one transfer
# over one descriptor list covering both pools; of two types (VRAM and DRAM) it is one
# transfer per type, its notices sent once both are done. True takes the second path always
# (how CI exercises it, on DRAM only).
SPLIT_TIERS = False


class NixlTransport(Transport):
    """The sender's side. ``src`` is the sender's own pool and ``host_src`` its host tier,
    if it has one (`KVSender(..., host_pool=...)`): NIXL registers every pool it reads from
    and the receiver's. ``hub``: the agents it shares (default: this process's sending one,
    `nixl_hub.senders`; a hub of its own stands for another process in tests)."""

    carries_notices = True  # the notification leaves with the write (`Transport.carries_notices`)
    costly_submit = True  # descriptors built and posted per write (`Transport.costly_submit`)

    def __init__(
        self,
        address: str,
        *,
        authkey: bytes,
        src: PagedKV,
        host_src: Optional[PagedKV] = None,
        handshake_timeout: Optional[float] = None,
        hub: Optional[AgentHub] = None,
    ) -> None:
        if host_src is not None:
            if not isinstance(host_src, PagedKV):
                raise TypeError(f"host_src must be a PagedKV, got {type(host_src).__name__}")
            if host_src.device.type != "cpu":
                raise InvalidArgumentError(
                    f"invalid host_src=<pool on {host_src.device}>: must be a CPU pool (the engine's host tier)"
                )
        # The socket stays open for its EOF: the cheapest sign that the receiver died.
        self._conn = PeerConnection(address, authkey, handshake_timeout)
        self.peer = self._conn.peer
        hello = self._conn.hello
        if hello["kind"] != "nixl":
            self._conn.close()
            raise TransferError(f"the {self.peer} serves a {hello['kind']} pool, not a NIXL agent", peer=self.peer)
        self._geometry = hello["geometry"]
        src.check_compatible(self._geometry)
        if host_src is not None:
            host_src.check_compatible(self._geometry)
        self._remote_blocks = int(hello["num_blocks"])
        try:  # before any agent exists: a hello that does not add up ends here
            remote = _remote_pool(hello, self.peer)
        except BaseException:
            self._conn.close()
            raise
        self._src = src
        self._host_src = host_src
        self._remote_name = str(hello["agent_name"])
        # The process's sending agent (kvferry.transports.nixl_hub): each pool registered
        # once for every transport, the receiver's agent added once.
        self._hub = senders(SENDER_PROGRESS_THREAD) if hub is None else hub
        self._lane: Optional[Lane] = None
        self._registered: list[Any] = []
        self._peer_added = False
        try:
            self._lane = self._hub.acquire(self._remote_name)
            self.agent = self._lane.agent
            self._conn.send(Agent(self.agent.name))  # before any announce
            # By the allocations the pools view (`nixl_hub.storage_spans`): a block-outer
            # pool's layer views are not contiguous, and slices of one pool share them.
            self._registered = [self._lane.register(p) for p in (src, host_src) if p is not None]
            self._lane.add_peer(hello["agent_metadata"], self._remote_name)
            self._peer_added = True
        except BaseException:
            self._unwind()
            raise
        # Local descriptor lists: rows of the device pool's blocks, then (one list) the host
        # pool's, from `_host_row`; or the host pool's in a list of its own (`_host_side`).
        self._split = host_src is not None and (SPLIT_TIERS or _mem_type(src) != _mem_type(host_src))
        descriptors = block_descriptors(src)
        self._host_row = len(descriptors)
        if host_src is not None and not self._split:
            descriptors = np.concatenate([descriptors, block_descriptors(host_src)])
        self._local_side = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descriptors, _mem_type(src))
        self._host_side = None
        if host_src is not None and self._split:
            self._host_side = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", block_descriptors(host_src), _mem_type(host_src)
            )
        self._remote_bases = list(hello["bases"])
        self._remote_device, self._remote_mem = int(hello["device"]), str(hello["mem_type"])
        # Where the receiver's blocks lie, by its own strides (block-outer pools, head slices).
        self._remote_strides = (int(hello["segment_stride"]), int(hello["block_stride"]))
        # Each side's registered regions' first bytes, for `joined_spans`.
        self._remote_regions = np.array(sorted(int(r["start"]) for r in hello["regions"]), dtype=np.uint64)
        self._local_regions = {id(p): registered_regions(p)[:, 0] for p in (src, host_src) if p is not None}
        self._remote_side = self.agent.prep_xfer_dlist(hello["agent_name"], remote, hello["mem_type"])

    @property
    def num_blocks(self) -> int:
        return self._remote_blocks

    def geometry(self) -> dict[str, object]:
        return dict(self._geometry)

    def check_source(self, src: Source) -> None:
        """NIXL reads only registered memory: the pool given as ``src`` and, for a sender
        with a host tier, the one given as ``host_src``."""
        if isinstance(src, TieredSource):
            if src.device is not self._src:
                raise InvalidArgumentError("invalid pool: not the pool this NIXL transport registered as src")
            if src.host is not self._host_src:
                raise InvalidArgumentError(
                    (
                        "invalid host_pool: not registered with this NIXL transport: create it as "
                        "NixlTransport(..., src=pool, host_src=host_pool)"
                    )
                )
        elif src is not self._src:
            raise InvalidArgumentError("invalid src: not the pool this NIXL transport registered")

    def write(self, engine: CopyEngine, job: Write) -> Pending:
        src, notices = job.src, job.notices
        self.check_source(src)
        s, d = packed_ids(job.src_ids, job.dst_ids, src.num_blocks, self._remote_blocks)
        pool = self._src
        layers = (0, pool.num_layers) if job.layers is None else job.layers
        segments = pool.segments
        # Per local descriptor list: the rows each part reads there, and where they go.
        lists: dict[int, tuple[Any, list[np.ndarray], list[np.ndarray]]] = {}
        for part in source_parts(src, s, d):
            if part.pool is pool:
                local, rows = self._local_side, descriptor_indices(part.src_ids, layers, segments, pool.num_blocks)
            else:  # a host-tier part: the registered host pool's rows
                assert self._host_src is not None
                rows = descriptor_indices(part.src_ids, layers, segments, self._host_src.num_blocks)
                local = self._host_side if self._split else self._local_side
                if not self._split:  # its rows follow the device pool's in the one list
                    rows = offset_rows(rows, self._host_row)
            entry = lists.setdefault(id(local), (local, [], []))
            entry[1].append(rows)
            entry[2].append(descriptor_indices(part.dst_ids, layers, segments, self._remote_blocks))
        sides = [(local, np.concatenate(rows), np.concatenate(remote)) for local, rows, remote in lists.values()]
        # Blocks that are contiguous on both sides go as one descriptor per run of them (per
        # layer and segment) in a transfer made for this write, instead of one prepared
        # descriptor per block: UCX's cost is per descriptor, about 8 us whatever its size
        # on one H200 (docs/benchmarks.md).
        coalesced = self._coalesced(src, s, d, layers) if COALESCE else None
        notify = None
        message = _encode(notices, d)
        # Several transfers, or checksums to carry: the notices follow once all are done
        # (and the sums of the blocks, queued on the engine, are known).
        if len(coalesced if coalesced is not None else sides) > 1 or job.checksums is not None:
            notify, message = (self._remote_name, message), b""
        handles = []
        try:
            if coalesced is not None:
                for local, remote in coalesced:
                    handles.append(self.agent.initialize_xfer("WRITE", local, remote, self._remote_name, message))
            else:
                for local, rows, remote in sides:
                    handles.append(
                        self.agent.make_prepped_xfer("WRITE", local, rows, self._remote_side, remote, message)
                    )
        except Exception as err:  # a receiver already gone: the write fails, not the caller
            return _XferPending(self.agent, handles, [], self.peer, failure=err)
        ready: list[Signal] = list(job.after)
        if pool.device.type == "cuda":
            import torch

            ready.append(torch.cuda.current_stream(pool.device).record_event())
        stamped = None
        if job.checksums is not None:
            # NIXL's write is no job of the engine's: the sums are one of their own, after
            # the same signals (and, on CUDA, the forward's stream work) as the write's post.
            job.checksums.pending = engine.submit_call(job.checksums.compute, after=job.after)
            stamped = (job.checksums, list(notices), d)
        return _XferPending(self.agent, handles, ready, self.peer, notify=notify, stamped=stamped)

    def _coalesced(
        self, src: Source, s: np.ndarray, d: np.ndarray, layers: tuple[int, int]
    ) -> Optional[list[tuple[Any, Any]]]:
        """The write as descriptor lists of runs (`block_runs`), one ``(local, remote)`` pair
        per memory type of its parts; None when no two of its blocks are contiguous on both
        sides (the prepared per-block lists are then cheaper), or when either pool's
        consecutive blocks are not adjacent (block-outer, token-major head slices: one
        descriptor per block anyway)."""
        pool = self._src
        geometry = self._geometry
        segments, seg = int(geometry["segments"]), int(geometry["segment_bytes"])
        parts = source_parts(src, s, d)
        remote_stride, remote_block = self._remote_strides
        # A source pool's or the receiver's consecutive blocks not adjacent (block-outer):
        # spans that continue on both sides, across layers and segments (`joined_spans`).
        if remote_block != seg or not all(
            _runs_fit(pool if part.pool is pool else self._host_src)  # type: ignore[arg-type]
            for part in parts
        ):
            return self._joined(parts, layers)
        runs = [block_runs(part.src_ids, part.dst_ids) for part in parts]
        if sum(len(r[2]) for r in runs) >= len(s):
            return None
        by_type: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for part, (s0, d0, n) in zip(parts, runs):
            mine = pool if part.pool is pool else self._host_src
            assert mine is not None
            bases = [t.data_ptr() for t in mine.layers]
            local = run_descriptors(
                bases, layers, segments, seg, mine.num_blocks, mine.device.index or 0, s0, n, mine.segment_stride
            )
            remote = run_descriptors(
                self._remote_bases,
                layers,
                segments,
                seg,
                self._remote_blocks,
                self._remote_device,
                d0,
                n,
                remote_stride,
            )
            entry = by_type.setdefault(_mem_type(mine), ([], []))
            entry[0].append(local)
            entry[1].append(remote)
        return [
            (
                self.agent.get_xfer_descs(np.concatenate(local), mem),
                self.agent.get_xfer_descs(np.concatenate(remote), self._remote_mem),
            )
            for mem, (local, remote) in by_type.items()
        ]

    def _joined(self, parts: Sequence[Any], layers: tuple[int, int]) -> Optional[list[tuple[Any, Any]]]:
        """The write as `joined_spans` of its (layer, segment, block) pieces, one ``(local,
        remote)`` pair per memory type of its parts; None when that joins nothing (the
        prepared per-block lists are then cheaper). Two block-outer pools of one layout
        join a block's layers into one descriptor, and a run of blocks into one too."""
        geometry = self._geometry
        segments, seg = int(geometry["segments"]), int(geometry["segment_bytes"])
        remote_stride, remote_block = self._remote_strides
        rows = joined = 0
        by_type: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for part in parts:
            mine = self._src if part.pool is self._src else self._host_src
            assert mine is not None
            local = block_addresses(
                [t.data_ptr() for t in mine.layers],
                layers,
                segments,
                mine.segment_stride,
                mine.block_stride,
                part.src_ids,
            )
            remote = block_addresses(self._remote_bases, layers, segments, remote_stride, remote_block, part.dst_ids)
            lo, ro, sizes = joined_spans(local, remote, seg, self._local_regions[id(mine)], self._remote_regions)
            rows, joined = rows + len(local), joined + len(lo)
            entry = by_type.setdefault(_mem_type(mine), ([], []))
            entry[0].append(np.stack([lo, sizes, np.full_like(lo, mine.device.index or 0)], axis=1))
            entry[1].append(np.stack([ro, sizes, np.full_like(ro, self._remote_device)], axis=1))
        if joined >= rows:
            return None
        return [
            (
                self.agent.get_xfer_descs(np.concatenate(local), mem),
                self.agent.get_xfer_descs(np.concatenate(remote), self._remote_mem),
            )
            for mem, (local, remote) in by_type.items()
        ]

    def check_peer(self) -> None:
        """Raises `TransferError` (naming the receiver) once its socket closed; without a
        progress thread, also progresses the agent (a notification still on its way out)."""
        self._conn.check()
        if not SENDER_PROGRESS_THREAD and self.agent is not None:
            try:
                self.agent.get_new_notifs()  # progresses the UCX worker; a sender is sent none
            except Exception as err:  # nixl's own error classes: the receiver's agent is gone
                raise TransferError(f"NIXL agent of {self.peer} failed: {err!r}", peer=self.peer) from err

    def cancel_requests(self) -> list[tuple[int, int]]:
        return self._conn.take_cancels()

    def announce(self, requests: Sequence[tuple[int, int]]) -> None:
        """On the socket: binds the requests to this sender's agent before their first
        notification."""
        self._conn.send(Announce([(int(r), int(e)) for r, e in requests]))

    def revoke(self, request_id: int, epoch: int) -> None:
        """A notification of its own, on the path of the writes' notifications: the sender
        posts it only once every write of the request is done or aborted."""
        self._conn.check()
        try:
            self.agent.send_notif(self._remote_name, _encode_revoke(request_id, epoch))
        except Exception as err:  # a receiver already gone
            raise TransferError(
                f"fence of request {request_id} to {self.peer} failed: {err!r}", peer=self.peer
            ) from err

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        """The notices arrived with the write's notification (a cancelled request's notices
        too: the receiver discards them once the request's fence, which follows, arrived or
        its epoch is gone); only checks that the receiver is still there, since a write can
        finish just before it died."""
        self._conn.check()

    def close(self) -> None:
        if self.agent is None:  # closed already
            return
        try:
            self.agent.release_dlist_handle(self._local_side)
            if self._host_side is not None:
                self.agent.release_dlist_handle(self._host_side)
            self.agent.release_dlist_handle(self._remote_side)
        finally:
            self._unwind()
            # see _agent: the descriptor handles hold the agent too
            self.agent = self._local_side = self._host_side = self._remote_side = None

    def _unwind(self) -> None:
        """Gives back what this transport holds of its hub's lane (the remote agent, the
        registrations, the lane) and closes the socket."""
        try:
            if self._lane is not None:
                try:
                    self._lane.remove_peer(self._remote_name, added=self._peer_added)
                finally:
                    for keys in self._registered:
                        self._lane.deregister(keys)
        finally:
            self._conn.close()
            if self._lane is not None:
                self._hub.release(self._lane)
            self._lane, self._registered, self._peer_added = None, [], False
