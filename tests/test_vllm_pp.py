"""KvferryConnector with pipeline parallelism on the prefill server, in real vLLM 0.32 CPU
engines (tests/vllm_harness.py): a prefill engine of two stages (the testbed's 4-layer tiny
Llama: stage 0 holds layers 0-1, stage 1 layers 2-3) sends into a TP-1 decode engine and
into a TP-2 one (each decode rank gets each stage's layers of its own KV head). Each stage's
worker sends its own layers, early prefix included; a decode request has arrived once both
stages' parts landed. Each decode output equals a plain engine's greedy output, and every
pool ends empty.

vLLM 0.32's CPU engine runs pipeline parallelism only with compilation on: with
``enforce_eager`` its warm-up is skipped, and stage 1's first forward fails
(``assert self.intermediate_tensors is not None``, the buffer the skipped warm-up makes).
So the prefill engine compiles (``compilation_config`` mode 1, torch.compile; about 30 s
more to start), the others run eager.

```
pp2    PP 2, kv_producer                       stage 0: layers 0-1, stage 1: layers 2-3
d1     TP 1, kv_consumer, prefill_pp_size 2    one receiver per stage
d2     TP 2, kv_consumer, prefill_pp_size 2    each rank: one receiver per stage, its KV head
plain  TP 1, no connector: the reference outputs
```
"""

from __future__ import annotations

import importlib.util
import json
import os
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
from vllm_harness import Engine, hello_of, model_with_own_key_dir, prompt_of  # noqa: E402

WAIT_S = 120.0  # what a decode request waits for its blocks, and a prefill request for its destination
BOUND = 600.0  # an engine command on the loaded 2-core box
BLOCK = 32
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (vLLM's CPU workers need a binding)
PP2 = {"pipeline_parallel_size": 2, "enforce_eager": False, "compilation_config": {"mode": 1}, "env": BIND}
TP2 = {"tensor_parallel_size": 2, "env": BIND}


def extra(**more: Any) -> dict[str, Any]:
    return {"transfer_timeout_s": WAIT_S, "destination_timeout_s": WAIT_S, **more}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    trace = tmp_path_factory.mktemp("trace") / "prefill.jsonl"
    for model in model_with_own_key_dir(tmp_path_factory):
        started: dict[str, Any] = {"trace": trace}
        try:
            # Started together; each answers its first command once it is up.
            # layer_groups 2: each stage's last chunk leaves layer by layer (its 2 layers).
            # admission_wait_s: a prefill request waits for its destination (a loaded box may
            # take past the default second to publish it), so a hit always leaves early.
            prefill = extra(trace=str(trace), layer_groups=2, admission_wait_s=WAIT_S / 2)
            started["pp2"] = Engine(model, "kv_producer", prefill, max_num_batched_tokens=64, **PP2)
            started["d1"] = Engine(model, "kv_consumer", extra(prefill_pp_size=2))
            started["d2"] = Engine(model, "kv_consumer", extra(prefill_pp_size=2), **TP2)
            started["plain"] = Engine(model, None)
            engines = [e for e in started.values() if isinstance(e, Engine)]
            for engine in engines:
                engine.start("usage")
            for engine in engines:
                assert engine.result(timeout=BOUND) == {"used": 0, "requests": 0}
            yield started
        finally:
            for engine in started.values():
                if isinstance(engine, Engine):
                    engine.close()


def send_through(prefill: Engine, decode: Engine, prompts: dict[str, list[int]]) -> tuple[dict, dict]:
    """Each prompt through the pair (6 decoded tokens); returns (prefill outputs, decode
    outputs) by key, and checks that no prefill request reports an error."""
    hello = hello_of(decode)
    transfers = {key: uuid.uuid4().hex for key in prompts}
    recv = [
        (f"d-{key}", p, 6, {"kvferry": {"op": "recv", "transfer": transfers[key], "timeout_s": WAIT_S}})
        for key, p in prompts.items()
    ]
    peer = {"peer": hello["peer"], "peer_mac": hello["peer_mac"]}
    send = [
        (f"p-{key}", p, 1, {"kvferry": {"op": "send", "transfer": transfers[key], **peer}})
        for key, p in prompts.items()
    ]
    decode.start("run", recv, None, None)
    sent = prefill.run(send)["outputs"]
    got = decode.result(timeout=BOUND)["outputs"]
    for key in prompts:
        assert "error" not in sent[f"p-{key}"]["kv_transfer_params"]["kvferry"], sent[f"p-{key}"]
    return sent, {key: got[f"d-{key}"] for key in prompts}


def assert_plain(plain: Engine, prompts: dict[str, list[int]], got: dict[str, Any]) -> None:
    want = plain.run([(f"r-{key}", p, 6, None) for key, p in prompts.items()])["outputs"]
    for key in prompts:
        assert got[key]["finish_reason"] == "length", (key, got[key])
        assert got[key]["tokens"] == want[f"r-{key}"]["tokens"], key


def assert_empty(*engines: Engine) -> None:
    for engine in engines:
        usage = engine.call("usage")
        assert usage == {"used": 0, "requests": 0}, usage


@pytest.mark.parametrize("decode", ["d1", "d2"])
def test_a_two_stage_prefill_server_feeds_a_decode_server(engines: dict[str, Any], decode: str) -> None:
    """Two prompts of 3-5 blocks (chunked: 64 tokens a step on the prefill side) from the
    two-stage prefill engine into a TP-1 decode engine (one rank, a receiver per stage) and a
    TP-2 one (a receiver per stage on each rank, over its KV head): outputs equal the plain
    engine's, both pools end empty."""
    prefill, dec, plain = engines["pp2"], engines[decode], engines["plain"]
    info = dec.call("groups")
    tp = 2 if decode == "d2" else 1
    if tp == 1:  # a TP-2 engine's receivers live in its rank processes
        assert info["receivers"] == [(1, 0), (1, 1)]  # (prefill TP size, vLLM's global rank): one per stage
    seed = 500 + tp
    prompts = {f"{decode}-{i}": prompt_of(100 + 40 * i, seed + i) for i in range(2)}
    _, got = send_through(prefill, dec, prompts)
    assert_plain(plain, prompts, got)
    assert_empty(prefill, dec)


def test_each_stage_sends_its_layers_of_the_hit_before_the_forward(engines: dict[str, Any]) -> None:
    """A prompt whose first 5 blocks the prefill engine's prefix cache holds (a first request
    of the same prefix, sent to the TP-2 engine, computed them): into the cold TP-1 decode
    engine, both stages' workers (two kvferry engines in the trace) issue that hit before
    their first forward, and their early writes together are the 5 blocks of all 4 layers,
    each stage's 2 layers once; each stage's last chunk leaves layer group by layer group
    (``layer_groups`` 2 over its own 2 layers)."""
    prefill, d1, d2, plain = engines["pp2"], engines["d1"], engines["d2"], engines["plain"]
    prefix = prompt_of(5 * BLOCK, 900)
    send_through(prefill, d2, {"warm": prefix + prompt_of(40, 901)})
    prompts = {"hit": prefix + prompt_of(70, 902)}
    sent, got = send_through(prefill, d1, prompts)
    assert_plain(plain, prompts, got)
    assert_empty(prefill, d1, d2)
    info = d1.call("groups")
    whole_block = info["block_bytes"] * info["regions"]  # every layer of one block
    transfer = sent["p-hit"]["kv_transfer_params"]["kvferry"].get("transfer")
    lines = [json.loads(line) for line in Path(engines["trace"]).read_text().splitlines()]
    mine = [
        line for line in lines if line["req"].startswith("p-hit") and (transfer is None or line["transfer"] == transfer)
    ]
    issued = {line["engine"]: line for line in mine if line["stage"] == "early_issued"}
    assert len(issued) == 2, mine  # one per stage's worker
    assert all(line["blocks"] == 5 for line in issued.values()), issued
    landed = [line for line in mine if line["stage"] == "early_landed"]
    assert {line["engine"] for line in landed} == set(issued)
    per_engine = {e: sum(line["bytes"] for line in landed if line["engine"] == e) for e in issued}
    assert sorted(per_engine.values()) == [5 * whole_block // 2] * 2, per_engine  # 2 of the 4 layers each
    # The last chunk streamed layer by layer on each stage: groups 0 and 1 of 2 (its own layers).
    layers = [line for line in mine if line["stage"] == "layer_landed"]
    assert {(line["engine"], line["group"], line["groups"]) for line in layers} == {
        (e, g, 2) for e in issued for g in (0, 1)
    }, layers
