"""The prefill worker of `KvferryConnector` (kvferry.vllm.worker draws both roles): one
kvferry `KVSender` per decode server it sends to, fed chunk by chunk from vLLM's steps."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvferry._core import BlockRange
from kvferry.errors import KvFerryError, TransferError, TransferTimeoutError, UnknownRequestError
from kvferry.hook import TransferHook
from kvferry.sender import KVSender
from kvferry.transports import registry
from kvferry.vllm import rendezvous
from kvferry.vllm.metadata import Chunk, KvferryMetadata, SendSpec
from kvferry.vllm.worker import WorkerCommon

logger = logging.getLogger("kvferry.vllm")


@dataclass
class _Peer:
    """One decode server this prefill worker sends to: one sender (one receiver per sender)."""

    address: str
    sender: KVSender
    hook: TransferHook
    lost: bool = False


@dataclass
class _Send:
    spec: SendSpec
    kv_id: int
    peer: Optional[_Peer]
    blocks: int
    added: bool = False
    early_done: bool = False
    finishing: bool = False
    error: Optional[str] = None
    forward_done: Optional[float] = None  # when the last chunk's forward ended
    first_forward_done: Optional[float] = None  # when the first chunk's forward ended (early writes landed by then?)
    writes: list[tuple[str, float, float, int]] = field(default_factory=list)  # kind, submitted, finished, bytes


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
        self._send: dict[str, _Send] = {}
        self._chunks: list[Chunk] = []
        self._released: list[tuple[str, str, str]] = []  # finished requests whose destination never came

    @property
    def pool(self) -> Any:
        return self.common.pool

    # -- per step ------------------------------------------------------------------------

    def preempt(self, meta: KvferryMetadata) -> None:
        """First thing of a step, before the forward that may overwrite preempted blocks."""
        for rid in meta.preempted:
            self._preempted(rid)

    def bind(self, meta: KvferryMetadata) -> None:
        self._released.extend(meta.releases)
        for send in meta.sends:
            self._add_send(send)
        self._chunks = [c for c in meta.chunks if c.req_id in self._send and self._send[c.req_id].added]
        for c in self._chunks:
            st = self._send[c.req_id]
            peer = st.peer
            assert peer is not None
            self._call(st, peer.hook.update_src_blocks, st.kv_id, c.src_blocks[: st.blocks])
            if not st.early_done:
                st.early_done = True
                reused_blocks = st.spec.reused_len // self.block_size
                self.trace.event("prefill", "early_issued", st.spec.transfer, c.req_id, blocks=reused_blocks)
                self._call(st, peer.hook.before_forward, [st.kv_id])

    def save_layer(self, layer_name: str) -> None:
        if self.config.layer_groups == 1 or not self._chunks:
            return
        layer = self.common.layer_of.get(layer_name)
        if layer is None:
            return
        for c in self._chunks:
            st = self._send[c.req_id]
            if c.end == st.spec.prompt_len and st.peer is not None:
                self._call(st, st.peer.hook.after_layer, [st.kv_id], [c.start], [c.end], layer)

    def after_forward(self) -> None:
        for c in self._chunks:
            st = self._send[c.req_id]
            assert st.peer is not None
            self.trace.chunk("prefill", st.spec.transfer, c.req_id, c.start, c.end)
            self._call(st, st.peer.hook.after_forward, [st.kv_id], [c.start], [c.end])
            if st.first_forward_done is None:
                st.first_forward_done = time.monotonic()
            if c.end == st.spec.prompt_len:
                st.forward_done = time.monotonic()
        self._chunks = []
        self._poll_peers()

    def results(self, finished_req_ids: set[str]) -> set[str]:
        """This step's finished_sending."""
        sending: set[str] = set()
        for rid, transfer, why in self._released:  # nothing was sent: vLLM may free the blocks
            self.common.ended("prefill", transfer, rid, "failed", why)
            sending.add(rid)
        self._released = []
        for rid in finished_req_ids:
            if rid in self._send:
                self._send[rid].finishing = True
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
                    del self._send[st.spec.req_id]
                    sending.add(st.spec.req_id)
        self._drop_dead_peers()
        return sending

    # -- sends ---------------------------------------------------------------------------

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None and not peer.lost:
            try:
                # The endpoint may have closed the connection since its last use (an idle
                # place reclaimed for another sender, a restart): a new request gets a new one.
                peer.sender.transport.check_peer()
                return peer
            except TransferError as err:
                peer.lost = True
                logger.info("kvferry: reconnecting to %s: %s", address, err)
                self._dead.append(self._peers.pop(address))
        assert self.pool is not None
        with torch.inference_mode(False):  # its ring view is written by the copy thread
            transport = registry.connect(address, authkey=self.authkey, src=self.pool)
        sender = KVSender(
            self.pool,
            transport,
            pipelined=self.config.early,
            timeout=self.config.transfer_timeout_s,
            record=True,
            progress=True,
            layer_groups=self.config.layer_groups,
        )
        peer = self._peers[address] = _Peer(address, sender, TransferHook(sender))
        return peer

    def _add_send(self, spec: SendSpec) -> None:
        dest = spec.destination
        st = _Send(spec, int(dest["request_id"]), None, math.ceil(spec.prompt_len / self.block_size))
        st.finishing = spec.finished  # a late send: vLLM finished the request already
        self._send[spec.req_id] = st
        try:
            st.peer = self._peer(str(dest["endpoint"]))
            held = [BlockRange(0, int(dest["held_blocks"]))] if dest["held_blocks"] else []
            st.peer.hook.add_request(
                st.kv_id,
                spec.prompt_len,
                reused_len=spec.reused_len,
                src_blocks=np.full(st.blocks, -1, dtype=np.int64),
                dst_blocks=dest["dst_blocks"],
                held=held,
                epoch=int(dest["epoch"]),
            )
            st.added = True
            self.tally.add("held_blocks", int(dest["held_blocks"]))
            self.trace.event("prefill", "plan", spec.transfer, spec.req_id, prompt=spec.prompt_len,
                             reused=spec.reused_len, blocks=st.blocks, held=int(dest["held_blocks"]))  # fmt: skip
        except KvFerryError as err:
            st.error = f"cannot send to the decode server: {err}"
            logger.error("kvferry: prefill request %s (transfer %s): %s", spec.req_id, spec.transfer, st.error)
            try:
                rendezvous.abandon(spec.peer, self.authkey, spec.transfer, st.error)
            except KvFerryError as why:
                logger.warning("kvferry: %s", why)

    def _preempted(self, rid: str) -> None:
        """vLLM preempted a prefill request: its blocks are free and this step's forward may
        overwrite them. Its transfer is given up (the decode side is told and fails it), and
        this waits, before the forward, until no copy reads those blocks any more."""
        st = self._send.get(rid)
        if st is None or not st.added or st.peer is None or st.error is not None:
            return
        st.error = "preempted by the prefill engine (its blocks were freed): the transfer is given up"
        logger.error("kvferry: prefill request %s (transfer %s): %s", rid, st.spec.transfer, st.error)
        try:
            st.peer.hook.cancel(st.kv_id, timeout=self.config.fence_timeout_s)
        except TransferTimeoutError as err:
            # Its decode request is revoked: the staging endpoint will not apply those writes.
            logger.error("kvferry: %s", err)
        except UnknownRequestError:
            pass

    def _call(self, st: _Send, fn: Callable[..., Any], *args: Any) -> None:
        if st.error is not None:
            return
        try:
            fn(*args)
        except KvFerryError as err:
            st.error = str(err)
            logger.error("kvferry: prefill request %s (transfer %s) failed: %s", st.spec.req_id, st.spec.transfer, err)

    def _by_kv(self) -> dict[tuple[int, int], _Send]:
        return {(id(st.peer), st.kv_id): st for st in self._send.values() if st.peer is not None}

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
                peer.sender.transport.check_peer()
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
                assert self.pool is not None
                lo, hi = (
                    (0, self.pool.num_layers)
                    if notice.groups == 1
                    else self.pool.group_layers(notice.group, notice.groups)
                )
                nbytes = (notice.end - notice.start) * self.pool.block_bytes * (hi - lo)
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
            self.common.ended(
                "prefill", st.spec.transfer, st.spec.req_id, "failed", st.error or "it never started sending"
            )
            return True
        hook, sender, kv = st.peer.hook, st.peer.sender, st.kv_id
        failure = failures.get(kv) if st.error is None else None
        if failure is not None:
            st.error = str(failure)
        if st.error is None and not sender.book.is_complete(kv):
            st.error = "the prefill request ended before all its blocks were sent (aborted)"
        if st.error is not None:
            try:
                hook.cancel(kv, timeout=0.0)
            except TransferTimeoutError:
                return False  # a copy still reads its blocks: next step
            except UnknownRequestError:
                pass
            self.tally.add("failed_transfers", 1)
            logger.warning(
                "kvferry: prefill request %s (transfer %s) released without completing: %s",
                st.spec.req_id,
                st.spec.transfer,
                st.error,
            )
            self.common.ended("prefill", st.spec.transfer, st.spec.req_id, "failed", st.error)
            return True
        if sender.in_flight(kv):
            return False
        # Its last write was posted after this step's poll took the records: take them now,
        # or its bytes would be missing from the tally and its hidden fraction.
        self._take_records(st.peer, by_kv)
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
        live = {id(st.peer) for st in self._send.values()}
        for peer in list(self._dead):
            if id(peer) not in live:
                self._dead.remove(peer)
                try:
                    peer.sender.close()
                except Exception as err:  # the receiver is gone: nothing to tell it
                    logger.debug("kvferry: closing the sender of %s: %r", peer.address, err)

    def close(self) -> None:
        for peer in [*self._peers.values(), *self._dead]:
            try:
                peer.sender.close()
            except Exception as err:
                logger.debug("kvferry: closing the sender of %s: %r", peer.address, err)
        self._peers.clear()
        self._dead.clear()
