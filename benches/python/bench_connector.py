"""The connector's own cost per engine step (issue 22, part 2): kvferry's scheduler half
(`SchedulerSide`) and worker halves (`DecodeWorker`, `PrefillWorker`) driven with vLLM's real
``Request`` / ``SchedulerOutput`` objects, no model and no forward. Needs vLLM, so it runs in
.venv-vllm:

    PYTHONPATH=python .venv-vllm/bin/python -m pytest benches/python/bench_connector.py \\
        --benchmark-only --benchmark-columns=median,rounds

Groups (each benchmark's extra_info names its sizes):
``digest``            `prompt_digest` of a 1k/32k/128k-token prompt (both schedulers run it per
                      new request: the decode side in update_state_after_alloc, the prefill
                      side when it checks the destination);
                      ``bench_vllm_request`` in the same group is the baseline: vLLM's own
                      Request with its prefix-cache block hashes, on the same thread;
``admit-recv``        one new decode request through get_num_new_matched_tokens +
                      update_state_after_alloc (1k/32k/128k tokens);
``sched-step``        build_connector_meta + update_connector_output on a server running
                      16/64/256 requests, 8 of them sends with a chunk this step;
``decode-results``    DecodeWorker.results (vLLM's get_finished) with 64 requests waiting for
                      their KV, none arrived, over a real receiver and rendezvous;
``prefill-settle``    PrefillWorker.results settling 16/64/256 finished sends whose blocks all
                      landed (in-process transport: kvferry's sender and receiver, no socket).
"""

from __future__ import annotations

import itertools
import random
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from kvferry.hook import TransferHook
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports.inprocess import InProcessTransport
from kvferry.vllm.config import ConnectorConfig, prompt_digest
from kvferry.vllm.decode_worker import DecodeWorker
from kvferry.vllm.metadata import KvferryWorkerMeta, SendSpec
from kvferry.vllm.prefill_worker import PrefillWorker, _Peer, _Send
from kvferry.vllm.scheduler import SchedulerSide, _Lookup, _Sending
from kvferry.vllm.worker import WorkerCommon
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import helpers  # noqa: E402  (tests/helpers.py: the decode worker the vLLM step tests use too)

TPB = 16  # vLLM's CPU block size
PROMPTS = (1024, 32 * 1024, 128 * 1024)
RUNNING = (16, 64, 256)
WAITING = 64
SENDS_PER_STEP = 8
_ids = itertools.count()


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


def _request(prompt: list[int], params: dict[str, Any] | None) -> Request:
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params else None)
    return Request(f"req-{next(_ids)}", prompt, sampling, None)


class _Manager:
    """What the scheduler half asks of vLLM's KV cache manager: a request's block table."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def get_block_ids(self, rid: str) -> tuple[list[int]]:
        return (self.tables[rid],)


def _scheduler(role: str, manager: _Manager) -> SchedulerSide:
    return SchedulerSide(
        ConnectorConfig(), block_size=TPB, role=role, engine_id="E", kv_cache_manager_getter=lambda: manager,
        authkey=b"k" * 32,
    )  # fmt: skip


def _output(new: list[NewRequestData], cached: CachedRequestData, scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


@pytest.mark.parametrize("tokens", PROMPTS)
def bench_digest(benchmark: Any, tokens: int) -> None:
    prompt = _prompt(tokens)
    benchmark.group = "digest"
    benchmark.extra_info.update(tokens=tokens)
    benchmark(prompt_digest, prompt)


@pytest.mark.parametrize("tokens", PROMPTS)
def bench_vllm_request(benchmark: Any, tokens: int) -> None:
    """The baseline: what vLLM itself does for a new request on the same thread, its Request
    with the prefix cache's block hashes (vLLM's default algorithm, sha256, 16-token blocks)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(TPB, hash_fn)
    prompt = _prompt(tokens)
    sampling = SamplingParams(max_tokens=1)
    benchmark.group = "digest"
    benchmark.extra_info.update(tokens=tokens)
    benchmark.pedantic(
        lambda: Request("r", prompt, sampling, None, block_hasher=hasher), rounds=30 if tokens > 32_000 else 100
    )


@pytest.mark.parametrize("tokens", PROMPTS)
def bench_admit_recv(benchmark: Any, tokens: int) -> None:
    """A new decode request (op recv, as the proxy's kvferry flow sets it) admitted."""
    manager = _Manager()
    side = _scheduler("kv_consumer", manager)
    prompt = _prompt(tokens)
    table = list(range(-(-tokens // TPB)))

    def setup() -> tuple[tuple[Request], dict[str, Any]]:
        req = _request(prompt, {"kvferry": {"op": "recv", "transfer": f"T{next(_ids)}"}})
        manager.tables[req.request_id] = table
        return (req,), {}

    def admit(req: Request) -> None:
        need, is_async = side.get_num_new_matched_tokens(req, 0)
        assert is_async and need == tokens
        side.update_state_after_alloc(req, None, need)

    benchmark.group = "admit-recv"
    benchmark.extra_info.update(tokens=tokens)
    benchmark.pedantic(admit, setup=setup, rounds=30 if tokens > 32_000 else 100)


@pytest.mark.parametrize("running", RUNNING)
def bench_sched_step(benchmark: Any, running: int) -> None:
    """One step of a prefill server running ``running`` requests, decoding, of which
    SENDS_PER_STEP are sends still prefilling (one 512-token chunk each this step)."""
    manager = _Manager()
    side = _scheduler("kv_producer", manager)
    rids = [f"r{i}" for i in range(running)]
    for rid in rids:
        manager.tables[rid] = list(range(64))
    for rid in rids[:SENDS_PER_STEP]:
        # The same step is replayed every round: a prompt long enough that each round has its chunk.
        spec = SendSpec(rid, f"T-{rid}", 1 << 50, 0, "unix:///p", {}, 60.0)
        side._sending[rid] = _Sending(spec, _Lookup(threading.Event(), spec.transfer, None, None, 0.0), emitted=True)
    computed = [512 if rid in side._sending else 1000 for rid in rids]
    cached = CachedRequestData(
        req_ids=rids,
        resumed_req_ids=set(),
        new_token_ids=[[] for _ in rids],
        all_token_ids={},
        new_block_ids=[None for _ in rids],
        num_computed_tokens=computed,
        num_output_tokens=[0 for _ in rids],
    )
    scheduled = {rid: 512 if rid in side._sending else 1 for rid in rids}
    out = _output([], cached, scheduled)
    worker_out = type("Out", (), {"kv_connector_worker_meta": KvferryWorkerMeta([])})()

    def step() -> None:
        meta = side.build_connector_meta(out)
        assert len(meta.chunks) == SENDS_PER_STEP
        side.record(worker_out.kv_connector_worker_meta.outcomes)

    benchmark.group = "sched-step"
    benchmark.extra_info.update(running=running, sends=SENDS_PER_STEP)
    benchmark(step)


@pytest.fixture
def decode_worker() -> Iterator[DecodeWorker]:
    with tempfile.TemporaryDirectory() as where, helpers.decode_worker(where, WAITING * 4, TPB) as worker:
        yield worker


def bench_decode_results(benchmark: Any, decode_worker: DecodeWorker) -> None:
    """get_finished on a decode server with WAITING requests waiting for KV, none arrived."""
    manager = _Manager()
    side = _scheduler("kv_consumer", manager)
    prompt = _prompt(4 * TPB)
    for i in range(WAITING):
        req = _request(prompt, {"kvferry": {"op": "recv", "transfer": f"W{i}"}})
        manager.tables[req.request_id] = list(range(4 * i, 4 * i + 4))
        need, _ = side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, None, need)
    decode_worker.bind(side.build_connector_meta(_output([], CachedRequestData.make_empty(), {})))
    assert len(decode_worker._recv) == WAITING

    def step() -> None:
        arrived, failed = decode_worker.results(set())
        assert not arrived and not failed

    benchmark.group = "decode-results"
    benchmark.extra_info.update(waiting=WAITING)
    benchmark(step)


@pytest.mark.parametrize("sends", RUNNING)
def bench_prefill_settle(benchmark: Any, sends: int) -> None:
    """get_finished on a prefill server whose ``sends`` finished requests all landed."""
    shape = (sends + 1, 2, TPB, 16)
    src = WorkerCommon(ConnectorConfig(), block_size=TPB, num_blocks=sends + 1, authkey=b"k" * 32)
    src.register_kv_caches({"layers.0.attn": torch.randn(shape)}, lambda n: 0)
    receiver = KVReceiver(type(src.pool)((torch.zeros(shape),), TPB))
    worker = PrefillWorker(src)

    def setup() -> tuple[tuple[set[str]], dict[str, Any]]:
        # One live sender at a time: the last round's threads would contend for the GIL.
        for old in worker._peers.values():
            old.sender.close()
        for kv in list(receiver._requests):  # the last round's, complete: the decode side's part, untimed
            receiver.release(kv, 0)
        sender = KVSender(src.pool, InProcessTransport(receiver), record=True, progress=True)
        peer = _Peer("inprocess", sender, TransferHook(sender))
        worker._peers = {"inprocess": peer}
        finished = set()
        for i in range(sends):
            kv = next(_ids)
            epoch = receiver.expect(kv, TPB)
            rid = f"s{kv}"
            spec = SendSpec(rid, f"T{kv}", TPB, 0, "p", {"request_id": kv, "held_blocks": 0}, 60.0)
            peer.hook.add_request(kv, TPB, reused_len=0, src_blocks=np.array([i]), dst_blocks=[i], epoch=epoch)
            peer.hook.after_forward([kv], [0], [TPB])
            worker._send[rid] = _Send(spec, kv, peer, 1, added=True, early_done=True)
            finished.add(rid)
        for rid in finished:
            receiver.wait(worker._send[rid].kv_id, timeout=30)
        return (finished,), {}

    def settle(finished: set[str]) -> None:
        done = worker.results(finished)
        assert done == finished, (len(done), len(finished))

    benchmark.group = "prefill-settle"
    benchmark.extra_info.update(sends=sends)
    try:
        benchmark.pedantic(settle, setup=setup, rounds=10)
    finally:
        for peer in worker._peers.values():
            peer.sender.close()
