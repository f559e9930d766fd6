"""KvferryConnector with tensor parallelism, in real vLLM 0.32 CPU engines (tests/vllm_harness.py):
prefill TP 2 -> decode TP 1, 1 -> 2 and 2 -> 2, on the testbed's tiny Llama made hybrid
(tests/test_vllm_hma.py: a sliding-window and a full-attention KV cache group, so TP and HMA
together; 2 KV heads: a TP-2 rank holds one, a TP-1 engine both, so the heterogeneous pairs
move head slices and the 2 -> 2 pair whole blocks, rank to rank; kvferry.ranks), and one
decode engine taking prefill engines of both sizes (``prefill_tp_size [1, 2]``). Each decode
output equals a plain engine's greedy output, and every pool ends empty.

Four engines, started together (vLLM's CPU TP runs one worker process per rank, each bound
to its own core with ``VLLM_CPU_OMP_THREADS_BIND="0|1"``):

```
tp2    TP 2, kv_both, prefill_tp_size 1   prefill of 2 -> 1 and 2 -> 2; decode of 1 -> 2
tp1    TP 1, kv_both, prefill_tp_size 2   prefill of 1 -> 2; decode of 2 -> 1
tp2d   TP 2, kv_consumer, prefill_tp_size [1, 2]   decode of 2 -> 2, and of 1 -> 2 and 2 -> 2
       at once (each request taken by the size of its first lookup)
plain  TP 1, no connector: the reference outputs
```
Every engine command is bounded (`Engine.result`); a decode request waits at most
``WAIT_S`` for its blocks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from typing import Any

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM (and transformers) not importable: run in the vLLM venv, see docs/vllm.md"
)

sys.path.insert(0, os.path.dirname(__file__))
# test_tp.py's tests of the connector's TP parts without an engine (the decode worker's parts,
# the refusals, the hello of several ranks) need kvferry.vllm, so `make test-python` (.venv)
# skips them: collected here too, so `make test-vllm` (.venv-vllm) runs them.
# test_kv_layouts.py's check of its caches against vLLM's own strides needs vLLM: run here too.
from test_kv_layouts import test_vllm_views_have_vllms_strides  # noqa: E402, F401
from test_tp import (  # noqa: E402, F401
    decode_p2,
    decode_p12,
    decode_pp2,
    test_a_list_of_prefill_tp_sizes_is_checked_by_name,
    test_a_listed_prefill_tp_size_that_does_not_pair_is_refused_by_name,
    test_a_lookup_racing_a_give_up_waits_for_its_fence_and_the_rest_go_at_once,
    test_a_prefill_tp_size_that_does_not_divide_is_refused_by_name,
    test_a_request_taken_by_one_size_refuses_the_others_lookups,
    test_a_size_chosen_between_two_publishes_withdraws_the_later_names,
    test_a_stage_partition_that_does_not_fit_the_pool_is_refused_by_name,
    test_a_staged_prefill_scheduler_plans_each_stages_links,
    test_an_abandoned_part_fails_the_request_and_frees_every_part,
    test_decode_rank_waits_for_every_prefill_ranks_part,
    test_decode_rank_waits_for_every_prefill_stages_layers,
    test_given_up_before_any_lookup_releases_every_size,
    test_one_decode_rank_takes_a_tp1_and_a_tp2_prefill_server_bit_exact,
    test_pipeline_parallelism_off_a_prefill_server_is_refused_by_name,
    test_pipeline_parallelism_with_several_kv_cache_groups_is_refused_by_name,
    test_prefill_pp_size_is_checked_by_name,
    test_the_hello_names_every_decode_rank_and_signs_them_together,
)
from test_vllm_hma import WINDOW, hybrid  # noqa: E402
from vllm_harness import Engine, hello_of, model_with_own_key_dir, prompt_of  # noqa: E402

WAIT_S = 120.0  # what a decode request waits for its blocks, and a prefill request for its destination
TP2 = {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
BOUND = 600.0  # an engine command on the loaded 2-core box (a TP-2 engine starts in about a minute)


def extra(prefill_tp_size: int | list[int]) -> dict[str, Any]:
    return {
        "transfer_timeout_s": WAIT_S,
        "destination_timeout_s": WAIT_S,
        "prefill_tp_size": prefill_tp_size,
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    for llama in model_with_own_key_dir(tmp_path_factory):
        # The hybrid tiny Llama (two KV cache groups: sliding window and full attention), so
        # every pair is TP and HMA together at no extra engine; the single-group data path of
        # every pair is tests/test_tp.py's.
        model = hybrid(llama)
        started: dict[str, Engine] = {}
        try:
            # Started together; each answers its first command once it is up.
            started["tp2"] = Engine(model, "kv_both", extra(1), max_num_batched_tokens=64, **TP2)
            started["tp1"] = Engine(model, "kv_both", extra(2), max_num_batched_tokens=64)
            started["tp2d"] = Engine(model, "kv_consumer", extra([1, 2]), **TP2)
            started["plain"] = Engine(model, None)
            for engine in started.values():
                engine.start("usage")
            for engine in started.values():
                assert engine.result(timeout=BOUND) == {"used": 0, "requests": 0}
            for engine in started.values():  # HMA stayed on with TP: two groups
                info = engine.call("groups")
                assert info["hma_disabled"] is False, info
                assert info["groups"] == [("SlidingWindowSpec", WINDOW), ("FullAttentionSpec", None)], info
            yield started
        finally:
            for engine in started.values():
                engine.close()


PAIRS = {"P2-D1": ("tp2", "tp1", 2, 1), "P1-D2": ("tp1", "tp2", 1, 2), "P2-D2": ("tp2", "tp2d", 2, 2)}


@pytest.mark.parametrize("pair", PAIRS)
def test_tp_pair_outputs_equal_a_plain_engines(engines: dict[str, Engine], pair: str) -> None:
    """Two prompts of 3-5 blocks (chunked: 64 tokens a step on the prefill side) through the
    pair; the decode engine computes 6 tokens of each from the KV that arrived. Both prompts
    are longer than the model's window of 64 tokens: each link moves the full-attention
    group's blocks and the sliding-window group's live window, from its head slices."""
    p_name, d_name, p_tp, d_tp = PAIRS[pair]
    prefill, decode, plain = engines[p_name], engines[d_name], engines["plain"]
    hello = hello_of(decode)
    assert len(hello["peer"].split(" ")) == d_tp  # one rendezvous per decode rank
    seed = sum(map(ord, pair))
    prompts = [prompt_of(100 + 40 * i, seed + i) for i in range(2)]
    transfers = [uuid.uuid4().hex for _ in prompts]
    recv = [
        (f"d-{pair}-{i}", p, 6, {"kvferry": {"op": "recv", "transfer": t, "timeout_s": WAIT_S}})
        for i, (p, t) in enumerate(zip(prompts, transfers))
    ]
    send = [
        (
            f"p-{pair}-{i}",
            p,
            1,
            {"kvferry": {"op": "send", "transfer": t, "peer": hello["peer"], "peer_mac": hello["peer_mac"]}},
        )
        for i, (p, t) in enumerate(zip(prompts, transfers))
    ]
    decode.start("run", recv, None, None)
    sent = prefill.run(send)["outputs"]
    got = decode.result(timeout=BOUND)["outputs"]
    want = plain.run([(f"r-{pair}-{i}", p, 6, None) for i, p in enumerate(prompts)])["outputs"]
    for i in range(len(prompts)):
        d = got[f"d-{pair}-{i}"]
        assert d["finish_reason"] == "length", (pair, i, d, sent[f"p-{pair}-{i}"])
        assert d["tokens"] == want[f"r-{pair}-{i}"]["tokens"], (pair, i)
        assert "error" not in sent[f"p-{pair}-{i}"]["kv_transfer_params"]["kvferry"], sent
    for engine in (prefill, decode):
        usage = engine.call("usage")
        assert usage == {"used": 0, "requests": 0}, (pair, usage)


def test_one_decode_engine_takes_prefill_engines_of_both_sizes(engines: dict[str, Engine]) -> None:
    """tp2d (``prefill_tp_size [1, 2]``) decodes, in one run, two prompts sent by the TP-1
    engine (its one rank writes each decode rank's head slice) and two by the TP-2 engine
    (rank to rank, whole blocks), the two prefill engines running at once: each request taken
    by the size of its first lookup, the other size's parts released. Each output equals the
    plain engine's; no prefill request reports an error; every pool ends empty."""
    decode, plain = engines["tp2d"], engines["plain"]
    hello = hello_of(decode)
    assert len(hello["peer"].split(" ")) == 2
    senders = {"tp1": engines["tp1"], "tp2": engines["tp2"]}
    prompts = {f"{name}-{i}": prompt_of(90 + 50 * i + 10 * j, 300 + 10 * j + i) for j, name in enumerate(senders)
               for i in range(2)}  # fmt: skip
    transfers = {key: uuid.uuid4().hex for key in prompts}
    recv = [
        (f"d-mixed-{key}", prompt, 6, {"kvferry": {"op": "recv", "transfer": transfers[key], "timeout_s": WAIT_S}})
        for key, prompt in prompts.items()
    ]
    decode.start("run", recv, None, None)
    for name, engine in senders.items():
        send = [
            (
                f"p-mixed-{key}",
                prompt,
                1,
                {
                    "kvferry": {
                        "op": "send",
                        "transfer": transfers[key],
                        "peer": hello["peer"],
                        "peer_mac": hello["peer_mac"],
                    }
                },
            )
            for key, prompt in prompts.items()
            if key.startswith(f"{name}-")
        ]
        engine.start("run", send, None, None)
    sent = {}
    for engine in senders.values():
        sent.update(engine.result(timeout=BOUND)["outputs"])
    got = decode.result(timeout=BOUND)["outputs"]
    want = plain.run([(f"r-mixed-{key}", prompt, 6, None) for key, prompt in prompts.items()])["outputs"]
    for key in prompts:
        d = got[f"d-mixed-{key}"]
        assert d["finish_reason"] == "length", (key, d, sent[f"p-mixed-{key}"])
        assert d["tokens"] == want[f"r-mixed-{key}"]["tokens"], key
        assert "error" not in sent[f"p-mixed-{key}"]["kv_transfer_params"]["kvferry"], sent
    for engine in (decode, *senders.values()):
        usage = engine.call("usage")
        assert usage == {"used": 0, "requests": 0}, usage
