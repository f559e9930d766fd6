"""The serving-load test (kvferry.bench.stress), small for CI: concurrent multi-turn
sessions through ``kvferry proxy`` onto a prefill and a decode server with small KV pools,
some clients hanging up mid-stream. The full size is ``kvferry bench vllm --stress``
(docs/benchmarks.md).

What must hold: vLLM preempted on both servers (the scenario happened); every turn either
completed or was hung up by its client: none failed (a prefill request preempted
mid-transfer is sent again under a new epoch), none is silently short; every completed
turn's output is a plain server's; both servers drain to no request and no KV block; the
proxy serves a request afterwards. Bound: each turn is given ``request_timeout_s`` (a turn
past it counts as failed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM (and transformers) not importable: run in the vLLM venv, see docs/vllm.md"
)


def test_sessions_under_preemption_and_hangups(tmp_path: Path) -> None:
    from kvferry.bench.stress import StressConfig, format_stress, run_stress

    cfg = StressConfig(
        sessions=12,
        turns=2,
        output=96,
        hangup=0.25,
        # 24 prefill blocks: two turns at once outgrow them (preemption there), yet most turns
        # reach the decode server, whose 36 blocks two 96-token decodes outgrow. With 20 and 64
        # a CI run lost 16 of 24 turns to prefill preemption and the decode server was never
        # full (it did not preempt: the scenario did not happen).
        prefill_blocks=24,
        decode_blocks=36,
        max_num_seqs=8,
        request_timeout_s=300.0,
        workdir=str(tmp_path),
    )
    result = run_stress(cfg)
    print(format_stress(result))
    assert result["preemptions"]["decode0"] > 0 and result["preemptions"]["prefill0"] > 0, result  # both sides
    assert result["turns"] == cfg.sessions * cfg.turns
    assert result["failed"] == {}, result
    assert result["completed"] > 0 and result["completed"] + result["hung_up"] == result["turns"], result
    assert result["mismatches"] == 0, result
    assert not any(result["leaked_blocks"].values()), result
    assert result["serves_after"], result
