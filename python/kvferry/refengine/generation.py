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
from kvferry.refengine.model import ModelConfig, TinyLlama, new_kv_pool
from kvferry.refengine.worker import Worker
from kvferry.transport import InProcessTransport, Transport

__all__ = ["Allocation", "FinishItem", "GenerationOutcome", "LocalGeneration", "RemoteGeneration", "TRANSPORTS"]

TRANSPORTS = ("in-process", "shm", "cuda-ipc", "staging", "nixl")


@dataclass(frozen=True)
class FinishItem:
    request_id: int
    prompt: tuple[int, ...]
    first_token: int
    max_new_tokens: int


@dataclass(frozen=True)
class Allocation:
    """The destination blocks of a request, one per prompt block, the ranges of them the
    generation worker already holds (they need not cross), and the epoch its receiver issued
    for them (`KVReceiver.expect`)."""

    blocks: list[int]
    held: list[tuple[int, int]]
    epoch: int = 0


def _allocate(worker: Worker, receiver: KVReceiver, request_id: int, prompt: Sequence[int]) -> Allocation:
    """With a prefix cache (prefix awareness on), the prompt's leading full blocks that this
    worker still holds from an earlier turn are mapped into the request and expected as held;
    the rest are fresh blocks that the context worker fills."""
    shared = worker.cache.lookup(prompt, len(prompt)).blocks if worker.cache is not None else []
    worker.alloc.ref(shared)
    blocks = shared + worker.alloc.allocate(-(-len(prompt) // worker.tpb) - len(shared))
    held = [(0, len(shared))] if shared else []
    epoch = receiver.expect(request_id, len(prompt), held=[BlockRange(s, e) for s, e in held])
    return Allocation(blocks, held, epoch)


@dataclass
class GenerationOutcome:
    kv_ready: float
    first_decode: float
    first_token_at_gen: float
    outputs: list[int]
    notices: list[Any] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)  # per destination block, prompt slots


def _finish(worker: Worker, receiver: KVReceiver, blocks: dict[int, list[int]], items: Sequence[FinishItem], digests: bool) -> dict[int, GenerationOutcome]:
    """Waits for each request's KV, then decodes the batch one token per request per step."""
    outcomes = {}
    for item in items:
        rid = item.request_id
        kv_ready = receiver.wait(rid, timeout=300)
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

    def __init__(self, model: TinyLlama, *, num_blocks: int, tokens_per_block: int, aware: bool = False) -> None:
        """``aware``: keep a prefix cache and advertise the blocks it still holds."""
        self.worker = Worker(model, num_blocks=num_blocks, tokens_per_block=tokens_per_block, prefix_cache=aware)
        self.receiver = KVReceiver(self.worker.pool)
        self.transport: Transport = InProcessTransport(self.receiver)
        self._blocks: dict[int, list[int]] = {}

    def allocate(self, request_id: int, prompt: Sequence[int]) -> Allocation:
        allocation = _allocate(self.worker, self.receiver, request_id, prompt)
        self._blocks[request_id] = allocation.blocks
        return allocation

    def finish_batch(self, items: Sequence[FinishItem], *, digests: bool = False) -> dict[int, GenerationOutcome]:
        return _finish(self.worker, self.receiver, self._blocks, items, digests)

    def close(self) -> None:
        """Nothing to stop: the worker lives in this process."""


class RemoteGeneration:
    """A generation worker in a spawned process, reached by ``transport`` (shm and staging
    serve CPU or CUDA pools as noted in kvferry.bench_copy; cuda-ipc needs CUDA)."""

    def __init__(
        self, cfg: ModelConfig, *, device: str, num_blocks: int, tokens_per_block: int, transport: str, src_pool: Any = None, aware: bool = False
    ) -> None:
        if transport not in TRANSPORTS[1:]:
            raise ValueError(f"invalid transport={transport!r}: choose from {', '.join(TRANSPORTS[1:])}")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        authkey = secrets.token_bytes(32)
        self._proc = ctx.Process(target=_generation_main, args=(child, cfg, device, num_blocks, tokens_per_block, transport, authkey, aware), daemon=True)
        self._proc.start()
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        self.transport = _open_transport(transport, reply, authkey, src_pool)

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


def _open_transport(kind: str, address: str, authkey: bytes, src_pool: Any) -> Transport:
    if kind == "shm":
        from kvferry.shm import ShmTransport

        return ShmTransport(address, authkey=authkey)
    if kind == "cuda-ipc":
        from kvferry.local import CudaIpcTransport

        return CudaIpcTransport(address, authkey=authkey)
    if kind == "staging":
        from kvferry.staging import StagingTransport

        return StagingTransport(address, authkey=authkey)
    from kvferry.nixl_link import NixlTransport

    return NixlTransport(address, authkey=authkey, src=src_pool)


def _generation_main(conn: Any, cfg: ModelConfig, device: str, num_blocks: int, tpb: int, kind: str, authkey: bytes, aware: bool) -> None:
    try:
        model = TinyLlama(cfg, device)
        shared = None
        if kind == "shm":
            from kvferry.shm import SharedPool

            shape = (num_blocks, 2, tpb, cfg.kv_heads, cfg.head_dim)
            shared = SharedPool.create(num_layers=cfg.layers, shape=shape, dtype=cfg.dtype, tokens_per_block=tpb)
            pool = shared.pool
        else:
            pool = new_kv_pool(cfg, num_blocks, tpb, device)
        worker = Worker(model, num_blocks=num_blocks, tokens_per_block=tpb, prefix_cache=aware, pool=pool)
        receiver = KVReceiver(worker.pool)
        endpoint = _endpoint(kind, receiver, shared, authkey, num_blocks)
    except Exception as err:  # reported to the parent, which raises it
        conn.send(err)
        return
    conn.send(endpoint.address)
    blocks: dict[int, list[int]] = {}
    while True:
        message = conn.recv()
        try:
            if message[0] == "stop":
                break
            if message[0] == "allocate":
                _, rid, prompt = message
                allocation = _allocate(worker, receiver, rid, prompt)
                blocks[rid] = allocation.blocks
                conn.send(allocation)
            else:
                _, items, digests = message
                conn.send(_finish(worker, receiver, blocks, items, digests))
        except Exception as err:  # reported to the parent, which raises it
            conn.send(err)
    endpoint.close()
    del worker, receiver, pool
    if shared is not None:
        shared.close()


def _endpoint(kind: str, receiver: KVReceiver, shared: Optional[Any], authkey: bytes, num_blocks: int) -> Any:
    if kind == "shm":
        from kvferry.shm import ShmEndpoint

        assert shared is not None, "an shm endpoint serves a shared pool"
        return ShmEndpoint(receiver, shared, authkey=authkey)
    if kind == "cuda-ipc":
        from kvferry.local import CudaIpcEndpoint

        return CudaIpcEndpoint(receiver, authkey=authkey)
    if kind == "staging":
        from kvferry.staging import StagingEndpoint

        return StagingEndpoint(receiver, authkey=authkey, capacity_blocks=num_blocks)
    from kvferry.nixl_link import NixlEndpoint

    return NixlEndpoint(receiver, authkey=authkey)
