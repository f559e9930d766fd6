"""A soak of the executor hook and the reference engine: many concurrent multi-turn sessions
with random prompt sizes, prefix reuse that ends mid-block, chunked and unchunked prefill,
cancellations at every stage and transfer timeouts, with both pools and the receiver's
ledgers audited after every request.

```
sessions --turn--> admit: prefix lookup, destination blocks, hook.add_request
                   step:  before_forward -> forward one chunk each -> after_forward -> poll
                   end:   finish (KV compared bit for bit, a few tokens decoded) or cancel
                          -> audit: every block of both pools free, cached or held, once
cancel at:  before early send | after early send | mid-chunk | after the last chunk
fast lane:  ThreadCopyEngine, notices posted as copies finish (the sender's announcer)
slow lane:  ThreadCopyEngine(link_gbps), sender and receiver timeouts
forced:     each stage once on the fast lane; a receiver timeout before a request's last
            chunk leaves (fast lane); a slow-lane write held past the sender's timeout
```
Every request holds the epoch its `expect` issued. A cancel from the context side revokes it
at the sender, whose fence lets `receiver.release` return; a receiver timeout goes the other
way: `receiver.release` asks the sender (through the transport) to cancel and waits for its
fence, and only then are the destination blocks reused. Notices that arrive for a request
the receiver already gave up on are discarded (`SoakReport.late_notices`), never counted.

Whether a timeout happens on its own depends on the machine's load, so every run also forces
each event its report counts (`FORCED_ROLES`): no count depends on timing.
"""

from __future__ import annotations

import enum
import os
import random
import secrets
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from kvferry.engine import ThreadCopyEngine
from kvferry.errors import DuplicateTransferError, KvFerryError, TransferError, TransferTimeoutError
from kvferry.geometry import Geometry
from kvferry.hook import TransferHook
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.refengine.cache import BlockAllocator
from kvferry.refengine.model import ModelConfig, TinyLlama
from kvferry.refengine.worker import Worker
from kvferry.sender import KVSender
from kvferry.transports import registry
from kvferry.transports.base import Transport

__all__ = [
    "BlockAudit",
    "CancelAt",
    "FORCED_ROLES",
    "Forced",
    "MemorySample",
    "Soak",
    "SoakConfig",
    "SoakReport",
    "audit_allocator",
    "mismatched_blocks",
    "rss_bytes",
]

# Two layers so per-layer handling is exercised; small enough that a forward costs well under
# a millisecond on one CPU thread.
SOAK_MODEL = ModelConfig(Geometry(vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, ffn=64))
# A cancel that keeps timing out for this long is a hang, not a slow link.
CANCEL_GIVE_UP_SECONDS = 30.0


class CancelAt(enum.Enum):
    BEFORE_EARLY = "before early send"
    AFTER_EARLY = "after early send"
    MID_CHUNK = "mid-chunk"
    AFTER_LAST = "after last chunk"


class Forced(enum.Enum):
    """Timeouts the soak makes happen rather than waits to happen."""

    # The slow link holds a request's last write until the executor, its wait past the
    # sender's timeout, cancels what is in flight.
    SENDER_TIMEOUT = "sender timeout"
    # The generation side's deadline passes after the request's last chunk was computed but
    # before it was sent: its release asks the sender, which still holds it, to cancel.
    RECEIVER_TIMEOUT = "receiver timeout"


# Every run plays each of these at least once, on the first requests that can (an early
# cancel needs a complete reused block, a mid-chunk one two chunks), so that a report's
# counts of each stage and of both timeouts never depend on how the machine's timing went;
# the rest of the mix is drawn at random, and the slow lane's own timeouts come on top.
FORCED_ROLES: tuple[CancelAt | Forced, ...] = (*CancelAt, *Forced)


@dataclass(frozen=True)
class SoakConfig:
    """The workload: sizes, probabilities per request, and the slow lane's link and deadlines."""

    requests: int = 10_000
    seed: int = 0
    model: ModelConfig = SOAK_MODEL
    tokens_per_block: int = 8
    # Context pool: room for max_running prompts of max_prompt tokens, the rest is prefix
    # cache, small enough that the cache evicts all along.
    ctx_blocks: int = 320
    gen_blocks: int = 256
    sessions: int = 32
    max_running: int = 8  # requests in prefill at once
    max_prompt: int = 192
    max_new: int = 40  # new tokens per turn
    max_output: int = 3  # tokens the generation worker decodes
    p_chunked: float = 0.5
    p_fork: float = 0.2  # a turn branches off mid-conversation
    p_cancel: float = 0.2
    p_slow: float = 0.15
    # 2 KiB blocks (two layers) at 1 MB/s: 2 ms a block, so a long slice outlives the timeouts.
    slow_link_gbps: float = 0.001
    sender_timeout: float = 0.01
    receiver_timeout: float = 0.01
    cancel_timeout: float = 0.005
    transport: str = "in-process"  # any of kvferry.transports.registry.names(device="cpu")
    rss_every: int = 1000


@dataclass(frozen=True)
class BlockAudit:
    leaked: int  # unreferenced yet neither free nor reusable from the cache
    double_owned: int  # could be handed out, or is held, twice


def audit_allocator(alloc: BlockAllocator, held: Counter[int], cached: Callable[[int], bool]) -> BlockAudit:
    """Checks every block of ``alloc`` against ``held`` (block -> live requests holding it):

    ```
    refs == held  and  refs > 0  ->  in neither list; shared (held > 1) only if cached
    refs == held == 0            ->  free (uncached) xor idle (cached)
    ```
    """
    free = Counter(alloc.free_ids())
    idle = set(alloc.idle_ids())
    leaked = double = 0
    for block in range(alloc.num_blocks):
        refs, want = alloc.refs[block], held.get(block, 0)
        places = free[block] + (block in idle)
        if refs > want:
            leaked += 1  # a reference no live request holds
        elif refs < want or (refs and places) or places > 1 or (want > 1 and not cached(block)):
            double += 1
        elif not refs and not places:
            leaked += 1
        elif block in idle and not cached(block):
            leaked += 1  # kept for reuse, yet no lookup can find it
        elif free[block] and cached(block):
            double += 1  # the cache still maps a block the allocator may hand out
    return BlockAudit(leaked, double)


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class MemorySample:
    requests: int  # requests ended so far
    rss: int  # bytes
    py_blocks: int  # sys.getallocatedblocks()


@dataclass
class SoakReport:
    config: SoakConfig
    requests: int = 0
    completed: int = 0
    cancelled: Counter[str] = field(default_factory=Counter)  # by stage or cause
    cancelled_with_early: int = 0  # cancelled after an early slice had left
    sender_timeouts: int = 0
    receiver_timeouts: int = 0
    cancel_timeouts: int = 0  # cancel raised while the request's own copies still ran
    misattributed_cancel_timeouts: int = 0  # ... while they had finished
    late_notices: int = 0  # stale notices the receiver discarded (a request it had given up on)
    receiver_cancels: int = 0  # requests the sender revoked because the receiver asked
    early_slices: int = 0
    chunked: int = 0
    unaligned_reuse: int = 0
    kv_checked: int = 0
    kv_mismatch_blocks: int = 0
    leaked_blocks: int = 0  # the most found by any audit
    double_owned_blocks: int = 0  # the most found by any audit
    duplicate_blocks: int = 0  # blocks that reached a request's receiver ledger twice
    errors: list[str] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)  # one per ``rss_every`` requests
    seconds: float = 0.0

    @property
    def rss_growth(self) -> Optional[float]:
        """From the end of the first ``rss_every`` requests to the end of the last ones."""
        if len(self.memory) < 2 or not self.memory[0].rss:
            return None
        return self.memory[-1].rss / self.memory[0].rss - 1

    @property
    def py_blocks_per_request(self) -> Optional[float]:
        """Python heap blocks gained per request over the same span: RSS is mostly torch,
        so a small leak of Python objects shows here long before it shows there."""
        if len(self.memory) < 2:
            return None
        first, last = self.memory[0], self.memory[-1]
        return (last.py_blocks - first.py_blocks) / (last.requests - first.requests)

    def failures(self, max_rss_growth: Optional[float] = None) -> list[str]:
        out = list(self.errors)
        for name in ("leaked_blocks", "double_owned_blocks", "duplicate_blocks", "kv_mismatch_blocks"):
            if getattr(self, name):
                out.append(f"{name} = {getattr(self, name)}")
        growth = self.rss_growth
        if max_rss_growth is not None and growth is not None and growth >= max_rss_growth:
            out.append(f"resident memory grew {growth:.1%} (limit {max_rss_growth:.0%})")
        return out

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        model = self.config.model
        out["config"]["model"] = {
            **asdict(model.geometry),
            "rope_theta": model.rope_theta,
            "norm_eps": model.norm_eps,
            "dtype": str(model.dtype),
        }
        out["cancelled"] = dict(self.cancelled)
        out["rss_growth"] = self.rss_growth
        out["py_blocks_per_request"] = self.py_blocks_per_request
        out["requests_per_second"] = self.requests / self.seconds if self.seconds else None
        return out


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)  # the conversation so far
    busy: bool = False


@dataclass
class _Lane:
    hook: TransferHook
    slow: bool


@dataclass
class _Live:
    rid: int
    session: _Session
    lane: _Lane
    prompt: list[int]
    dst: list[int]
    chunks: list[tuple[int, int]]
    cancel_at: Optional[CancelAt]
    cancel_after: int = 0  # MID_CHUNK: chunks computed when it is cancelled
    forced: Optional[Forced] = None
    done: int = 0  # chunks computed
    early: bool = False  # an early slice left for it
    first_token: int = 0


def _chunks(start: int, end: int, size: Optional[int]) -> list[tuple[int, int]]:
    step = size or (end - start)
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def mismatched_blocks(src: PagedKV, dst: PagedKV, src_blocks: list[int], dst_blocks: list[int], tokens: int) -> int:
    """Blocks whose prompt slots differ in any bit, in any layer."""
    tpb, n = src.tokens_per_block, len(dst_blocks)
    last_used = tokens - (n - 1) * tpb
    s_ids, d_ids = torch.tensor(src_blocks[:n]), torch.tensor(dst_blocks)
    bad = torch.zeros(n, dtype=torch.bool)
    for a, b in zip(src.layers, dst.layers):
        # Bytes, not values: -0.0 == 0.0 and NaN != NaN would hide or invent differences.
        x, y = a[s_ids].view(torch.uint8), b[d_ids].view(torch.uint8)
        bad[:-1] |= (x[:-1] != y[:-1]).flatten(1).any(1)
        bad[-1] |= bool((x[-1, :, :last_used] != y[-1, :, :last_used]).any())
    return int(bad.sum())


class Soak:
    """Owns both workers, the receiver and two lanes (hook + sender each); `run` drives
    ``config.requests`` requests through them and returns the report."""

    def __init__(self, config: SoakConfig, progress: Optional[Callable[[SoakReport], None]] = None) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.progress = progress
        self.report = SoakReport(config)
        model = TinyLlama(config.model)
        tpb = config.tokens_per_block
        self.ctx = Worker(model, num_blocks=config.ctx_blocks, tokens_per_block=tpb)
        m = config.model
        # Both workers in this process; the generation pool as the transport serves it (in a
        # shared segment for shm) and, for any but in-process, an endpoint in front of it.
        self._pool = registry.receiver_pool(
            config.transport,
            num_layers=m.geometry.layers,
            shape=m.kv_layer_shape(config.gen_blocks, tpb),
            dtype=m.dtype,
            tokens_per_block=tpb,
        )
        self.gen = Worker(
            model, num_blocks=config.gen_blocks, tokens_per_block=tpb, prefix_cache=False, pool=self._pool.pool
        )
        self.receiver = KVReceiver(self.gen.pool)
        self._authkey = secrets.token_bytes(32)
        self._endpoint: Any = None
        self._url = config.transport
        if registry.spec(config.transport).has_endpoint:
            served = registry.serve(
                config.transport,
                self.receiver,
                authkey=self._authkey,
                **self._pool.serve_options,
            )
            self._endpoint, self._url = served.endpoint, served.url
        fast = KVSender(self.ctx.pool, self._transport(), engine=ThreadCopyEngine())
        slow = KVSender(
            self.ctx.pool,
            self._transport(),
            engine=ThreadCopyEngine(config.slow_link_gbps),
            timeout=config.sender_timeout,
        )
        self.lanes = (_Lane(TransferHook(fast), slow=False), _Lane(TransferHook(slow), slow=True))
        # A request's context blocks stay referenced while either lane's transfer reads them.
        self.ctx.leased = lambda rid: any(lane.hook.leased(rid) for lane in self.lanes)
        self.sessions = [_Session() for _ in range(config.sessions)]
        self.systems = [
            [self.rng.randrange(config.model.geometry.vocab) for _ in range(self.rng.randint(1, 60))] for _ in range(4)
        ]
        self.running: list[_Live] = []
        # Requests the receiver gave up on: the sender reports each once it revoked it.
        # Bounded: the report comes within a step or two.
        self._receiver_gave_up: deque[int] = deque(maxlen=256)
        self._refusals_seen = 0
        self._discards_seen = 0
        self._endpoint_errors_seen = 0
        self._next_id = 0
        self._owed: list[CancelAt | Forced] = list(FORCED_ROLES)
        self._gates: list[threading.Event] = []  # the stalled link's held writes

    def _transport(self) -> Transport:
        if self._endpoint is None:
            return registry.connect(self._url, receiver=self.receiver)
        return registry.connect(self._url, authkey=self._authkey, src=self.ctx.pool)

    def run(self) -> SoakReport:
        started = time.monotonic()
        try:
            while self._next_id < self.cfg.requests or self.running:
                self._admit()
                if self.running:
                    self._step()
            self._final_audit()
        except DuplicateTransferError as err:
            self.report.duplicate_blocks += 1
            self.report.errors.append(f"{type(err).__name__}: {err}")
        except KvFerryError as err:  # anything else the hook or the data plane refused
            self.report.errors.append(f"{type(err).__name__}: {err}")
        self.report.seconds = time.monotonic() - started
        return self.report

    def _next_prompt(self, session: _Session) -> list[int]:
        cfg, rng = self.cfg, self.rng
        if not session.tokens or len(session.tokens) + cfg.max_new > cfg.max_prompt:
            session.tokens = list(rng.choice(self.systems))
        elif rng.random() < cfg.p_fork:
            session.tokens = session.tokens[: rng.randrange(1, len(session.tokens))]
        return session.tokens + [rng.randrange(cfg.model.geometry.vocab) for _ in range(rng.randint(1, cfg.max_new))]

    def _admit(self) -> None:
        cfg, rng = self.cfg, self.rng
        idle = [s for s in self.sessions if not s.busy]
        while len(self.running) < cfg.max_running and self._next_id < cfg.requests and idle:
            session = idle.pop(rng.randrange(len(idle)))
            prompt = self._next_prompt(session)
            rid = self._next_id
            self._next_id += 1
            state = self.ctx.admit(rid, prompt)
            dst = self.gen.alloc.allocate(-(-len(prompt) // cfg.tokens_per_block))
            epoch = self.receiver.expect(rid, len(prompt), dst_blocks=dst)
            lane = self.lanes[rng.random() < cfg.p_slow]
            chunked = rng.random() < cfg.p_chunked
            size = rng.randint(2, 2 * cfg.tokens_per_block) if chunked else None
            live = _Live(rid, session, lane, prompt, dst, _chunks(state.reused_len, len(prompt), size), None)
            if rng.random() < cfg.p_cancel:
                # Mid-chunk needs two chunks: those requests get it more often, so that each
                # stage is drawn about as often as the others.
                if len(live.chunks) > 1 and rng.random() < 0.5:
                    live.cancel_at = CancelAt.MID_CHUNK
                    live.cancel_after = rng.randrange(1, len(live.chunks))
                else:
                    live.cancel_at = rng.choice([CancelAt.BEFORE_EARLY, CancelAt.AFTER_EARLY, CancelAt.AFTER_LAST])
            self._take_owed_role(live, state.reused_len)
            live.lane.hook.add_request(
                rid, len(prompt), reused_len=state.reused_len, src_blocks=state.blocks, dst_blocks=dst, epoch=epoch
            )
            self.report.chunked += chunked or len(live.chunks) > 1
            self.report.unaligned_reuse += state.reused_len % cfg.tokens_per_block != 0
            session.busy = True
            self.running.append(live)
            if live.cancel_at is CancelAt.BEFORE_EARLY:
                self._cancel(live, CancelAt.BEFORE_EARLY.value)

    def _take_owed_role(self, live: _Live, reused_len: int) -> None:
        """Gives the request the first owed role it can play (`FORCED_ROLES`), on the lane
        where nothing else can end it first: a cancellation stage or a forced receiver
        timeout on the fast lane (no timeouts there), a forced sender timeout on the slow
        lane (the only one with a sender timeout)."""
        fast, slow = self.lanes
        for role in self._owed:
            if role is CancelAt.AFTER_EARLY and reused_len < self.cfg.tokens_per_block:
                continue  # no complete reused block: nothing leaves early
            if role is CancelAt.MID_CHUNK:
                start, end = live.chunks[0][0], live.chunks[-1][1]
                if end - start < 2:
                    continue
                live.chunks = _chunks(start, end, -(-(end - start) // 2))
                live.cancel_after = 1
            self._owed.remove(role)
            live.cancel_at = role if isinstance(role, CancelAt) else None
            live.forced = role if isinstance(role, Forced) else None
            live.lane = slow if role is Forced.SENDER_TIMEOUT else fast
            return

    def _step(self) -> None:
        for lane in self.lanes:
            ids = [r.rid for r in self.running if r.lane is lane]
            if ids:
                early = {n.request_id for n in lane.hook.before_forward(ids)}
                self.report.early_slices += len(early)
                for r in self.running:
                    r.early |= r.rid in early
        for r in [r for r in self.running if r.cancel_at is CancelAt.AFTER_EARLY]:
            self._cancel(r, CancelAt.AFTER_EARLY.value)
        done: dict[int, tuple[int, int]] = {}
        for r in self.running:
            start, end = r.chunks[r.done]
            logits = self.ctx.forward(r.rid, end)
            r.done += 1
            done[r.rid] = (start, end)
            if end == len(r.prompt):
                r.first_token = int(logits.argmax())
        for r in [r for r in self.running if r.forced is Forced.RECEIVER_TIMEOUT and r.done == len(r.chunks)]:
            self._force_receiver_timeout(r)
        for r in self.running:
            if r.forced is Forced.SENDER_TIMEOUT and r.done == len(r.chunks):
                # The link stalls on the request's last write: it is held until the executor,
                # past its timeout, gives up on it (`_cancel` opens the gate).
                gate = threading.Event()
                self._gates.append(gate)
                r.lane.hook.order_after(self.ctx.requests[r.rid].blocks, gate)
        for lane in self.lanes:
            ids = [r.rid for r in self.running if r.lane is lane]
            if ids:
                lane.hook.after_forward(ids, [done[i][0] for i in ids], [done[i][1] for i in ids])
        if self._gates:
            self._force_sender_timeout(self.lanes[1])
        for lane in self.lanes:
            self._poll(lane)
        for r in list(self.running):
            if r.cancel_at is CancelAt.MID_CHUNK and r.done == r.cancel_after:
                self._cancel(r, CancelAt.MID_CHUNK.value)
            elif r.done == len(r.chunks):
                if r.cancel_at is CancelAt.AFTER_LAST:
                    self._cancel(r, CancelAt.AFTER_LAST.value)
                else:
                    self._complete(r)

    def _force_receiver_timeout(self, r: _Live) -> None:
        """The generation side's deadline passes while the request's last chunk has been
        computed but not sent: its wait cannot succeed, so it times out, and the receiver
        gives up on it while the sender still holds it (a receiver cancellation, for sure)."""
        try:
            self.receiver.wait(r.rid, timeout=self.cfg.receiver_timeout)
            self.report.errors.append(f"request {r.rid}: complete at the receiver before its last chunk was sent")
        except TransferTimeoutError:
            self.report.receiver_timeouts += 1
            self._cancel(r, "receiver timeout", receiver_first=True)

    def _force_sender_timeout(self, lane: _Lane) -> None:
        """A write of the lane is held (`_gates`): waiting for the lane's copies for as long
        as the sender's timeout times out for sure, and the executor gives up."""
        while True:
            try:
                lane.hook.sender.flush(timeout=self.cfg.sender_timeout)
            except TransferTimeoutError:
                break
            except TransferError as err:
                self._receiver_cancelled(err)  # reported first; the flush goes on
                continue
            self.report.errors.append("a held write finished before the link was released")
            break
        self._on_sender_timeout(lane)

    def _on_sender_timeout(self, lane: _Lane) -> None:
        # The executor's answer to a stuck link: cancel what is still waiting on it.
        self.report.sender_timeouts += 1
        for r in [r for r in self.running if r.lane is lane and lane.hook.sender.in_flight(r.rid)]:
            self._cancel(r, "sender timeout")

    def _poll(self, lane: _Lane) -> None:
        try:
            lane.hook.poll()
        except TransferTimeoutError:
            if not lane.slow:
                raise
            self._on_sender_timeout(lane)
        except TransferError as err:
            self._receiver_cancelled(err)

    def _receiver_cancelled(self, err: TransferError) -> None:
        """The sender's report that it revoked requests because the receiver asked: the
        receiver's own timeout path has acknowledged them already (`_cancel`); anything else
        is raised."""
        if "cancelled by the" not in str(err) or not set(err.request_ids) <= set(self._receiver_gave_up):
            raise err

    def _cancel(self, r: _Live, why: str, *, receiver_first: bool = False) -> None:
        """Ends a request that will not complete. By default the context side cancels
        first (its fence lets the receiver release at once); ``receiver_first``: the
        generation side gives up, and its release waits for the sender to hear of it and
        post its fence (the sender's announcer takes the receiver's cancellations)."""
        if receiver_first:
            self._check_ledger(r, complete=False)
            self._receiver_gave_up.append(r.rid)
            self.receiver.release(r.rid, timeout=CANCEL_GIVE_UP_SECONDS)
            # The request may have completed at the sender before the cancellation reached
            # it (a natural receiver timeout); otherwise the sender failed it for the receiver.
            failure = r.lane.hook.sender.failures().get(r.rid)
            self.report.receiver_cancels += failure is not None and "cancelled by the" in str(failure)
        give_up = time.monotonic() + CANCEL_GIVE_UP_SECONDS
        while True:
            try:
                r.lane.hook.cancel(r.rid, timeout=self.cfg.cancel_timeout)
                break
            except TransferTimeoutError as err:
                # Documented: the request stays revoked and its blocks are not to be freed
                # until a later call returns.
                if err.request_ids and r.rid not in err.request_ids:
                    self.report.misattributed_cancel_timeouts += 1
                else:
                    self.report.cancel_timeouts += 1
                if time.monotonic() > give_up:
                    raise
                # The executor gave up on the stalled link: it recovers (held writes run).
                while self._gates:
                    self._gates.pop().set()
        if receiver_first:
            self._poll(r.lane)  # the sender's report of the receiver's cancellation, if any
        else:
            self._check_ledger(r, complete=False)
            self.receiver.release(r.rid, timeout=CANCEL_GIVE_UP_SECONDS)  # its fence is on the way
        self.gen.alloc.release(r.dst, [False] * len(r.dst))
        self.ctx.finish(r.rid)  # what was computed stays cached
        r.session.tokens = r.prompt  # the user tries again with more words
        self.report.cancelled[why] += 1
        self.report.cancelled_with_early += r.early
        self._end(r)

    def _complete(self, r: _Live) -> None:
        rid, prompt_len = r.rid, len(r.prompt)
        if r.lane.slow:
            # The generation worker's own deadline: it gives up on KV that is late.
            try:
                self.receiver.wait(rid, timeout=self.cfg.receiver_timeout)
            except TransferTimeoutError:
                self.report.receiver_timeouts += 1
                self._cancel(r, "receiver timeout", receiver_first=True)
                return
        r.lane.hook.finish(rid)
        self.receiver.wait(rid, timeout=30)
        self._check_ledger(r, complete=True)
        self.report.kv_mismatch_blocks += mismatched_blocks(
            self.ctx.pool, self.gen.pool, self.ctx.requests[rid].blocks, r.dst, prompt_len
        )
        self.report.kv_checked += 1
        self.receiver.release(rid)
        self.ctx.finish(rid, cache_tokens=prompt_len)
        self.gen.admit_with_blocks(rid, r.prompt, r.dst, computed=prompt_len)
        outputs = self.gen.decode(rid, self.rng.randint(1, self.cfg.max_output), r.first_token)
        self.gen.finish(rid)
        r.session.tokens = r.prompt + outputs
        self.report.completed += 1
        self._end(r)

    def _check_ledger(self, r: _Live, *, complete: bool) -> None:
        notices: list[Notice] = self.receiver.notices(r.rid)
        seen = Counter(b for n in notices for b in range(n.start, n.end))
        self.report.duplicate_blocks += sum(c - 1 for c in seen.values())
        if complete and sorted(seen) != list(range(len(r.dst))):
            self.report.errors.append(
                f"request {r.rid}: blocks {sorted(set(range(len(r.dst))) - set(seen))} never arrived"
            )
        if len({n.slice_id for n in notices}) != len(notices):
            self.report.errors.append(f"request {r.rid}: a slice id arrived twice in {notices}")

    def _end(self, r: _Live) -> None:
        self.running.remove(r)
        r.session.busy = False
        self.report.requests += 1
        self._audit()
        if self.report.requests % self.cfg.rss_every == 0:
            self.report.memory.append(MemorySample(self.report.requests, rss_bytes(), sys.getallocatedblocks()))
        if self.progress is not None and self.report.requests % 100 == 0:
            self.progress(self.report)

    def _audit(self) -> None:
        assert self.ctx.cache is not None
        held = Counter(b for s in self.ctx.requests.values() for b in s.blocks)
        held.update(b for blocks in self.ctx.parked.values() for b in blocks)  # leased to a transfer
        ctx = audit_allocator(self.ctx.alloc, held, self.ctx.cache.is_cached)
        gen_held = Counter(b for r in self.running for b in r.dst)
        gen = audit_allocator(self.gen.alloc, gen_held, lambda block: False)
        self.report.leaked_blocks = max(self.report.leaked_blocks, ctx.leaked + gen.leaked)
        self.report.double_owned_blocks = max(self.report.double_owned_blocks, ctx.double_owned + gen.double_owned)
        self._check_refusals()

    def _check_refusals(self) -> None:
        """Notices the receiver refused since the last audit: every one is a failure (a
        duplicate counts its blocks too). Stale notices are discarded, not refused: those
        are only counted (`SoakReport.late_notices`)."""
        discards = self.receiver.discarded_count - self._discards_seen
        if discards:  # audited after every request: far fewer than the receiver keeps
            self._discards_seen = self.receiver.discarded_count
            self.report.late_notices += sum(1 for d in self.receiver.discarded()[-discards:] if d.kind == "notice")
        new = self.receiver.refused_count - self._refusals_seen
        new_errors = 0 if self._endpoint is None else self._endpoint.error_count - self._endpoint_errors_seen
        if not new and not new_errors:
            return
        self._refusals_seen = self.receiver.refused_count
        refusals = self.receiver.refused()[-new:] if new else []
        for refusal in refusals:
            if isinstance(refusal.error, DuplicateTransferError):
                self.report.duplicate_blocks += refusal.notice.end - refusal.notice.start
            self.report.errors.append(
                f"receiver refused {refusal.notice}: {type(refusal.error).__name__}: {refusal.error}"
            )
        # The endpoint records the refusals above too (the same exception objects), and
        # whatever else went wrong on its side (handshakes, broken messages). It keeps the
        # last few only; its count says how many there were.
        endpoint_errors = list(self._endpoint.errors)[-new_errors:] if new_errors else []
        known = {id(r.error) for r in refusals}
        self.report.errors += [f"endpoint: {type(e).__name__}: {e}" for e in endpoint_errors if id(e) not in known]
        self._endpoint_errors_seen += new_errors

    def _final_audit(self) -> None:
        """Everything ended: no request may be left anywhere, and once the prefix cache has
        been evicted every block of both pools is free."""
        for lane in self.lanes:
            sender = lane.hook.sender
            assert isinstance(sender, KVSender)  # the soak's lanes have one receiver each
            sender.flush()
            # White-box: the sender's own tables are private, but a request they keep is a leak.
            kept = {
                "hook": len(lane.hook),
                "book": len(sender.book),
                "slice counters": len(getattr(sender, "_next_slice", ())),
                "epochs": len(getattr(sender, "_epochs", ())),
                "revoked set": len(getattr(sender, "_revoked", ())),
                "unposted fences": len(getattr(sender, "_unfenced", ())),
                "failures": len(sender.failures()),
            }
            for what, n in kept.items():
                if n:
                    self.report.errors.append(f"{'slow' if lane.slow else 'fast'} lane: the {what} keeps {n} requests")
        if len(self.receiver):
            self.report.errors.append(f"receiver keeps {len(self.receiver)} requests")
        self.ctx.reap()
        if self.ctx.parked:
            self.report.errors.append(
                f"context worker keeps the blocks of {sorted(self.ctx.parked)} leased after every transfer ended"
            )
        alloc = self.ctx.alloc
        evicted = alloc.allocate(alloc.available)
        alloc.release(evicted, [False] * len(evicted))
        assert self.ctx.cache is not None
        if self.ctx.cache.index_entries:
            self.report.errors.append(
                f"prefix cache index keeps {self.ctx.cache.index_entries} entries after every block was evicted"
            )
        for name, a in (("context", alloc), ("generation", self.gen.alloc)):
            if len(a.free_ids()) != a.num_blocks:
                self.report.leaked_blocks = max(self.report.leaked_blocks, a.num_blocks - len(set(a.free_ids())))
                self.report.errors.append(f"{name} pool: {a.num_blocks - len(a.free_ids())} blocks not free at the end")
        self._audit()

    def close(self) -> None:
        while self._gates:  # a run that stopped on an error may have left the link stalled
            self._gates.pop().set()
        for lane in self.lanes:
            lane.hook.sender.close()
        if self._endpoint is not None:
            self._endpoint.close()
        # A shared segment can be unmapped only once no tensor views it.
        del self.gen, self.receiver
        self._pool.close()
