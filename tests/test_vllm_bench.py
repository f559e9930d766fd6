"""`kvferry bench vllm` end to end, small: real vLLM servers behind the proxies, two of the
configurations (early send without and with decode-side awareness: they share one prefill
server, three servers in all), taking turns, one host. Checks what the bench reports, not how
fast anything is: every output equals the plain server's, the rows move the bytes their
configuration says (and the bytes the ideal bound counts are those), every measured turn has
its ideal and losses, nothing stays allocated, the table and JSON say it.

Needs vLLM (``make setup-vllm && make test-vllm``); skipped where it is not importable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make setup-vllm; make test-vllm runs these)")

from kvferry.bench.vllm import CASES, VllmBenchConfig, format_vllm_bench, run_vllm_bench, write_json  # noqa: E402
from kvferry.geometry import VLLM_TEST_MODEL  # noqa: E402

BLOCK = 32


def test_bench_vllm_reports_awareness_early_bytes_and_equal_outputs(tmp_path: Path) -> None:
    cfg = VllmBenchConfig(
        sessions=1, turns=1, cached_tokens=256, new_tokens=64, output_tokens=4, model=VLLM_TEST_MODEL,
        layer_groups=2, max_num_batched_tokens=128, kv_cache_memory_bytes=64 << 20,
        configs=("kvferry-early", "kvferry-aware"), workdir=str(tmp_path),
    )  # fmt: skip
    progress: list[str] = []
    result = run_vllm_bench(cfg, progress=progress.append)
    assert set(result["configs"]) == {"kvferry-early", "kvferry-aware"}
    early, aware = result["configs"]["kvferry-early"], result["configs"]["kvferry-aware"]
    assert early["aware"] is False and aware["aware"] is True
    assert len(result["kv_blocks_left"]) == 3 and set(result["kv_blocks_left"].values()) == {0}
    per_block = result["kv_bytes_per_token"] * BLOCK
    for conf in (early, aware):
        for case in CASES:
            assert conf[case]["outputs_equal"] is True
            assert conf[case]["duplicates"] == 0
            assert conf[case]["turns"] and all(t["ttft_ms"] > 0 for t in conf[case]["turns"])
            # The bytes the ideal bound counts are the bytes the connector moved.
            assert conf[case]["needed_bytes_per_turn"] == conf[case]["link_bytes_per_turn"]
            for t in conf[case]["turns"]:
                assert t["ideal_kv_ready_ms"] >= t["clean_prefill_ms"] > 0
                assert set(t["losses"]) == {"admission", "prefill_slowed", "after_prefill", "first_token"}
    # The measured turn's prompt: the warm-up conversation, its output and the new tokens.
    prompt = early["decode-warm"]["turns"][0]["prompt_tokens"]
    full = prompt // BLOCK
    # decode-warm: the decode server that served the last turn still holds the conversation.
    # Without awareness it holds nothing (no prefix cache) and every block crosses; with it,
    # the blocks it holds are skipped and only the rest crosses.
    warm_early, warm_aware = early["decode-warm"], aware["decode-warm"]
    assert warm_early["held_blocks_per_turn"] == 0
    assert warm_aware["held_blocks_per_turn"] > 0
    assert warm_early["link_bytes_per_turn"] == -(-prompt // BLOCK) * per_block
    assert (
        warm_aware["link_bytes_per_turn"]
        == warm_early["link_bytes_per_turn"] - warm_aware["held_blocks_per_turn"] * per_block
    )
    # decode-cold: the decode server's cache is reset, the prefill server's is not: the complete
    # blocks of the prefill server's hit leave early, with or without awareness.
    for conf in (early, aware):
        cold = conf["decode-cold"]
        assert cold["held_blocks_per_turn"] == 0
        assert 0 < cold["early_bytes_per_turn"] < cold["link_bytes_per_turn"] == -(-prompt // BLOCK) * per_block
        assert cold["early_bytes_per_turn"] <= full * per_block
    table = format_vllm_bench(result)
    assert "placement: one host, loopback" in table
    assert "kvferry-early" in table and "kvferry-aware" in table and "veth" not in table
    assert "KV blocks left allocated at the end: none" in table
    assert "where KV-ready lost time against the ideal" in table
    path = tmp_path / "bench.json"
    write_json(result, str(path))
    assert (
        json.loads(path.read_text())["configs"]["kvferry-aware"]["decode-warm"]["held_blocks_per_turn"]
        == warm_aware["held_blocks_per_turn"]
    )
    assert any("decode-cold: turn 1 of 1 done" in line for line in progress)


def test_bench_vllm_under_vllm_router(tmp_path: Path) -> None:
    """The same bench with vllm-router sending the legs (--router vllm-router): NixlConnector
    and KvferryConnector both in NixlConnector's protocol, outputs equal, kvferry's prefix
    leaves early (the router runs both legs at once once the prefill answered push)."""
    cfg = VllmBenchConfig(
        sessions=1, turns=1, cached_tokens=256, new_tokens=64, output_tokens=4, model=VLLM_TEST_MODEL,
        max_num_batched_tokens=128, kv_cache_memory_bytes=64 << 20, configs=("nixl", "kvferry-early"),
        workdir=str(tmp_path), router="vllm-router",
    )  # fmt: skip
    result = run_vllm_bench(cfg)
    assert result["router"] == "vllm-router" and set(result["kv_blocks_left"].values()) == {0}
    for name in ("nixl", "kvferry-early"):
        for case in CASES:
            assert result["configs"][name][case]["outputs_equal"] is True
    assert result["configs"]["kvferry-early"]["decode-cold"]["early_bytes_per_turn"] > 0
    assert result["configs"]["kvferry-early"]["decode-cold"]["ttft_vs_nixl"] is not None
    assert "legs sent by vllm-router" in format_vllm_bench(result)
