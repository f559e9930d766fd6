"""The prefill worker of `KvferryConnector` (kvferry.vllm.worker draws both roles): one
kvferry `KVSender` per decode server it sends to, fed chunk by chunk from vLLM's steps.

Every call here runs on vLLM's engine thread and returns without waiting on the network:
connecting to a new decode endpoint, telling a decode server that a transfer was given up
(an abandon at its rendezvous) and closing a dead peer's sender run on a small pool of background
threads; the senders post notices and fences and wait for ring room on their own threads
(`KVSender`). A request whose endpoint is still being connected to keeps its chunks
(``_Send.queued``) and sends them, in order, once the connection is up; if it cannot be
made, the request fails and its transfer is abandoned. A slow or dead decode server
delays only the requests that go to it.

Tensor parallelism (kvferry.ranks): each prefill rank's worker sends its own heads, one
`_Send` per link of a request (one per decode rank it overlaps, each to that rank's own
endpoint, over a head slice of this rank's pool when the two split heads differently). A
request is finished_sending here once every link of this rank settled; a rank that holds
no link of it (a replicated head or MLA's latent head sent by a lower rank) reports it as
soon as vLLM finished it. vLLM frees the blocks once every rank reported it.

Pipeline parallelism: each stage's worker registers only its layers, so its pool is its
stage's, and it takes the links of its global rank (``stage * tp + tp rank``,
`kvferry.ranks.staged_links`): every stage sends its own layers of the early prefix and of
each chunk, after its own forward.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from kvferry import affinity
from kvferry.errors import (
    KvFerryError,
    TransferError,
    TransferTimeoutError,
    UnknownRequestError,
    UnqueuedWriteError,
)
from kvferry.groups import add_groups
from kvferry.hook import TransferHook
from kvferry.layout import PagedKV
from kvferry.sender import KVSender
from kvferry.tiers import tiered_source
from kvferry.vllm import paths
from kvferry.vllm.client import Client
from kvferry.vllm.metadata import Chunk, KvferryMetadata, SendSpec
from kvferry.vllm.park import park_pool
from kvferry.vllm.worker import WorkerCommon

logger = logging.getLogger("kvferry.vllm")
# Background threads of one prefill worker: connections to new decode endpoints, abandons,
# closing the senders of dead peers (each bounded by the handshake's timeout).
BACKGROUND_THREADS = 4


@dataclass
class _Peer:
    """One decode server this prefill worker sends to: one sender (one receiver per sender)."""

    address: str
    sender: KVSender
    hook: TransferHook
    pool: PagedKV  # what it sends from: this rank's pool, or a head slice of it
    path: str = ""  # the transport it sends over (kvferry.vllm.paths)
    lost: bool = False


@dataclass
class _Send:
    spec: SendSpec
    kv_id: int  # its first KV cache group's kvferry id (GroupSet.kv_ids: one per group)
    peer: Optional[_Peer]
    blocks: int
    destination: dict[str, Any]  # its decode rank's published blocks, epoch and endpoint
    pool: PagedKV  # what it sends from (this rank's pool, or the link's head slice)
    transfer: str  # the name its decode rank published it under (for an abandon)
    rendezvous: str  # its decode rank's rendezvous
    address: str = ""  # its decode endpoint
    decode_rank: int = 0
    heads: Optional[tuple[int, int]] = None  # the link's head slice of this rank's pool (None: whole)
    added: bool = False  # registered with its peer's hook (its connection is up)
    # Until then (the connection being made): its latest block table and the chunks whose
    # forward ran, sent in order once it is added (`_start`).
    src_blocks: Optional[list[list[int]]] = None  # one table per KV cache group
    queued: list[tuple[int, int]] = field(default_factory=list)
    early_done: bool = False
    finishing: bool = False
    error: Optional[str] = None
    forward_done: Optional[float] = None  # when the last chunk's forward ended
    first_forward_done: Optional[float] = None  # when the first chunk's forward ended (early writes landed by then?)
    writes: list[tuple[str, float, float, int]] = field(default_factory=list)  # kind, submitted, finished, bytes


@dataclass
class _Owed:
    """The hook calls one peer is owed since the last flush (`PrefillWorker._flush`), in
    the order they leave: every early send, then the queued chunks round by round (a
    request's k-th chunk in round k, so its chunks stay in order). Each is one call for all
    its requests, so one write (and one notice batch) per peer per step, not one per request."""

    peer: _Peer
    early: list[_Send] = field(default_factory=list)
    rounds: list[list[tuple[_Send, tuple[int, int]]]] = field(default_factory=list)
    placed: dict[int, int] = field(default_factory=dict)  # chunks of each send (by id) in ``rounds``


@dataclass
class _Parked:
    """A late prompt copied into the host pool (kvferry.vllm.park): vLLM frees its blocks
    once the copy completed (``reported``); its host blocks go back once its late send ended
    or it was released (``done``) and the copy completed."""

    host: list[int]
    copied: Any = None  # a CUDA event recorded after the copy; None: copied already (CPU)
    ordered: set[int] = field(default_factory=set)  # senders whose copies wait on ``copied`` (`order_after`)
    reported: bool = False
    done: bool = False

    def complete(self) -> bool:
        return self.copied is None or bool(self.copied.query())


class PrefillWorker:
    def __init__(self, common: WorkerCommon) -> None:
        self.common = common
        self.config = common.config
        self.authkey = common.authkey
        self.block_size = common.block_size
        self.tally = common.tally
        self.trace = common.trace
        self._peers: dict[str, _Peer] = {}
        self._dead: list[_Peer] = []
        # One send per (request, decode rank) link of this rank; `_reqs` lists each
        # request's, none for a request this rank sends nothing of (then: finished yet?).
        self._send: dict[tuple[str, int], _Send] = {}
        self._reqs: dict[str, list[tuple[str, int]]] = {}
        self._bare: dict[str, bool] = {}
        self._chunks: list[Chunk] = []
        self._connecting: dict[str, Future[_Peer]] = {}  # by endpoint address
        self._bg = ThreadPoolExecutor(
            BACKGROUND_THREADS, thread_name_prefix="kvferry-prefill", initializer=affinity.pin_current_thread
        )
        self._released: list[tuple[str, str, str]] = []  # finished requests whose destination never came
        self._client = Client(self.authkey)  # abandons: one kept connection per decode rendezvous
        self._retired: list[_Send] = []  # preempted sends still in their senders (`_retire`)
        # Late prompts in host memory (kvferry.vllm.park): the pool, as the copies address it
        # (a CUDA view of its pinned memory on CUDA), and the requests parked there.
        self._park: Optional[PagedKV] = None
        self._park_view: Optional[PagedKV] = None
        self._parked: dict[str, _Parked] = {}
        self._stream: Any = None  # the parking copies' CUDA stream (`_side_stream`)
        # The sends this call issued, by peer (id), made at its end (`_flush`): empty between calls.
        self._owed: dict[int, _Owed] = {}

    @property
    def pool(self) -> Any:
        return self.common.pool

    def start(self) -> None:
        """Once vLLM registered its KV cache: the host pool late prompts park in, when the
        scheduler half sizes one (allocated now, page-locked on CUDA, not on a step)."""
        n = self.common.park_blocks
        if n <= 0 or self.pool is None:
            return
        self._park = park_pool(self.common.views, n, self.block_size, pinned=self.pool.device.type == "cuda")
        self._park_view = tiered_source(self.pool, self._park).host_view

    def _host_pool(self, heads: Optional[tuple[int, int]]) -> Optional[PagedKV]:
        """The host pool as a link with ``heads`` reads it (None: the whole pool)."""
        if self._park is None:
            return None
        return self._park if heads is None else self._park.heads(*heads)

    def _legs(self, rid: str) -> list[_Send]:
        return [self._send[key] for key in self._reqs.get(rid, ()) if key in self._send]

    # -- per step ------------------------------------------------------------------------

    def preempt(self, meta: KvferryMetadata) -> None:
        """First thing of a step, before the forward that may overwrite preempted blocks."""
        for rid in meta.preempted:
            self._preempted(rid)

    def bind(self, meta: KvferryMetadata) -> None:
        self._adopt()
        self._released.extend(meta.releases)
        for rid, table, host in meta.parks:
            self._park_blocks(rid, table, host)
        for send in meta.sends:
            self._add_send(send)
        self._chunks = []
        for c in meta.chunks:
            legs = [st for st in self._legs(c.req_id) if st.error is None]
            if not legs:
                continue
            if not legs[0].spec.finished:
                self._chunks.append(c)
            for st in legs:
                st.src_blocks = c.src_blocks
                if st.spec.finished:
                    # A late send: its prompt was computed in earlier steps, so its one chunk is
                    # queued now (no forward of this step writes it); sent once it is added.
                    st.queued.append((c.start, c.end))
                    self.trace.chunk("prefill", st.spec.transfer, c.req_id, c.start, c.end)
                    st.forward_done = time.monotonic()
                if st.added:
                    self._issue(st)  # the early send (or a late send) leaves here, before the forward
        self._flush()

    def save_layer(self, layer_name: str) -> None:
        if self.config.layer_groups == 1 or not self._chunks:
            return
        layer = self.common.layer_of.get(layer_name)
        if layer is None:
            return
        owed: dict[int, tuple[_Peer, list[tuple[_Send, tuple[int, int]]]]] = {}
        for c in self._chunks:
            for st in self._legs(c.req_id):
                if c.end == st.spec.prompt_len and st.added and st.peer is not None:
                    owed.setdefault(id(st.peer), (st.peer, []))[1].append((st, (c.start, c.end)))
        for peer, items in owed.values():  # one call per peer: one write of this layer group
            self._batched(peer.hook.after_layer, items, layer)

    def after_forward(self) -> None:
        for c in self._chunks:
            legs = self._legs(c.req_id)
            if legs:
                self.trace.chunk("prefill", legs[0].spec.transfer, c.req_id, c.start, c.end)
            for st in legs:
                if st.first_forward_done is None:
                    st.first_forward_done = time.monotonic()
                st.queued.append((c.start, c.end))
                if st.added:
                    self._issue(st)
                if c.end == st.spec.prompt_len:
                    st.forward_done = time.monotonic()
        self._chunks = []
        self._adopt()
        self._flush()
        self._poll_peers()

    def results(self, finished_req_ids: set[str]) -> set[str]:
        """This step's finished_sending."""
        sending: set[str] = set()
        for rid, transfer, why in self._released:  # nothing was sent: vLLM may free the blocks
            self.common.ended("prefill", transfer, rid, "failed", why)
            self._let_go(rid, sending)
        self._released = []
        for rid in finished_req_ids:
            for st in self._legs(rid):
                st.finishing = True
            if rid in self._bare:
                self._bare[rid] = True
        self._adopt()
        self._flush()
        self._poll_peers()
        finishing = [st for st in self._send.values() if st.finishing]
        if finishing:
            # Once per step, not per settle (that was quadratic in the sends): the sends by
            # (peer, kv id), for the late records a settle takes, and each peer's failures.
            by_kv = self._by_kv()
            peers = {id(st.peer): st.peer for st in finishing if st.peer is not None}
            failures = {key: peer.sender.failures() for key, peer in peers.items()}
            for st in finishing:
                if self._settle_send(st, by_kv, failures.get(id(st.peer), {})):
                    rid = st.spec.req_id
                    del self._send[(rid, st.decode_rank)]
                    if not self._legs(rid):  # every link of this rank settled
                        del self._reqs[rid]
                        self._let_go(rid, sending)
        for rid, finished in list(self._bare.items()):
            if finished:  # nothing of it leaves this rank: its blocks are vLLM's again
                del self._bare[rid], self._reqs[rid]
                self._let_go(rid, sending)
        self._drop_dead_peers()
        self._settle_parked(sending)
        return sending

    # -- parking (kvferry.vllm.park) -----------------------------------------------------

    def _park_blocks(self, rid: str, table: list[int], host: list[int]) -> None:
        """Copies a late prompt's blocks ``table`` into host blocks ``host`` (the scheduler
        half chose them); vLLM frees its blocks once the copy completed (`_settle_parked`).
        On CUDA the copy runs on a side stream after what the engine's stream queued (the
        forward that computed them), so nothing here waits."""
        assert self.pool is not None and self._park_view is not None
        from kvferry.copy import copy_blocks

        parked = _Parked(list(host))
        if self.pool.device.type == "cuda":
            side = self._side_stream()
            side.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(side):
                copy_blocks(self.pool, self._park_view, table, host)
                parked.copied = torch.cuda.Event()
                parked.copied.record(side)
        else:
            copy_blocks(self.pool, self._park_view, table, host)
        self._parked[rid] = parked
        self.tally.add("parked_prompts", 1)

    def _side_stream(self) -> Any:
        if self._stream is None:  # made at the first park: a CPU pool never needs one
            self._stream = torch.cuda.Stream(self.pool.device)
        return self._stream

    def _let_go(self, rid: str, sending: set[str]) -> None:
        """A finished request's transfer ended on this rank: vLLM may free its blocks, or, for
        a parked one (whose blocks vLLM freed once parked), its host blocks may go back."""
        parked = self._parked.get(rid)
        if parked is None:
            sending.add(rid)
        else:
            parked.done = True

    def _settle_parked(self, sending: set[str]) -> None:
        """Parked requests whose copy completed: finished_sending once (vLLM frees the
        blocks), then, once their late send ended too, given back to the scheduler half."""
        for rid, parked in list(self._parked.items()):
            if not parked.complete():
                continue
            if not parked.reported:
                parked.reported = True
                sending.add(rid)
            if parked.done:
                del self._parked[rid]
                self.common.unparked.append(rid)

    # -- sends ---------------------------------------------------------------------------

    def _ready_peer(self, address: str, pool: PagedKV, heads: Optional[tuple[int, int]] = None) -> Optional[_Peer]:
        """The live peer at ``address``, or None while a connection to it is being made
        (started here, on a background thread, when there is none: never on this thread)."""
        peer = self._peers.get(address)
        if peer is not None and not peer.lost:
            try:
                # The endpoint may have closed the connection since its last use (an idle
                # place reclaimed for another sender, a restart): a new request gets a new one.
                peer.sender.check_peer()  # never blocks: what the sender knows, or a look
                return peer
            except TransferError as err:
                peer.lost = True
                logger.info("kvferry: reconnecting to %s: %s", address, err)
                self._dead.append(self._peers.pop(address))
        if address not in self._connecting:
            self._connecting[address] = self._bg.submit(self._connect, address, pool, self._host_pool(heads))
        return None

    def _connect(self, address: str, pool: PagedKV, host: Optional[PagedKV] = None) -> _Peer:
        """On a background thread: the connection (TCP or Unix connect, handshake, hello)
        and its sender, over ``pool`` (an endpoint serves one decode rank's one link, so
        every send through it moves the same heads) and ``host``, the same heads of the host
        pool late prompts park in."""
        what = f"prefill rank {self.common.rank} to the decode endpoint {address}"
        with torch.inference_mode(False):  # its ring view is written by the copy thread
            transport, path = paths.connect(
                address, transport=self.config.transport, authkey=self.authkey, src=pool, host_src=host, what=what
            )
        try:
            sender = KVSender(
                pool,
                transport,
                pipelined=self.config.early,
                timeout=self.config.transfer_timeout_s,
                record=True,
                progress=True,
                host_pool=host,
                layer_groups=self.config.layer_groups,
                # With transfer cores, writes start on them (the announcer's), not on the
                # engine's; else the sender's default (NIXL over CUDA caches hands them off).
                handoff=True if self.config.transfer_cores else None,
                checksum=self.config.checksum,
            )
        except BaseException:
            transport.close()
            raise
        logger.info("kvferry: %s: sending over %s", what, path)
        self.tally.add(f"connections_{path.replace('-', '_')}", 1)
        return _Peer(address, sender, TransferHook(sender), pool, path)

    def _adopt(self) -> None:
        """Takes the connections made since the last call, then starts the sends that waited
        for them; a connection that failed fails its waiting sends."""
        for address, future in list(self._connecting.items()):
            if not future.done():
                continue
            del self._connecting[address]
            try:
                self._peers[address] = future.result()
            except Exception as err:
                for st in [*self._send.values(), *self._retired]:
                    if st.address == address and not st.added and st.error is None:
                        self._give_up(st, f"cannot send to the decode server: {err}")
        self._retire()
        for st in list(self._send.values()):
            if not st.added and st.error is None and st.address not in self._connecting and not self._retiring(st):
                self._start(st)

    def _add_send(self, spec: SendSpec) -> None:
        """One `_Send` per link of this rank (kvferry.ranks): without tensor parallelism,
        the one destination."""
        blocks = math.ceil(spec.prompt_len / self.block_size)
        assert self.pool is not None
        legs: list[tuple[int, dict[str, Any], Optional[tuple[int, int]], str, str]]
        if spec.legs is None:
            legs = [(0, spec.destination, None, spec.transfer, spec.peer)]
        else:
            legs = [
                (leg.decode_rank, leg.destination, None if leg.whole else leg.src_heads, leg.transfer, leg.rendezvous)
                for leg in spec.legs
                if leg.prefill_rank == self.common.rank  # vLLM's global rank: stage * tp + tp rank
            ]
        self._reqs[spec.req_id] = [(spec.req_id, d) for d, *_ in legs]
        if not legs:
            self._bare[spec.req_id] = spec.finished  # a late send: vLLM finished the request already
        for d, dest, heads, transfer, rendezvous_address in legs:
            pool = self.pool if heads is None else self.common.link_pool(heads, False)
            st = _Send(spec, int(dest["request_id"]), None, blocks, dest, pool, transfer, rendezvous_address)
            st.decode_rank, st.heads = d, heads
            st.address = str(dest["endpoint"])
            st.finishing = spec.finished  # a late send: vLLM finished the request already
            self._send[(spec.req_id, d)] = st
            if not self._retiring(st):
                self._start(st)  # else once the preempted send it replaces left (`_adopt`)

    def _start(self, st: _Send) -> None:
        """Registers the send with its peer once the connection is up (else it waits,
        keeping its chunks), then issues what its chunks so far call for."""
        spec, dest = st.spec, st.destination
        try:
            peer = self._ready_peer(st.address, st.pool, st.heads)
            if peer is None:
                return  # connecting: its sends wait until the connection is up
            st.peer = peer
            # One kvferry request per KV cache group, each with its own tables and window.
            add_groups(peer.hook, self.common.groups, st.kv_id, spec.prompt_len, spec.reused_len, dest)
        except KvFerryError as err:
            self._give_up(st, f"cannot send to the decode server: {err}")
            return
        st.added = True
        self.tally.add("held_blocks", int(dest["held_blocks"]))
        self.trace.event("prefill", "plan", spec.transfer, spec.req_id, prompt=spec.prompt_len,
                         reused=spec.reused_len, blocks=st.blocks, held=int(dest["held_blocks"]))  # fmt: skip
        self._issue(st)

    def _issue(self, st: _Send) -> None:
        """The one place that decides a request's sends: its block table so far, then the
        early send (once, before the first forward it is issued for; a send that waited
        for its connection issues it late, still before the chunks), then each chunk whose
        forward ran, in order. The sends are owed to its peer and made, with the other
        requests' to the same peer, when the engine's call ends (`_flush`). None of it
        waits (`KVSender`)."""
        peer = st.peer
        assert peer is not None and st.added
        kvs = self._kv_ids(st)
        parked = self._parked.get(st.spec.req_id)
        if (
            parked is not None
            and st.src_blocks is not None
            and id(peer) not in parked.ordered
            and not parked.complete()
        ):
            # Its late send reads the host copy the side stream is still writing.
            parked.ordered.add(id(peer))
            self._call(st, peer.sender.order_after, [b for table in st.src_blocks for b in table], parked.copied)
        owed = self._owed.get(id(peer))
        if owed is None:
            owed = self._owed[id(peer)] = _Owed(peer)
        if st.src_blocks is not None:
            for kv, table in zip(kvs, st.src_blocks):
                self._call(st, peer.hook.update_src_blocks, kv, table[: st.blocks])
            if not st.early_done:
                st.early_done = True
                reused_blocks = st.spec.reused_len // self.block_size
                if st.spec.early:
                    self.trace.event("prefill", "early_issued", st.spec.transfer, st.spec.req_id, blocks=reused_blocks)
                    owed.early.append(st)
                else:  # the forward writes some of the hit: the first chunk sends it all after
                    self.trace.event(
                        "prefill", "early_deferred", st.spec.transfer, st.spec.req_id, blocks=reused_blocks
                    )
                    self.tally.add("early_deferred", 1)
        k = owed.placed.get(id(st), 0)
        for start, end in st.queued:
            if end == st.spec.prompt_len and st.src_blocks is not None:
                # The last chunk sends every group's live blocks: none may be vLLM's null block.
                self._call(st, self.common.groups.check_live, st.src_blocks, st.spec.prompt_len, "the prefill request")
            if k == len(owed.rounds):
                owed.rounds.append([])
            owed.rounds[k].append((st, (start, end)))
            k += 1
        owed.placed[id(st)] = k
        st.queued = []

    def _flush(self) -> None:
        """Makes the sends owed to each peer (`_Owed`): its early sends in one hook call, then
        each round of chunks in one, so a step's small writes to a peer leave as one
        submission. Called at the end of every engine call that issues sends."""
        owed, self._owed = self._owed, {}
        for batch in owed.values():
            hook = batch.peer.hook
            self._batched(hook.before_forward, [(st, None) for st in batch.early])
            for chunks in batch.rounds:
                self._batched(hook.after_forward, chunks)

    def _batched(
        self, fn: Callable[..., Any], items: Sequence[tuple[_Send, Optional[tuple[int, int]]]], *extra: Any
    ) -> None:
        """One hook call ``fn`` for the sends of ``items`` to one peer, each with its chunk
        ``(start, end)`` (None: an early send, which takes none), every KV cache group's
        kvferry request of each; ``extra`` follows (a layer). A failure fails only the sends
        it concerns (as `_call` does for one): a call refused before anything was claimed (a
        request its sender failed already, a bad chunk) is made again request by request,
        so only the refused ones fail; one whose writes could not all be queued
        (`UnqueuedWriteError`) names the requests that failed, the rest were sent."""
        live = [(st, bounds) for st, bounds in items if st.error is None]
        if not live:
            return
        try:
            fn(*self._batch_args(live), *extra)
        except UnqueuedWriteError as err:
            failed = set(err.request_ids)
            for st, _ in live:
                if failed.intersection(self._kv_ids(st)):
                    self._failed(st, err)
        except KvFerryError as err:
            if len(live) == 1:
                self._failed(live[0][0], err)
                return
            for st, bounds in live:
                self._call(st, fn, *self._batch_args([(st, bounds)]), *extra)

    def _batch_args(self, items: list[tuple[_Send, Optional[tuple[int, int]]]]) -> tuple[list[int], ...]:
        """A hook call's request ids (every group's of each send), with the chunk bounds of
        each when the sends have chunks."""
        kvs: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        for st, bounds in items:
            ids = self._kv_ids(st)
            kvs += ids
            if bounds is not None:
                starts += [bounds[0]] * len(ids)
                ends += [bounds[1]] * len(ids)
        return (kvs,) if items[0][1] is None else (kvs, starts, ends)

    def _give_up(self, st: _Send, reason: str) -> None:
        """Fails a send before its worker wrote anything and tells the decode server (from
        a background thread), which frees its blocks at once."""
        st.error = reason
        spec = st.spec
        logger.error("kvferry: prefill request %s (transfer %s): %s", spec.req_id, spec.transfer, reason)
        # The destination's epoch says this request took it: the rendezvous takes an abandon of
        # a transfer taken already only from its taker.
        self._bg.submit(self._abandon, st.rendezvous, st.transfer, reason, int(st.destination["epoch"]))

    def _abandon(self, address: str, transfer: str, reason: str, epoch: int) -> None:
        try:
            self._client.abandon(address, transfer, reason, epoch).result()
        except KvFerryError as why:
            logger.warning("kvferry: %s", why)

    def _preempted(self, rid: str) -> None:
        """vLLM preempted a prefill request: its blocks are free and this step's forward may
        overwrite them. Each of its sends is revoked (its fence tells the decode side, which
        expects the request again under a new epoch; the scheduler half looks it up again
        and the request is sent again once computed again) and retired: it leaves the sender
        once no copy reads those blocks any more. Nothing is waited for before the forward,
        except with NIXL (below). A send whose connection is still being made wrote nothing:
        it is added and revoked at once when the connection is up (`_retire`), so its decode
        rank gets its fence all the same."""
        for st in self._legs(rid):
            self._preempted_leg(rid, st)
            del self._send[(rid, st.decode_rank)]
            if st.error is None or st.added:
                self._retired.append(st)  # (a send that failed before leaves its sender the same way)
        self._reqs.pop(rid, None)
        self._bare.pop(rid, None)

    def _preempted_leg(self, rid: str, st: _Send) -> None:
        if st.error is not None:
            return
        self.tally.add("preempted_resends", 1)
        if not st.added or st.peer is None:  # connecting: nothing was written; revoked once added
            return
        logger.info(
            "kvferry: prefill request %s (transfer %s): preempted by the prefill engine; revoked, sent again once"
            " computed again",
            rid,
            st.spec.transfer,
        )
        # The revoke takes effect at once (local state): its backlogged writes are dropped,
        # and every copy still queued or running has its notices dropped when it ends,
        # judged after its copy into the ring (or the receiver's pool) finished, so no
        # decode request completes with blocks read after this step's forward overwrote
        # them; its fence follows those copies, and the decode side expects the request
        # again (a new epoch) only then. So nothing is waited for, except with a transport
        # whose writes carry their notices (NIXL: the notification leaves with the write,
        # reading the blocks as it goes): there, the writes reading the blocks now, within
        # fence_timeout_s.
        carries = st.peer.sender.transport.carries_notices
        for kv in self._kv_ids(st):
            try:
                st.peer.hook.cancel(kv, timeout=self.config.fence_timeout_s if carries else 0.0)
            except TransferTimeoutError as err:
                # Revoked; its copies' notices are dropped; it leaves at a later step (`_retire`).
                if carries:
                    logger.error("kvferry: %s", err)
            except UnknownRequestError:
                pass

    def _retire(self) -> None:
        """The preempted sends whose copies all ended leave their senders (then the request
        may be added again, under its new epoch). One preempted while its connection was
        being made is added once it is up, and revoked at once: its fence reaches its decode
        rank as any preempted send's (a connection that failed gave it up, `_adopt`)."""
        for st in list(self._retired):
            if not st.added:
                if st.error is not None:
                    self._retired.remove(st)  # its connection failed: given up, the decode side told
                    continue
                if st.address in self._connecting:
                    continue
                peer = self._ready_peer(st.address, st.pool, st.heads)
                if peer is None:
                    continue
                try:
                    add_groups(peer.hook, self.common.groups, st.kv_id, st.spec.prompt_len, st.spec.reused_len,
                               st.destination)  # fmt: skip
                except KvFerryError as err:
                    self._retired.remove(st)
                    self._give_up(st, f"cannot send to the decode server: {err}")
                    continue
                st.peer, st.added = peer, True
            try:
                reading = self._still_reading(st)
            except TransferError:  # its sender lost its peer: nothing reads its blocks any more
                reading = False
            if not reading:
                self._retired.remove(st)

    def _still_reading(self, st: _Send) -> bool:
        """Cancels each of an added send's kvferry requests in its sender (no wait); whether
        a copy still reads its blocks (call again at a later step). A request cancelled by an
        earlier call, or never added, is passed over."""
        assert st.peer is not None
        reading = False
        for kv in self._kv_ids(st):
            try:
                st.peer.hook.cancel(kv, timeout=0.0)
            except TransferTimeoutError:
                reading = True
            except UnknownRequestError:
                pass
        return reading

    def _retiring(self, st: _Send) -> bool:
        """Whether an earlier, preempted send of the same kvferry request to the same
        endpoint is still in its sender: the new one waits for it to leave."""
        return any(old.address == st.address and old.kv_id == st.kv_id for old in self._retired)

    def _call(self, st: _Send, fn: Callable[..., Any], *args: Any) -> None:
        if st.error is not None:
            return
        try:
            fn(*args)
        except KvFerryError as err:
            self._failed(st, err)

    def _failed(self, st: _Send, err: KvFerryError) -> None:
        st.error = str(err)
        logger.error("kvferry: prefill request %s (transfer %s) failed: %s", st.spec.req_id, st.spec.transfer, err)

    def _kv_ids(self, st: _Send) -> list[int]:
        return self.common.groups.kv_ids(st.kv_id)

    def _by_kv(self) -> dict[tuple[int, int], _Send]:
        return {(id(st.peer), kv): st for st in self._send.values() if st.peer is not None for kv in self._kv_ids(st)}

    def _poll_peers(self) -> None:
        by_kv = self._by_kv()
        for peer in [*self._peers.values(), *self._dead]:
            try:
                peer.hook.poll()
            except TransferError as err:
                for kv in err.request_ids or ():
                    st = by_kv.get((id(peer), kv))
                    if st is not None and st.error is None:
                        st.error = str(err)
                        logger.error(
                            "kvferry: prefill request %s (transfer %s) failed: %s",
                            st.spec.req_id,
                            st.spec.transfer,
                            err,
                        )
            try:
                peer.sender.check_peer()
            except TransferError as err:
                if not peer.lost:
                    peer.lost = True
                    logger.error("kvferry: %s", err)
            self._take_records(peer, by_kv)
        for address, peer in list(self._peers.items()):
            if peer.lost:
                self._dead.append(self._peers.pop(address))

    def _take_records(self, peer: _Peer, by_kv: dict[tuple[int, int], _Send]) -> None:
        """Tallies the records of the peer's posted writes (the sender's announcer appends
        them from its own thread, so a settle takes them again before it reports)."""
        records = peer.sender.records
        if not records:
            return
        n = len(records)
        batch, records[:n] = records[:n], []
        for rec in batch:
            for notice in rec.notices:
                st = by_kv.get((id(peer), notice.request_id))
                if st is None:
                    continue
                pool = peer.pool
                lo, hi = (0, pool.num_layers) if notice.groups == 1 else pool.group_layers(notice.group, notice.groups)
                nbytes = (notice.end - notice.start) * pool.block_bytes * (hi - lo)
                st.writes.append((rec.kind, rec.submitted, rec.finished, nbytes))
                self.trace.write(
                    "prefill", st.spec.transfer, st.spec.req_id, rec.kind, notice, nbytes, rec.submitted, rec.finished
                )
                self.tally.add(
                    {"early": "early_issued_bytes", "chunk": "chunk_bytes", "layer": "layer_bytes"}[rec.kind], nbytes
                )
                # Taken before the first forward ended (no stamp yet): it landed before it, too.
                if rec.kind == "early" and (st.first_forward_done is None or rec.finished <= st.first_forward_done):
                    self.tally.add("early_landed_bytes", nbytes)

    def _settle_send(self, st: _Send, by_kv: dict[tuple[int, int], _Send], failures: dict[int, TransferError]) -> bool:
        """A finished prefill request: True once no write reads its blocks any more (vLLM
        may then free them)."""
        if not st.added or st.peer is None:
            if st.error is None:
                return False  # its connection is being made (bounded by its handshake timeout)
            self.common.ended("prefill", st.spec.transfer, st.spec.req_id, "failed", st.error)
            return True
        hook, sender, kvs = st.peer.hook, st.peer.sender, self._kv_ids(st)
        failure = next((failures[kv] for kv in kvs if kv in failures), None) if st.error is None else None
        if failure is not None:
            st.error = str(failure)
        if st.error is None and not all(sender.book.is_complete(kv) for kv in kvs):
            st.error = "the prefill request ended before all its blocks were sent (aborted)"
        if st.error is not None:
            if self._still_reading(st):
                return False  # a copy still reads its blocks: next step
            self.tally.add("failed_transfers", 1)
            logger.warning(
                "kvferry: prefill request %s (transfer %s) released without completing: %s",
                st.spec.req_id,
                st.spec.transfer,
                st.error,
            )
            self.common.ended("prefill", st.spec.transfer, st.spec.req_id, "failed", st.error)
            return True
        if any(sender.in_flight(kv) for kv in kvs):
            return False
        # Its last write was posted after this step's poll took the records: take them now,
        # or its bytes would be missing from the tally and its hidden fraction.
        self._take_records(st.peer, by_kv)
        for kv in kvs:
            hook.finish(kv)
        self._observe(st)
        last = max((w[2] for w in st.writes), default=time.monotonic())
        nbytes = sum(w[3] for w in st.writes)
        self.common.ended("prefill", st.spec.transfer, st.spec.req_id, "done", nbytes=nbytes, t=self.trace.wall(last))
        return True

    def _observe(self, st: _Send) -> None:
        if not st.writes:
            return
        total = sum(b for *_, b in st.writes)
        end = st.forward_done if st.forward_done is not None else max(f for _, _, f, _ in st.writes)
        hidden = sum(b for _, _, f, b in st.writes if f <= end)
        self.tally.observe("transfer_seconds", max(f for _, _, f, _ in st.writes) - min(s for _, s, _, _ in st.writes))
        self.tally.observe("hidden_fraction", hidden / total if total else 1.0)
        self.tally.add("transfers", 1)

    def _drop_dead_peers(self) -> None:
        live = {id(st.peer) for st in [*self._send.values(), *self._retired]}
        for peer in list(self._dead):
            if id(peer) not in live:
                self._dead.remove(peer)
                self._bg.submit(self._close_sender, peer)  # joins its threads: not on this one

    def _close_sender(self, peer: _Peer) -> None:
        try:
            peer.sender.close()
        except Exception as err:  # the receiver is gone: nothing to tell it
            logger.debug("kvferry: closing the sender of %s: %r", peer.address, err)

    def close(self) -> None:
        self._bg.shutdown(wait=True)  # connections under way end (made or failed), abandons sent
        self._client.close()
        for future in self._connecting.values():
            if future.exception() is None:
                self._dead.append(future.result())
        self._connecting.clear()
        for peer in [*self._peers.values(), *self._dead]:
            self._close_sender(peer)
        self._peers.clear()
        self._dead.clear()
