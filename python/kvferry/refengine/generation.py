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

import itertools
import multiprocessing as mp
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from kvferry._core import BlockRange
from kvferry.receiver import KVReceiver
from kvferry.refengine.cache import PrefixCache
from kvferry.refengine.model import ModelConfig, TinyLlama
from kvferry.refengine.worker import Worker
from kvferry.transports import registry
from kvferry.transports.base import Transport

__all__ = ["Allocation", "FinishItem", "GenerationHost", "GenerationOutcome", "LocalGeneration", "RemoteGeneration"]


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


class GenerationHost:
    """A spawned process holding one copy of the model, in which any number of generation
    workers live (`RemoteGeneration`, each with its own pool, receiver and endpoint): the
    modes of a bench share the weights and the process instead of paying for them once
    each (at Llama-8B geometry a copy of the weights is 16 GB)."""

    def __init__(self, cfg: ModelConfig, *, device: str, netns: Optional[str] = None) -> None:
        """``netns``: the network namespace the process runs in (a second host on one
        machine; None: this one)."""
        self.cfg, self.device = cfg, device
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()  # one request and its reply at a time on the pipe
        self._keys = itertools.count(1)
        self._proc = ctx.Process(target=_host_main, args=(child, cfg, device, netns), daemon=True)
        self._proc.start()
        self.call(("ready",))

    def add(self, **spec: Any) -> int:
        """A new worker (`_Spec`'s fields); its key for `call`."""
        key = next(self._keys)
        self.call(("add", key, _Spec(**spec)))
        return key

    def call(self, message: tuple) -> Any:
        with self._lock:
            self._conn.send(message)
            reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def stats(self) -> dict[str, Any]:
        """What the process holds: ``models`` (copies of the weights), ``pools`` (blocks of
        each live worker's pool, by key), ``pool_bytes`` (their bytes in all), ``peaks`` (on
        CUDA, the caching allocator's ``max_allocated`` and ``max_reserved`` bytes so far;
        None elsewhere) and ``rings`` (blocks of each staging worker's ring, by key)."""
        return dict(self.call(("stats",)))

    def close(self) -> None:
        """Stops the process with every worker still in it."""
        with self._lock:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()


@dataclass(frozen=True)
class _Spec:
    """One generation worker of a `GenerationHost`."""

    num_blocks: int
    tokens_per_block: int
    transport: str
    authkey: bytes
    aware: bool = False
    dedup: bool = False
    listen: str = "unix://"
    ring_blocks: Optional[int] = None  # staging: the ring's capacity (None: the receiver's pool)


class RemoteGeneration:
    """A generation worker in a spawned process, reached by ``transport``: any name of
    `kvferry.transports.registry` with an endpoint that serves ``device`` pools. The process
    is ``host`` (shared with other workers, which it keeps running) or one of its own."""

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
        host: Optional[GenerationHost] = None,
        ring_blocks: Optional[int] = None,
    ) -> None:
        """``listen``: where its endpoint listens (`registry.serve`'s ``address``); ``netns``:
        the network namespace of the process it starts when no ``host`` is given;
        ``ring_blocks``: the staging ring's capacity in blocks (None: the receiver's pool)."""
        if not registry.check(transport, device=device).has_endpoint:
            raise ValueError(
                (
                    f"invalid transport={transport!r}: the generation worker runs in another process; choose from "
                    f"{', '.join(n for n in registry.names(device=device) if registry.spec(n).has_endpoint)}"
                )
            )
        if host is not None and (host.cfg != cfg or host.device != device):
            raise ValueError(
                f"invalid host: it holds a {host.cfg} on {host.device}, this worker needs a {cfg} on {device}"
            )
        self._owned = host is None
        self.host = host if host is not None else GenerationHost(cfg, device=device, netns=netns)
        authkey = secrets.token_bytes(32)
        try:
            self._key = self.host.add(
                num_blocks=num_blocks,
                tokens_per_block=tokens_per_block,
                transport=transport,
                authkey=authkey,
                aware=aware,
                dedup=dedup,
                listen=listen,
                ring_blocks=ring_blocks,
            )
            url = self.host.call(("url", self._key))
        except BaseException:
            if self._owned:
                self.host.close()
            raise
        self.transport = registry.connect(url, authkey=authkey, src=src_pool)

    def allocate(self, request_id: int, prompt: Sequence[int]) -> Allocation:
        return self.host.call(("allocate", self._key, request_id, tuple(prompt)))

    def finish_batch(self, items: Sequence[FinishItem], *, digests: bool = False) -> dict[int, GenerationOutcome]:
        return self.host.call(("finish", self._key, list(items), digests))

    def close(self) -> None:
        """Removes this worker (its endpoint and pool) from the process, and stops the
        process if it is this worker's own (the transport is closed by the sender that owns
        it)."""
        try:
            self.host.call(("drop", self._key))
        finally:
            if self._owned:
                self.host.close()


@dataclass
class _Hosted:
    """A worker living in the host process."""

    worker: Worker
    receiver: KVReceiver
    served: Any
    pool: Any  # the registry's receiver pool (closed last)
    inflight: Optional[InflightBlocks]
    blocks: dict[int, list[int]] = field(default_factory=dict)

    def close(self) -> None:
        self.served.close()
        self.receiver = self.worker = None  # type: ignore[assignment]
        self.pool.close()


def _host_main(conn: Any, cfg: ModelConfig, device: str, netns: Optional[str]) -> None:
    try:
        if netns is not None:  # first: the endpoints' sockets and NIXL's threads then live there
            from kvferry.bench.util import enter_netns

            enter_netns(netns)
        model = TinyLlama(cfg, device)
    except Exception as err:  # reported to the parent, which raises it
        conn.recv()
        conn.send(err)
        return
    hosted: dict[int, _Hosted] = {}
    while True:
        message = conn.recv()
        try:
            op = message[0]
            if op == "stop":
                break
            if op == "ready":
                conn.send(None)
            elif op == "add":
                _, key, spec = message
                hosted[key] = _host_worker(model, cfg, device, spec)
                conn.send(None)
            elif op == "url":
                conn.send(hosted[message[1]].served.url)
            elif op == "drop":
                gone = hosted.pop(message[1], None)
                if gone is not None:
                    gone.close()
                conn.send(None)
            elif op == "stats":
                conn.send(
                    {
                        "models": 1,
                        "pools": {key: h.worker.pool.num_blocks for key, h in hosted.items()},
                        "pool_bytes": sum(
                            h.worker.pool.num_blocks * h.worker.pool.num_layers * h.worker.pool.block_bytes
                            for h in hosted.values()
                        ),
                        # On CUDA: this process's allocator peaks so far.
                        "peaks": (
                            {
                                "max_allocated": torch.cuda.max_memory_allocated(),
                                "max_reserved": torch.cuda.max_memory_reserved(),
                            }
                            if device == "cuda"
                            else None
                        ),
                        # Staging: each worker's ring, in blocks (its endpoint's capacity).
                        "rings": {
                            key: h.served.endpoint.capacity
                            for key, h in hosted.items()
                            if hasattr(h.served.endpoint, "capacity")
                        },
                    }
                )
            elif op == "allocate":
                _, key, rid, prompt = message
                h = hosted[key]
                allocation = _allocate(h.worker, h.receiver, rid, prompt, h.inflight)
                h.blocks[rid] = allocation.blocks
                conn.send(allocation)
            else:
                _, key, items, digests = message
                h = hosted[key]
                conn.send(_finish(h.worker, h.receiver, h.blocks, items, digests, h.inflight))
        except Exception as err:  # reported to the parent, which raises it
            conn.send(err)
    for h in hosted.values():
        h.close()


def _host_worker(model: TinyLlama, cfg: ModelConfig, device: str, spec: _Spec) -> _Hosted:
    # new_kv_pool's geometry, zeroed (in shared memory where the transport maps it).
    tpb = spec.tokens_per_block
    shape = cfg.kv_layer_shape(spec.num_blocks, tpb)
    pool = registry.receiver_pool(
        spec.transport,
        num_layers=cfg.geometry.layers,
        shape=shape,
        dtype=cfg.dtype,
        tokens_per_block=tpb,
        device=device,
    )
    try:
        worker = Worker(
            model, num_blocks=spec.num_blocks, tokens_per_block=tpb, prefix_cache=spec.aware, pool=pool.pool
        )
        receiver = KVReceiver(worker.pool)
        options = dict(pool.serve_options)
        if spec.ring_blocks is not None:
            options["capacity_blocks"] = spec.ring_blocks
        served = registry.serve(spec.transport, receiver, authkey=spec.authkey, address=spec.listen, **options)
    except BaseException:
        pool.close()
        raise
    return _Hosted(worker, receiver, served, pool, InflightBlocks() if spec.dedup else None)
