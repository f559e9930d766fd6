"""The decode worker of `KvferryConnector` (kvferry.vllm.worker draws both roles): one
kvferry `KVReceiver` over vLLM's KV tensors, a rendezvous where prefill engines look up each
request's destination, and one endpoint per prefill engine.

Tensor parallelism (kvferry.ranks): each decode rank's worker has its own rendezvous (the
hello names every rank's) and one receiver per prefill rank that writes into it
(``prefill_tp_size`` ranks split the heads; the links of this rank), each over the part of
this rank's pool that prefill rank writes (a head slice when the two sides split heads
differently). A request is published once per such receiver, under the name of that
prefill rank's part (`leg_name`), and has arrived once every one of them holds every block.

Pipeline parallelism on the prefill servers (``prefill_pp_size`` stages): one receiver per
(size, prefill rank) of every stage, over the run of this rank's pool layers that stage holds
(`WorkerCommon.stage_slices`); the prefill rank is then vLLM's global one, ``stage * size +
tensor-parallel rank``, and the names ``<transfer>@p<rank>of<size>x<stages>``.

Several prefill sizes (``prefill_tp_size`` a list): one receiver per (size, prefill rank)
that writes here, each request expected on all of them and published under every size's
names, as `rendezvous.Alternatives` (one alternative per size). The first lookup of a
request chooses its size, under the rendezvous's lock: the other sizes' names are never
handed out, so their parts are released unfenced and their names withdrawn once this worker
sees the choice (`_settle_size`), and the request has arrived once every part of the chosen
size holds every block:

```
expect T:   receivers (1, 0), (2, 0), (2, 1)     published T | T@p0of2, T@p1of2
lookup T@p0of2 (prefill TP 2, rank 0)  -> size 2 chosen; T withdrawn (a lookup of it refused)
next step:  (1, 0) released unfenced; T arrived once (2, 0) and (2, 1) hold every block
```
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from kvferry import ranks
from kvferry.errors import KvFerryError, TransferError, TransferTimeoutError
from kvferry.groups import expect_groups
from kvferry.receiver import KVReceiver
from kvferry.transports import registry, wire
from kvferry.vllm import client, paths, rendezvous
from kvferry.vllm.metadata import LEG_MARK, Handshake, KvferryMetadata, RecvSpec, leg_name, leg_rank
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

# One receiver and one published name of a request: (prefill tensor parallel size, prefill
# rank; under pipeline parallelism vLLM's global rank, stage * size + tensor-parallel rank).
# ONE: the only part without tensor or pipeline parallelism, under the transfer's own name.
Part = tuple[int, int]
ONE: Part = (1, 0)


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
    # Under tensor parallelism, its parts: (prefill size, prefill rank) -> the name it was
    # published under (empty: the one part, ONE, under the transfer's own name); the parts
    # never published, abandoned by their prefill rank (never written), and released so far.
    subs: dict[Part, str] = field(default_factory=dict)
    unpublished: set[Part] = field(default_factory=set)
    abandoned: set[Part] = field(default_factory=set)
    released: set[Part] = field(default_factory=set)
    # (part, kv id) of each KV cache group's kvferry request a part's receiver already forgot.
    released_kvs: set[tuple[Part, int]] = field(default_factory=set)
    # Several prefill sizes: its names' group of alternatives (one per size), and the size its
    # first lookup chose, once `DecodeWorker._settle_size` saw it (None: not yet, or one size).
    among: Optional[rendezvous.Alternatives] = None
    size: Optional[int] = None

    def parts(self) -> dict[Part, str]:
        return self.subs or {ONE: self.spec.transfer}

    def live(self) -> dict[Part, str]:
        """The parts a sender may write: the chosen size's, or every part before a choice."""
        parts = self.parts()
        return parts if self.size is None else {k: name for k, name in parts.items() if k[0] == self.size}


class DecodeWorker:
    def __init__(self, common: WorkerCommon) -> None:
        self.common = common
        self.config = common.config
        self.authkey = common.authkey
        self.block_size = common.block_size
        self.tally = common.tally
        # The transports each prefill engine is offered, in the order it tries them (set at
        # `start`, from the caches' device: kvferry.vllm.paths).
        self.offered: tuple[str, ...] = ()
        self.engine = common.engine
        # One receiver per (prefill size, prefill rank) that writes into this rank (ONE alone
        # without tensor parallelism), each over what that rank writes.
        self.receivers: dict[Part, KVReceiver] = {}
        self._ring_of: dict[Part, int] = {}  # part -> its staging ring's blocks
        # One endpoint (staging: one ring, one writer) per prefill engine, made on its first
        # lookup; with ``auto`` over CUDA caches, a direct one and a staging one (`paths.Choice`).
        self.endpoints: dict[str, registry.Served | paths.Choice] = {}
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
        self._refused_seen = self._duplicates_seen = self._corrupt_seen = self._checked_seen = 0
        # Prefill sizes learnt from requests (a router's decode request names its prefill
        # server's tensor parallel size): their receivers are made on first use.
        self._learnt: list[int] = []

    @property
    def receiver(self) -> Optional[KVReceiver]:
        """The receiver of the first part (the only one without tensor parallelism)."""
        return self.receivers[min(self.receivers)] if self.receivers else None

    @receiver.setter
    def receiver(self, value: KVReceiver) -> None:
        self.receivers = {(self.sizes[0], 0): value}

    @property
    def sizes(self) -> tuple[int, ...]:
        """The tensor parallel sizes of the prefill servers this decode server takes: those of
        ``prefill_tp_size``, then those learnt from requests."""
        return self.config.prefill_tp_sizes + tuple(self._learnt)

    def _add_receivers(self, size: int) -> None:
        """One receiver per prefill rank of a server of tensor parallel size ``size`` that
        writes into this rank (of every pipeline stage), each with its staging ring's size.
        Raises `KvFerryError` for a size kvferry.ranks cannot pair with this server's."""
        from kvferry.transports.staging import default_ring_bytes

        common = self.common
        with torch.inference_mode(False):  # the ring is written by kvferry's own threads
            for stage, layers in enumerate(common.stage_slices()):
                for link in self._links(size):
                    part = common.link_pool(link.dst_heads, link.whole)
                    if layers is not None:  # that stage's ranks write their layers only
                        part = part.layer_slice(*layers)
                    key = (size, stage * size + link.prefill_rank)
                    self.receivers[key] = KVReceiver(part, checksum=self.config.checksum)
                    ring = self.config.staging_bytes or default_ring_bytes(part.device)
                    self._ring_of[key] = max(2, ring // (part.block_bytes * part.num_layers))

    def _learn(self, size: int) -> None:
        """A router's request from a prefill server of a size not taken yet: its receivers."""
        if size in self.sizes:
            return
        self._add_receivers(size)
        self._learnt.append(size)
        logger.info("kvferry: decode rank %d now takes prefill servers of tensor parallel size %d",
                    self.common.tp_rank, size)  # fmt: skip

    def start(self) -> None:
        """After `WorkerCommon.register_kv_caches`: the receivers and the rendezvous."""
        common = self.common
        assert common.pool is not None
        self.offered = paths.offered(self.config.transport, common.pool.device.type)
        for size in self.sizes:
            self._add_receivers(size)
        self._ring_blocks = self._ring_of[min(self._ring_of)]
        with torch.inference_mode(False):
            self.rendezvous = rendezvous.Rendezvous(
                self.authkey,
                self._endpoint_for,
                self.config.rendezvous_dir,
                listen=_rank_address(self.config.listen, common.tp_rank),
                advertise=self.config.advertise,
                admit=self._admit,
                alternative_of=lambda sender: self._part_of(sender)[0],
                family_of=lambda name: name.partition(LEG_MARK)[0],
                not_in_family=self._not_published,
            )
        why = paths.why_not_direct(common.pool.device.type) if self.config.transport == paths.AUTO else None
        logger.info("kvferry: decode rendezvous %s (transport %s: %s%s)", self.rendezvous.address,
                    self.config.transport, ", else ".join(self.offered), f"; {why}" if why else "")  # fmt: skip

    def _links(self, size: int) -> tuple[ranks.Link, ...]:
        """The links prefill servers of tensor parallel size ``size`` write into this rank
        on; refused by name when that size cannot pair with this server's (kvferry.ranks)."""
        common = self.common
        if size == 1 and common.tp_size == 1:
            return (ranks.Link(0, 0, (0, 1), (0, 1), True),)
        try:
            every = ranks.links(size, common.tp_size, common.num_kv_heads, mla=common.mla)
        except KvFerryError as err:
            if size not in self.config.prefill_tp_sizes:  # learnt from a request
                raise KvFerryError(
                    f"a prefill server of tensor_parallel_size={size} cannot send to this decode server of "
                    f"tensor_parallel_size={common.tp_size}: {err}"
                ) from None
            given = self.config.prefill_tp_size
            which = "" if isinstance(given, int) else f"its size {size}: "
            shown = given if isinstance(given, int) else list(given)
            raise KvFerryError(
                f"invalid kv_connector_extra_config prefill_tp_size={shown} with this server's "
                f"tensor_parallel_size={common.tp_size}: {which}{err}"
            ) from None
        return ranks.contributors(common.tp_rank, every)

    def _endpoint_options(self, part: Part, transport: str) -> dict[str, Any]:
        """Where an endpoint of ``transport`` for ``part``'s receiver listens: ``unix://``
        beside the rendezvous, or on the rendezvous's tcp:// host with a port of its own; a
        staging endpoint's ring size."""
        where = wire.parse_address(self.config.listen, "kv_connector_extra_config listen")
        # A prefill rank's handshake may take as long as it waits for it (kvferry.vllm.client:
        # a peer still connected is slow, not gone), so a starved prefill rank is not cut off.
        options: dict[str, Any] = {"handshake_timeout": client.PATIENCE_SECONDS}
        if where.scheme == "tcp":
            options["address"] = wire.Address("tcp", host=where.host).url()  # port 0: any
            if self.config.advertise is not None:
                options["advertise"] = self.config.advertise
        spec = registry.spec(transport)
        if spec.ring_option is not None:
            options[spec.ring_option] = self._ring_of.get(part, self._ring_blocks)
        return options

    def _endpoint_for(self, sender: str) -> str:
        """The URL of prefill engine ``sender``'s endpoint (called on the rendezvous thread,
        once a lookup of ``sender`` took a destination). At the bound, the oldest endpoint
        that no sender is connected to and that holds no taken destination is closed to make
        room, grace or not: only MAX_PREFILL_ENGINES engines really sending can fill it."""
        evicted: Optional[tuple[str, registry.Served | paths.Choice]] = None
        try:
            with self._endpoints_lock:
                endpoint = self.endpoints.get(sender)
                if endpoint is not None:
                    # Handed out again: its engine has a grace from now to connect, so a sweep
                    # racing this lookup cannot close an endpoint whose URL just left.
                    self._made[sender] = time.monotonic()
                    return endpoint.url
                if len(self.endpoints) >= MAX_PREFILL_ENGINES:
                    evicted = self._idlest()
                    if evicted is None:
                        raise KvFerryError(
                            f"already {len(self.endpoints)} prefill engines connected or holding a destination, "
                            "the most this decode server serves"
                        )
                part = self._part_of(sender)
                receiver = self.receivers.get(part)
                if receiver is None:
                    raise KvFerryError(f"prefill rank {part[1]} of {part[0]} writes nothing into this decode rank")
                with torch.inference_mode(False):  # a staging ring is written by kvferry's threads
                    endpoint = paths.serve(
                        self.offered,
                        lambda name: registry.serve(
                            name, receiver, authkey=self.authkey, **self._endpoint_options(part, name)
                        ),
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

    @staticmethod
    def _part_of(sender: str) -> Part:
        """(prefill size, prefill rank) a lookup's sender name carries (`leg_name`); ONE for
        a name without a mark (one rank)."""
        mark = leg_rank(sender)
        if mark is None:
            return ONE
        rank, size, stages = mark
        return (size, 0 if size * stages == 1 else rank)

    def _admit(self, sender: str) -> Optional[str]:
        """Why a lookup from ``sender`` is refused before it waits, or None: a prefill server
        of a tensor parallel size that cannot pair with this server's would look up names this
        server never publishes (and wait out its whole timeout). A size that pairs but is not
        in ``prefill_tp_size`` waits: a router's request names it (`_learn`); once its request
        published the parts of other sizes only, the rendezvous refuses it (`_not_published`)."""
        mark = leg_rank(sender)
        size, stages = (1, 1) if mark is None else mark[1:]
        if stages != self.config.prefill_pp_size:
            return (
                f"this decode server takes prefill servers of pipeline parallel size {self.config.prefill_pp_size} "
                f"(its kv_connector_extra_config prefill_pp_size); prefill engine {sender!r} has {stages}"
            )
        if size in self.sizes:
            return None
        try:  # a size a router's request may still teach this server (its lookup waits for the publish)
            self._links(size)
            return None
        except KvFerryError:
            return self._size_refusal(sender, self.sizes)

    def _not_published(self, sender: str, names: frozenset[str]) -> str:
        """The rendezvous's refusal of a lookup from ``sender`` of a part its request never
        published (the request's ``names`` are of other tensor parallel sizes)."""
        return self._size_refusal(sender, sorted({(leg_rank(n) or (0, 1, 1))[1] for n in names}))

    @staticmethod
    def _size_refusal(sender: str, sizes: Sequence[int]) -> str:
        mark = leg_rank(sender)
        size = 1 if mark is None else mark[1]
        takes = f"tensor parallel size {sizes[0]}" if len(sizes) == 1 else f"tensor parallel sizes {list(sizes)}"
        return (
            f"this decode server takes prefill servers of {takes} (its kv_connector_extra_config "
            f"prefill_tp_size, or the size its router named); prefill engine {sender!r} has {size}"
        )

    def _idlest(self) -> Optional[tuple[str, registry.Served | paths.Choice]]:
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
        returns their senders' names. Runs on the engine thread each step, so it never waits
        for the endpoints' lock: while a lookup holds it to make an endpoint (the first NIXL
        endpoint registers the whole pool then, which takes a while), this step sweeps
        nothing; the next does."""
        assert self.rendezvous is not None
        gone: list[registry.Served | paths.Choice] = []
        names: list[str] = []
        if not self._endpoints_lock.acquire(blocking=False):
            return names
        try:
            # Under the lock: a lookup that takes a destination after this reads the endpoint
            # table after this sweep (it finds its endpoint gone and makes a new one).
            busy = self.rendezvous.takers()
            for sender, served in list(self.endpoints.items()):
                if sender in busy or now - self._made[sender] < ENDPOINT_GRACE_S or served.endpoint.connected():
                    continue
                del self.endpoints[sender], self._made[sender]
                gone.append(served)
                names.append(sender)
        finally:
            self._endpoints_lock.release()
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
        assert self.receivers and self.rendezvous is not None
        now = time.monotonic()
        blocks = -(-spec.prompt_len // self.block_size)
        pp = self.config.prefill_pp_size
        # The sizes that may send it: the one its router named, else every configured one.
        sizes = self.config.prefill_tp_sizes if spec.prefill_tp is None else (spec.prefill_tp,)
        if spec.prefill_tp is not None:
            try:
                self._learn(spec.prefill_tp)
            except KvFerryError as err:  # its prefill server's lookups are refused at once
                for p in range(spec.prefill_tp * pp):
                    self.rendezvous.withdraw(leg_name(spec.transfer, p, spec.prefill_tp, pp), str(err))
                self.common.fail_next(spec.req_id, spec.transfer, str(err))
                return
        mine = [part for part in self.receivers if part[0] in sizes]
        epochs: dict[Part, int] = {}  # part -> its receiver's epoch of the first group
        try:
            for part in mine:
                epochs[part] = expect_groups(self.receivers[part], self.common.groups, spec.kv_id, spec.prompt_len,
                                             spec.held_blocks, spec.dst_blocks)  # fmt: skip
        except KvFerryError as err:
            self._forget_expected(spec, epochs)  # never published: nothing writes them
            self.common.fail_next(spec.req_id, spec.transfer, f"cannot expect its blocks: {err}")
            return
        st = _Recv(spec, now, now + spec.timeout_s)
        if mine != [ONE]:
            st.subs = {(size, p): leg_name(spec.transfer, p, size, pp) for size, p in mine}
        if len(sizes) > 1:  # its first lookup chooses the size (kvferry.vllm.rendezvous)
            st.among = rendezvous.Alternatives("tensor parallel size")
        parts = list(st.parts().items())
        for i, (part, name) in enumerate(parts):
            try:
                destination = self._destination(spec, epochs[part])
                self.rendezvous.publish(name, destination, among=st.among, alternative=part[0])
            except TransferError as err:
                st.unpublished = {q for q, _ in parts[i:]}
                if i == 0:  # none published: nothing can write it
                    self._forget_expected(spec, epochs)
                    self.common.fail_next(spec.req_id, spec.transfer, str(err))
                    return
                self._track(st, now)  # its published parts are released as a given-up request's
                self._give_up(st, str(err), now)
                self._look.add(spec.req_id)
                return
        self._track(st, now)
        if any(self.rendezvous.abandoned(name) is not None for name in st.parts().values()):
            self._look.add(spec.req_id)  # abandoned before it was published: take_abandoned said so already
        self.common.trace.event("decode", "plan", spec.transfer, spec.req_id, prompt=spec.prompt_len,
                                reused=spec.held_blocks * self.block_size, blocks=blocks,
                                held=spec.held_blocks)  # fmt: skip

    def _track(self, st: _Recv, now: float) -> None:
        spec = st.spec
        self._recv[spec.req_id] = st
        for kv in self.common.groups.kv_ids(spec.kv_id):
            self._rid_of_kv[kv] = spec.req_id
        for name in st.parts().values():
            self._rid_of_transfer[name] = spec.req_id
        heapq.heappush(self._deadlines, (now + spec.timeout_s, spec.req_id))

    def _forget_expected(self, spec: RecvSpec, epochs: dict[Part, int]) -> None:
        """Releases, unfenced, every group of ``spec`` on the receivers that expected it."""
        for part in epochs:
            for kv in self.common.groups.kv_ids(spec.kv_id):
                self.receivers[part].release_unfenced(kv)

    def _destination(self, spec: RecvSpec, epoch: int) -> dict[str, Any]:
        """What a prefill rank's lookup of ``spec`` answers: ``epoch`` is the first group's
        on that rank's receiver (group g's: ``epoch + g``, kv id ``kv_id + g``)."""
        blocks = -(-spec.prompt_len // self.block_size)
        return {
            "request_id": spec.kv_id,
            "epoch": epoch,
            "prompt_len": spec.prompt_len,
            "digest": spec.digest,
            "block_size": self.block_size,
            "dst_blocks": [b for table in spec.dst_blocks for b in table[:blocks]],  # group after group
            "held_blocks": spec.held_blocks,
            "engine": self.engine,
        }

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        recving: set[str] = set()
        failed: set[str] = set()
        assert self.receivers and self.rendezvous is not None
        refused = sum(r.refused_count for r in self.receivers.values())
        duplicates = sum(r.duplicate_count for r in self.receivers.values())
        corrupt = sum(r.checksum_failures for r in self.receivers.values())
        checked = sum(r.checksummed_blocks for r in self.receivers.values())
        self.tally.add("duplicates_refused", duplicates - self._duplicates_seen)
        self.tally.add("checksum_mismatches", corrupt - self._corrupt_seen)
        self.tally.add("checksummed_blocks", checked - self._checked_seen)
        other, seen = refused - duplicates - corrupt, self._refused_seen - self._duplicates_seen - self._corrupt_seen
        self.tally.add("notices_refused", other - seen)
        self._refused_seen, self._duplicates_seen = refused, duplicates
        self._corrupt_seen, self._checked_seen = corrupt, checked
        now = time.monotonic()
        for rid in self._to_look(finished_req_ids, now):
            st = self._recv[rid]
            kvs = self.common.groups.kv_ids(st.spec.kv_id)
            self._settle_size(st)
            if st.giving_up is None:
                # Before a size is chosen, any prefill server giving a name up gives the request
                # up (it was sent there); after, only the chosen size's.
                live = st.live()
                abandoned = {p: why for p, name in live.items() if (why := self.rendezvous.abandoned(name))}
                if rid in finished_req_ids:
                    self._give_up(st, "the decode request was aborted", now, aborted=True)
                elif abandoned:
                    self._give_up(st, f"the prefill side gave up: {next(iter(abandoned.values()))}", now)
                    st.abandoned |= set(abandoned)
                elif now > st.deadline:
                    self._give_up(st, f"its blocks did not all arrive within {st.spec.timeout_s} s", now)
                else:
                    try:
                        # Every prefill rank's part (one without TP) of the chosen size (before a
                        # choice: of every size; all of them hold every block only when none was
                        # to move), every group.
                        for p in live:
                            for kv in kvs:
                                self.receivers[p].wait(kv, 0)
                    except TransferTimeoutError:
                        continue  # still arriving
                    except TransferError as err:
                        if self._offer_again(st, live, kvs, now):
                            continue
                        self._give_up(st, str(err), now)
                    else:
                        for p, name in live.items():
                            for kv in kvs:
                                self.receivers[p].release(kv, 0)
                            self.rendezvous.withdraw(name, "its blocks arrived")
                        self.tally.observe("recv_seconds", now - st.started)
                        self._forget(st)
                        recving.add(rid)
                        arrived = self.common.groups.live_count(st.spec.prompt_len, st.spec.held_blocks)
                        # Every region (layer), summed over the head slices one size's parts write.
                        size = st.size if st.size is not None else min(live)[0]
                        block = sum(
                            self.receivers[p].pool.block_bytes * self.receivers[p].pool.num_layers
                            for p in live
                            if p[0] == size
                        )
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

    def _offer_again(self, st: _Recv, live: dict[Part, str], kvs: list[int], now: float) -> bool:
        """A request whose failed parts were all revoked by their senders (a prefill engine
        preempted the request and freed its blocks): each such part is expected again under
        a new epoch and offered again to the prefill engine that took it, which sends it
        again once it computed the request again; the request goes on waiting, within its
        deadline. Every block crosses once per epoch: the old epoch's fence came, so none of
        its writes lands any more. False (nothing changed) when a part failed otherwise."""
        assert self.rendezvous is not None
        failed: list[Part] = []
        for p, name in live.items():
            receiver = self.receivers[p]
            revoked = False
            for kv in kvs:  # every group: one that failed otherwise fails the request
                try:
                    receiver.wait(kv, 0)
                except TransferTimeoutError:
                    pass
                except TransferError:
                    if not receiver.revoked_by_sender(kv) or self.rendezvous.taker(name) is None:
                        return False
                    revoked = True
            if revoked:
                failed.append(p)
        if not failed:
            return False
        spec = st.spec
        if any(self.receivers[p].landing(kv) for p in failed for kv in kvs):
            self._look.add(spec.req_id)  # a staged write admitted before the revoke still copies: next step
            return True
        for p in failed:
            receiver = self.receivers[p]
            for kv in kvs:
                receiver.release(kv, 0)  # fenced, nothing landing: at once
            try:
                epoch = expect_groups(receiver, self.common.groups, spec.kv_id, spec.prompt_len, spec.held_blocks,
                                      spec.dst_blocks)  # fmt: skip
            except KvFerryError as err:  # released, never offered again: nothing writes it
                st.released.add(p)
                self.rendezvous.withdraw(live[p], f"cannot expect it again: {err}")
                self._give_up(st, f"its prefill engine preempted it, and it cannot be expected again: {err}", now)
                self._look.add(spec.req_id)  # released at the next step
                return True
            self.rendezvous.republish(live[p], self._destination(spec, epoch))
            self.tally.add("reoffered_parts", 1)
            logger.info(
                "kvferry: decode request %s (transfer %s): its prefill engine revoked %s before all its blocks"
                " arrived (preempted); offered again under epoch %d",
                spec.req_id, spec.transfer, live[p], epoch,
            )  # fmt: skip
        return True

    def _to_look(self, finished_req_ids: set[str], now: float) -> set[str]:
        """The requests this step must look at (see ``__init__``); the others are still
        arriving, with nothing new to report."""
        assert self.receivers and self.rendezvous is not None
        look, self._look = self._look, set()
        for receiver in self.receivers.values():
            look.update(self._rid_of_kv[kv] for kv in receiver.take_settled() if kv in self._rid_of_kv)
        look.update(rid for rid in finished_req_ids if rid in self._recv)
        gone = self.rendezvous.take_abandoned()
        look.update(self._rid_of_transfer[t] for t in gone if t in self._rid_of_transfer)
        # Given up before any request here published it: the scheduler half has its request,
        # once vLLM admits it, computed here rather than waiting for KV that will not come.
        self.common.given_up.extend(t.split(LEG_MARK)[0] for t in gone if t not in self._rid_of_transfer)
        if len(self.config.prefill_tp_sizes) > 1:  # a first lookup chose a request's size: its other parts go
            chosen = self.rendezvous.take_chosen()
            look.update(self._rid_of_transfer[t] for t in chosen if t in self._rid_of_transfer)
        while self._deadlines and self._deadlines[0][0] < now:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self._recv:
                look.add(rid)
        return {rid for rid in look if rid in self._recv}

    def _forget(self, st: _Recv) -> None:
        del self._recv[st.spec.req_id]
        for kv in self.common.groups.kv_ids(st.spec.kv_id):
            self._rid_of_kv.pop(kv, None)
        for name in st.parts().values():
            if self._rid_of_transfer.get(name) == st.spec.req_id:
                del self._rid_of_transfer[name]

    def _settle_size(self, st: _Recv) -> None:
        """Once a lookup chose ``st``'s prefill size (the first to take one of its names,
        `rendezvous.Alternatives`): releases the other sizes' parts unfenced and withdraws
        their names. The rendezvous never hands those names out after the choice, nor took
        one before it (a take is the choice), so no sender can write them."""
        if st.among is None or st.size is not None:
            return
        assert self.rendezvous is not None
        chosen = self.rendezvous.chosen(st.among)
        if chosen is None:
            return
        assert isinstance(chosen, int)
        st.size = chosen
        for part, name in st.parts().items():
            if part[0] != chosen and part not in st.released:
                self._release_groups(st, part, unfenced=True)
                if part not in st.unpublished:
                    self.rendezvous.withdraw(name, st.among.why_not(part[0]))
                st.released.add(part)

    def _give_up(self, st: _Recv, reason: str, now: float, aborted: bool = False) -> None:
        st.giving_up, st.aborted = reason, aborted
        st.fence_deadline = now + self.config.fence_timeout_s
        for p in st.parts():
            if p not in st.unpublished and p not in st.released:
                for kv in self.common.groups.kv_ids(st.spec.kv_id):
                    self.receivers[p].cancel(kv, reason)  # asks its sender to stop (no-op once fenced)

    def _late_writes_possible(self, transfer: str) -> bool:
        """Whether the prefill engine that took ``transfer`` may still write into its blocks
        after this side gave up on it: it is connected to its endpoint here (one per prefill
        engine, so the connection is that engine's) over a transport whose writes land
        whatever the receiver decided (NIXL's one-sided writes, CUDA IPC's direct copies; a
        staging endpoint applies only writes of requests it still admits)."""
        sender = self.rendezvous.taker(transfer) if self.rendezvous is not None else None
        served = self.endpoints.get(sender) if sender is not None else None
        if served is None:
            return False
        if isinstance(served, paths.Choice):
            taken = served.taken()
            return taken is not None and not registry.spec(taken).refuses_late_writes
        return not registry.spec(served.name).refuses_late_writes and bool(served.endpoint.connected())

    def _release(self, st: _Recv, now: float) -> bool:
        """Releases a request given up on once each of its parts' senders fenced it (one
        part without tensor parallelism; see `_release_part`). A part of a size not chosen
        goes at once: `Rendezvous.withdraw_untaken` says no sender learnt it."""
        for p, name in st.parts().items():
            if p not in st.released and self._release_part(st, p, name, now):
                st.released.add(p)
        return len(st.released) == len(st.parts())

    def _release_part(self, st: _Recv, p: Part, name: str, now: float) -> bool:
        """`_release_now`, or False while a write the staging endpoint admitted before the
        request was given up is still copying into its blocks (`kvferry.receiver.Landing`):
        the next step tries again, this one never waits for it."""
        try:
            return self._release_now(st, p, name, now)
        except TransferTimeoutError:
            return False

    def _release_now(self, st: _Recv, p: Part, name: str, now: float) -> bool:
        """Releases part ``p`` (a prefill size's rank, published as ``name``) of a request
        given up on once its sender fenced it. Past the fence timeout: staging releases at once (its
        endpoint applies a write only for a request it still admits, so a late write of a
        released request never reaches vLLM's blocks); nixl writes are one-sided, and
        cuda-ipc writes the prefill GPU's copies straight into the blocks, so nothing here can
        stop a late one: while the sender is connected over either, its blocks stay allocated
        (the request stays unreported, vLLM keeps them) until the fence comes or the sender's
        connection ends (`_late_writes_possible`)."""
        assert self.rendezvous is not None
        reason = st.giving_up or "given up"
        if p in st.unpublished:
            self._release_groups(st, p, unfenced=True)  # never handed out: nothing writes it
            return True
        if self.rendezvous.withdraw_untaken(name, reason):
            self._release_groups(st, p, unfenced=True)  # no sender ever learnt its blocks
            return True
        if st.unwritten or p in st.abandoned:
            self._release_groups(st, p, unfenced=True)  # a sender learnt them, never wrote
            self.rendezvous.withdraw(name, reason)
            return True
        try:
            self._release_groups(st, p, unfenced=False)
        except TransferTimeoutError:
            if now < st.fence_deadline:
                return False
            if self._late_writes_possible(name):
                if not st.kept_logged:
                    st.kept_logged = True
                    logger.error(
                        "kvferry: decode request %s (transfer %s): no fence from its sender within %s s; its blocks"
                        " stay allocated until the fence or the sender's connection ends (its writes land whatever"
                        " this side decided)",
                        st.spec.req_id,
                        name,
                        self.config.fence_timeout_s,
                    )
                return False
            logger.warning(
                "kvferry: decode request %s: no fence from its sender within %s s; released",
                st.spec.req_id,
                self.config.fence_timeout_s,
            )
            self._release_groups(st, p, unfenced=True)
        self.rendezvous.withdraw(name, reason)
        return True

    def _release_groups(self, st: _Recv, p: Part, *, unfenced: bool) -> None:
        """Releases each KV cache group's kvferry request on part ``p``'s receiver
        once (`KVReceiver.release`, or `release_unfenced`); raises `TransferTimeoutError`
        while a group's fence has not come (the groups released so far stay released)."""
        receiver = self.receivers[p]
        for kv in self.common.groups.kv_ids(st.spec.kv_id):
            if (p, kv) in st.released_kvs:
                continue
            if unfenced:
                receiver.release_unfenced(kv, 0)
            else:
                receiver.release(kv, 0)
            st.released_kvs.add((p, kv))

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()
        if self.rendezvous is not None:
            self.rendezvous.close()


def _rank_address(listen: str, rank: int) -> str:
    """Where tensor-parallel decode rank ``rank``'s rendezvous listens: rank 0 at ``listen``;
    the others beside it (``unix://`` makes a fresh directory each; a fixed socket path gets
    ``.<rank>`` appended; a fixed tcp port is offset by the rank; port 0 stays any)."""
    if rank == 0:
        return listen
    where = wire.parse_address(listen, "kv_connector_extra_config listen")
    if where.scheme == "unix":
        return listen if not where.path else wire.Address("unix", path=f"{where.path}.{rank}").url()
    if where.port:
        return wire.Address("tcp", host=where.host, port=where.port + rank).url()
    return listen
