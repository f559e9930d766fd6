"""Aggregated and disaggregated serving with the reference engine.

Both cache prompt blocks only (not decoded tokens): a disaggregated context worker never
sees decode KV, so this keeps each turn's reuse, and therefore each prefill computation,
identical in the two modes, which is what makes their greedy outputs comparable token for
token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from kvferry.engine import ThreadCopyEngine
from kvferry.hook import TransferHook
from kvferry.receiver import KVReceiver
from kvferry.refengine.model import ModelConfig, TinyLlama
from kvferry.refengine.worker import Worker
from kvferry.sender import KVSender
from kvferry.transport import InProcessTransport, Transport

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


def _chunks(start: int, end: int, chunk: Optional[int]) -> list[tuple[int, int]]:
    step = chunk or (end - start)
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def _stamp_first(result: TurnResult) -> None:
    if not result.first_token_at_gen:
        result.first_token_at_gen = time.monotonic()


def _argmax(logits: torch.Tensor) -> int:
    return int(logits.argmax())


class Aggregated:
    """One worker does prefill and decode."""

    def __init__(self, model: TinyLlama, *, num_blocks: int, tokens_per_block: int, chunk_size: Optional[int]) -> None:
        self.worker = Worker(model, num_blocks=num_blocks, tokens_per_block=tokens_per_block)
        self.chunk_size = chunk_size

    def run(self, turns: Sequence[Turn]) -> dict[int, TurnResult]:
        results = {}
        for turn in turns:
            admitted = time.monotonic()
            state = self.worker.admit(turn.request_id, turn.prompt)
            result = TurnResult(turn.request_id, [], state.prompt_len, state.reused_len, admitted=admitted, prefill_start=time.monotonic())
            for _, end in _chunks(state.reused_len, state.prompt_len, self.chunk_size):
                logits = self.worker.forward(turn.request_id, end)
            result.prefill_done = result.kv_ready = time.monotonic()
            result.outputs = self.worker.decode(turn.request_id, turn.max_new_tokens, _argmax(logits))
            self.worker.finish(turn.request_id, cache_tokens=state.prompt_len)
            results[turn.request_id] = result
        return results


class Disaggregated:
    """A context worker and a generation worker in one process, connected by ``transport``
    (in-process by default), driven through the executor hook."""

    def __init__(
        self,
        model: TinyLlama,
        *,
        num_blocks: int,
        tokens_per_block: int,
        chunk_size: Optional[int],
        early: bool = True,
        overlap: bool = False,
        gen_model: Optional[TinyLlama] = None,
        link_gbps: Optional[float] = None,
        record: bool = False,
    ) -> None:
        """``link_gbps`` emulates a slower link for CPU pools (see `ThreadCopyEngine`);
        ``record`` keeps every transfer's timing in ``self.hook.sender.records``."""
        self.ctx = Worker(model, num_blocks=num_blocks, tokens_per_block=tokens_per_block)
        self.gen = Worker(gen_model or model, num_blocks=num_blocks, tokens_per_block=tokens_per_block, prefix_cache=False)
        self.receiver = KVReceiver(self.gen.pool)
        engine = ThreadCopyEngine(link_gbps) if self.ctx.pool.device.type == "cpu" else None
        if link_gbps is not None and engine is None:
            raise ValueError("link_gbps emulates a link for CPU pools only; on CUDA use a real transport")
        sender = KVSender(self.ctx.pool, InProcessTransport(self.receiver), pipelined=early, engine=engine, record=record)
        self.hook = TransferHook(sender)
        self.chunk_size = chunk_size
        self.overlap = overlap

    def run(self, turns: Sequence[Turn], *, check_kv: bool = False) -> dict[int, TurnResult]:
        """Runs a batch of turns: all prefill together (one scheduler step per chunk), then
        each request decodes on the generation worker once its KV has arrived."""
        results: dict[int, TurnResult] = {}
        dst_blocks: dict[int, list[int]] = {}
        plans: dict[int, list[tuple[int, int]]] = {}
        for turn in turns:
            rid = turn.request_id
            admitted = time.monotonic()
            state = self.ctx.admit(rid, turn.prompt)
            dst_blocks[rid] = self.gen.alloc.allocate(len(state.blocks))
            self.receiver.expect(rid, state.prompt_len)
            self.hook.add_request(rid, state.prompt_len, reused_len=state.reused_len, src_blocks=state.blocks, dst_blocks=dst_blocks[rid])
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
                logits = self.ctx.forward(rid, end)
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
        for turn in turns:
            rid = turn.request_id
            self.hook.finish(rid)
            result = results[rid]
            result.kv_ready = self.receiver.wait(rid, timeout=60)
            result.notices = self.receiver.notices(rid)
            self.receiver.release(rid)
            if check_kv:
                result.kv_mismatch_blocks = self._kv_mismatch(self.ctx.requests[rid].blocks, dst_blocks[rid], result.prompt_len)
            self.ctx.finish(rid)
            self.gen.admit_with_blocks(rid, turn.prompt, dst_blocks[rid], computed=result.prompt_len)
            result.first_decode = time.monotonic()
            result.outputs = [first[rid]]
        # The generation worker decodes its batch one token per request per step.
        for _ in range(max(t.max_new_tokens for t in turns) - 1):
            for turn in turns:
                result = results[turn.request_id]
                if len(result.outputs) < turn.max_new_tokens:
                    result.outputs.append(self.gen.step(turn.request_id, result.outputs[-1]))
                    _stamp_first(result)
        for turn in turns:
            self.gen.finish(turn.request_id)
        return results

    def _kv_mismatch(self, src_blocks: list[int], dst_blocks: list[int], prompt_len: int) -> int:
        """Blocks whose prompt-token slots differ between the two pools (0 when bit exact)."""
        tpb = self.ctx.tpb
        bad = 0
        for i, (s, d) in enumerate(zip(src_blocks, dst_blocks)):
            used = min(tpb, prompt_len - i * tpb)
            for a, b in zip(self.ctx.pool.layers, self.gen.pool.layers):
                if not torch.equal(a[s, :, :used].contiguous().view(torch.uint8), b[d, :, :used].contiguous().view(torch.uint8)):
                    bad += 1
                    break
        return bad
