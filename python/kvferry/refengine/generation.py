"""The generation side of disaggregated serving: in this process, or in another process
connected by a real cross-process transport.

```
context process                           generation process (spawned)
allocate(rid, prompt)  --control--->     allocates destination blocks, expects the request;
                <--blocks, held, epoch--  with prefix awareness: the prompt's full blocks it
                                          still holds (prefix cache, by chained hash); the
                                          epoch is the lease the sender stamps on its notices
KVSender --transport (shm, CUDA IPC, ---> pool; notices -> KVReceiver
           staging, NIXL)
finish_batch(items) --control--------->   waits for each request's KV, checks it, decodes
                    <--outcomes--------
```
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from kvferry._core import BlockRange
from kvferry.receiver import KVReceiver
from kvferry.refengine.cache import PrefixCache
from kvferry.refengine.model import ModelConfig, TinyLlama
from kvferry.refengine.worker import Worker
from kvferry.transports import registry
from kvferry.transports.base import Transport

__all__ = ["Allocation", "FinishItem", "GenerationOutcome", "LocalGeneration", "RemoteGeneration"]


@dataclass(frozen=True)
class FinishItem:
    request_id: int
    prompt: tuple[int, ...]
    first_token: int
    max_new_tokens: int


@dataclass(frozen=True)
class Allocation:
    """The destination blocks of a request, one per prompt block, the ranges of them that
    need not cross (the generation worker already holds them, or another request's transfer
    is bringing them), and the epoch its receiver issued for them (`KVReceiver.expect`)."""

    blocks: list[int]
    held: list[tuple[int, int]]
    epoch: int = 0


class InflightBlocks:
    """Blocks whose KV is on its way to this worker, by chained block hash (in-flight dedup):
    a request that carries the same full block maps the block already coming instead of
    having it sent again, and waits for that transfer."""

    def __init__(self) -> None:
        self._by_hash: dict[int, tuple[int, int]] = {}  # hash -> (block, owner request)
        self._by_owner: dict[int, list[int]] = {}

    def get(self, block_hash: int) -> Optional[tuple[int, int]]:
        return self._by_hash.get(block_hash)

    def add(self, owner: int, hashes_and_blocks: Sequence[tuple[int, int]]) -> None:
        for h, block in hashes_and_blocks:
            self._by_hash.setdefault(h, (block, owner))
        self._by_owner.setdefault(owner, []).extend(h for h, _ in hashes_and_blocks)

    def drop(self, owner: int) -> None:
        """The owner's transfer ended (arrived, failed or cancelled): later requests get its
        blocks from the prefix cache, if at all."""
        for h in self._by_owner.pop(owner, []):
            if self._by_hash.get(h, (None, None))[1] == owner:
                del self._by_hash[h]

    def __len__(self) -> int:
        return len(self._by_hash)


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted block indices as maximal ``[start, end)`` runs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _allocate(
    worker: Worker,
    receiver: KVReceiver,
    request_id: int,
    prompt: Sequence[int],
    inflight: Optional[InflightBlocks] = None,
) -> Allocation:
    """With a prefix cache (prefix awareness on), the prompt's leading full blocks that this
    worker still holds from an earlier turn are mapped into the request and expected as held.
    With ``inflight`` (dedup on), full blocks that another request's transfer is already
    bringing are mapped too (shared, reference-counted) and awaited. The rest are fresh
    blocks that the context worker fills."""
    tpb = worker.tpb
    shared = worker.cache.lookup(prompt, len(prompt)).blocks if worker.cache is not None else []
    worker.alloc.ref(shared)
    num_blocks = -(-len(prompt) // tpb)
    blocks: list[Optional[int]] = [*shared, *([None] * (num_blocks - len(shared)))]
    hashes: list[int] = []
    borrowed: dict[int, list[int]] = {}  # owner -> block indices
    if inflight is not None:
        parent = 0
        for i in range(len(prompt) // tpb):  # full blocks only: a partial one is recomputed
            parent = PrefixCache.chain(parent, prompt[i * tpb : (i + 1) * tpb])
            hashes.append(parent)
            hit = inflight.get(parent) if blocks[i] is None else None
            if hit is not None:
                worker.alloc.ref([hit[0]])
                blocks[i] = hit[0]
                borrowed.setdefault(hit[1], []).append(i)
    fresh = iter(worker.alloc.allocate(sum(b is None for b in blocks)))
    fresh_at = [i for i, b in enumerate(blocks) if b is None]
    for i in fresh_at:
        blocks[i] = next(fresh)
    held = [(0, len(shared))] if shared else []
    awaits = [(owner, BlockRange(s, e)) for owner, idx in borrowed.items() for s, e in _runs(idx)]
    # The lease names the request's blocks: a notice whose write used others is refused.
    epoch = receiver.expect(
        request_id,
        len(prompt),
        held=[BlockRange(s, e) for s, e in held],
        awaits=awaits,
        dst_blocks=[int(b) for b in blocks if b is not None],
    )
    if inflight is not None:
        inflight.add(request_id, [(hashes[i], blocks[i]) for i in fresh_at if i < len(hashes)])  # type: ignore[misc]
    never_sent = sorted(held + [(r.start, r.end) for _, r in awaits])
    return Allocation([int(b) for b in blocks if b is not None], never_sent, epoch)


@dataclass
class GenerationOutcome:
    kv_ready: float
    first_decode: float
    first_token_at_gen: float
    outputs: list[int]
    notices: list[Any] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)  # per destination block, prompt slots


def _finish(
    worker: Worker,
    receiver: KVReceiver,
    blocks: dict[int, list[int]],
    items: Sequence[FinishItem],
    digests: bool,
    inflight: Optional[InflightBlocks] = None,
) -> dict[int, GenerationOutcome]:
    """Waits for each request's KV, then decodes the batch one token per request per step."""
    outcomes = {}
    for item in items:
        rid = item.request_id
        try:
            kv_ready = receiver.wait(rid, timeout=300)
        finally:
            if inflight is not None:
                inflight.drop(rid)
        notices = receiver.notices(rid)
        receiver.release(rid)
        dst = blocks.pop(rid)
        worker.admit_with_blocks(rid, item.prompt, dst, computed=len(item.prompt))
        outcomes[rid] = GenerationOutcome(kv_ready, time.monotonic(), 0.0, [item.first_token], notices)
    for _ in range(max((i.max_new_tokens for i in items), default=1) - 1):
        for item in items:
            outcome = outcomes[item.request_id]
            if len(outcome.outputs) < item.max_new_tokens:
                outcome.outputs.append(worker.step(item.request_id, outcome.outputs[-1]))
                outcome.first_token_at_gen = outcome.first_token_at_gen or time.monotonic()
    for item in items:
        if digests:  # after decoding, so that hashing does not count as time to first token
            state = worker.requests[item.request_id]  # decode only appends past the prompt
            outcomes[item.request_id].digests = worker.block_digests(state.blocks, len(item.prompt))
        # Only the prompt's blocks are kept for later turns: they hold the context worker's
        # bytes, while blocks of decoded tokens hold KV a prefill would compute differently.
        worker.finish(item.request_id, cache_tokens=len(item.prompt))
    return outcomes


class LocalGeneration:
    """A generation worker in this process; the transport is in-process."""

    def __init__(
        self, model: TinyLlama, *, num_blocks: int, tokens_per_block: int, aware: bool = False, dedup: bool = False
    ) -> None:
        """``aware``: keep a prefix cache and advertise the blocks it still holds; ``dedup``:
        map full blocks another request is already bringing instead of receiving them again."""
        self.worker = Worker(model, num_blocks=num_blocks, tokens_per_block=tokens_per_block, prefix_cache=aware)
        self.inflight = InflightBlocks() if dedup else None
        self.receiver = KVReceiver(self.worker.pool)
        self.transport: Transport = registry.connect("in-process", receiver=self.receiver)
        self._blocks: dict[int, list[int]] = {}

    def allocate(self, request_id: int, prompt: Sequence[int]) -> Allocation:
        allocation = _allocate(self.worker, self.receiver, request_id, prompt, self.inflight)
        self._blocks[request_id] = allocation.blocks
        return allocation

    def finish_batch(self, items: Sequence[FinishItem], *, digests: bool = False) -> dict[int, GenerationOutcome]:
        return _finish(self.worker, self.receiver, self._blocks, items, digests, self.inflight)

    def close(self) -> None:
        """Nothing to stop: the worker lives in this process."""


class RemoteGeneration:
    """A generation worker in a spawned process, reached by ``transport``: any name of
    `kvferry.transports.registry` with an endpoint that serves ``device`` pools."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        device: str,
        num_blocks: int,
        tokens_per_block: int,
        transport: str,
        src_pool: Any = None,
        aware: bool = False,
        dedup: bool = False,
        listen: str = "unix://",
        netns: Optional[str] = None,
    ) -> None:
        """``listen``: where its endpoint listens (`registry.serve`'s ``address``); ``netns``:
        the network namespace the process runs in (a second host on one machine; None: this one)."""
        if not registry.check(transport, device=device).has_endpoint:
            raise ValueError(
                (
                    f"invalid transport={transport!r}: the generation worker runs in another process; choose from "
                    f"{', '.join(n for n in registry.names(device=device) if registry.spec(n).has_endpoint)}"
                )
            )
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        authkey = secrets.token_bytes(32)
        self._proc = ctx.Process(
            target=_generation_main,
            args=(child, cfg, device, num_blocks, tokens_per_block, transport, authkey, aware, dedup, listen, netns),
            daemon=True,
        )
        self._proc.start()
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        self.transport = registry.connect(reply, authkey=authkey, src=src_pool)

    def allocate(self, request_id: int, prompt: Sequence[int]) -> Allocation:
        return self._call(("allocate", request_id, tuple(prompt)))

    def finish_batch(self, items: Sequence[FinishItem], *, digests: bool = False) -> dict[int, GenerationOutcome]:
        return self._call(("finish", list(items), digests))

    def _call(self, message: tuple) -> Any:
        self._conn.send(message)
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        """Stops the process (the transport is closed by the sender that owns it)."""
        self._conn.send(("stop",))
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()


def _generation_main(
    conn: Any,
    cfg: ModelConfig,
    device: str,
    num_blocks: int,
    tpb: int,
    kind: str,
    authkey: bytes,
    aware: bool,
    dedup: bool,
    listen: str = "unix://",
    netns: Optional[str] = None,
) -> None:
    try:
        if netns is not None:  # first: the endpoint's sockets and NIXL's threads then live there
            from kvferry.bench.util import enter_netns

            enter_netns(netns)
        model = TinyLlama(cfg, device)
        # new_kv_pool's geometry, zeroed (in shared memory where the transport maps it).
        shape = cfg.kv_layer_shape(num_blocks, tpb)
        pool = registry.receiver_pool(
            kind, num_layers=cfg.geometry.layers, shape=shape, dtype=cfg.dtype, tokens_per_block=tpb, device=device
        )
        worker = Worker(model, num_blocks=num_blocks, tokens_per_block=tpb, prefix_cache=aware, pool=pool.pool)
        receiver = KVReceiver(worker.pool)
        served = registry.serve(
            kind,
            receiver,
            authkey=authkey,
            address=listen,
            **pool.serve_options,
        )
    except Exception as err:  # reported to the parent, which raises it
        conn.send(err)
        return
    conn.send(served.url)
    blocks: dict[int, list[int]] = {}
    inflight = InflightBlocks() if dedup else None
    while True:
        message = conn.recv()
        try:
            if message[0] == "stop":
                break
            if message[0] == "allocate":
                _, rid, prompt = message
                allocation = _allocate(worker, receiver, rid, prompt, inflight)
                blocks[rid] = allocation.blocks
                conn.send(allocation)
            else:
                _, items, digests = message
                conn.send(_finish(worker, receiver, blocks, items, digests, inflight))
        except Exception as err:  # reported to the parent, which raises it
            conn.send(err)
    served.close()
    del worker, receiver
    pool.close()
