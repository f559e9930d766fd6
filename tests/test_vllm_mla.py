"""KvferryConnector with a real MLA model: the testbed's random DeepSeek-V2 (2 layers,
kv_lora_rank 512 + qk_rope_head_dim 64: one latent head of 576 per token and layer) in vLLM
0.32's CPU engines on the CPU_MLA backend (16-token blocks, its decode kernel's only size).
The KV that lands on the decode engine must be the prefill engine's bit for bit, each block of
each layer's one latent head moved exactly once, and the decode engine's first token must be
a plain engine's (why only the first: the second test's doc and docs/vllm.md, "MLA on a real
engine").

vLLM's CPU platform turns prefix caching and chunked prefill off for an MLA model (its
reference MLA backend computes a prefill only from scratch): every prompt is one chunk, and
no prefix is ever cached, so kvferry sends nothing before the forward (early) and streams the
layers of the one chunk (``layer_groups``).

Run in the vLLM venv:
    PYTHONPATH=python .venv-vllm/bin/python -m pytest tests/test_vllm_mla.py -q
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import uuid
from typing import Any

import pytest
import torch

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM (and transformers) not importable: run in the vLLM venv, see docs/vllm.md"
)

sys.path.insert(0, os.path.dirname(__file__))
from vllm_harness import Engine, build_tiny_deepseek_v2, hello_of, model_with_own_key_dir  # noqa: E402

BLOCK = 16  # tokens: CPU_MLA's only block size
LAYERS = 2
LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: MLA's one latent head
REGION_BYTES = BLOCK * LATENT * 4  # one block of one layer, fp32
OUT = 6
WAIT_S = 120.0  # what a decode request waits for its blocks, and a prefill request for its destination
MOVED = ("early_issued_bytes", "chunk_bytes", "layer_bytes")


# CPU_MLA named: on a CPU with AMX tiles vLLM would pick AMX_MLA, whose block size differs.
MLA = {"block_size": BLOCK, "attention_backend": "CPU_MLA"}


def extra(**more: Any) -> dict[str, Any]:
    return {"transfer_timeout_s": WAIT_S, "destination_timeout_s": WAIT_S, **more}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    for model in model_with_own_key_dir(tmp_path_factory, build_tiny_deepseek_v2):
        # layer_groups 2: each layer's blocks leave once it saved (the one chunk is the last).
        prefill = Engine(model, "kv_producer", extra(layer_groups=LAYERS), **MLA)
        decode = Engine(model, "kv_consumer", extra(), **MLA)
        plain = Engine(model, None, **MLA)
        try:
            yield model, prefill, decode, plain, hello_of(decode)
        finally:
            for engine in (prefill, decode, plain):
                engine.close()


def turn(prefill: Engine, decode: Engine, hello: dict[str, Any], rid: str, prompt: list[int]) -> tuple[Any, list[int]]:
    """``prompt`` through the pair: the KV rows of its tokens but the last as they landed on the
    decode engine (read once it computed its first token: the last token's row it computes
    itself), and its greedy output."""
    transfer = uuid.uuid4().hex
    recv = {"op": "recv", "transfer": transfer, "timeout_s": WAIT_S}
    decode.start("run", [(f"d-{rid}", prompt, OUT, {"kvferry": recv})], None, (f"d-{rid}", "decoding"))
    send = {"op": "send", "transfer": transfer, "peer": hello["peer"], "peer_mac": hello["peer_mac"]}
    prefill.run([(f"p-{rid}", prompt, 1, {"kvferry": send})])
    assert decode.result(timeout=600.0).get("stopped_at") is not None
    landed = decode.call("kv", f"d-{rid}", len(prompt) - 1)
    out = decode.run([])["outputs"][f"d-{rid}"]
    assert out["finish_reason"] == "length", out
    return landed, list(out["tokens"])


def computed(engine: Engine, rid: str, prompt: list[int], n: int) -> tuple[Any, list[int]]:
    """``engine``'s own KV rows of ``prompt`` (after its prefill) and its greedy output of ``n``."""
    engine.run([(rid, prompt, n, None)], until=(rid, "decoding"))
    rows = engine.call("kv", rid, len(prompt))
    return rows, list(engine.run([])["outputs"][rid]["tokens"])


def counts(engine: Engine) -> dict[str, int]:
    return dict(engine.call("totals").get("counts", {}))


def test_engines_run_the_model_as_mla_with_one_latent_head(engines: Any) -> None:
    _, prefill, decode, plain, _ = engines
    for engine in (prefill, decode, plain):
        config = engine.call("config")
        # vLLM saw an MLA model and chose its CPU MLA backend; its platform turned prefix
        # caching and chunked prefill off (what this module's expectations rest on).
        assert config == {
            "use_mla": True,
            "block_size": BLOCK,
            "prefix_caching": False,
            "chunked_prefill": False,
            "backends": ["CPU_MLA"],
        }, config
    for engine in (prefill, decode):
        info = engine.call("groups")
        assert info["groups"] == [("MLAAttentionSpec", None)], info
        assert info["moved"] == "0: MLAAttentionSpec (2 layers)", info
        # Registered as one region per layer, each block one latent head of BLOCK tokens.
        assert (info["regions"], info["heads"], info["block_bytes"]) == (LAYERS, 1, REGION_BYTES), info
    assert decode.call("groups")["receivers"] == [(1, 0)]


def test_the_kv_lands_as_computed_each_block_once_and_decodes_from_it(engines: Any) -> None:
    """Each prompt P = Q + [t], t the plain engine's greedy token after Q. The KV rows that
    land on the decode engine must be, bit for bit, the rows the prefill engine computes for
    P, every block of every layer moved once; and the decode engine's first token (computed
    by vLLM's decode path over that KV, after recomputing t's row) must be the plain
    engine's token after t (the same path, over the plain engine's KV of Q).

    Why not a plain engine's output for P: vLLM's CPU MLA computes a prompt's next token by
    its prefill path (dense attention over decompressed K/V) and every later token by its
    decode path (absorbed attention over the latent cache), and on this random model they
    pick different tokens at most lengths measured (docs/vllm.md, "MLA on a real
    engine"); a decode engine computes its first token by the decode path. Only the first
    token is compared: vLLM's prefill of Q and of P do not give the same rows for every
    token (a few RoPE rows differ), so later tokens may diverge on vLLM's side."""
    _, prefill, decode, plain, hello = engines
    rng = random.Random(5)
    # 37: a partial last block; 96: whole blocks only (vLLM recomputes the last token's row
    # from the blocks that arrived); 161: many blocks and a partial one.
    for i, length in enumerate([37, 96, 161]):
        q = [rng.randrange(3, 500) for _ in range(length - 1)]
        _, plain_out = computed(plain, f"r{i}", q, OUT + 1)
        prompt = q + plain_out[:1]
        own_kv, _ = computed(prefill, f"k{i}", prompt, 2)
        before = counts(prefill)
        landed, got = turn(prefill, decode, hello, f"cold{i}", prompt)
        assert torch.equal(landed, own_kv[:, : length - 1]), length
        assert got[0] == plain_out[1], (length, got, plain_out)
        after = counts(prefill)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in MOVED}
        # Every block of every layer, one latent head each, exactly once.
        assert sum(delta.values()) == -(-length // BLOCK) * LAYERS * REGION_BYTES, (length, delta)
        assert delta["early_issued_bytes"] == 0, delta  # no prefix cache: nothing to send before the forward
        if i > 0:  # the first request's connection is made while it computes: it may miss the layers
            assert delta["layer_bytes"] > 0, delta
    received = counts(decode)
    assert received.get("duplicates_refused", 0) == 0 and received.get("notices_refused", 0) == 0, received
    for engine in (prefill, decode):
        usage = engine.call("usage")
        assert usage == {"used": 0, "requests": 0}, usage


# Tensor parallelism: vLLM's CPU TP runs one worker process per rank, each on its own core.
TP2 = {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}


@pytest.fixture(scope="module")
def tp_pair(engines: Any) -> Any:
    """A prefill engine of TP 2 and a decode engine of TP 1 that takes it (``prefill_tp_size``
    2); started only for the test that uses them."""
    model = engines[0]
    started: list[Engine] = []
    try:
        started.append(Engine(model, "kv_producer", extra(), **MLA, **TP2))
        started.append(Engine(model, "kv_consumer", extra(prefill_tp_size=2), **MLA))
        for engine in started:  # each answers its first command once it is up
            engine.start("usage")
        for engine in started:
            assert engine.result(timeout=600.0) == {"used": 0, "requests": 0}
        yield started[0], started[1], hello_of(started[1])
    finally:
        for engine in started:
            engine.close()


def test_tp2_prefill_to_tp1_decode_moves_the_latent_head_from_rank_0(engines: Any, tp_pair: Any) -> None:
    """MLA's latent head is whole on every rank: prefill rank 0 alone sends it (rank 1 sends
    nothing and reports the request finished), and the decode engine receives from rank 0
    only (kvferry.ranks.links). Layer 0's latent rows do not depend on the split (the
    embedding and kv_a_proj are whole on each rank), so they must land bit for bit as the
    TP-1 prefill engine computes them; the later layers' rows come from attention split over
    the ranks, which vLLM computes differently (some rows differ far beyond rounding, as the
    TP-2 engine's own outputs do), so they are checked as arrived (every row written) only,
    and the greedy output is not compared."""
    _, prefill_tp1, _, _, _ = engines
    prefill, decode, hello = tp_pair
    assert decode.call("groups")["receivers"] == [(2, 0)]
    rng = random.Random(7)
    for i, length in enumerate([50, 130]):
        prompt = [rng.randrange(3, 500) for _ in range(length)]
        own_kv, _ = computed(prefill_tp1, f"ktp{i}", prompt, 2)
        landed, _ = turn(prefill, decode, hello, f"tp{i}", prompt)
        assert torch.equal(landed[0], own_kv[0, : length - 1]), length
        assert bool(landed.abs().sum(dim=2).all()), length  # every row of every layer arrived
    for engine in (prefill, decode):
        usage = engine.call("usage")
        assert usage == {"used": 0, "requests": 0}, usage
