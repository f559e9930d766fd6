"""The scheduler half of `KvferryConnector`: decides, per request, what the worker half does.

```
decode request (op recv), prompt L, own prefix hit h (block aligned):
  get_num_new_matched_tokens -> (L - h, async)    blocks [0, h/tpb) held, the rest arrive
  update_state_after_alloc   -> RecvSpec(kv id, its block table, held) to the worker, which
                                expects it and publishes the destination under T
prefill request (op send), own prefix hit r:
  get_num_new_matched_tokens -> None (wait) until the destination of T is looked up, then (0, sync);
                                past admission_wait_s without one: (0, sync) anyway, the
                                lookup goes on (off the engine thread) while the prompt computes
  build_connector_meta       -> SendSpec once (reused_len r, or where the prompt's computation
                                stood when its destination came), then a Chunk per scheduled step
  request_finished           -> delay the free until the worker reports finished_sending
computed before its destination (the decode server had not admitted its request):
  request_finished           -> delay the free; the blocks wait, at most until the lookup's
                                own deadline (destination_timeout_s after the request arrived)
  build_connector_meta       -> destination found: a late SendSpec (finished) + one Chunk
                                [0, L) over the finished request's blocks; the worker sends it
                                and reports finished_sending. None within the deadline: a
                                release (the worker reports finished_sending at once, vLLM
                                frees the blocks; the decode rendezvous marked T abandoned)
```
A request whose parameters are refused is turned into a failed load: it asks to load its
remaining tokens asynchronously, the worker reports that load failed, and vLLM finishes it
with an error (``kv_load_failure_policy`` "fail", the default) and frees its blocks.

vLLM gives a request it finishes with an error no ``kv_transfer_params``, so the reason a
transfer failed cannot ride on its own answer. This half keeps how the last ``MAX_OUTCOMES``
transfers ended (its own refusals, and the worker half's outcomes, which come back with each
step's output) and answers the one-token ``status`` op from them, as it answers ``hello``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

from kvferry import ranks
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.groups import GroupSet
from kvferry.transports import registry
from kvferry.transports.guard import RateLimitedLog
from kvferry.vllm import moriio, paths, redact, router, trust
from kvferry.vllm.client import Client, NoAnswerError
from kvferry.vllm.config import ConnectorConfig, RequestParams, parse_params, parse_router_params, prompt_digest
from kvferry.vllm.metadata import Chunk, Handshake, KvferryMetadata, Outcome, RecvSpec, SendLeg, SendSpec, leg_name
from kvferry.vllm.park import ParkBook
from kvferry.vllm.tally import Tally

logger = logging.getLogger("kvferry.vllm")
# Requests whose kv_transfer_params are served other than as asked: a few lines, then a count.
_warn = RateLimitedLog(logger)

MAX_KV_ID = 2**62
# Transfers whose end (done, failed, aborted) a server remembers for `status` (oldest forgotten
# first): a proxy asks right after the failed answer, so a few thousand is plenty.
MAX_OUTCOMES = 4096


@dataclass
class _Lookup:
    """A prefill request's destination lookup, run on its own thread."""

    done: threading.Event
    transfer: str
    request: Any  # vLLM's Request (its prompt, to check the destination against)
    params: RequestParams
    started: float  # time.monotonic() of the request's first ask
    # Tensor or pipeline parallelism: each link (its prefill rank vLLM's global one) and the
    # decode rank's rendezvous it looks up (`SchedulerSide._plan`); None: one lookup of
    # ``destination``.
    plan: Optional[list[tuple[ranks.Link, str]]] = None
    destination: Optional[dict[str, Any]] = None
    legs: Optional[list[SendLeg]] = None
    prefill_tp: int = 1  # this engine's tensor parallel size, for the links' names
    prefill_pp: int = 1  # and its pipeline parallel size
    error: Optional[str] = None
    # A lookup again after a preemption: the epochs the request's first take had (its
    # abandon names them until this lookup takes the destinations again).
    previous: Optional[dict[str, int]] = None
    # The request ended before it used this lookup: why. A lookup still waiting then gives
    # back what it takes (`_give_back`): the request's own abandon went out before it took.
    ended: Optional[str] = None
    # A router's request (NixlConnector's protocol) whose decode server has not offered yet:
    # when its blocks stop waiting for the offer (set once the prompt is computed).
    offer_deadline: Optional[float] = None


@dataclass
class _Late:
    """A prefill request that computed its whole prompt before its destination came (the
    decode server had not admitted its request): vLLM keeps its blocks (request_finished
    delayed their free) until the lookup ends; then one late send covers the prompt, or the
    blocks are released."""

    block_ids: list[list[int]]  # one table per KV cache group moved
    lookup: Optional[_Lookup]  # still looking
    spec: Optional[SendSpec] = None  # the destination came, not sent yet
    host: Optional[list[int]] = None  # parked: its blocks are in these host blocks (kvferry.vllm.park)


@dataclass
class _Sending:
    spec: SendSpec
    lookup: _Lookup  # the lookup it came from (a preempted send looks up again)
    emitted: bool = False  # the worker knows it (its SendSpec left in a step's metadata)
    next_start: int = 0  # once emitted: where its next scheduled chunk starts (tokens computed so far)


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        *,
        block_size: int,
        role: str,
        engine_id: str,
        kv_cache_manager_getter: Any,
        authkey: bytes,
        tp_size: int = 1,
        num_kv_heads: int = 1,
        mla: bool = False,
        groups: Optional[GroupSet] = None,
        pp_size: int = 1,
        park_blocks: int = 0,
        num_blocks: int = 0,
    ) -> None:
        self.config = config
        # This engine's tensor parallel size and its model's KV heads: with a decode server's
        # rank count (its peer names one rendezvous per rank), which rank sends what (kvferry.ranks).
        # ``pp_size`` stages: each stage's ranks send their own layers, the same heads.
        self.tp_size, self.num_kv_heads, self.mla = tp_size, num_kv_heads, mla
        self.pp_size = pp_size
        self._authkey = authkey  # read at startup (config.load_authkey); never in a request or answer
        # Lookups, abandons and offers: one kept connection per rendezvous, no thread per request.
        self._client = Client(authkey)
        self.engine_id = engine_id  # vLLM's, shared with this engine's worker half
        self.block_size = block_size
        self.role = role  # "kv_producer", "kv_consumer", "kv_both"
        self._manager = kv_cache_manager_getter
        self.handshake: Optional[Handshake] = None
        self.groups = groups if groups is not None else GroupSet.single(block_size)
        # kvferry request ids: a random namespace per process in the high bits, so an id
        # never means two requests to a decode server's receiver across restarts. A request
        # takes one id per KV cache group (GroupSet.kv_ids).
        self._kv_ids = itertools.count((secrets.randbits(29) + 1) << 32, len(self.groups))
        self._refused: dict[str, str] = {}
        self._lookups: dict[str, _Lookup] = {}  # prefill requests waiting (up to admission_wait_s) for a destination
        # Prefill requests computing before their destination (their lookup goes on).
        self._computing: dict[str, _Lookup] = {}
        self._sending: dict[str, _Sending] = {}
        self._late: dict[str, _Late] = {}  # finished prefill requests whose blocks wait for a destination
        # Late prompts park in a host pool of each worker (kvferry.vllm.park): its free blocks,
        # the engine's pool size (a host block h is source block num_blocks + h), and each
        # parked request's host blocks with the workers yet to report it done.
        self._park = ParkBook(park_blocks)
        self._num_blocks = num_blocks
        self._parked: dict[str, tuple[list[int], int]] = {}
        self._lost: dict[str, str] = {}  # computing prefill requests whose lookup failed: why
        self._receiving: dict[str, str] = {}  # req_id -> transfer
        # Requests whose one load was handed to the worker (a RecvSpec, or a refusal reported
        # as a failed load). vLLM asks again for a request it preempted, or whose load failed
        # under kv_load_failure_policy "recompute": such a request is computed here from what
        # this engine's prefix cache still holds, never given a second transfer that no
        # prefill server will send.
        self._loaded: set[str] = set()
        self._claimed: OrderedDict[str, None] = OrderedDict()  # transfers received here (the newest MAX_OUTCOMES)
        # Transfers the prefill side gave up before a decode request here published them
        # (the newest MAX_OUTCOMES; the decode workers report them): computed here.
        self._given_up: OrderedDict[str, None] = OrderedDict()
        self._meta = KvferryMetadata()
        self._outcomes: OrderedDict[str, Outcome] = OrderedDict()  # transfer -> how it ended here
        # Routers (NixlConnector's protocol, kvferry.vllm.router): the offers decode servers
        # make to this prefill server, and each router prefill request's transfer id.
        self._book: router.OfferBook[_Lookup] = router.OfferBook(authkey, config, self._offer_came)
        self._router_rids: dict[str, str] = {}
        # vllm-router's moriio mode (kvferry.vllm.moriio): this server's registration with the
        # router; a decode server's starts once its rendezvous are known (`set_handshakes`).
        self._registration: Optional[moriio.Registration] = None
        if config.router_discovery is not None and role == "kv_both":
            raise InvalidArgumentError(
                f"invalid kv_connector_extra_config router_discovery={config.router_discovery!r} on a kv_both server:"
                " vllm-router's moriio mode registers a server as prefill (kv_producer) or decode (kv_consumer)"
            )
        if config.router_discovery is not None and role == "kv_producer":
            self._register("P", "kvferry")
        self.tally = Tally()  # what this half counts (vllm:kvferry_* on /metrics)
        self._unhonoured: deque[str] = deque()  # reasons counted on other threads, tallied each step

    # -- vLLM calls --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        rid = request.request_id
        remaining = request.num_tokens - num_computed_tokens
        if rid in self._loaded:
            return 0, False
        if rid in self._refused:
            return 1, True
        try:
            params = self._params(request)
            if params is None or params.op in ("hello", "status"):
                return 0, False
            if params.op == "recv":
                if self.role == "kv_producer":
                    raise KvFerryError(
                        f"{_what(params, 'recv')} on a kv_producer server: send decode requests to a kv_consumer (or"
                        " kv_both) server"
                    )
                if params.prefill_tp is not None:
                    self._check_prefill_size(params)
                return self._claim(rid, params.transfer or "", remaining)
            if self.role == "kv_consumer":
                raise KvFerryError(
                    f"{_what(params, 'send')} on a kv_consumer server: send prefill requests to a kv_producer (or"
                    " kv_both) server"
                )
            if params.router:
                return self._router_send(request, params, num_computed_tokens)
            return self._destination(request, params, num_computed_tokens)
        except KvFerryError as err:
            self.tally.unhonoured("refused")
            return self._refuse(rid, str(err), request), True

    def _params(self, request: Any) -> Optional[RequestParams]:
        """The request's parameters: kvferry's own (``kv_transfer_params.kvferry``), or
        NixlConnector's protocol (a router's); None for a plain request. Keys kvferry does
        not read, and parameters of a protocol it does not speak, are logged and counted
        (the request is then served as it can be: never an unannounced recompute)."""
        raw = getattr(request, "kv_transfer_params", None)
        params = _parse(raw, request.request_id)
        if params is not None and params.ignored:
            self.tally.unhonoured("ignored_keys")
            _warn.warning(
                "ignored",
                "kvferry: request %s: kv_transfer_params keys %s are not %s and are ignored",
                request.request_id,
                list(params.ignored),
                "NixlConnector's" if params.router else "vllm-router moriio mode's",
            )
        elif params is None and isinstance(raw, dict) and set(raw) - router.PLAIN_KEYS:
            self.tally.unhonoured("not_kvferry")
            _warn.warning(
                "foreign",
                "kvferry: request %s has kv_transfer_params %s, which ask for no kvferry transfer (neither"
                " do_remote_decode nor do_remote_prefill is true, and no 'kvferry' key): it is served on this server"
                " alone",
                request.request_id,
                sorted(raw)[:20],
            )
        return params

    def _check_prefill_size(self, params: RequestParams) -> None:
        """A decode request that names its prefill server's tensor parallel size (a router's
        ``tp_size``, or kvferry's ``prefill_tp`` from a proxy): that size pairs with this
        server's (the decode workers learn it: `DecodeWorker._learn`); a router's needs this
        server's rendezvous known too (its workers' handshake), for its offer."""
        assert params.prefill_tp is not None
        what = "kv_transfer_params.tp_size" if params.router else "kv_transfer_params.kvferry.prefill_tp"
        try:  # refused now, by both sizes, rather than by the worker after the offer
            ranks.links(params.prefill_tp, self.tp_size, self.num_kv_heads, mla=self.mla)
        except KvFerryError as err:
            raise KvFerryError(
                f"the prefill server's tensor_parallel_size={params.prefill_tp} ({what}) cannot"
                f" send to this decode server's tensor_parallel_size={self.tp_size}: {err}"
            ) from None
        if params.router and self.handshake is None:
            raise KvFerryError("this decode server's workers have not started their rendezvous yet")

    def _claim(self, rid: str, transfer: str, remaining: int) -> tuple[Optional[int], bool]:
        """One receive per transfer: vLLM's parallel sampling (``n > 1``, ``best_of``) makes
        one request per sample, all with the same parameters. The first receives; the others
        wait until its blocks arrived (then vLLM's prefix cache holds them) and compute the
        rest here, as does a request naming a transfer this server already took."""
        if transfer not in self._claimed:
            if transfer in self._given_up:
                return self._computed_here(rid, transfer)
            return remaining, True
        if transfer not in self._outcomes and transfer in self._receiving.values():
            return None, False  # still arriving for another request: asked again next step
        return 0, False

    def _computed_here(self, rid: str, transfer: str) -> tuple[int, bool]:
        """A decode request whose prefill side gave its transfer up before this server
        admitted it (a decode server saturated past ``destination_timeout_s``, the prefill
        request refused or ended): nothing will come, so this server computes the prompt, as
        a server on its own would, and says so (log, ``unhonoured{reason="prefill_gave_up"}``,
        its ``status``)."""
        self.tally.unhonoured("prefill_gave_up")
        _warn.warning(
            "gave_up",
            "kvferry: decode request %s (transfer %s): its prefill side gave the transfer up before this server"
            " admitted the request; the prompt is computed here",
            rid,
            transfer,
        )
        why = "the prefill side gave it up before this server admitted its request: computed here"
        self.record([Outcome(transfer, "failed", why)])
        self._loaded.add(rid)  # asked again (preempted, or not scheduled this step): computed here still
        return 0, False

    def _refuse(self, rid: str, reason: str, request: Any = None) -> int:
        self._refused[rid] = reason
        logger.error("kvferry: request %s refused: %s", rid, reason)
        transfer = _named_transfer(getattr(request, "kv_transfer_params", None))
        if transfer is not None:
            self.record([Outcome(transfer, "failed", f"request refused: {reason}")])
        return 1  # a one-token load that the worker reports failed; see the module doc

    def _destination(self, request: Any, params: RequestParams, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        rid = request.request_id
        if rid in self._sending or rid in self._lost:
            return 0, False
        found = self._computing.get(rid)
        if found is not None:  # preempted while it computed before its destination: computes again
            if not found.done.is_set():
                return 0, False
            del self._computing[rid]
            self._sending[rid] = _Sending(self._send_spec(found, num_computed_tokens), found)
            return 0, False
        found = self._lookups.get(rid)
        if found is None:
            # Before any connection: only a signed or trusted decode server (kvferry.vllm.trust).
            trust.check_peer(self._authkey, self.config.trusted_peers, params.peer, params.peer_mac)
            assert params.transfer is not None
            found = self._lookups[rid] = _Lookup(threading.Event(), params.transfer, request, params, time.monotonic())
            self._start_lookup(found)
        if not found.done.is_set():
            if time.monotonic() - found.started < self.config.admission_wait_s:
                return None, False  # vLLM asks again next step; the request waits for its destination
            # The decode server has not admitted its request yet (saturated, or its half is
            # late): compute now rather than idle; the blocks wait for the destination instead.
            self._computing[rid] = self._lookups.pop(rid)
            logger.info(
                "kvferry: prefill request %s (transfer %s): no destination within admission_wait_s=%s;"
                " computing before it",
                rid,
                params.transfer,
                self.config.admission_wait_s,
            )
            return 0, False
        del self._lookups[rid]
        self._sending[rid] = _Sending(self._send_spec(found, num_computed_tokens), found)
        return 0, False

    def _start_lookup(self, found: _Lookup) -> None:
        """Starts ``found``'s lookup at its peer (checked by the caller) on the rendezvous
        client: nothing here waits on the network. Raises `KvFerryError` for a split
        kvferry.ranks refuses."""
        params = found.params
        assert params.peer is not None and params.transfer is not None
        found.plan, found.prefill_tp, found.prefill_pp = self._plan(params.peer), self.tp_size, self.pp_size
        wait_s = _capped(params.timeout_s, self.config.destination_timeout_s)
        _run_lookup(found, self._client, params.peer, params.transfer, wait_s, self.engine_id)

    def _router_send(self, request: Any, params: RequestParams, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """A router's prefill request (kvferry.vllm.router): its decode server is learnt
        from that server's offer. An offer already here starts the lookup as a kvferry send's
        peer would; else the request waits for it (up to admission_wait_s, when the router
        runs both legs at once) or computes at once, and its lookup starts when the offer comes."""
        rid = request.request_id
        if rid in self._router_rids:  # asked again: the state it is in says what to do
            return self._destination(request, params, num_computed_tokens)
        assert params.transfer is not None
        self._book.listen()
        found = _Lookup(threading.Event(), params.transfer, request, params, time.monotonic())
        taken, offered = self._book.claim(params.transfer, found)
        if not taken:  # another sample of the same request serves the decode server
            self.tally.unhonoured("duplicate")
            return 0, False
        self._router_rids[rid] = params.transfer
        if offered is not None:
            peer, mac = offered
            return self._destination(request, dataclasses.replace(params, peer=peer, peer_mac=mac), num_computed_tokens)
        if self._book.expects_concurrent(params.transfer):
            self._lookups[rid] = found  # `_destination` waits for it as for a lookup
            return None, False
        self._computing[rid] = found
        return 0, False

    def _offer_came(self, found: _Lookup, peer: str, peer_mac: str) -> Optional[str]:
        """On the offer rendezvous's thread (`router.OfferBook`): starts the waiting
        request's lookup, or says why it cannot (the decode server is then refused at once)."""
        found.params = dataclasses.replace(found.params, peer=peer, peer_mac=peer_mac)
        try:
            self._start_lookup(found)
        except KvFerryError as err:
            found.error = str(err)
            found.done.set()
            return str(err)
        return None

    def set_handshakes(self, by_rank: dict[int, Handshake]) -> None:
        """The decode workers' handshakes, one per tensor-parallel rank: the hello's ``peer``
        names each rank's rendezvous, in rank order, separated by spaces."""
        if not by_rank:
            return
        ordered = [by_rank[r] for r in sorted(by_rank)]
        self.handshake = Handshake(ordered[0].engine, " ".join(h.peer for h in ordered))
        if self.config.router_discovery is not None and self.role == "kv_consumer" and self._registration is None:
            peer = self.handshake.peer  # signed: a prefill server connects only to it (kvferry.vllm.trust)
            self._register("D", moriio.registered_address(peer, trust.sign_peer(self._authkey, peer)))

    def _register(self, role: str, zmq_address: str) -> None:
        assert self.config.router_discovery is not None and self.config.http_address is not None
        self._registration = moriio.Registration(
            self.config.router_discovery, role, self.config.http_address, zmq_address
        )

    def _plan(self, peer: str) -> Optional[list[tuple[ranks.Link, str]]]:
        """Each link of a send to decode server ``peer`` and the rendezvous of its decode
        rank; None with one rank on each side (one lookup, as without tensor parallelism).
        With ``pp_size`` stages, every stage's ranks have the links of one stage, each link's
        prefill rank vLLM's global one (``stage * tp_size + tp rank``). Raises `KvFerryError`
        for a split kvferry.ranks refuses."""
        peers = peer.split(" ")
        if self.tp_size == 1 and self.pp_size == 1 and len(peers) == 1:
            return None
        try:
            links = ranks.staged_links(self.tp_size, self.pp_size, len(peers), self.num_kv_heads, mla=self.mla)
        except KvFerryError as err:
            raise KvFerryError(f"cannot send to a decode server of {len(peers)} tensor-parallel ranks: {err}") from None
        return [(link, peers[link.decode_rank]) for link in links]

    def _abandon_targets(self, params: RequestParams) -> list[tuple[str, str]]:
        """(rendezvous, published name) of each link of a send, for an abandon."""
        assert params.peer is not None and params.transfer is not None
        try:
            plan = self._plan(params.peer)
        except KvFerryError:
            plan = None
        if plan is None:
            return [(params.peer, params.transfer)]
        return [
            (address, leg_name(params.transfer, link.prefill_rank, self.tp_size, self.pp_size))
            for link, address in plan
        ]

    def _send_spec(self, found: _Lookup, reused_len: int) -> SendSpec:
        """The SendSpec of a finished lookup, its destination checked against the request
        (refused: the decode side is told, off this thread, and the request fails);
        `KvFerryError` says why."""
        request, params = found.request, found.params
        if found.error is not None:
            raise TransferError(f"no destination for transfer {params.transfer!r}: {found.error}")
        try:
            # Under tensor parallelism, one destination per link (each decode rank's own blocks).
            dests = [leg.destination for leg in found.legs] if found.legs is not None else [found.destination]
            checked = [
                _check_destination(d, request, self.block_size, self.config.transport, len(self.groups))
                for d in dests
                if d is not None  # always, once its lookup ended without an error
            ]
            destination = checked[0]
        except KvFerryError as err:
            why = f"prefill request refused the destination: {err}"
            self._tell_abandon(params, why, _taken(found, None))
            raise
        return SendSpec(
            request.request_id,
            params.transfer or "",
            request.num_prompt_tokens,
            reused_len,
            params.peer or "",
            destination,
            _capped(params.timeout_s, self.config.transfer_timeout_s),
            legs=found.legs,
        )

    def _tell_abandon(self, params: RequestParams, reason: str, taken: Optional[dict[str, int]] = None) -> None:
        """Tells the decode side (every rank a link goes to), off this thread, that the send
        is given up. ``taken``: the epoch of each name whose destination this request took
        (the decode side takes an abandon of a taken name from its taker only)."""
        targets = [(address, name, (taken or {}).get(name, 0)) for address, name in self._abandon_targets(params)]
        _tell_abandon(targets, self._client, reason)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens <= 0:
            return
        self._loaded.add(rid)
        if rid in self._refused:
            self._meta.fails.append((rid, self._refused[rid]))
            return
        params = self._params(request)  # checked in get_num_new_matched_tokens
        assert params is not None and params.op == "recv" and params.transfer is not None
        tables = self.groups.tables(self._manager().get_block_ids(rid))
        prompt_len = request.num_prompt_tokens
        held = (prompt_len - num_external_tokens) // self.block_size
        kv_id = next(self._kv_ids)
        assert kv_id + len(self.groups) <= MAX_KV_ID
        blocks = math.ceil(prompt_len / self.block_size)
        timeout = _capped(params.timeout_s, self.config.transfer_timeout_s)
        self._meta.recvs.append(
            RecvSpec(
                rid,
                kv_id,
                params.transfer,
                prompt_len,
                [table[:blocks] for table in tables],
                held,
                prompt_digest(request.prompt_token_ids),
                timeout,
                params.prefill_tp,
            )
        )
        self._receiving[rid] = params.transfer
        _remember(self._claimed, params.transfer)
        if params.router:  # tell the prefill server where to send (its lookup waits for the publish)
            assert self.handshake is not None and params.offer_to is not None and params.offer_mac is not None
            router.offer_async(
                self._client,
                params.offer_to,
                params.offer_mac,
                params.transfer,
                self.handshake.peer,
                self._own_names(params.transfer, params.prefill_tp),
                lambda reason: self._unhonoured.append("offer_failed"),
            )

    def _own_names(self, transfer: str, size: Optional[int] = None) -> list[tuple[str, str]]:
        """Every name this decode server may publish ``transfer`` under, at each rank's
        rendezvous (kvferry.vllm.decode_worker): what an abandon of it must reach."""
        assert self.handshake is not None
        pp = self.config.prefill_pp_size
        sizes = self.config.prefill_tp_sizes if size is None else (size,)
        names = {transfer} | {leg_name(transfer, p, n, pp) for n in sizes for p in range(n * pp)}
        return [(address, name) for address in self.handshake.peer.split(" ") for name in sorted(names)]

    def build_connector_meta(self, scheduler_output: Any) -> KvferryMetadata:
        """This step's metadata. It walks the sends (and the new requests) only, not every
        scheduled request: a send's chunk starts where its last one ended (``next_start``);
        only a resumed one (preempted, then scheduled again) is looked up in the step's list.

        ```
        tokens:  |<- reused ->|<- chunk of step k ->|<- chunk of step k+1 ->| ... prompt_len
                 0            start_k               next_start = start_k + scheduled_k
        ```"""
        meta, self._meta = self._meta, KvferryMetadata()
        self._destinations_arrived(meta)
        self._router_housekeeping()
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in self._sending and self._sending[rid].emitted:
                meta.preempted.append(rid)  # its workers revoke its sends before this step's forward
                self._send_again(rid, self._sending.pop(rid))
        if not self._sending:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        new = {
            r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs if r.req_id in self._sending
        }
        cached = scheduler_output.scheduled_cached_reqs
        completing: Optional[list[set[int]]] = None  # this step's, read once a send needs it
        for rid, sending in self._sending.items():
            if rid not in scheduled:
                continue
            if rid in new:
                start = new[rid]
            elif not sending.emitted or rid in cached.resumed_req_ids:
                start = cached.num_computed_tokens[cached.req_ids.index(rid)]
            else:
                start = sending.next_start
            sending.next_start = start + scheduled[rid]
            spec = sending.spec
            end = min(start + scheduled[rid], spec.prompt_len)
            early = 0 if sending.emitted or spec.finished else start // self.block_size
            # Read only when a chunk or a hit needs them: a send past its prompt (decoding on a
            # kv_both server) is scheduled every step with neither.
            tables = self.groups.tables(self._manager().get_block_ids(rid)) if start < end or early else []
            if not sending.emitted:
                sending.emitted = True
                # The first chunk starts where the prefix-cache hit ends (block aligned).
                spec.reused_len = start
                meta.sends.append(spec)
                if early:
                    completing = completing if completing is not None else self._completing(scheduler_output)
                    spec.early = not any(
                        done.intersection(table[:early])
                        for done, table, window in zip(completing, tables, self.groups.windows)
                        if window is None  # a sliding-window group sends nothing early
                    )
            if start < end:
                meta.chunks.append(Chunk(rid, start, end, tables))
        return meta

    def _send_again(self, rid: str, sending: _Sending) -> None:
        """vLLM preempted a prefill request mid-transfer (its blocks freed): its workers
        revoke the sends, each decode rank expects its part again under a new epoch once the
        revoke came (`DecodeWorker._offer_again`), and this looks the destinations up again.
        The request computes again meanwhile, as one computing before its destination: its
        blocks go once the lookup ended (those computed by then before its next forward, the
        rest after it; all of them late if it finished first). No request fails for being
        preempted, and every block crosses once per epoch."""
        old = sending.lookup
        again = _Lookup(threading.Event(), old.transfer, old.request, old.params, time.monotonic())
        again.previous = _taken(None, sending.spec)
        try:
            self._start_lookup(again)
        except KvFerryError as err:  # the same split as the first lookup's: not expected
            again.error = str(err)
            again.done.set()
        self._computing[rid] = again

    def _completing(self, scheduler_output: Any) -> list[set[int]]:
        """Each group's blocks that this step's forward completes. vLLM puts a block in its
        prefix cache when it schedules the tokens that fill it, so a request scheduled after
        them in the same step (the same prompt twice at once, or ``n > 1``) finds it as a hit
        whose KV is not written yet: its early send, issued before the forward, would copy
        what the block held before. Only blocks the step fills matter (a hit is a full
        block), so a decoding request is read once every ``block_size`` tokens."""
        bs = self.block_size
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        completing: list[set[int]] = [set() for _ in range(len(self.groups))]
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            first, end = starts[rid] // bs, (starts[rid] + n) // bs
            if end > first:
                for done, table in zip(completing, self.groups.tables(self._manager().get_block_ids(rid))):
                    done.update(table[first:end])
        return completing

    def _router_housekeeping(self) -> None:
        """Counts what other threads saw go wrong since the last step, and tells each decode
        server whose offer found no prefill request within destination_timeout_s."""
        while self._unhonoured:
            self.tally.unhonoured(self._unhonoured.popleft())
        for transfer, peer in self._book.stale(time.monotonic()):
            self.tally.unhonoured("no_request")
            wait = self.config.destination_timeout_s
            why = f"no prefill request of this transfer came within destination_timeout_s={wait} s"
            self._tell_abandon(RequestParams("send", transfer, peer), why)

    def _destinations_arrived(self, meta: KvferryMetadata) -> None:
        """The lookups of requests computing without a destination that ended since the last
        step: a running request gets its SendSpec (emitted at its next scheduled chunk, with
        ``reused_len`` where its computation stands then); a finished one a late send of its
        whole prompt, or, with no destination, a release of its blocks."""
        for rid, found in list(self._computing.items()):
            if found.done.is_set():
                del self._computing[rid]
                try:
                    self._sending[rid] = _Sending(self._send_spec(found, 0), found)
                except KvFerryError as err:
                    self._lost[rid] = str(err)
                    logger.error("kvferry: prefill request %s (transfer %s): %s", rid, found.transfer, err)
        for rid, late in list(self._late.items()):
            if late.spec is None:
                pending = late.lookup
                assert pending is not None
                if not pending.done.is_set():
                    deadline = pending.offer_deadline
                    late_now = deadline is not None and time.monotonic() > deadline
                    if late_now and self._book.drop(pending.transfer, pending):
                        # No decode server asked for it: the router's decode leg never came
                        # (the client went away between the legs, or the router failed it).
                        del self._late[rid]
                        self.tally.unhonoured("no_offer")
                        why = (
                            f"no decode server asked for its KV within destination_timeout_s="
                            f"{self.config.destination_timeout_s} s of its prefill's end"
                        )
                        logger.warning("kvferry: prefill request %s (transfer %s): %s", rid, pending.transfer, why)
                        self._book.end(pending.transfer, why)  # a decode server offering later is told at once
                        meta.releases.append((rid, pending.transfer, why))
                    continue
                try:
                    late.spec = self._send_spec(pending, 0)
                except KvFerryError as err:
                    del self._late[rid]
                    meta.releases.append((rid, pending.transfer, str(err)))
                    continue
            del self._late[rid]
            spec = late.spec
            spec.reused_len, spec.finished = 0, True
            meta.sends.append(spec)
            tables = late.block_ids if late.host is None else [[self._num_blocks + h for h in late.host]]
            meta.chunks.append(Chunk(rid, 0, spec.prompt_len, tables))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """vLLM without its hybrid KV cache manager: one group, one table."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """``block_ids``: the request's table of every KV cache group (vLLM's order)."""
        rid = request.request_id
        self._loaded.discard(rid)
        refused = self._refused.pop(rid, None)
        if refused is not None:
            return False, {"kvferry": {"error": redact.scrub(refused)}}
        try:
            params = _parse(getattr(request, "kv_transfer_params", None), rid)
        except KvFerryError:
            params = None
        if params is not None and params.op == "hello":
            return False, {"kvferry": self._hello()}
        if params is not None and params.op == "status":
            assert params.transfer is not None
            return False, {"kvferry": self._status(params.transfer)}
        self._receiving.pop(rid, None)  # its blocks: vLLM delays their free while it waits for them
        lookup = self._lookups.pop(rid, None)
        computing = self._computing.pop(rid, None)
        sending = self._sending.pop(rid, None)
        lost = self._lost.pop(rid, None)
        key = self._router_rids.pop(rid, None)
        if params is None or params.op != "send":
            return False, None
        if params.router:
            found = lookup or computing
            return self._router_finished(request, key or params.transfer or "", block_ids, found, sending, lost)
        answer = {"op": "send", "transfer": params.transfer}
        if sending is not None and sending.emitted:
            return True, {"kvferry": answer}  # freed once the worker reports finished_sending
        computed = request.status.name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
        if computed and (sending is not None or computing is not None):
            # Its whole prompt is computed, its destination not used yet: the blocks wait
            # for it (build_connector_meta sends them late, or releases them).
            self._late_wait(
                request, _Late(self.groups.tables(block_ids), computing, None if sending is None else sending.spec)
            )
            return True, {"kvferry": answer}
        if lost is not None:
            answer["error"] = redact.scrub(lost)  # its lookup failed while it computed (recorded below)
            assert params.transfer is not None
            self.record([Outcome(params.transfer, "failed", lost)])
            return False, {"kvferry": answer}
        # Never scheduled: nothing was sent; the decode side must not wait for it.
        if lookup is not None or computing is not None or sending is not None:
            if computing is not None:
                reason = f"prefill request {rid} ended ({request.status.name.lower()}) before its destination came"
            else:
                reason = f"prefill request {rid} ended before its first chunk"
            found = lookup or computing
            if found is not None:
                found.ended = reason  # before reading what it took: see _give_back
            self._tell_abandon(params, reason, _taken(found, None if sending is None else sending.spec))
            answer["error"] = redact.scrub(reason)
            assert params.transfer is not None
            self.record([Outcome(params.transfer, "failed", reason)])
        return False, {"kvferry": answer}

    def _router_finished(
        self,
        request: Any,
        key: str,
        block_ids: tuple[list[int], ...],
        found: Optional[_Lookup],
        sending: Optional[_Sending],
        lost: Optional[str],
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """A router's prefill request ended: its answer (NixlConnector's shape, whatever
        happened: a decode server that offers for a transfer that failed here is refused at
        once, with the reason), and its blocks kept for the late send or freed."""
        rid = request.request_id
        answer = router.answer(self._book, self._authkey, self.engine_id, key, self.tp_size)
        if sending is not None and sending.emitted:
            return True, answer  # freed once the worker reports finished_sending
        computed = request.status.name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
        if computed and lost is None and (sending is not None or found is not None):
            if found is not None and not found.done.is_set():
                # Still no offer, the usual case when the router sends the decode leg once this
                # answer reached it: the blocks wait for it, at most destination_timeout_s.
                found.offer_deadline = time.monotonic() + self.config.destination_timeout_s
            self._late_wait(
                request, _Late(self.groups.tables(block_ids), found, None if sending is None else sending.spec)
            )
            return True, answer
        if found is not None:
            self._book.drop(key, found)
        if lost is None and found is None and sending is None:
            return False, answer  # another sample served this transfer
        reason = lost or f"prefill request {rid} ended ({request.status.name.lower()}) before its KV was sent"
        self._book.end(key, reason)
        peer = sending.spec.peer if sending is not None else (found.params.peer if found is not None else None)
        if lost is None and peer:
            taken = _taken(found, None if sending is None else sending.spec)
            self._tell_abandon(RequestParams("send", key, peer), reason, taken)
        self.record([Outcome(key, "failed", reason)])
        return False, answer

    def _late_wait(self, request: Any, late: _Late) -> None:
        """A prefill request computed its prompt before its destination came: its blocks wait
        for it, parked in the workers' host pool when it has room (vLLM then frees them once
        copied: kvferry.vllm.park), else in vLLM's pool."""
        rid = request.request_id
        self._late[rid] = late
        if late.spec is not None or len(late.block_ids) != 1:
            return  # its destination came already (it leaves at the next step), or several groups
        n = math.ceil(request.num_prompt_tokens / self.block_size)
        host = self._park.take(n)
        if host is None:
            return
        late.host = host
        self._parked[rid] = (host, self.tp_size * self.pp_size)  # every worker reports it done
        self._meta.parks.append((rid, late.block_ids[0][:n], host))

    def unparked(self, rids: list[str]) -> None:
        """Parked requests a worker is done with (their late send ended or was released):
        their host blocks go back once every worker reported them."""
        for rid in rids:
            host, left = self._parked[rid]
            if left > 1:
                self._parked[rid] = (host, left - 1)
            else:
                del self._parked[rid]
                self._park.give(host)

    def _hello(self) -> dict[str, Any]:
        # The sizes: a proxy passes a prefill server's to its decode requests (prefill_tp), so
        # the decode server takes prefill servers of any size that pairs, with no setting.
        hello: dict[str, Any] = {"op": "hello", "role": self.role, "tp_size": self.tp_size, "pp_size": self.pp_size}
        if self.handshake is not None:
            # never the key; the peer signed, so a prefill server connects to it (kvferry.vllm.trust)
            peer = self.handshake.peer
            hello.update(peer=peer, peer_mac=trust.sign_peer(self._authkey, peer), engine=self.handshake.engine)
        return hello

    def given_up(self, transfers: list[str]) -> None:
        """Transfers the prefill side gave up before any decode request here published them
        (the decode workers' report)."""
        for transfer in transfers:
            _remember(self._given_up, transfer)

    def record(self, outcomes: list[Outcome]) -> None:
        """Remembers how transfers ended here (the newest ``MAX_OUTCOMES``). A failure is not
        overwritten by a success of the same id (a kv_both server holds both halves)."""
        for outcome in outcomes:
            known = self._outcomes.pop(outcome.transfer, None)
            self._outcomes[outcome.transfer] = (
                known if known is not None and known.state != "done" and outcome.state == "done" else outcome
            )
        while len(self._outcomes) > MAX_OUTCOMES:
            self._outcomes.popitem(last=False)

    def _status(self, transfer: str) -> dict[str, Any]:
        """The ``status`` answer: ``done``, ``failed`` or ``aborted`` (with ``error``) once the
        transfer ended here, ``active`` while a request of this server holds it, else
        ``unknown`` (never seen, or forgotten)."""
        answer: dict[str, Any] = {"op": "status", "transfer": transfer}
        ended = self._outcomes.get(transfer)
        if ended is not None:
            answer["state"] = ended.state
            if ended.error is not None:
                answer["error"] = ended.error
            return answer
        active = (
            transfer in self._receiving.values()
            or any(s.spec.transfer == transfer for s in self._sending.values())
            or any(found.transfer == transfer for found in [*self._lookups.values(), *self._computing.values()])
            or any(late.spec is not None and late.spec.transfer == transfer for late in self._late.values())
            or any(late.lookup is not None and late.lookup.transfer == transfer for late in self._late.values())
        )
        answer["state"] = "active" if active else "unknown"
        return answer

    def close(self) -> None:
        """Stops the offer rendezvous (routers) and the router registration, if they started,
        and the rendezvous client."""
        self._book.close()
        if self._registration is not None:
            self._registration.close()
        self._client.close()

    def has_pending(self) -> bool:
        return bool(self._lookups or self._computing or self._late or self._parked)


def _remember(recent: OrderedDict[str, None], transfer: str) -> None:
    """Adds ``transfer`` to ``recent`` as its newest, keeping the newest `MAX_OUTCOMES`."""
    recent[transfer] = None
    recent.move_to_end(transfer)
    while len(recent) > MAX_OUTCOMES:
        recent.popitem(last=False)


def _parse(raw: Any, rid: str) -> Optional[RequestParams]:
    """A request's parameters in whichever protocol it speaks: vllm-router's moriio mode,
    NixlConnector's (other routers), kvferry's own; None for a plain request."""
    return moriio.parse_moriio_params(raw, rid) or parse_router_params(raw, rid) or parse_params(raw)


def _capped(asked: Optional[float], bound: float) -> float:
    """A request's own ``timeout_s`` (from an HTTP body) within the operator's ``bound``: a
    client may ask to wait less, never to hold blocks (and a parked lookup) longer."""
    return bound if asked is None else min(asked, bound)


def _what(params: RequestParams, op: str) -> str:
    """How a refusal names what the request asked for."""
    if params.router:
        return "kv_transfer_params.do_remote_prefill" if op == "recv" else "kv_transfer_params.do_remote_decode"
    return f"op {op!r}"


def _named_transfer(params: Any) -> Optional[str]:
    """The transfer id a refused recv or send request names, if it names one as a string
    (a refused ``status`` request records nothing: it must not mark a real transfer failed)."""
    ours = params.get("kvferry") if isinstance(params, dict) else None
    if not isinstance(ours, dict) or ours.get("op") not in ("recv", "send"):
        return None
    transfer = ours.get("transfer")
    return transfer if isinstance(transfer, str) and 0 < len(transfer) <= 256 else None


def _run_lookup(found: _Lookup, client: Client, peer: str, transfer: str, wait_s: float, sender: str) -> None:
    """Asks for ``found``'s destination, or under tensor parallelism one per link, all at
    once (every decode rank publishes in the same step), each within ``wait_s``. The last
    answer fills ``found`` and sets ``found.done``, on the client's thread."""
    links: list[tuple[ranks.Link, str, str]] = []  # (link, its rendezvous, its name); none: one lookup
    asked: list[Future[dict[str, Any]]] = []
    try:
        if found.plan is None:
            asked.append(client.lookup(peer, transfer, wait_s, sender))
        else:
            tp, pp = found.prefill_tp, found.prefill_pp
            links = [(link, address, leg_name(transfer, link.prefill_rank, tp, pp)) for link, address in found.plan]
            for link, address, name in links:
                asked.append(client.lookup(address, name, wait_s, leg_name(sender, link.prefill_rank, tp, pp)))
    except KvFerryError as err:
        # A name the wire cannot carry fails as a refusal would: the links asked before it
        # give back what they take.
        refused: Future[dict[str, Any]] = Future()
        refused.set_exception(err)
        asked.append(refused)
    left = [len(asked)]
    lock = threading.Lock()

    def answered(_: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        _collect(found, client, peer, asked, links)

    for future in asked:
        future.add_done_callback(answered)


def _collect(
    found: _Lookup,
    client: Client,
    peer: str,
    asked: list[Future[dict[str, Any]]],
    links: list[tuple[ranks.Link, str, str]],
) -> None:
    """Fills ``found`` from its answers (each done). Under tensor parallelism a lookup that
    failed on one link gives back what it took on the others (abandoned under their epochs),
    so those decode ranks free their blocks at once instead of waiting for them. A link
    whose rendezvous never answered (`NoAnswerError`: no connection, a broken one, no answer
    within its bound) may not know that this request gave up: it is told too (an abandon
    naming no epoch), so its decode request fails at once, not at its own timeout."""
    try:
        errors = [future.exception() for future in asked]
        failed = next((err for err in errors if err is not None), None)
        if failed is not None:
            found.error = str(failed) if isinstance(failed, KvFerryError) else repr(failed)
            took = [  # (zip stops at the links asked)
                (address, name, int(future.result()["epoch"]))
                for (_, address, name), future, err in zip(links, asked, errors)
                if err is None
            ]
            if took:
                _tell_abandon(took, client, f"another link of the send failed: {found.error}")
            named = [(address, name) for _, address, name in links] if links else [(peer, found.transfer)]
            unanswered = [(address, name, 0) for (address, name), err in zip(named, errors)
                          if isinstance(err, NoAnswerError)]  # fmt: skip
            if unanswered and not client.closed:
                _tell_abandon(unanswered, client, f"the prefill request gave up: {found.error}")
            return
        if not links:
            found.destination = asked[0].result()
            return
        found.legs = [
            SendLeg(
                link.prefill_rank,
                link.decode_rank,
                link.src_heads,
                link.dst_heads,
                link.whole,
                address,
                name,
                future.result(),
            )  # fmt: skip
            for (link, address, name), future in zip(links, asked)
        ]
    except Exception as err:  # a malformed answer: the request fails, the server goes on
        found.error = repr(err)
    finally:
        found.done.set()
        if found.ended is not None:
            _give_back(found, client, peer, found.ended)


def _give_back(found: _Lookup, client: Client, peer: str, reason: str) -> None:
    """A lookup that took destinations after its request ended (the request's own abandon,
    naming no epoch, went out before and is refused for a taken transfer) abandons them under
    their epochs, so the decode request fails at once instead of waiting for blocks. The
    request's end sets ``found.ended`` before it reads what the lookup took, so one of the
    two abandons names the epoch."""
    taken = _taken(found, None)
    where = {leg.transfer: leg.rendezvous for leg in found.legs} if found.legs is not None else {found.transfer: peer}
    if taken:
        _tell_abandon([(where[name], name, epoch) for name, epoch in taken.items()], client, reason)


def _taken(found: Optional[_Lookup], spec: Optional[SendSpec]) -> dict[str, int]:
    """The epoch of each name a send's lookup took a destination of (one name without
    tensor parallelism, a leg's each with it); empty when it took none."""
    if spec is None and found is not None and found.previous and not found.done.is_set():
        return found.previous  # looking up again after a preemption: the first take's epochs
    legs = spec.legs if spec is not None else found.legs if found is not None else None
    if legs is not None:
        return {leg.transfer: int(leg.destination["epoch"]) for leg in legs}
    destination = spec.destination if spec is not None else found.destination if found is not None else None
    if spec is not None and destination:
        return {spec.transfer: int(destination["epoch"])}
    if found is not None and destination:
        return {found.transfer: int(destination["epoch"])}
    return {}


def _tell_abandon(targets: list[tuple[str, str, int]], client: Client, reason: str) -> None:
    """Abandons each (rendezvous, name, epoch) on the client; a failure is logged."""
    for address, transfer, epoch in targets:
        client.abandon(address, transfer, reason, epoch).add_done_callback(_log_failure)


def _log_failure(future: Future[Any]) -> None:
    err = future.exception()
    if err is not None:
        logger.warning("kvferry: %s", err)


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
        raise KvFerryError(f"invalid destination {name}={value!r}: must be an integer in [{lo}, {hi})")
    return value


def _check_destination(
    destination: dict[str, Any], request: Any, block_size: int, transport: str = "auto", groups: int = 1
) -> dict[str, Any]:
    """The decode side's published destination, checked against this request: the same
    prompt, one destination block per prompt block and KV cache group (the groups' tables
    back to back, group by group, in ``dst_blocks``), sane ids."""
    prompt_len = request.num_prompt_tokens
    blocks = math.ceil(prompt_len / block_size)
    if destination.get("prompt_len") != prompt_len or destination.get("digest") != prompt_digest(
        request.prompt_token_ids
    ):
        raise KvFerryError(
            f"the decode request of this transfer has another prompt ({destination.get('prompt_len')!r} tokens there, "
            f"{prompt_len} here, or other token ids)"
        )
    if destination.get("block_size") != block_size:
        raise KvFerryError(
            f"the decode server's block_size is {destination.get('block_size')!r}, this server's is {block_size}"
        )
    dst = destination.get("dst_blocks")
    if not isinstance(dst, list) or len(dst) != blocks * groups:
        have = len(dst) if isinstance(dst, list) else dst
        raise KvFerryError(
            f"invalid destination dst_blocks=<{have} ids>: must list the {blocks} blocks of the prompt for each of "
            f"this server's {groups} KV cache groups (another model, or another KV cache group layout, there?)"
        )
    for i, b in enumerate(dst):
        _int(f"dst_blocks[{i}]", b, 0, 2**31)
    _int("held_blocks", destination.get("held_blocks"), 0, blocks)
    # Group g's kvferry id and lease are the first group's plus g (GroupSet.kv_ids; the decode
    # worker expects a request's groups one after another, so their epochs follow too).
    _int("request_id", destination.get("request_id"), 0, MAX_KV_ID - groups + 1)
    _int("epoch", destination.get("epoch"), 1, 2**63 - groups + 1)
    endpoint = destination.get("endpoint")
    if not isinstance(endpoint, str):
        raise KvFerryError(f"invalid destination endpoint={endpoint!r}: must be a '<transport>+<address>' URL")
    if not paths.taken(endpoint, transport):
        theirs = [registry.parse_url(url)[0] for url in paths.urls_of(endpoint)]
        raise KvFerryError(
            f"the decode server's endpoint {endpoint!r} is for transport {' or '.join(map(repr, theirs))}, this"
            f" server's kv_connector_extra_config transport is {transport!r}"
        )
    return destination
