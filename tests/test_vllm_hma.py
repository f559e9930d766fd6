"""KvferryConnector with vLLM's hybrid KV cache manager on (``SupportsHMA``): a tiny random
Llama whose even layers use a sliding window of 64 tokens and odd layers full attention, so
vLLM 0.32 makes two KV cache groups (a SlidingWindowSpec and a FullAttentionSpec group, their
layers overlaying one allocation). Prompts are longer than the window; the decode engine's
greedy output must equal a plain engine's, and the blocks moved must be each group's once: the
full-attention group's whole prompt, the sliding-window group's live window only.

Run in the vLLM venv:
    PYTHONPATH=python .venv-vllm/bin/python -m pytest tests/test_vllm_hma.py -q
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM (and transformers) not importable: run in the vLLM venv, see docs/vllm.md"
)

sys.path.insert(0, os.path.dirname(__file__))
from vllm_harness import BLOCK, Engine, hello_of, model_with_own_key_dir  # noqa: E402

WINDOW = 64  # tokens: 2 blocks
KV_HEADS, HEAD_DIM = 2, 32
REGION_BYTES = KV_HEADS * BLOCK * 2 * HEAD_DIM * 4  # one block of one layer, fp32
REGIONS = 2  # 4 layers in 2 groups of 2, overlaid: 2 regions per block
OUT = 6


def hybrid(llama: str) -> str:
    """The testbed's tiny Llama, its layers alternating sliding_attention / full_attention
    (vLLM's Llama reads ``layer_types`` and ``sliding_window``)."""
    path = Path(llama).parent / "tiny-hybrid"
    if not path.exists():
        tmp = Path(llama).parent / ".tiny-hybrid"
        shutil.copytree(llama, tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        n = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        cfg["sliding_window"] = WINDOW
        (tmp / "config.json").write_text(json.dumps(cfg))
        tmp.rename(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    for llama in model_with_own_key_dir(tmp_path_factory):
        model = hybrid(llama)
        # A small token budget forces chunked prefill on the prefill engine; the last chunk
        # streams layer slices (a region leaves once both groups' layers on it saved).
        extra = {"transfer_timeout_s": 60.0, "layer_groups": 2}
        prefill = Engine(model, "kv_producer", extra, max_num_batched_tokens=64)
        decode = Engine(model, "kv_consumer", {"transfer_timeout_s": 60.0})
        plain = Engine(model, None)
        try:
            yield prefill, decode, plain, hello_of(decode)
        finally:
            for engine in (prefill, decode, plain):
                engine.close()


def turn(prefill: Engine, decode: Engine, hello: dict[str, Any], rid: str, prompt: list[int]) -> list[int]:
    transfer = uuid.uuid4().hex
    decode.start("run", [(f"d-{rid}", prompt, OUT, {"kvferry": {"op": "recv", "transfer": transfer}})], None, None)
    send = {"op": "send", "transfer": transfer, "peer": hello["peer"], "peer_mac": hello["peer_mac"]}
    prefill.run([(f"p-{rid}", prompt, 1, {"kvferry": send})])
    out = decode.result()["outputs"][f"d-{rid}"]
    assert out["finish_reason"] == "length", out
    return list(out["tokens"])


def moved(engine: Engine) -> int:
    counts = engine.call("totals").get("counts", {})
    return sum(counts.get(k, 0) for k in ("early_issued_bytes", "chunk_bytes", "layer_bytes"))


def live_blocks(prompt_len: int) -> int:
    """Blocks a cold decode engine receives: the full-attention group's all, the window
    group's live window (the token at P attends to [P+1-W, P])."""
    n = -(-prompt_len // BLOCK)
    return n + (n - (prompt_len + 1 - WINDOW) // BLOCK)


def test_hybrid_model_moves_each_group_with_its_table_and_decodes_as_a_plain_engine(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    for engine in (prefill, decode, plain):
        info = engine.call("groups")
        # HMA stayed on (vLLM turns it off for a connector that is not SupportsHMA), and the
        # model really has two groups: a sliding window and full attention.
        assert info["hma_disabled"] is False, info
        assert info["groups"] == [("SlidingWindowSpec", WINDOW), ("FullAttentionSpec", None)], info
    for engine in (prefill, decode):
        info = engine.call("groups")
        assert info["moved"] == "0: SlidingWindowSpec (2 layers, window 64), 1: FullAttentionSpec (2 layers)", info
        assert info["regions"] == REGIONS, info
    rng = random.Random(11)
    # Longer than the window; 159: the live window starts on a block boundary (160 - 64 = 96).
    for i, length in enumerate([159, 200, 256]):
        prompt = [rng.randrange(3, 500) for _ in range(length)]
        before, layers = moved(prefill), prefill.call("totals").get("counts", {}).get("layer_bytes", 0)
        got = turn(prefill, decode, hello, f"cold{i}", prompt)
        want = plain.run([(f"r{i}", prompt, OUT, None)])["outputs"][f"r{i}"]["tokens"]
        assert got == want, (length, got, want)
        # Exactly once per (group, block), never a dropped (null) block: a cold decode engine
        # holds nothing, so it receives the full group's blocks and the window's live ones.
        assert moved(prefill) - before == live_blocks(length) * REGIONS * REGION_BYTES, length
        if i > 0:  # the first request's connection is made while it computes: it may miss them
            assert prefill.call("totals")["counts"].get("layer_bytes", 0) > layers  # layer slices left too
    # A prefix the prefill engine caches (warmed there only): the decode engine is cold, and
    # the full-attention group's cached prefix leaves before the first forward (the window
    # group's blocks go with the last chunk). Then the next turn of the session: the decode
    # engine holds what it cached of the last one (held blocks, in each group).
    system = [rng.randrange(3, 500) for _ in range(4 * BLOCK)]
    prefill.run([("warm", system, 1, None)])
    prompt = system + [rng.randrange(3, 500) for _ in range(60)]
    for t in range(2):
        before = prefill.call("totals")["counts"]
        got = turn(prefill, decode, hello, f"s{t}", prompt)
        want = plain.run([(f"rs{t}", prompt, OUT, None)])["outputs"][f"rs{t}"]["tokens"]
        assert got == want, (t, got, want)
        after = prefill.call("totals")["counts"]
        early = after.get("early_issued_bytes", 0) - before.get("early_issued_bytes", 0)
        if t == 0:
            assert 0 < early <= 4 * REGIONS * REGION_BYTES, early  # full-attention blocks of the prefix only
            assert moved(prefill) - sum(
                before.get(k, 0) for k in ("early_issued_bytes", "chunk_bytes", "layer_bytes")
            ) == (live_blocks(len(prompt)) * REGIONS * REGION_BYTES)
        else:
            assert after.get("held_blocks", 0) > before.get("held_blocks", 0)  # the decode engine's own hit
        prompt = prompt + got + [rng.randrange(3, 500) for _ in range(50)]
    counts = decode.call("totals")["counts"]
    assert counts.get("duplicates_refused", 0) == 0 and counts.get("notices_refused", 0) == 0, counts
    for engine in (prefill, decode):
        usage = engine.call("usage")
        assert usage == {"used": 0, "requests": 0}, usage
