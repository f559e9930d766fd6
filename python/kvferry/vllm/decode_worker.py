"""The decode worker of `KvferryConnector` (kvferry.vllm.worker draws both roles): one
kvferry `KVReceiver` over vLLM's KV tensors, a rendezvous where prefill engines look up each
request's destination, and one endpoint per prefill engine."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvferry.errors import KvFerryError, TransferError, TransferTimeoutError
from kvferry.receiver import KVReceiver
from kvferry.transports import registry, wire
from kvferry.vllm import rendezvous
from kvferry.vllm.groups import expect_groups
from kvferry.vllm.metadata import Handshake, KvferryMetadata, RecvSpec
from kvferry.vllm.worker import WorkerCommon

logger = logging.getLogger("kvferry.vllm")

# Endpoints a decode worker holds at once, one per prefill engine (a staging one holds a ring
# of ``staging_bytes``): a bound on what lookups can make it allocate. An endpoint is closed
# once no sender is connected to it, no destination it was handed is still taken, and
# ENDPOINT_GRACE_S passed since it was made (the time a prefill engine has to connect after
# its lookup): prefill restarts (a new vLLM engine id each) and made-up sender names free
# theirs. An endpoint is made only for a lookup that took a destination, and at the bound the
# oldest idle one (no connection, no destination taken) is closed at once, grace or not, so only
# 64 engines connected or holding a destination at once can reach the bound.
MAX_PREFILL_ENGINES = 64
ENDPOINT_GRACE_S = 30.0


@dataclass
class _Recv:
    spec: RecvSpec
    started: float
    deadline: float
    giving_up: Optional[str] = None
    aborted: bool = False
    fence_deadline: float = 0.0
    # The prefill side abandoned it: it does so only for a request its worker never wrote
    # (kvferry.vllm.rendezvous, "abandon"), so no late write can come and no fence is due.
    unwritten: bool = False
    kept_logged: bool = False  # one-sided writes: logged once that its blocks are kept past the fence timeout
    released: set[int] = field(default_factory=set)  # its groups' kv ids the receiver already forgot


class DecodeWorker:
    def __init__(self, common: WorkerCommon) -> None:
        self.common = common
        self.config = common.config
        self.authkey = common.authkey
        self.block_size = common.block_size
        self.tally = common.tally
        self._spec = registry.spec(self.config.transport)
        self.engine = common.engine
        self.receiver: Optional[KVReceiver] = None
        # One endpoint (staging: one ring, one writer) per prefill engine, made on its first lookup.
        self.endpoints: dict[str, registry.Served] = {}
        self._endpoints_lock = threading.Lock()
        self._made: dict[str, float] = {}  # sender -> when its endpoint was made (monotonic)
        self._ring_blocks = 0
        self.rendezvous: Optional[rendezvous.Rendezvous] = None
        self._recv: dict[str, _Recv] = {}
        # What `results` looks at, so a step costs O(changes), not one receiver wait per
        # request still arriving: the receiver's settled requests (by kv id), abandoned
        # transfers, due deadlines (a heap; entries of requests gone are skipped), and the
        # requests given up and waiting for their fence.
        self._rid_of_kv: dict[int, str] = {}
        self._rid_of_transfer: dict[str, str] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._look: set[str] = set()  # looked at next step whatever happens (given up, or abandoned early)
        self._refused_seen = self._duplicates_seen = 0

    def start(self) -> None:
        """After `WorkerCommon.register_kv_caches`: the receiver and the rendezvous."""
        pool = self.common.pool
        assert pool is not None
        with torch.inference_mode(False):  # the ring is written by kvferry's own threads
            self.receiver = KVReceiver(pool)
            self._ring_blocks = max(2, self.config.staging_bytes // (pool.block_bytes * pool.num_layers))
            self.rendezvous = rendezvous.Rendezvous(
                self.authkey,
                self._endpoint_for,
                self.config.rendezvous_dir,
                listen=self.config.listen,
                advertise=self.config.advertise,
            )
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
        if self._spec.ring_option is not None:
            options[self._spec.ring_option] = self._ring_blocks
        return options

    def _endpoint_for(self, sender: str) -> str:
        """The URL of prefill engine ``sender``'s endpoint (called on the rendezvous thread,
        once a lookup of ``sender`` took a destination). At the bound, the oldest endpoint
        that no sender is connected to and that holds no taken destination is closed to make
        room, grace or not: only MAX_PREFILL_ENGINES engines really sending can fill it."""
        evicted: Optional[tuple[str, registry.Served]] = None
        try:
            with self._endpoints_lock:
                endpoint = self.endpoints.get(sender)
                if endpoint is not None:
                    return endpoint.url
                if len(self.endpoints) >= MAX_PREFILL_ENGINES:
                    evicted = self._idlest()
                    if evicted is None:
                        raise KvFerryError(
                            f"already {len(self.endpoints)} prefill engines connected or holding a destination, "
                            "the most this decode server serves"
                        )
                assert self.receiver is not None
                with torch.inference_mode(False):  # a staging ring is written by kvferry's threads
                    endpoint = registry.serve(
                        self.config.transport, self.receiver, authkey=self.authkey, **self._endpoint_options()
                    )
                self.endpoints[sender] = endpoint
                self._made[sender] = time.monotonic()
                logger.info("kvferry: endpoint %s for prefill engine %s", endpoint.url, sender)
                return endpoint.url
        finally:
            if evicted is not None:
                evicted[1].close()
                logger.info("kvferry: closed the idle endpoint %s of prefill engine %s (room for %s)",
                            evicted[1].url, evicted[0], sender)  # fmt: skip

    def _idlest(self) -> Optional[tuple[str, registry.Served]]:
        """Takes out (under the endpoints' lock) the oldest endpoint no sender is connected
        to and whose engine holds no destination, or returns ``None`` when there is none."""
        assert self.rendezvous is not None
        busy = self.rendezvous.takers()
        for sender in sorted(self.endpoints, key=self._made.__getitem__):
            served = self.endpoints[sender]
            if sender not in busy and not served.endpoint.connected():
                del self.endpoints[sender], self._made[sender]
                return sender, served
        return None

    def sweep(self, now: float) -> list[str]:
        """Closes the endpoints of prefill engines that went away (see ENDPOINT_GRACE_S);
        returns their senders' names."""
        assert self.rendezvous is not None
        busy = self.rendezvous.takers()
        gone: list[registry.Served] = []
        names: list[str] = []
        with self._endpoints_lock:
            for sender, served in list(self.endpoints.items()):
                if sender in busy or now - self._made[sender] < ENDPOINT_GRACE_S or served.endpoint.connected():
                    continue
                del self.endpoints[sender], self._made[sender]
                gone.append(served)
                names.append(sender)
        for sender, served in zip(names, gone):
            served.close()
            logger.info("kvferry: closed the endpoint %s of prefill engine %s (gone)", served.url, sender)
        return names

    def handshake(self) -> Optional[Handshake]:
        if self.rendezvous is None:
            return None
        return Handshake(self.engine, self.rendezvous.address)

    def bind(self, meta: KvferryMetadata) -> None:
        for spec in meta.recvs:
            self._expect(spec)

    def _expect(self, spec: RecvSpec) -> None:
        assert self.receiver is not None and self.rendezvous is not None
        now = time.monotonic()
        blocks = -(-spec.prompt_len // self.block_size)
        try:
            epoch = expect_groups(self.receiver, self.common.groups, spec.kv_id, spec.prompt_len,
                                  spec.held_blocks, spec.dst_blocks)  # fmt: skip
        except KvFerryError as err:
            self.common.fail_next(spec.req_id, spec.transfer, f"cannot expect its blocks: {err}")
            return
        destination = {
            "request_id": spec.kv_id,
            "epoch": epoch,
            "prompt_len": spec.prompt_len,
            "digest": spec.digest,
            "block_size": self.block_size,
            "dst_blocks": [b for table in spec.dst_blocks for b in table[:blocks]],  # group after group
            "held_blocks": spec.held_blocks,
            "engine": self.engine,
        }
        try:
            self.rendezvous.publish(spec.transfer, destination)
        except TransferError as err:
            for kv in self.common.groups.kv_ids(spec.kv_id):
                self.receiver.release_unfenced(kv)  # never handed out: nothing writes it
            self.common.fail_next(spec.req_id, spec.transfer, str(err))
            return
        self._recv[spec.req_id] = _Recv(spec, now, now + spec.timeout_s)
        for kv in self.common.groups.kv_ids(spec.kv_id):
            self._rid_of_kv[kv] = spec.req_id
        self._rid_of_transfer[spec.transfer] = spec.req_id
        heapq.heappush(self._deadlines, (now + spec.timeout_s, spec.req_id))
        if self.rendezvous.abandoned(spec.transfer) is not None:
            self._look.add(spec.req_id)  # abandoned before it was published: take_abandoned said so already
        self.common.trace.event("decode", "plan", spec.transfer, spec.req_id, prompt=spec.prompt_len,
                                reused=spec.held_blocks * self.block_size, blocks=blocks,
                                held=spec.held_blocks)  # fmt: skip

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        recving: set[str] = set()
        failed: set[str] = set()
        assert self.receiver is not None and self.rendezvous is not None
        refused, duplicates = self.receiver.refused_count, self.receiver.duplicate_count
        self.tally.add("duplicates_refused", duplicates - self._duplicates_seen)
        self.tally.add("notices_refused", (refused - duplicates) - (self._refused_seen - self._duplicates_seen))
        self._refused_seen, self._duplicates_seen = refused, duplicates
        now = time.monotonic()
        for rid in self._to_look(finished_req_ids, now):
            st = self._recv[rid]
            kvs = self.common.groups.kv_ids(st.spec.kv_id)
            if st.giving_up is None:
                if rid in finished_req_ids:
                    self._give_up(st, "the decode request was aborted", now, aborted=True)
                elif (why := self.rendezvous.abandoned(st.spec.transfer)) is not None:
                    self._give_up(st, f"the prefill side gave up: {why}", now)
                    st.unwritten = True
                elif now > st.deadline:
                    self._give_up(st, f"its blocks did not all arrive within {st.spec.timeout_s} s", now)
                else:
                    try:
                        for kv in kvs:  # every group arrived (or one failed: all are given up)
                            self.receiver.wait(kv, 0)
                    except TransferTimeoutError:
                        continue  # still arriving
                    except TransferError as err:
                        self._give_up(st, str(err), now)
                    else:
                        for kv in kvs:
                            self.receiver.release(kv, 0)
                        self.rendezvous.withdraw(st.spec.transfer, "its blocks arrived")
                        self.tally.observe("recv_seconds", now - st.started)
                        self._forget(st)
                        recving.add(rid)
                        arrived = self.common.groups.live_count(st.spec.prompt_len, st.spec.held_blocks)
                        block = self.receiver.pool.block_bytes * self.receiver.pool.num_layers  # all regions
                        self.common.ended("decode", st.spec.transfer, rid, "done", nbytes=arrived * block)
                        continue
            if not self._release(st, now):
                self._look.add(rid)  # given up, its fence not yet come: asked again next step
                continue
            self._forget(st)
            recving.add(rid)
            state = "aborted" if st.aborted else "failed"
            self.common.ended("decode", st.spec.transfer, rid, state, st.giving_up or "given up")
            if not st.aborted:
                failed.add(rid)
                logger.error("kvferry: decode request %s (transfer %s) failed: %s", rid, st.spec.transfer, st.giving_up)
        self.sweep(now)
        return recving, failed

    def _to_look(self, finished_req_ids: set[str], now: float) -> set[str]:
        """The requests this step must look at (see ``__init__``); the others are still
        arriving, with nothing new to report."""
        assert self.receiver is not None and self.rendezvous is not None
        look, self._look = self._look, set()
        look.update(self._rid_of_kv[kv] for kv in self.receiver.take_settled() if kv in self._rid_of_kv)
        look.update(rid for rid in finished_req_ids if rid in self._recv)
        gone = self.rendezvous.take_abandoned()
        look.update(self._rid_of_transfer[t] for t in gone if t in self._rid_of_transfer)
        while self._deadlines and self._deadlines[0][0] < now:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self._recv:
                look.add(rid)
        return {rid for rid in look if rid in self._recv}

    def _forget(self, st: _Recv) -> None:
        del self._recv[st.spec.req_id]
        for kv in self.common.groups.kv_ids(st.spec.kv_id):
            self._rid_of_kv.pop(kv, None)
        if self._rid_of_transfer.get(st.spec.transfer) == st.spec.req_id:
            del self._rid_of_transfer[st.spec.transfer]

    def _give_up(self, st: _Recv, reason: str, now: float, aborted: bool = False) -> None:
        assert self.receiver is not None
        st.giving_up, st.aborted = reason, aborted
        st.fence_deadline = now + self.config.fence_timeout_s
        for kv in self.common.groups.kv_ids(st.spec.kv_id):
            self.receiver.cancel(kv, reason)  # asks its sender to stop (no-op once fenced)

    def _sender_connected(self, transfer: str) -> bool:
        """Whether the prefill engine that took ``transfer`` still has a connection to its
        endpoint here (one endpoint per prefill engine, so its connection is that engine's)."""
        sender = self.rendezvous.taker(transfer) if self.rendezvous is not None else None
        served = self.endpoints.get(sender) if sender is not None else None
        return served is not None and bool(served.endpoint.connected())

    def _release(self, st: _Recv, now: float) -> bool:
        """Releases a request given up on once its sender fenced it. Past the fence timeout:
        staging releases at once (its endpoint applies a write only for a request it still
        admits, so a late write of a released request never reaches vLLM's blocks); nixl
        writes are one-sided and nothing here can stop a late one, so its blocks stay
        allocated (the request stays unreported, vLLM keeps them) until the fence comes or
        the sender's connection ends."""
        assert self.receiver is not None and self.rendezvous is not None
        if self.rendezvous.withdraw_untaken(st.spec.transfer, st.giving_up or "given up"):
            self._release_groups(st, unfenced=True)  # no sender ever learnt its blocks
            return True
        if st.unwritten:
            self._release_groups(st, unfenced=True)  # a sender learnt them, never wrote
            self.rendezvous.withdraw(st.spec.transfer, st.giving_up or "given up")
            return True
        try:
            self._release_groups(st, unfenced=False)
        except TransferTimeoutError:
            if now < st.fence_deadline:
                return False
            if not self._spec.refuses_late_writes and self._sender_connected(st.spec.transfer):
                if not st.kept_logged:
                    st.kept_logged = True
                    logger.error(
                        "kvferry: decode request %s (transfer %s): no fence from its sender within %s s; its blocks"
                        " stay allocated until the fence or the sender's connection ends (its writes are one-sided)",
                        st.spec.req_id,
                        st.spec.transfer,
                        self.config.fence_timeout_s,
                    )
                return False
            logger.warning(
                "kvferry: decode request %s: no fence from its sender within %s s; released",
                st.spec.req_id,
                self.config.fence_timeout_s,
            )
            self._release_groups(st, unfenced=True)
        self.rendezvous.withdraw(st.spec.transfer, st.giving_up or "given up")
        return True

    def _release_groups(self, st: _Recv, *, unfenced: bool) -> None:
        """Releases each KV cache group's kvferry request once (`KVReceiver.release`, or
        `release_unfenced`); raises `TransferTimeoutError` while a group's fence has not come
        (the groups released so far stay released)."""
        assert self.receiver is not None
        for kv in self.common.groups.kv_ids(st.spec.kv_id):
            if kv in st.released:
                continue
            if unfenced:
                self.receiver.release_unfenced(kv)
            else:
                self.receiver.release(kv, 0)
            st.released.add(kv)

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()
        if self.rendezvous is not None:
            self.rendezvous.close()
