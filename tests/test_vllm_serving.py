"""KvferryConnector under serving conditions (issue 19), in real vLLM engines
(tests/vllm_harness.py): a decode engine whose small KV pool makes vLLM preempt running
requests, a decode engine under ``kv_load_failure_policy: "recompute"`` whose prefill engine
is killed mid-transfer, requests refused under that policy, a decode engine held full while
the prefill engine computes (admission), a prefill engine whose small pool makes vLLM preempt
there, a prefill engine killed and replaced. Each scenario is forced and checked (the
preemption count, the point a server is killed at, an engine stopped while full), every
completed request's greedy output equals a plain engine's, and no block stays allocated
afterwards.

Bounds: a decode request waits at most its ``timeout_s`` (given per request below) for its
blocks, a prefill request at most ``destination_timeout_s`` (or its send's ``timeout_s``)
for its destination; every engine command here is bounded by `Engine.result`'s timeout.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import sys
import uuid
from typing import Any

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM (and transformers) not importable: run in the vLLM venv, see docs/vllm.md"
)

sys.path.insert(0, os.path.dirname(__file__))
from sched_fakes import Manager, Request, Status, publish, scheduler_pair, step  # noqa: E402
from vllm_harness import BLOCK, Engine, hello_of, model_with_own_key_dir, prompt_of, wait_until  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 32
BLOCK_BYTES = LAYERS * KV_HEADS * BLOCK * 2 * HEAD_DIM * 4  # one block over all layers, fp32
SMALL_POOL = 41  # blocks: six requests of 200-280 prompt tokens and 150 output tokens outgrow it
WAIT_S = 60.0  # what a decode request waits for its blocks at most


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from model_with_own_key_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def prefill(model: str) -> Any:
    engine = Engine(
        model, "kv_producer", {"transfer_timeout_s": WAIT_S, "destination_timeout_s": WAIT_S}, max_num_batched_tokens=64
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def plain(model: str) -> Any:
    engine = Engine(model, None)
    yield engine
    engine.close()


def recv(transfer: str) -> dict[str, Any]:
    return {"kvferry": {"op": "recv", "transfer": transfer, "timeout_s": WAIT_S}}


def send(hello: dict[str, Any], transfer: str) -> dict[str, Any]:
    return {"kvferry": {"op": "send", "transfer": transfer, "peer": hello["peer"], "peer_mac": hello["peer_mac"]}}


def no_blocks_used(*engines: Engine) -> None:
    for engine in engines:
        usage = engine.call("usage")
        assert usage == {"used": 0, "requests": 0}, usage


def served(
    prefill: Engine, decode: Engine, plain: Engine, prompts: list[list[int]], out: int, tag: str
) -> dict[str, Any]:
    """All ``prompts`` at once through the pair (the decode halves first, then the prefill
    halves), each decode output checked against the plain engine's."""
    hello = hello_of(decode)
    transfers = [uuid.uuid4().hex for _ in prompts]
    decode.start(
        "run", [(f"d-{tag}{i}", p, out, recv(t)) for i, (p, t) in enumerate(zip(prompts, transfers))], None, None
    )
    sent = prefill.run([(f"p-{tag}{i}", p, 1, send(hello, t)) for i, (p, t) in enumerate(zip(prompts, transfers))])[
        "outputs"
    ]
    got = decode.result(timeout=600.0)["outputs"]  # a loaded 2-core box: six long decodes and their recomputes
    want = plain.run([(f"r-{tag}{i}", p, out, None) for i, p in enumerate(prompts)])["outputs"]
    for i in range(len(prompts)):
        d = got[f"d-{tag}{i}"]
        assert d["finish_reason"] == "length", (i, d, sent[f"p-{tag}{i}"])
        assert d["tokens"] == want[f"r-{tag}{i}"]["tokens"], i
    return got


# -- decode-side preemption -----------------------------------------------------------------


@pytest.fixture(scope="module")
def small_decode(model: str) -> Any:
    engine = Engine(
        model,
        "kv_consumer",
        {"transfer_timeout_s": WAIT_S},
        kv_cache_memory_bytes=SMALL_POOL * BLOCK_BYTES,
        max_model_len=1024,
    )
    yield engine
    engine.close()


def test_decode_preemption_takes_one_transfer_and_recomputes(
    prefill: Engine, small_decode: Engine, plain: Engine
) -> None:
    """Six requests (200-280 prompt and 150 output tokens: 2,300 tokens against a pool of
    1,312) whose outputs outgrow the decode pool: vLLM preempts running requests
    after their blocks arrived; each is recomputed from the decode engine's own prefix cache
    (never a second transfer, never a negative held count) and its output is a plain
    engine's."""
    rng = random.Random(5)
    prompts = [prompt_of(rng.randrange(200, 281), 100 + i) for i in range(6)]
    before = small_decode.call("preemptions")
    served(prefill, small_decode, plain, prompts, 150, "pre")
    assert small_decode.call("preemptions") > before  # the scenario happened
    no_blocks_used(prefill, small_decode)
    served(prefill, small_decode, plain, [prompt_of(90, 7)], 6, "after")  # still serves


# -- kv_load_failure_policy "recompute" -----------------------------------------------------


@pytest.fixture(scope="module")
def recompute_decode(model: str) -> Any:
    engine = Engine(model, "kv_consumer", {"transfer_timeout_s": WAIT_S, "fence_timeout_s": 2.0}, policy="recompute")
    yield engine
    engine.close()


def test_recompute_policy_survives_a_killed_prefill_server(
    model: str, prefill: Engine, recompute_decode: Engine, plain: Engine
) -> None:
    """The prefill engine is killed mid-transfer: the decode engine reports the load failed
    and vLLM recomputes the request there (one load per request: no second receive); its
    output is a plain engine's."""
    decode = recompute_decode
    doomed = Engine(model, "kv_producer", max_num_batched_tokens=64)
    prompt, transfer = prompt_of(200, 17), uuid.uuid4().hex
    try:
        hello = hello_of(decode)
        assert decode.run([("d-orphan", prompt, 6, recv(transfer))], until=("d-orphan", "waiting_for_blocks"))[
            "stopped_at"
        ]
        assert doomed.run([("p-orphan", prompt, 1, send(hello, transfer))], until=("p-orphan", "mid_prefill"))[
            "stopped_at"
        ]
    finally:
        doomed.process.kill()  # mid-transfer: its connection ends with it
        doomed.process.join(30)
    decode.start("run", [], None, None)
    out = decode.result(timeout=WAIT_S + 30)["outputs"]["d-orphan"]
    assert out["finish_reason"] == "length", out
    assert out["tokens"] == plain.run([("r-orphan", prompt, 6, None)])["outputs"]["r-orphan"]["tokens"]
    no_blocks_used(decode)
    served(prefill, decode, plain, [prompt_of(90, 8)], 6, "rc-after")


def test_recompute_policy_answers_a_refused_request_once(recompute_decode: Engine, plain: Engine) -> None:
    """A request the decode engine refuses (its parameters) under "recompute": its failed
    load is reported once, vLLM computes it locally, the refusal rides on its answer (it
    looped on the refusal before)."""
    prompt = prompt_of(80, 9)
    bad = {"kvferry": {"op": "recv", "transfer": 7}}  # not a string
    decode = recompute_decode
    decode.start("run", [("d-bad", prompt, 6, bad)], None, None)
    out = decode.result(timeout=60)["outputs"]["d-bad"]
    assert out["finish_reason"] == "length", out
    assert out["tokens"] == plain.run([("r-bad", prompt, 6, None)])["outputs"]["r-bad"]["tokens"]
    assert "transfer" in out["kv_transfer_params"]["kvferry"]["error"], out
    no_blocks_used(decode)


# -- a prefill request that ends before its first chunk (nixl) ------------------------------


def test_prefill_ending_before_its_first_chunk_frees_the_decode_blocks_with_nixl(model: str, plain: Engine) -> None:
    """NIXL writes are one-sided, so a decode request given up on keeps its blocks until its
    sender's fence. A prefill request that refuses its destination (another prompt) ends
    before its first chunk and abandons the transfer: its worker never wrote, so the decode
    engine frees the blocks at once, although that prefill engine stays connected (it kept
    them as long as the connection lasted before)."""
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl not importable")
    prefill = Engine(model, "kv_producer", {"transport": "nixl"}, max_num_batched_tokens=64)
    decode = Engine(model, "kv_consumer", {"transport": "nixl", "listen": "tcp://127.0.0.1:0", "fence_timeout_s": 1.0})
    try:
        served(prefill, decode, plain, [prompt_of(100, 30)], 6, "nx")  # the prefill engine connects
        hello, transfer = hello_of(decode), uuid.uuid4().hex
        decode.start("run", [("d-other", prompt_of(100, 31), 6, recv(transfer))], None, None)
        p = prefill.run([("p-other", prompt_of(100, 32), 1, send(hello, transfer))])["outputs"]["p-other"]
        d = decode.result(timeout=WAIT_S + 30)["outputs"]["d-other"]
        assert p["finish_reason"] == "error" and d["finish_reason"] == "error", (p, d)
        no_blocks_used(prefill, decode)
        assert decode.call("totals")["endpoints"], "the prefill engine's endpoint is still there"
    finally:
        prefill.close()
        decode.close()


# -- n > 1, the same prompt twice at once ---------------------------------------------------


def test_samples_and_twin_prompts_do_not_collide_on_one_transfer(
    prefill: Engine, small_decode: Engine, plain: Engine
) -> None:
    """``n = 3`` makes one vLLM request per sample, all naming one transfer: one receives,
    the others wait for its blocks and compute the rest (a second receive of one transfer
    failed them before). vLLM takes ``n > 1`` only with sampling: seeded, so the plain
    engine's samples are the reference. Two requests with the same prompt at once each have
    their own transfer, and equal a plain engine's greedy output."""
    decode = small_decode
    hello = hello_of(decode)
    prompt, twin = prompt_of(150, 50), prompt_of(120, 51)
    t_n, t_a, t_b = uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
    sampled = {"n": 3, "temperature": 1.0, "seed": 11}
    decode.start(
        "run",
        [("d-n", prompt, 6, recv(t_n), sampled), ("d-a", twin, 6, recv(t_a)), ("d-b", twin, 6, recv(t_b))],
        None,
        None,
    )
    sent = prefill.run(
        [("p-n", prompt, 1, send(hello, t_n)), ("p-a", twin, 1, send(hello, t_a)), ("p-b", twin, 1, send(hello, t_b))]
    )["outputs"]
    got = decode.result(timeout=WAIT_S + 30)["outputs"]
    want = plain.run([("r-n", prompt, 6, None, sampled), ("r-twin", twin, 6, None)])["outputs"]
    assert len(got["d-n"]["samples"]) == 3 and all(reason == "length" for _, reason in got["d-n"]["samples"]), (
        got["d-n"],
        sent,
    )
    assert sorted(got["d-n"]["samples"]) == sorted(want["r-n"]["samples"]), (got["d-n"], want["r-n"])
    for rid in ("d-a", "d-b"):
        assert (got[rid]["tokens"], got[rid]["finish_reason"]) == (want["r-twin"]["tokens"], "length"), (
            rid,
            got[rid],
            sent,
        )
    no_blocks_used(prefill, decode)


def test_a_twin_whose_hit_the_same_step_computes_sends_its_prefix_after_that_forward(
    prefill: Engine, small_decode: Engine, plain: Engine
) -> None:
    """vLLM caches a block when it schedules the tokens that fill it. Two sends of one
    120-token prompt whose destinations are known before either computes, under a 64-token
    budget: the first computes [0, 64), then [64, 120) beside the second, which finds
    blocks 0-6 as its hit although that step's forward writes blocks 4-6. Its early send
    would copy those blocks before they hold the prompt's KV (the decode engine then
    answered from garbage, at random in CI); it waits for the forward instead, counted as
    ``early_deferred``, and both decode requests answer as a plain engine does."""
    decode, hello = small_decode, hello_of(small_decode)
    twin = prompt_of(120, 52)
    t_a, t_b = uuid.uuid4().hex, uuid.uuid4().hex
    both = [("d-a2", twin, 6, recv(t_a)), ("d-b2", twin, 6, recv(t_b))]
    assert decode.run(both, until=("d-b2", "waiting_for_blocks"))["stopped_at"]
    decode.start("run", [], None, None)
    before = prefill.call("totals")["counts"].get("early_deferred", 0)
    sends = [("p-a2", twin, 1, send(hello, t_a)), ("p-b2", twin, 1, send(hello, t_b))]
    # One step starts both lookups; both end before either request computes.
    assert prefill.run(sends, until=("p-b2", "waiting_for_destination"))["stopped_at"]
    assert prefill.call("lookups_done", WAIT_S)
    sent = prefill.run([])["outputs"]
    assert all(out["finish_reason"] == "length" for out in sent.values()), sent
    got = decode.result(timeout=WAIT_S + 30)["outputs"]
    want = plain.run([("r-twin2", twin, 6, None)])["outputs"]["r-twin2"]["tokens"]
    for rid in ("d-a2", "d-b2"):
        assert (got[rid]["tokens"], got[rid]["finish_reason"]) == (want, "length"), (rid, got[rid], sent)
    assert prefill.call("totals")["counts"].get("early_deferred", 0) == before + 1
    no_blocks_used(prefill, decode)


# -- endpoints over time --------------------------------------------------------------------


@pytest.mark.parametrize("staging_bytes", [None, 1 << 20])
def test_decode_rings_default_to_their_caches_device_size(tmp_path: Any, staging_bytes: Any) -> None:
    """Each staging ring holds ``staging_bytes`` of whole blocks; unset, the size follows the
    caches' device: 64 MiB for CPU caches, 1 GiB for CUDA ones (`staging.RING_BYTES`)."""
    import torch
    from kvferry.layout import PagedKV
    from kvferry.transports.staging import RING_BYTES, default_ring_bytes
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker
    from kvferry.vllm.worker import WorkerCommon

    assert default_ring_bytes(torch.device("cpu")) == RING_BYTES["cpu"] == 64 << 20
    assert default_ring_bytes(torch.device("cuda", 3)) == RING_BYTES["cuda"] == 1 << 30
    config = ConnectorConfig(rendezvous_dir=str(tmp_path), staging_bytes=staging_bytes)
    common = WorkerCommon(config, block_size=4, num_blocks=8, authkey=b"k" * 32)
    common.pool = PagedKV(tuple(torch.zeros(8, 2, 4, 8) for _ in range(2)), 4)  # 1 KiB a block, both layers
    worker = DecodeWorker(common)
    worker.start()
    try:
        block = common.pool.block_bytes * common.pool.num_layers
        want = (staging_bytes or 64 << 20) // block
        assert set(worker._ring_of.values()) == {want} and worker._ring_blocks == want
        served = worker._endpoint_for("engine-0")  # what a prefill engine's first lookup makes
        assert worker.endpoints["engine-0"].endpoint.capacity == want, served
    finally:
        worker.close()


def test_departed_prefill_engines_free_their_endpoints(tmp_path: Any) -> None:
    """Each prefill restart is a new vLLM engine id, so a new endpoint: one a prefill engine
    no longer uses (no connection, no destination taken, past the grace) is closed, so 70
    restarts (or made-up sender names) never reach the 64-endpoint bound (they did before),
    while one that still holds a destination is kept."""
    import torch
    from kvferry.layout import PagedKV
    from kvferry.vllm import decode_worker
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker
    from kvferry.vllm.worker import WorkerCommon

    common = WorkerCommon(
        ConnectorConfig(rendezvous_dir=str(tmp_path), staging_bytes=1 << 20),
        block_size=4,
        num_blocks=8,
        authkey=b"k" * 32,
    )
    common.pool = PagedKV(tuple(torch.zeros(8, 2, 4, 8) for _ in range(2)), 4)
    worker = DecodeWorker(common)
    worker.start()
    try:
        later = decode_worker.ENDPOINT_GRACE_S + 1.0
        for i in range(decode_worker.MAX_PREFILL_ENGINES + 6):
            worker._endpoint_for(f"engine-{i}")  # what a lookup from a new engine does
            assert worker.sweep(time_now() + later) == [f"engine-{i}"]
        assert worker.endpoints == {}
        worker._endpoint_for("fresh")
        assert worker.sweep(time_now()) == [] and list(worker.endpoints) == ["fresh"]  # within its grace
        worker.rendezvous._taken["T"] = "fresh"  # type: ignore[union-attr]  # a lookup took a destination
        assert worker.sweep(time_now() + later) == [] and list(worker.endpoints) == ["fresh"]
    finally:
        worker.close()


def test_an_endpoint_handed_out_again_is_not_swept_before_its_engine_connects(tmp_path: Any) -> None:
    """A prefill engine's endpoint, idle past the grace, handed out again by a new lookup:
    the grace restarts then, so the step's sweep (which runs right after the publish that
    woke the lookup) does not close the endpoint whose URL just left. It did, and the
    prefill server then found no socket at that URL (a tensor-parallel decode server lost
    every such request)."""
    import torch
    from kvferry.layout import PagedKV
    from kvferry.vllm import decode_worker
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker
    from kvferry.vllm.worker import WorkerCommon

    common = WorkerCommon(ConnectorConfig(rendezvous_dir=str(tmp_path), staging_bytes=1 << 20), block_size=4,
                          num_blocks=8, authkey=b"k" * 32)  # fmt: skip
    common.pool = PagedKV(tuple(torch.zeros(8, 2, 4, 8) for _ in range(2)), 4)
    worker = DecodeWorker(common)
    worker.start()
    try:
        url = worker._endpoint_for("engine")
        worker._made["engine"] -= decode_worker.ENDPOINT_GRACE_S + 1.0  # idle past its grace
        assert worker._endpoint_for("engine") == url  # a new lookup hands it out again
        assert worker.sweep(time_now()) == [] and list(worker.endpoints) == ["engine"]
    finally:
        worker.close()


def test_made_up_sender_names_cannot_fill_the_endpoint_bound_within_the_grace(tmp_path: Any) -> None:
    """Lookups with made-up sender names, all within one grace period (no sweep): one naming
    a transfer no decode request published makes no endpoint; at the bound, one that took a
    real destination reclaims the oldest idle endpoint at once, so a new prefill engine that
    connects still gets one; engines connected or holding a destination are never reclaimed,
    and only they can fill the bound (before: 64 made-up names did, for 30 s)."""
    import torch
    from kvferry.errors import TransferError
    from kvferry.layout import PagedKV
    from kvferry.transports import registry
    from kvferry.vllm import decode_worker, rendezvous
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker
    from kvferry.vllm.worker import WorkerCommon

    key = b"k" * 32
    common = WorkerCommon(
        ConnectorConfig(rendezvous_dir=str(tmp_path), staging_bytes=1 << 20), block_size=4, num_blocks=8, authkey=key
    )
    common.pool = PagedKV(tuple(torch.zeros(8, 2, 4, 8) for _ in range(2)), 4)
    worker = DecodeWorker(common)
    worker.start()
    assert worker.rendezvous is not None
    address = worker.rendezvous.address
    destination = {"request_id": 1, "epoch": 1, "prompt_len": 8, "digest": "0" * 32, "block_size": 4,
                   "dst_blocks": [1, 2], "held_blocks": 0, "engine": "decode-0"}  # fmt: skip
    connected = None
    try:
        for i in range(decode_worker.MAX_PREFILL_ENGINES + 8):  # no such transfer: refused, no endpoint
            with pytest.raises(TransferError, match="no decode request expected it"):
                rendezvous.lookup(address, key, f"made-up-{i}", 0.0, f"fake-{i}")
        assert worker.endpoints == {}
        first = None
        for i in range(decode_worker.MAX_PREFILL_ENGINES + 8):  # real destinations, then withdrawn
            worker.rendezvous.publish(f"T{i}", destination)
            found = rendezvous.lookup(address, key, f"T{i}", 5.0, f"fake-{i}")
            first = first or found["endpoint"]
            worker.rendezvous.withdraw(f"T{i}", "done")
        assert len(worker.endpoints) == decode_worker.MAX_PREFILL_ENGINES
        assert "fake-0" not in worker.endpoints  # the oldest idle ones made room
        # A real prefill engine: takes a destination and connects; it stays while connected.
        worker.rendezvous.publish("real", destination)
        found = rendezvous.lookup(address, key, "real", 5.0, "real-engine")
        connected = registry.connect(found["endpoint"], authkey=key, src=common.pool)
        worker.rendezvous.withdraw("real", "done")
        for i in range(decode_worker.MAX_PREFILL_ENGINES + 8):
            worker.rendezvous.publish(f"U{i}", destination)
            rendezvous.lookup(address, key, f"U{i}", 5.0, f"more-{i}")
            worker.rendezvous.withdraw(f"U{i}", "done")
        assert "real-engine" in worker.endpoints and first is not None
        # Every endpoint connected or holding a destination: the bound holds, the lookup is refused.
        for i, name in enumerate(list(worker.endpoints)):
            if name != "real-engine":
                worker.rendezvous._taken[f"held-{i}"] = name
        worker.rendezvous.publish("over", destination)
        with pytest.raises(TransferError, match="connected or holding a destination"):
            rendezvous.lookup(address, key, "over", 5.0, "one-too-many")
        assert worker.rendezvous.abandoned("over") is not None  # its decode request fails now
    finally:
        if connected is not None:
            connected.close()
        worker.close()


def time_now() -> float:
    import time

    return time.monotonic()


# -- admission: a saturated decode server (issue 19 item 5) ---------------------------------

ADMISSION_WAIT_S = 0.2  # what a prefill request waits for its destination before computing anyway
PREFILL_POOL = 20  # blocks: three 250-token prompts growing together outgrow it
BUSY_OUT = 40  # output tokens of the request that keeps the one-sequence decode engine full


@pytest.fixture(scope="module")
def eager_prefill(model: str) -> Any:
    """A prefill engine that computes a request whose destination has not come within
    ``ADMISSION_WAIT_S`` and parks it once computed (a host pool of its pool's size); a small
    pool, requests admitted by their first chunk and growing 32 tokens a step together (so
    that concurrent prompts outgrow it and vLLM preempts)."""
    engine = _small_prefill(model, ADMISSION_WAIT_S, late_host_bytes=PREFILL_POOL * BLOCK_BYTES)
    yield engine
    engine.close()


def _small_prefill(model: str, admission_wait_s: float, late_host_bytes: int = 0) -> Engine:
    """A prefill engine of ``PREFILL_POOL`` blocks admitting requests by their first chunk,
    32 tokens a step, that computes a request whose destination has not come within
    ``admission_wait_s`` (parking it in ``late_host_bytes`` of host memory once computed)."""
    return Engine(
        model,
        "kv_producer",
        {
            "admission_wait_s": admission_wait_s,
            "destination_timeout_s": WAIT_S,
            "transfer_timeout_s": WAIT_S,
            "late_host_bytes": late_host_bytes,
        },
        kv_cache_memory_bytes=PREFILL_POOL * BLOCK_BYTES,
        max_model_len=512,
        max_num_batched_tokens=96,
        scheduler_reserve_full_isl=False,
        long_prefill_token_threshold=32,
    )


@pytest.fixture(scope="module")
def one_seq_decode(model: str) -> Any:
    """A decode engine that runs one request at a time: one running request saturates it."""
    engine = Engine(model, "kv_consumer", {"transfer_timeout_s": WAIT_S}, max_num_seqs=1)
    yield engine
    engine.close()


def status_of(engine: Engine, transfer: str) -> dict[str, Any]:
    rid = f"status-{uuid.uuid4().hex[:8]}"
    out = engine.run([(rid, [0], 1, {"kvferry": {"op": "status", "transfer": transfer}})])["outputs"][rid]
    assert out["finish_reason"] == "length", out
    return dict(out["kv_transfer_params"]["kvferry"])


def saturate(decode: Engine, busy: str, queued: list[tuple]) -> None:
    """Leaves ``decode`` stopped (it steps only while a command runs) with ``busy`` decoding
    and ``queued`` in vLLM's waiting queue behind it (``max_num_seqs`` 1): not admitted, so
    no destination is published for them."""
    stopped = decode.run([(busy, prompt_of(64, 600), BUSY_OUT, None), *queued], until=(busy, "decoding"))
    assert stopped.get("stopped_at"), stopped
    for rid, *_ in queued:
        assert decode.run([], until=(rid, "waiting")).get("stopped_at"), rid  # returns without a step


def test_saturated_decode_prefill_computes_at_once_and_sends_late(
    eager_prefill: Engine, one_seq_decode: Engine, plain: Engine
) -> None:
    """The decode engine is full (one running request, ``max_num_seqs`` 1) and stopped, so
    the second request's destination cannot come: the prefill engine computes it anyway
    after ``admission_wait_s`` and finishes it while the decode side is still full (it
    waited for the destination until ``destination_timeout_s`` and then failed before).
    Its blocks park in host memory (kvferry.vllm.park): vLLM frees them while the decode
    engine is still stopped, and the whole prompt goes from the host copy once the decode
    engine admits the request; the output is a plain engine's and no block stays allocated."""
    prefill, decode = eager_prefill, one_seq_decode
    hello = hello_of(decode)
    prompt, transfer = prompt_of(200, 61), uuid.uuid4().hex
    saturate(decode, "d-busy", [("d-late", prompt, 6, recv(transfer))])
    p = prefill.run([("p-late", prompt, 1, send(hello, transfer))], until=("p-late", "finished_length_capped"))
    assert p.get("stopped_at") and p["outputs"]["p-late"]["finish_reason"] == "length", p
    assert p["outputs"]["p-late"]["kv_transfer_params"] == {"kvferry": {"op": "send", "transfer": transfer}}
    assert prefill.call("usage") == {"used": 7, "requests": 1}  # its 7 blocks wait to be parked
    assert prefill.run([], until=("p-late", None)).get("stopped_at")  # copied out, then freed by vLLM
    assert prefill.call("usage") == {"used": 0, "requests": 0}  # the decode engine is still stopped
    assert prefill.call("totals")["counts"]["parked_prompts"] == 1
    # (no status asked here: a one-token request on the prefill engine would step until the
    # parked prompt's send ended, as vLLM steps while the connector has a send to make)
    prefill.start("run", [], None, None)  # steps while the parked prompt waits for its destination
    got = decode.run([])["outputs"]  # the busy request ends, the queued one is admitted
    sent = prefill.result(timeout=WAIT_S + 30)
    want = plain.run([("r-late", prompt, 6, None)])["outputs"]["r-late"]
    assert (got["d-late"]["tokens"], got["d-late"]["finish_reason"]) == (want["tokens"], "length"), (got, sent)
    assert got["d-busy"]["finish_reason"] == "length"
    assert status_of(prefill, transfer) == {"op": "status", "transfer": transfer, "state": "done"}
    assert status_of(decode, transfer) == {"op": "status", "transfer": transfer, "state": "done"}
    counts = prefill.call("totals")["counts"]
    assert counts.get("chunk_bytes", 0) >= 7 * BLOCK_BYTES, counts  # the whole prompt went as one late chunk
    no_blocks_used(prefill, decode)


def test_saturated_decode_past_the_bound_frees_both_sides(
    eager_prefill: Engine, one_seq_decode: Engine, plain: Engine
) -> None:
    """The decode engine stays full past the prefill request's bound (``timeout_s`` 3 s on
    its send, as ``destination_timeout_s``): the prefill engine computed it, then releases
    its blocks at the bound while the decode engine is still stopped, and the decode
    rendezvous marks the transfer abandoned. The decode workers report it given up while
    the busy request finishes, so the decode request, once admitted, computes its prompt
    there (its output a plain engine's, the reason in ``status`` and counted) instead of
    failing or waiting ``transfer_timeout_s``; both engines end with no block used and go
    on serving."""
    prefill, decode = eager_prefill, one_seq_decode
    hello = hello_of(decode)
    prompt, transfer = prompt_of(200, 62), uuid.uuid4().hex
    saturate(decode, "d-busy2", [("d-over", prompt, 6, recv(transfer))])
    params = send(hello, transfer)
    params["kvferry"]["timeout_s"] = 3.0
    p = prefill.run([("p-over", prompt, 1, params)])  # returns once vLLM freed its blocks
    assert p["outputs"]["p-over"]["finish_reason"] == "length", p  # computed, then released
    no_blocks_used(prefill)  # while the decode engine is still full
    mine = status_of(prefill, transfer)
    assert mine["state"] == "failed" and "no decode request expected it within 3 s" in mine["error"], mine
    got = decode.run([])["outputs"]
    assert got["d-busy2"]["finish_reason"] == "length"
    want = plain.run([("r-over", prompt, 6, None)])["outputs"]["r-over"]
    assert (got["d-over"]["tokens"], got["d-over"]["finish_reason"]) == (want["tokens"], "length"), got
    theirs = status_of(decode, transfer)
    assert theirs == {
        "op": "status",
        "transfer": transfer,
        "state": "failed",
        "error": "the prefill side gave it up before this server admitted its request: computed here",
    }, theirs
    assert decode.call("sched_totals").get("unhonoured/prefill_gave_up") == 1
    no_blocks_used(prefill, decode)
    served(prefill, decode, plain, [prompt_of(90, 63)], 6, "adm-after")


# -- prefill-side preemption ----------------------------------------------------------------


@pytest.fixture(scope="module")
def preempting_prefill(model: str) -> Any:
    """``eager_prefill``'s small pool and chunking, but each request waits for its destination
    (``admission_wait_s`` past the test's length): every send is under way from the first
    chunk, so a preemption always comes mid-transfer."""
    engine = _small_prefill(model, WAIT_S - 1)
    yield engine
    engine.close()


def test_prefill_preemption_loses_no_request(preempting_prefill: Engine, small_decode: Engine, plain: Engine) -> None:
    """Three 250-token prompts (8 blocks each) growing together on a prefill pool of 20
    blocks: nothing is freed until a prompt completes, so vLLM must preempt one on the prefill
    side, mid-transfer (the preemptions, the sends revoked and the parts the decode side
    expected again are counted). Under the default kv_load_failure_policy ("fail") no request
    fails: each preempted send is revoked, expected again under a new epoch and sent again
    once its prompt is computed again. Every output is a plain engine's, both sides say
    ``done``, and no block stays allocated on either side."""
    prefill, decode = preempting_prefill, small_decode
    hello = hello_of(decode)
    prompts = [prompt_of(250, 70 + i) for i in range(3)]
    transfers = [uuid.uuid4().hex for _ in prompts]
    before = prefill.call("preemptions")
    resent = prefill.call("totals")["counts"].get("preempted_resends", 0)
    reoffered = decode.call("totals")["counts"].get("reoffered_parts", 0)
    decode.start("run", [(f"d-pp{i}", p, 6, recv(t)) for i, (p, t) in enumerate(zip(prompts, transfers))], None, None)
    sent = prefill.run([(f"p-pp{i}", p, 1, send(hello, t)) for i, (p, t) in enumerate(zip(prompts, transfers))])
    got = decode.result(timeout=WAIT_S + 60)["outputs"]
    assert prefill.call("preemptions") > before  # the scenario happened
    assert prefill.call("totals")["counts"].get("preempted_resends", 0) > resent  # mid-transfer
    assert decode.call("totals")["counts"].get("reoffered_parts", 0) > reoffered
    want = plain.run([(f"r-pp{i}", p, 6, None) for i, p in enumerate(prompts)])["outputs"]
    for i, transfer in enumerate(transfers):
        mine = (got[f"d-pp{i}"]["tokens"], got[f"d-pp{i}"]["finish_reason"])
        assert mine == (want[f"r-pp{i}"]["tokens"], "length"), (i, got[f"d-pp{i}"], sent["outputs"])
        assert status_of(prefill, transfer) == {"op": "status", "transfer": transfer, "state": "done"}
        assert status_of(decode, transfer) == {"op": "status", "transfer": transfer, "state": "done"}
    no_blocks_used(prefill, decode)


# -- a prefill server restarted -------------------------------------------------------------


def test_prefill_restart_frees_the_old_endpoint_and_serves_the_new_engine(model: str, plain: Engine) -> None:
    """A prefill engine is killed (SIGKILL) right after its first transfer landed, and a new
    one starts (a new vLLM engine id, as a restarted server gets): the decode engine closes
    the dead engine's endpoint once its grace passed (no connection, nothing taken), serves
    the new engine's requests, and leaks no block. A regression test: the sweep works today."""
    from kvferry.vllm import decode_worker

    decode = Engine(model, "kv_consumer", {"transfer_timeout_s": WAIT_S})
    old = Engine(model, "kv_producer", max_num_batched_tokens=64)
    new = None
    try:
        served(old, decode, plain, [prompt_of(100, 80)], 6, "rs-old")  # returns once its writes landed
        (dead,) = decode.call("totals")["endpoints"]
        old.process.kill()
        old.process.join(30)
        new = Engine(model, "kv_producer", max_num_batched_tokens=64)
        served(new, decode, plain, [prompt_of(100, 81)], 6, "rs-new")
        live = [e for e in decode.call("totals")["endpoints"] if e != dead]
        assert len(live) == 1, live
        # The dead engine's endpoint goes at the first step past its grace (decode_worker.sweep).
        deadline = decode_worker.ENDPOINT_GRACE_S + 60.0
        wait_until(lambda: hello_of(decode) and decode.call("totals")["endpoints"] == live, "the sweep", deadline)
        served(new, decode, plain, [prompt_of(120, 82)], 6, "rs-again")
        no_blocks_used(new, decode)
    finally:
        for engine in (old, new, decode):
            if engine is not None:
                engine.close()


# -- admission, at the scheduler half (no engine) -------------------------------------------


def test_admission_wait_is_checked_by_name() -> None:
    from kvferry.errors import InvalidArgumentError
    from kvferry.vllm.config import ConnectorConfig

    assert ConnectorConfig().admission_wait_s == 1.0
    assert ConnectorConfig.from_extra({"admission_wait_s": 0}).admission_wait_s == 0.0
    for value, named in [
        (-1, r"admission_wait_s=-1: must be a number of seconds >= 0"),
        (True, r"admission_wait_s=True: must be"),
        ("1", r"admission_wait_s='1': must be"),
        (float("nan"), r"admission_wait_s=nan: must be"),
        (float("inf"), r"admission_wait_s=inf: must be"),
        (60, r"admission_wait_s=60.0: must be less than destination_timeout_s \(60.0\)"),
    ]:
        with pytest.raises(InvalidArgumentError, match=named):
            ConnectorConfig.from_extra({"admission_wait_s": value})


HALF_KEY = b"a" * 32


def prefill_half(manager: Any, **more: Any) -> Any:
    """A prefill scheduler half computing at once (``admission_wait_s`` 0), blocks of 4
    tokens, its KV cache manager ``manager``; ``more``: `SchedulerSide`'s other arguments."""
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.scheduler import SchedulerSide

    return SchedulerSide(ConnectorConfig(admission_wait_s=0.0), block_size=4, role="kv_producer",
                         engine_id="prefill-engine", kv_cache_manager_getter=lambda: manager, authkey=HALF_KEY,
                         **more)  # fmt: skip


@pytest.fixture
def half(tmp_path: Any) -> Any:
    """A prefill scheduler half computing at once (``admission_wait_s`` 0) against a real
    decode rendezvous (published by hand: the decode engine's admission is the test's)."""
    from kvferry.vllm import rendezvous, trust

    rdv = rendezvous.Rendezvous(HALF_KEY, lambda sender: "staging+unix:///nowhere/ring.sock", str(tmp_path))
    manager = Manager({})
    side = prefill_half(manager)
    mac = trust.sign_peer(HALF_KEY, rdv.address)
    yield side, rdv, manager, mac
    rdv.close()


def _send_params(rdv: Any, mac: str, transfer: str, timeout_s: float = 30.0) -> dict[str, Any]:
    ours = {"op": "send", "transfer": transfer, "peer": rdv.address, "peer_mac": mac, "timeout_s": timeout_s}
    return {"kvferry": ours}


def test_destination_after_the_prompt_computed_goes_as_one_late_send(half: Any) -> None:
    """Computed before its destination: the free is delayed, nothing is sent while the
    lookup goes on; once the decode side publishes, the next step carries one finished
    SendSpec and one chunk [0, L) over the finished request's blocks."""
    side, rdv, manager, mac = half
    prompt, transfer = list(range(1, 11)), uuid.uuid4().hex  # 10 tokens, 3 blocks of 4
    req = Request("p1", prompt, _send_params(rdv, mac, transfer))
    manager.tables["p1"] = [7, 8, 9]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # computes at once (before: None)
    meta = side.build_connector_meta(step({"p1": (0, 10)}))
    assert meta.sends == [] and meta.chunks == []  # no destination: nothing to send yet
    req.status = Status("FINISHED_LENGTH_CAPPED")
    assert side.request_finished(req, [7, 8, 9]) == (True, {"kvferry": {"op": "send", "transfer": transfer}})
    assert side._status(transfer)["state"] == "active" and side.has_pending()
    publish(rdv, transfer, prompt)
    (late,) = side._late.values()
    assert late.lookup is not None and late.lookup.done.wait(30)
    meta = side.build_connector_meta(step({}))
    (spec,) = meta.sends
    assert (spec.req_id, spec.transfer, spec.reused_len, spec.finished) == ("p1", transfer, 0, True)
    assert spec.destination["dst_blocks"] == [100, 101, 102]
    assert [(c.req_id, c.start, c.end, c.src_blocks) for c in meta.chunks] == [("p1", 0, 10, [[7, 8, 9]])]
    assert not side.has_pending() and side.build_connector_meta(step({})).sends == []  # sent once


def test_a_late_prompt_parks_in_host_blocks_and_its_late_send_reads_them(half: Any) -> None:
    """With a host pool (kvferry.vllm.park), a prompt computed before its destination parks:
    the next step's metadata tells the workers to copy its blocks into host blocks (they
    report it finished_sending once copied, so vLLM frees its pool blocks), its late send's
    chunk names those host blocks in the combined id space (pool size + host id), and its
    host blocks come back once every worker reported it done. A prompt with no room left
    in the host pool holds its blocks in vLLM's pool, as without one."""
    _, rdv, manager, mac = half
    side = prefill_half(manager, park_blocks=5, num_blocks=40)
    prompt, transfer = list(range(1, 11)), uuid.uuid4().hex  # 3 blocks of 4
    other, transfer2 = list(range(20, 30)), uuid.uuid4().hex
    reqs = [
        Request("k1", prompt, _send_params(rdv, mac, transfer)),
        Request("k2", other, _send_params(rdv, mac, transfer2)),
    ]
    for req, table in zip(reqs, ([7, 8, 9], [4, 5, 6])):
        manager.tables[req.request_id] = table
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        req.status = Status("FINISHED_LENGTH_CAPPED")
        assert side.request_finished(req, table)[0] is True  # vLLM delays the free (until copied)
    meta = side.build_connector_meta(step({}))
    assert meta.parks == [("k1", [7, 8, 9], [0, 1, 2])]  # k2 found 2 host blocks free of its 3: it holds
    assert side.has_pending()
    publish(rdv, transfer, prompt)
    publish(rdv, transfer2, other)
    for late in side._late.values():
        assert late.lookup is not None and late.lookup.done.wait(30)
    meta = side.build_connector_meta(step({}))
    chunks = {c.req_id: c.src_blocks for c in meta.chunks}
    assert chunks == {"k1": [[40, 41, 42]], "k2": [[4, 5, 6]]}
    assert {s.req_id for s in meta.sends} == {"k1", "k2"} and all(s.finished for s in meta.sends)
    assert side._park.free == 2 and side.has_pending()  # until its worker reports it done
    side.unparked(["k1"])
    assert side._park.free == 5 and not side.has_pending()
    assert side._park.take(5) == [0, 1, 2, 3, 4]  # every host block back, lowest first


def test_a_decode_request_whose_prefill_side_gave_up_first_is_computed_here(tmp_path: Any) -> None:
    """A transfer the decode workers report given up (the prefill side abandoned it before
    this server admitted its request: a saturated decode server past
    ``destination_timeout_s``): its decode request loads nothing and computes its prompt
    here, once counted and recorded in ``status``, however often vLLM asks; a request of
    another transfer still loads its KV."""
    with scheduler_pair(str(tmp_path), HALF_KEY) as (_, decode, _, _):
        gone, live = uuid.uuid4().hex, uuid.uuid4().hex
        decode.given_up([gone])
        late = Request("d-late", list(range(1, 41)), {"kvferry": {"op": "recv", "transfer": gone}})
        assert decode.get_num_new_matched_tokens(late, 0) == (0, False)
        assert decode.get_num_new_matched_tokens(late, 0) == (0, False)  # not scheduled that step: asked again
        assert decode.tally.totals.get("unhonoured/prefill_gave_up") == 1
        assert decode._status(gone)["state"] == "failed"
        assert "computed here" in decode._status(gone)["error"]
        other = Request("d-live", list(range(1, 41)), {"kvferry": {"op": "recv", "transfer": live}})
        assert decode.get_num_new_matched_tokens(other, 0) == (40, True)


def test_destination_during_the_computation_joins_at_the_next_chunk(half: Any) -> None:
    """The destination comes while the prompt computes: its SendSpec goes with the next
    scheduled chunk, ``reused_len`` where the computation stands (the blocks computed so
    far leave early), and the request's end delays the free as for any send."""
    side, rdv, manager, mac = half
    prompt, transfer = list(range(1, 11)), uuid.uuid4().hex
    req = Request("p2", prompt, _send_params(rdv, mac, transfer))
    manager.tables["p2"] = [3, 4, 5]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.build_connector_meta(step({"p2": (0, 4)})).sends == []
    publish(rdv, transfer, prompt)
    assert side._computing["p2"].done.wait(30)
    meta = side.build_connector_meta(step({"p2": (4, 4)}))
    (spec,) = meta.sends
    assert (spec.reused_len, spec.finished) == (4, False)
    assert [(c.start, c.end) for c in meta.chunks] == [(4, 8)]
    assert [(c.start, c.end) for c in side.build_connector_meta(step({"p2": (8, 2)})).chunks] == [(8, 10)]
    req.status = Status("FINISHED_LENGTH_CAPPED")
    assert side.request_finished(req, [3, 4, 5])[0] is True


def test_no_destination_within_the_bound_releases_and_abandons(half: Any) -> None:
    """Computed, and no decode request published the transfer within the send's
    ``timeout_s``: the next step releases the blocks (the worker reports them sent, vLLM
    frees them), and the decode rendezvous marked the transfer abandoned, so a decode
    request that names it later fails at once."""
    side, rdv, manager, mac = half
    prompt, transfer = list(range(1, 11)), uuid.uuid4().hex
    req = Request("p3", prompt, _send_params(rdv, mac, transfer, timeout_s=0.5))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = Status("FINISHED_STOPPED")
    assert side.request_finished(req, [1, 2, 3])[0] is True
    (late,) = side._late.values()
    assert late.lookup is not None and late.lookup.done.wait(30)
    meta = side.build_connector_meta(step({}))
    assert meta.sends == [] and meta.chunks == []
    ((rid, named, why),) = meta.releases
    assert (rid, named) == ("p3", transfer) and "no decode request expected it within 0.5 s" in why, why
    assert rdv.abandoned(transfer) == "no destination within its 0.5 s wait"
    assert not side.has_pending()


def test_a_lookup_that_takes_its_destination_after_its_request_ended_gives_it_back(
    half: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request ends while its lookup waits; its abandon (naming no epoch) is held back
    until the decode side published and the lookup took the destination (forced), so the
    rendezvous refuses it (a taken transfer is abandoned by its taker only). The lookup then
    gives the destination back under its epoch: the decode side sees the transfer abandoned
    at once. (Before, the decode request waited its whole transfer_timeout_s.)"""
    import threading

    from kvferry.vllm import scheduler

    side, rdv, manager, mac = half
    side.config = dataclasses.replace(side.config, admission_wait_s=30.0)  # the request waits for its lookup
    gate = threading.Event()
    real = scheduler._tell_abandon

    def held(targets: Any, client: Any, reason: str) -> None:
        if any(epoch == 0 for _, _, epoch in targets):  # asked on the engine's thread, which never waits
            threading.Thread(target=lambda: gate.wait(30) and real(targets, client, reason), daemon=True).start()
            return
        real(targets, client, reason)

    monkeypatch.setattr(scheduler, "_tell_abandon", held)
    prompt, transfer = list(range(1, 11)), uuid.uuid4().hex
    req = Request("p5", prompt, _send_params(rdv, mac, transfer))
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # waits for its destination
    req.status = Status("FINISHED_ABORTED")
    delay, answer = side.request_finished(req, [])
    assert delay is False and "ended before its first chunk" in answer["kvferry"]["error"]
    publish(rdv, transfer, prompt)  # the lookup, still waiting, takes it
    wait_until(lambda: rdv.taker(transfer) is not None, "the lookup to take the destination", 30)
    wait_until(lambda: rdv.abandoned(transfer) is not None, "the lookup to give it back", 30)
    assert "ended before its first chunk" in rdv.abandoned(transfer)
    gate.set()


def test_an_aborted_request_computing_before_its_destination_is_freed_at_once(half: Any) -> None:
    """Aborted while it computed without a destination: nothing is kept (its blocks are
    freed at once) and the decode side is told the transfer was abandoned."""
    side, rdv, manager, mac = half
    prompt, transfer = list(range(1, 11)), uuid.uuid4().hex
    req = Request("p4", prompt, _send_params(rdv, mac, transfer))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = Status("FINISHED_ABORTED")
    delay, answer = side.request_finished(req, [1, 2])
    assert (
        delay is False
        and answer["kvferry"]["error"] == "prefill request p4 ended (finished_aborted) before its destination came"
    )
    wait_until(lambda: rdv.abandoned(transfer) is not None, "the abandon to reach the rendezvous", 30)
    assert not side.has_pending()
