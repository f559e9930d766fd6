"""Aggregated and disaggregated serving with the reference engine.

Both cache prompt blocks only (not decoded tokens): a disaggregated context worker never
sees decode KV, so this keeps each turn's reuse, and therefore each prefill computation,
identical in the two modes, which is what makes their greedy outputs comparable token for
token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Sequence

import torch

from kvferry._core import BlockRange
from kvferry.engine import ThreadCopyEngine
from kvferry.hook import TransferHook
from kvferry.refengine.generation import FinishItem, GenerationHost, LocalGeneration, RemoteGeneration
from kvferry.refengine.model import TinyLlama
from kvferry.refengine.worker import Worker
from kvferry.sender import KVSender
from kvferry.transports import registry

__all__ = ["Aggregated", "Disaggregated", "Turn", "TurnResult"]


@dataclass(frozen=True)
class Turn:
    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclass
class TurnResult:
    request_id: int
    outputs: list[int]
    prompt_len: int
    reused_len: int
    # Monotonic timestamps (seconds).
    admitted: float = 0.0
    prefill_start: float = 0.0
    prefill_done: float = 0.0  # this request's last chunk computed
    step_done: float = 0.0  # ... and the scheduler step holding it finished (batch forward)
    kv_ready: float = 0.0
    first_decode: float = 0.0  # the generation worker starts decoding
    first_token_at_gen: float = 0.0  # ... and has its first decoded token
    kv_mismatch_blocks: int = 0
    notices: list = field(default_factory=list)
    # With ``check_kv``: one hash per prompt block of the KV this request's prefill wrote.
    digests: list[str] = field(default_factory=list)


def _chunks(start: int, end: int, chunk: Optional[int]) -> list[tuple[int, int]]:
    step = chunk or (end - start)
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def _argmax(logits: torch.Tensor) -> int:
    return int(logits.argmax())


class Aggregated:
    """One worker does prefill and decode."""

    def __init__(self, model: TinyLlama, *, num_blocks: int, tokens_per_block: int, chunk_size: Optional[int]) -> None:
        self.worker = Worker(model, num_blocks=num_blocks, tokens_per_block=tokens_per_block)
        self.chunk_size = chunk_size

    def run(self, turns: Sequence[Turn], *, check_kv: bool = False) -> dict[int, TurnResult]:
        """``check_kv``: also hash each request's prompt blocks after its prefill."""
        results = {}
        for turn in turns:
            admitted = time.monotonic()
            state = self.worker.admit(turn.request_id, turn.prompt)
            result = TurnResult(
                turn.request_id,
                [],
                state.prompt_len,
                state.reused_len,
                admitted=admitted,
                prefill_start=time.monotonic(),
            )
            for _, end in _chunks(state.reused_len, state.prompt_len, self.chunk_size):
                logits = self.worker.forward(turn.request_id, end)
            result.prefill_done = result.kv_ready = time.monotonic()
            if check_kv:
                result.digests = self.worker.block_digests(state.blocks, state.prompt_len)
            result.outputs = self.worker.decode(turn.request_id, turn.max_new_tokens, _argmax(logits))
            self.worker.finish(turn.request_id, cache_tokens=state.prompt_len)
            results[turn.request_id] = result
        return results


class Disaggregated:
    """A context worker driven through the executor hook, and a generation worker in this
    process (default, ``transport="in-process"``) or another one (``transport``: any other
    name of `kvferry.transports.registry` serving the model's device)."""

    def __init__(
        self,
        model: TinyLlama,
        *,
        num_blocks: int,
        tokens_per_block: int,
        chunk_size: Optional[int],
        early: bool = True,
        overlap: bool = False,
        transport: str = "in-process",
        link_gbps: Optional[float] = None,
        record: bool = False,
        aware: bool = False,
        dedup: bool = False,
        layer_groups: Optional[int] = None,
        listen: str = "unix://",
        netns: Optional[str] = None,
        generation_host: Optional[GenerationHost] = None,
        ring_blocks: Optional[int] = None,
    ) -> None:
        """``listen`` and ``netns`` place a generation worker in another process (see
        `RemoteGeneration`; ``ring_blocks``: its staging ring's capacity, None for the
        endpoint's default); ``generation_host``: that process, shared with other engines'
        generation workers (None: one of its own). ``link_gbps`` emulates a slower link for
        CPU pools (see `ThreadCopyEngine`);
        ``record`` keeps every transfer's timing in ``self.hook.sender.records``; ``aware``
        turns on receiver prefix awareness (the generation worker keeps the prompts' blocks
        and advertises those it still holds, which then never cross); ``dedup`` turns on
        in-flight dedup (a full block that another request's transfer is already bringing
        is mapped and awaited instead of sent again). ``layer_groups`` turns on layer-wise
        streaming with that many groups of consecutive layers (1 to the model's layers):
        during the chunk that ends a request's prompt, each group's part of the blocks the
        chunk completes leaves as soon as the forward wrote the group's last layer
        (`TransferHook.after_layer`); None (default): whole blocks after the forward."""
        layers = model.cfg.geometry.layers
        if layer_groups is not None and not 1 <= layer_groups <= layers:
            raise ValueError(f"invalid layer_groups={layer_groups}: must be None or 1 to the model's {layers} layers")
        self.ctx = Worker(model, num_blocks=num_blocks, tokens_per_block=tokens_per_block)
        self.generation: LocalGeneration | RemoteGeneration
        device = "cuda" if model.device.type == "cuda" else "cpu"
        remote = registry.check(transport, device=device).has_endpoint
        if not remote:
            self.generation = LocalGeneration(
                model, num_blocks=num_blocks, tokens_per_block=tokens_per_block, aware=aware, dedup=dedup
            )
        else:
            self.generation = RemoteGeneration(
                model.cfg,
                device=device,
                num_blocks=num_blocks,
                tokens_per_block=tokens_per_block,
                transport=transport,
                src_pool=self.ctx.pool,
                aware=aware,
                dedup=dedup,
                listen=listen,
                netns=netns,
                host=generation_host,
                ring_blocks=ring_blocks,
            )
        engine = ThreadCopyEngine(link_gbps) if self.ctx.pool.device.type == "cpu" else None
        if link_gbps is not None and engine is None:
            raise ValueError("link_gbps emulates a link for CPU pools only; on CUDA use a real transport")
        # A remote receiver may still have work on arrival (the staging path's second leg):
        # post each write as soon as it finished rather than at the next scheduler step.
        sender = KVSender(
            self.ctx.pool,
            self.generation.transport,
            pipelined=early,
            engine=engine,
            record=record,
            progress=remote,
            layer_groups=layer_groups or 1,
        )
        self.hook = TransferHook(sender)
        # The context worker keeps a request's blocks (the reused prefix-cache blocks too)
        # referenced while its transfer still reads them.
        self.ctx.leased = self.hook.leased
        self.chunk_size = chunk_size
        self.overlap = overlap
        self.layer_groups = layer_groups

    def run(self, turns: Sequence[Turn], *, check_kv: bool = False) -> dict[int, TurnResult]:
        """Runs a batch of turns: all prefill together (one scheduler step per chunk), then
        the generation worker decodes the batch once each request's KV has arrived."""
        results: dict[int, TurnResult] = {}
        plans: dict[int, list[tuple[int, int]]] = {}
        for turn in turns:
            rid = turn.request_id
            admitted = time.monotonic()
            state = self.ctx.admit(rid, turn.prompt)
            allocation = self.generation.allocate(rid, turn.prompt)
            held = [BlockRange(s, e) for s, e in allocation.held]
            self.hook.add_request(
                rid,
                state.prompt_len,
                reused_len=state.reused_len,
                src_blocks=state.blocks,
                dst_blocks=allocation.blocks,
                held=held,
                epoch=allocation.epoch,
            )
            results[rid] = TurnResult(rid, [], state.prompt_len, state.reused_len, admitted=admitted)
            plans[rid] = _chunks(state.reused_len, state.prompt_len, self.chunk_size)
        first: dict[int, int] = {}
        step = 0
        live = [t.request_id for t in turns]
        if self.overlap:  # the first batch is queued before anything runs
            self.hook.on_batch_queued(live)
        while live:
            batch = [rid for rid in live if step < len(plans[rid])]
            if not self.overlap:
                self.hook.before_forward(batch)
            starts, ends = [], []
            for rid in batch:
                start, end = plans[rid][step]
                if step == 0:
                    results[rid].prefill_start = time.monotonic()
                on_layer = None
                if self.layer_groups is not None and end == results[rid].prompt_len:
                    # The last chunk: each layer group's blocks leave as the forward passes it.
                    # This engine runs a batch as one forward per request, so the hook hears
                    # of each request's layers on their own (a batch of one).
                    on_layer = partial(self._after_layer, rid, start, end)
                logits = self.ctx.forward(rid, end, on_layer=on_layer)
                starts.append(start)
                ends.append(end)
                if end == results[rid].prompt_len:
                    first[rid] = _argmax(logits)
                    results[rid].prefill_done = time.monotonic()
            step_done = time.monotonic()
            for rid in batch:
                if rid in first and not results[rid].step_done:
                    results[rid].step_done = step_done
            step += 1
            live = [rid for rid in batch if step < len(plans[rid])]
            if self.overlap and live:
                # Batch n+1 is queued before batch n's transfers are issued: its early sends
                # must not wait for them.
                self.hook.on_batch_queued(live)
            self.hook.after_forward(batch, starts, ends)
            self.hook.poll()
        src_digests = {}
        for turn in turns:
            rid = turn.request_id
            self.hook.finish(rid)  # its copies are done: the source blocks may be released
            if check_kv:
                src_digests[rid] = self.ctx.block_digests(self.ctx.requests[rid].blocks, results[rid].prompt_len)
            self.ctx.finish(rid)
        items = [FinishItem(t.request_id, t.prompt, first[t.request_id], t.max_new_tokens) for t in turns]
        outcomes = self.generation.finish_batch(items, digests=check_kv)
        for rid, outcome in outcomes.items():
            result = results[rid]
            result.kv_ready, result.first_decode = outcome.kv_ready, outcome.first_decode
            result.first_token_at_gen, result.outputs, result.notices = (
                outcome.first_token_at_gen,
                outcome.outputs,
                outcome.notices,
            )
            if check_kv:
                result.digests = src_digests[rid]
                result.kv_mismatch_blocks = sum(a != b for a, b in zip(src_digests[rid], outcome.digests))
        return results

    def _after_layer(self, request_id: int, start: int, end: int, layer: int) -> None:
        self.hook.after_layer([request_id], [start], [end], layer)

    def close(self) -> None:
        self.hook.sender.close()
        self.generation.close()
