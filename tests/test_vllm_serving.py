"""KvferryConnector under serving conditions (issue 19), in real vLLM engines
(tests/vllm_harness.py): a decode engine whose small KV pool makes vLLM preempt running
requests, a decode engine under ``kv_load_failure_policy: "recompute"`` whose prefill engine
is killed mid-transfer, requests refused under that policy. Each scenario is forced and
checked (the preemption count, the point a server is killed at), every completed request's
greedy output equals a plain engine's, and no block stays allocated afterwards.

Bounds: a decode request waits at most its ``timeout_s`` (given per request below) for its
blocks; every engine command here is bounded by `Engine.result`'s timeout.
"""

from __future__ import annotations

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
from vllm_harness import BLOCK, Engine, model_with_own_key_dir  # noqa: E402

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


def hello_of(decode: Engine) -> dict[str, Any]:
    out = decode.run([(f"hello-{uuid.uuid4().hex[:6]}", [1], 1, {"kvferry": {"op": "hello"}})])["outputs"]
    (answer,) = out.values()
    return answer["kv_transfer_params"]["kvferry"]


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


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


# -- endpoints over time --------------------------------------------------------------------


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
