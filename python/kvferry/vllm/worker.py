"""The worker half of `KvferryConnector`: kvferry's sender (prefill) and receiver (decode)
over vLLM's KV tensors.

```
prefill step:  bind_connector_metadata: add new sends (TransferHook.add_request), then
                 TransferHook.before_forward for each first chunk  (the early send)
               forward: save_kv_layer -> TransferHook.after_layer on the last chunk (layer groups)
               wait_for_save: TransferHook.after_forward for each chunk, poll
               get_transfer_results: a finished request whose writes all landed -> finished_sending
decode step:   bind_connector_metadata: KVReceiver.expect each new request, publish its destination
               get_transfer_results: every block arrived -> finished_recving; failed, aborted,
                 timed out or abandoned -> cancelled, released once fenced -> finished_recving
                 (+ failed_recving unless it was aborted)
```
Every kvferry call is made per request: one request's failure (its peer gone, a refused
write) fails that request and leaves the others' sends running.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvferry._core import BlockRange
from kvferry.errors import KvFerryError, TransferError, TransferTimeoutError, UnknownRequestError
from kvferry.hook import TransferHook
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.trace import Tracer
from kvferry.transports import registry, wire
from kvferry.vllm import rendezvous
from kvferry.vllm.config import ConnectorConfig
from kvferry.vllm.metadata import Chunk, Handshake, KvferryMetadata, KvferryWorkerMeta, Outcome, RecvSpec, SendSpec
from kvferry.vllm.stats import Tally

logger = logging.getLogger("kvferry.vllm")

# Endpoints a decode worker makes, one per prefill engine (a staging one holds a ring of
# ``staging_bytes``): a bound on what lookups can make it allocate.
MAX_PREFILL_ENGINES = 64


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
    writes: list[tuple[str, float, float, int]] = field(default_factory=list)  # kind, submitted, finished, bytes


@dataclass
class _Recv:
    spec: RecvSpec
    started: float
    deadline: float
    giving_up: Optional[str] = None
    aborted: bool = False
    fence_deadline: float = 0.0
    kept_logged: bool = False  # nixl: logged once that its blocks are kept past the fence timeout


def _writable(t: torch.Tensor) -> torch.Tensor:
    """vLLM allocates its KV cache under ``torch.inference_mode``; kvferry's copy threads run
    outside it, where an in-place write into an inference tensor is refused. On the CPU the
    same memory is taken as a plain tensor (no copy)."""
    if not t.is_inference():
        return t
    if t.device.type != "cpu":
        raise KvFerryError(f"kvferry: KV cache on {t.device} is an inference tensor; this version handles CPU caches")
    return torch.from_numpy(t.numpy())


class WorkerSide:
    def __init__(self, config: ConnectorConfig, *, block_size: int, num_blocks: int, role: str, authkey: bytes) -> None:
        self.config = config
        # The control channel's key, read at startup (config.load_authkey): the same file on
        # both servers; it never travels in a request, an answer, a log line or a metric.
        self.authkey = authkey
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.role = role
        self.engine = secrets.token_hex(8)
        self.trace = Tracer(config.trace, engine=self.engine)  # one JSON line per stage, when on
        self.pool: Optional[PagedKV] = None
        self.layer_of: dict[str, int] = {}
        self.tally = Tally()
        # decode
        self.receiver: Optional[KVReceiver] = None
        # One endpoint (staging: one ring, one writer) per prefill engine, made on its first lookup.
        self.endpoints: dict[str, registry.Served] = {}
        self._endpoints_lock = threading.Lock()
        self._ring_blocks = 0
        self.rendezvous: Optional[rendezvous.Rendezvous] = None
        self._recv: dict[str, _Recv] = {}
        self._fail_next: dict[str, tuple[Optional[str], str]] = {}  # req_id -> (transfer, reason)
        self._refused_seen = 0
        # prefill
        self._peers: dict[str, _Peer] = {}
        self._dead: list[_Peer] = []
        self._send: dict[str, _Send] = {}
        self._chunks: list[Chunk] = []
        # How transfers ended since the last step's report (both sides), for the scheduler
        # half's ``status`` answers.
        self._outcomes: list[Outcome] = []

    # -- setup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layer_index: Callable[[str], int]) -> None:
        names = sorted(kv_caches, key=layer_index)
        tensors = tuple(_writable(kv_caches[n]) for n in names)
        shape = tuple(tensors[0].shape)
        # CPU: (blocks, heads, block_size, 2 * head_dim); CUDA: (2, blocks, ...).
        block_dim = 0 if shape[0] == self.num_blocks else 1
        if shape[block_dim] != self.num_blocks:
            raise KvFerryError(f"kvferry: KV cache tensors of shape {shape} have no dimension of {self.num_blocks} blocks")
        self.pool = PagedKV(tensors, self.block_size, block_dim)
        self.layer_of = {n: i for i, n in enumerate(names)}
        if self.config.layer_groups > self.pool.num_layers:
            raise KvFerryError(f"invalid kv_connector_extra_config layer_groups={self.config.layer_groups}: the model has {self.pool.num_layers} layers")
        if self.role in ("kv_consumer", "kv_both"):
            with torch.inference_mode(False):  # the ring is written by kvferry's own threads
                self._start_decode_side()

    def _start_decode_side(self) -> None:
        assert self.pool is not None
        self.receiver = KVReceiver(self.pool)
        self._ring_blocks = max(2, self.config.staging_bytes // (self.pool.block_bytes * self.pool.num_layers))
        self.rendezvous = rendezvous.Rendezvous(self.authkey, self._endpoint_for, self.config.rendezvous_dir, listen=self.config.listen, advertise=self.config.advertise)
        logger.info("kvferry: decode rendezvous %s (transport %s)", self.rendezvous.address, self.config.transport)

    def _endpoint_options(self) -> dict[str, Any]:
        """Where an endpoint listens: ``unix://`` beside the rendezvous, or on the
        rendezvous's tcp:// host with a port of its own."""
        where = wire.parse_address(self.config.listen, "kv_connector_extra_config listen")
        options: dict[str, Any] = {}
        if where.scheme == "tcp":
            options["address"] = wire.Address("tcp", host=where.host).url()  # port 0: any
            if self.config.advertise is not None:
                options["advertise"] = self.config.advertise
        if self.config.transport == "staging":
            options["capacity_blocks"] = self._ring_blocks
        return options

    def _endpoint_for(self, sender: str) -> str:
        """The URL of prefill engine ``sender``'s endpoint (called on the rendezvous thread)."""
        with self._endpoints_lock:
            endpoint = self.endpoints.get(sender)
            if endpoint is None:
                if len(self.endpoints) >= MAX_PREFILL_ENGINES:
                    raise KvFerryError(f"already {len(self.endpoints)} prefill engines, the most this decode server serves")
                assert self.receiver is not None
                with torch.inference_mode(False):  # a staging ring is written by kvferry's threads
                    endpoint = registry.serve(self.config.transport, self.receiver, authkey=self.authkey, **self._endpoint_options())
                self.endpoints[sender] = endpoint
                logger.info("kvferry: endpoint %s for prefill engine %s", endpoint.url, sender)
            return endpoint.url

    def handshake(self) -> Optional[Handshake]:
        if self.rendezvous is None:
            return None
        return Handshake(self.engine, self.rendezvous.address)

    # -- per step ------------------------------------------------------------------------

    def bind(self, meta: KvferryMetadata) -> None:
        for rid in meta.preempted:
            self._preempted(rid)
        for spec in meta.recvs:
            self._expect(spec)
        for rid, reason in meta.fails:
            self._fail_next[rid] = (None, reason)  # refused by the scheduler half, which keeps the reason
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
        layer = self.layer_of.get(layer_name)
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
            if c.end == st.spec.prompt_len:
                st.forward_done = time.monotonic()
        self._chunks = []
        self._poll_peers()

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this step."""
        sending: set[str] = set()
        for rid in finished_req_ids:
            if rid in self._send:
                self._send[rid].finishing = True
        self._poll_peers()
        for rid, st in list(self._send.items()):
            if st.finishing and self._settle_send(st):
                del self._send[rid]
                sending.add(rid)
        self._drop_dead_peers()
        recving, failed = self._settle_recvs(finished_req_ids)
        return sending, recving, failed

    # -- prefill -------------------------------------------------------------------------

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None and not peer.lost:
            return peer
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
                             reused=spec.reused_len, blocks=st.blocks, held=int(dest["held_blocks"]))
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

    def _poll_peers(self) -> None:
        by_kv = {(id(st.peer), st.kv_id): st for st in self._send.values() if st.peer is not None}
        for peer in [*self._peers.values(), *self._dead]:
            try:
                peer.hook.poll()
            except TransferError as err:
                for kv in err.request_ids or ():
                    st = by_kv.get((id(peer), kv))
                    if st is not None and st.error is None:
                        st.error = str(err)
                        logger.error("kvferry: prefill request %s (transfer %s) failed: %s", st.spec.req_id, st.spec.transfer, err)
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
                lo, hi = (0, self.pool.num_layers) if notice.groups == 1 else self.pool.group_layers(notice.group, notice.groups)
                nbytes = (notice.end - notice.start) * self.pool.block_bytes * (hi - lo)
                st.writes.append((rec.kind, rec.submitted, rec.finished, nbytes))
                self.trace.write("prefill", st.spec.transfer, st.spec.req_id, rec.kind, notice, nbytes,
                                 rec.submitted, rec.finished)
                self.tally.add({"early": "early_bytes", "chunk": "chunk_bytes", "layer": "layer_bytes"}[rec.kind], nbytes)

    def _settle_send(self, st: _Send) -> bool:
        """A finished prefill request: True once no write reads its blocks any more (vLLM
        may then free them)."""
        if not st.added or st.peer is None:
            self._outcomes.append(Outcome(st.spec.transfer, "failed", st.error or "it never started sending"))
            self.trace.ended("prefill", st.spec.transfer, st.spec.req_id, st.error or "it never started sending")
            self.tally.fail(st.error or "it never started sending")
            return True
        hook, sender, kv = st.peer.hook, st.peer.sender, st.kv_id
        if st.error is None and kv in sender.failures():
            st.error = str(sender.failures()[kv])
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
            logger.warning("kvferry: prefill request %s (transfer %s) released without completing: %s", st.spec.req_id, st.spec.transfer, st.error)
            self._outcomes.append(Outcome(st.spec.transfer, "failed", st.error))
            self.trace.ended("prefill", st.spec.transfer, st.spec.req_id, st.error)
            self.tally.fail(st.error)
            return True
        if sender.in_flight(kv):
            return False
        # Its last write was posted after this step's poll took the records: take them now,
        # or its bytes would be missing from the tally and its hidden fraction.
        self._take_records(st.peer, {(id(p.peer), p.kv_id): p for p in self._send.values() if p.peer is not None})
        hook.finish(kv)
        self._observe(st)
        self._outcomes.append(Outcome(st.spec.transfer, "done"))
        last = max((w[2] for w in st.writes), default=time.monotonic())
        self.trace.ended("prefill", st.spec.transfer, st.spec.req_id, nbytes=sum(w[3] for w in st.writes),
                         t=self.trace.wall(last))
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

    # -- decode --------------------------------------------------------------------------

    def _expect(self, spec: RecvSpec) -> None:
        assert self.receiver is not None and self.rendezvous is not None
        now = time.monotonic()
        try:
            held = [BlockRange(0, spec.held_blocks)] if spec.held_blocks else []
            # The lease names the request's blocks: a notice whose write used others is refused.
            blocks = spec.dst_blocks[: -(-spec.prompt_len // self.block_size)]
            epoch = self.receiver.expect(spec.kv_id, spec.prompt_len, held=held, dst_blocks=blocks)
        except KvFerryError as err:
            self._fail_next[spec.req_id] = (spec.transfer, f"cannot expect its blocks: {err}")
            return
        destination = {
            "request_id": spec.kv_id,
            "epoch": epoch,
            "prompt_len": spec.prompt_len,
            "digest": spec.digest,
            "block_size": self.block_size,
            "dst_blocks": spec.dst_blocks,
            "held_blocks": spec.held_blocks,
            "engine": self.engine,
        }
        try:
            self.rendezvous.publish(spec.transfer, destination)
        except TransferError as err:
            self.receiver.release_unfenced(spec.kv_id)  # never handed out: nothing writes it
            self._fail_next[spec.req_id] = (spec.transfer, str(err))
            return
        self._recv[spec.req_id] = _Recv(spec, now, now + spec.timeout_s)
        self.trace.event("decode", "plan", spec.transfer, spec.req_id, prompt=spec.prompt_len,
                         reused=spec.held_blocks * self.block_size, blocks=len(blocks), held=spec.held_blocks)

    def _settle_recvs(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        recving, failed = set(), set()
        for rid, (transfer, reason) in self._fail_next.items():
            logger.error("kvferry: request %s failed: %s", rid, reason)
            recving.add(rid)
            failed.add(rid)
            if transfer is not None:
                self._outcomes.append(Outcome(transfer, "failed", reason))
                self.trace.ended("decode", transfer, rid, reason)
            self.tally.fail(reason)
        self._fail_next.clear()
        if self.receiver is None or self.rendezvous is None:
            return recving, failed
        refused = self.receiver.refused_count
        self.tally.add("duplicates_refused", refused - self._refused_seen)
        self._refused_seen = refused
        now = time.monotonic()
        for rid, st in list(self._recv.items()):
            kv = st.spec.kv_id
            if st.giving_up is None:
                if rid in finished_req_ids:
                    self._give_up(st, "the decode request was aborted", now, aborted=True)
                elif (why := self.rendezvous.abandoned(st.spec.transfer)) is not None:
                    self._give_up(st, f"the prefill side gave up: {why}", now)
                elif now > st.deadline:
                    self._give_up(st, f"its blocks did not all arrive within {st.spec.timeout_s} s", now)
                else:
                    try:
                        self.receiver.wait(kv, 0)
                    except TransferTimeoutError:
                        continue  # still arriving
                    except TransferError as err:
                        self._give_up(st, str(err), now)
                    else:
                        self.receiver.release(kv, 0)
                        self.rendezvous.withdraw(st.spec.transfer, "its blocks arrived")
                        self.tally.observe("recv_seconds", now - st.started)
                        del self._recv[rid]
                        recving.add(rid)
                        self._outcomes.append(Outcome(st.spec.transfer, "done"))
                        arrived = -(-st.spec.prompt_len // self.block_size) - st.spec.held_blocks
                        all_layers = self.receiver.pool.block_bytes * self.receiver.pool.num_layers  # one block's bytes
                        self.trace.ended("decode", st.spec.transfer, rid, nbytes=arrived * all_layers)
                        continue
            if not self._release(st, now):
                continue
            del self._recv[rid]
            recving.add(rid)
            self._outcomes.append(Outcome(st.spec.transfer, "aborted" if st.aborted else "failed", st.giving_up))
            self.trace.ended("decode", st.spec.transfer, rid, st.giving_up or "given up")
            self.tally.fail(st.giving_up or "given up")
            if not st.aborted:
                failed.add(rid)
                logger.error("kvferry: decode request %s (transfer %s) failed: %s", rid, st.spec.transfer, st.giving_up)
        return recving, failed

    def outcomes(self) -> Optional[KvferryWorkerMeta]:
        """The transfers settled since the last call (vLLM hands them to the scheduler half
        with this step's output), or ``None``."""
        if not self._outcomes:
            return None
        meta, self._outcomes = KvferryWorkerMeta(self._outcomes), []
        return meta

    def _give_up(self, st: _Recv, reason: str, now: float, aborted: bool = False) -> None:
        assert self.receiver is not None
        st.giving_up, st.aborted = reason, aborted
        st.fence_deadline = now + self.config.fence_timeout_s
        self.receiver.cancel(st.spec.kv_id, reason)  # asks its sender to stop (no-op once fenced)

    def _sender_connected(self, transfer: str) -> bool:
        """Whether the prefill engine that took ``transfer`` still has a connection to its
        endpoint here (one endpoint per prefill engine, so its connection is that engine's)."""
        sender = self.rendezvous.taker(transfer) if self.rendezvous is not None else None
        served = self.endpoints.get(sender) if sender is not None else None
        if served is None:
            return False
        endpoint = served.endpoint
        with endpoint._lock:  # kvferry.transports.control.LocalEndpoint: its authenticated peers
            return any(p.channel is not None for p in endpoint._peers)

    def _release(self, st: _Recv, now: float) -> bool:
        """Releases a request given up on once its sender fenced it. Past the fence timeout:
        staging releases at once (its endpoint applies a write only for a request it still
        admits, so a late write of a released request never reaches vLLM's blocks); nixl
        writes are one-sided and nothing here can stop a late one, so its blocks stay
        allocated (the request stays unreported, vLLM keeps them) until the fence comes or
        the sender's connection ends."""
        assert self.receiver is not None and self.rendezvous is not None
        if self.rendezvous.withdraw_untaken(st.spec.transfer, st.giving_up or "given up"):
            self.receiver.release_unfenced(st.spec.kv_id)  # no sender ever learnt its blocks
            return True
        try:
            self.receiver.release(st.spec.kv_id, 0)
        except TransferTimeoutError:
            if now < st.fence_deadline:
                return False
            if self.config.transport == "nixl" and self._sender_connected(st.spec.transfer):
                if not st.kept_logged:
                    st.kept_logged = True
                    logger.error(
                        "kvferry: decode request %s (transfer %s): no fence from its sender within %s s; its blocks stay allocated until the fence or the sender's connection ends (NIXL writes are one-sided)",
                        st.spec.req_id, st.spec.transfer, self.config.fence_timeout_s,
                    )  # fmt: skip
                return False
            logger.warning("kvferry: decode request %s: no fence from its sender within %s s; released", st.spec.req_id, self.config.fence_timeout_s)
            self.receiver.release_unfenced(st.spec.kv_id)
        self.rendezvous.withdraw(st.spec.transfer, st.giving_up or "given up")
        return True

    def close(self) -> None:
        for peer in [*self._peers.values(), *self._dead]:
            try:
                peer.sender.close()
            except Exception as err:
                logger.debug("kvferry: closing the sender of %s: %r", peer.address, err)
        self._peers.clear()
        self._dead.clear()
        for endpoint in self.endpoints.values():
            endpoint.close()
        if self.rendezvous is not None:
            self.rendezvous.close()
        self.trace.close()
