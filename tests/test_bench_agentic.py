"""The main job's figures: the ideal bound, the busy-machine verdict, the header."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.bench.agentic import BUSY_SPREAD, busy_verdict, ideal_bound, turns_phrase
from kvferry.notice import Notice
from kvferry.sender import TransferRecord


def rec(kind: str, notices: list[Notice], submitted: float, started: float, finished: float) -> TransferRecord:
    return TransferRecord(kind, tuple(notices), 0, submitted, started, finished)


def test_ideal_bound_of_a_batch_shares_the_early_copy() -> None:
    """Three requests' prefixes leave in one early copy of 3 s (one second each by blocks);
    request 2's turn leaves after its forward, submitted at 5 s, and takes 0.5 s. Its bound:
    max(admitted + 1 + 0.5, 5 + 0.5) = 5.5, not the 3 s of the whole early copy added to its
    own late prefill start (the old bound, which exceeded what runs achieved)."""
    early = rec(
        "early", [Notice(1, 0, 0, 10, False), Notice(2, 0, 0, 10, False), Notice(3, 0, 0, 10, False)], 0.0, 0.0, 3.0
    )
    chunk = rec("chunk", [Notice(2, 1, 10, 12, True)], 5.0, 5.0, 5.5)
    assert ideal_bound(2, [early, chunk], layers=4, admitted=0.0) == pytest.approx(5.5)
    # With a quick forward the link is what binds: 1 s of prefix share, then 0.5 s of chunk.
    quick = rec("chunk", [Notice(2, 1, 10, 12, True)], 0.2, 3.0, 3.5)
    assert ideal_bound(2, [early, quick], layers=4, admitted=0.0) == pytest.approx(1.5)


def test_ideal_bound_weighs_layer_slices_by_their_layers() -> None:
    """A layer-group slice of 2 of 4 layers is half a block's worth of the record."""
    both = rec(
        "layer",
        [Notice(1, 1, 0, 4, False, group=0, groups=2), Notice(2, 1, 0, 4, False, group=0, groups=2)],
        1.0,
        1.0,
        2.0,
    )
    whole = rec("chunk", [Notice(2, 2, 4, 6, True)], 4.0, 4.0, 4.2)
    assert ideal_bound(1, [both], layers=4, admitted=0.0) == pytest.approx(1.5)
    assert ideal_bound(2, [both, whole], layers=4, admitted=0.0) == pytest.approx(4.2)


def test_ideal_bound_never_exceeds_a_serial_schedule_end() -> None:
    """Any serial schedule of the request's copies (each starting at or after its submission)
    ends at or after the bound."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        t, records = 0.0, []
        for i in range(rng.randrange(1, 6)):
            submitted = t + rng.random()
            started = max(submitted, t) + rng.random() * 0.1
            t = started + rng.random()
            others = [Notice(9, i, 0, rng.randrange(1, 5), False)] if rng.random() < 0.5 else []
            records.append(rec("chunk", [Notice(1, i, 0, rng.randrange(1, 5), False), *others], submitted, started, t))
        assert ideal_bound(1, records, layers=2, admitted=0.0) <= t + 1e-9


def test_ideal_bound_of_nothing_sent_is_admission() -> None:
    assert ideal_bound(1, [], layers=2, admitted=3.0) == 3.0


def turn(t: int, baseline: float, early: float) -> dict:  # type: ignore[type-arg]
    return {"turn": t, "prefill_ms": {"baseline": baseline, "early": early}}


def test_busy_verdict_from_the_modes_prefill_spread() -> None:
    quiet = busy_verdict([turn(1, 600, 620), turn(2, 610, 590), turn(3, 600, 1200)])  # one disturbed turn
    assert quiet["busy"] is False and quiet["prefill_spread"] == pytest.approx(610 / 590)
    assert (quiet["worst_turn"], quiet["worst_spread"]) == (3, pytest.approx(2.0))
    over = 600 * BUSY_SPREAD * 1.01
    busy = busy_verdict([turn(1, 600, 620), turn(2, over, 600), turn(3, 600, over)])
    assert busy["busy"] is True and busy["prefill_spread"] == pytest.approx(over / 600)


def test_turns_phrase_counts_the_warm_up() -> None:
    assert turns_phrase({"sessions": 3, "turns": 4}) == "3 sessions x 5 turns (1 warm-up + 4 measured)"


LLAMA8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=1024)


def test_pools_of_the_8b_run_with_every_mode_fit_an_h200() -> None:
    """`--sessions 2 --cached 32768 --new 2048 --aware --layerwise 8` at Llama-8B geometry
    (bf16): the eight pools are sized from what the run holds at its last turn, so they and
    the weights fit a 139 GiB H200 with room for the forward (at 1.5 prompts per session
    they took 131 GB and the run ran out of memory)."""
    from kvferry.bench.agentic import AgenticConfig, pools_bytes
    from kvferry.geometry import Geometry

    cfg = AgenticConfig(
        device="cuda",
        sessions=2,
        cached_tokens=32768,
        new_tokens=2048,
        aware=True,
        layer_groups=8,
        model=Geometry(**LLAMA8B),
    )
    weights = cfg.model.weight_elements() * 2
    assert pools_bytes(cfg) + weights < 110e9, (pools_bytes(cfg), weights)


def _tight(config: Any, **over: Any) -> Any:
    """A small run whose pools `_pool_blocks` sizes tightly: every mode, a short session."""
    fields = dict(sessions=2, turns=1, cached_tokens=128, new_tokens=32, output_tokens=2, tokens_per_block=16)
    return config(**fields, link_gbps=None, aware=True, layer_groups=2, check_kv=True, **over)


def test_tight_pools_keep_every_turns_reuse_and_outputs() -> None:
    """The pools sized by `_pool_blocks` hold each session's running request and the prefix
    the next turn reuses: every mode reuses what aggregated serving reuses and decodes the
    same tokens."""
    from kvferry.bench.agentic import AgenticConfig, run_agentic

    result = run_agentic(_tight(AgenticConfig))
    assert result["outputs_match"] and result["reuse_mismatches"] == 0, result


def test_every_mode_shares_one_generation_process_and_its_weights() -> None:
    """Over a transport with an endpoint (staging here) the generation workers of all four
    modes live in one process holding one copy of the weights: its pools are one per mode,
    each of `_pool_blocks` blocks, and nothing else grows per mode; outputs and reuse
    match aggregated serving."""
    from kvferry.bench.agentic import AgenticConfig, _pool_blocks, run_agentic

    cfg = _tight(AgenticConfig, transport="staging")
    result = run_agentic(cfg)
    generation = result["generation"]
    block_bytes = cfg.model_config().kv_bytes_per_token * cfg.tokens_per_block
    assert generation["models"] == 1, generation
    assert sorted(generation["pools"].values()) == [_pool_blocks(cfg)] * len(cfg.modes), generation
    assert generation["pool_bytes"] == len(cfg.modes) * _pool_blocks(cfg) * block_bytes, generation
    assert result["outputs_match"] and result["reuse_mismatches"] == 0, result


def test_a_small_staging_ring_carries_every_mode_and_is_the_one_asked_for(capsys: Any) -> None:
    """``ring_bytes`` sizes each generation worker's staging ring (whole blocks): a ring of 4
    blocks, far smaller than each turn's prefix, still lands every mode's KV (outputs and
    reuse match aggregated serving), and the endpoints report 4 blocks. Unset, the ring is
    the pool's size. Refused by name on the command line for another transport."""
    from kvferry.bench.agentic import AgenticConfig, run_agentic
    from kvferry.cli import main

    cfg = _tight(AgenticConfig, transport="staging")
    block_bytes = cfg.model_config().kv_bytes_per_token * cfg.tokens_per_block
    assert cfg.ring_blocks() is None
    small = _tight(AgenticConfig, transport="staging", ring_bytes=4 * block_bytes + block_bytes // 2)
    assert small.ring_blocks() == 4
    result = run_agentic(small)
    assert sorted(result["generation"]["rings"].values()) == [4] * len(small.modes), result["generation"]
    assert result["outputs_match"] and result["reuse_mismatches"] == 0, result
    assert result["duplicate_blocks"] == 0, result
    assert main(["bench", "agentic", "--ring-mib", "64", "--transport", "in-process"]) == 2
    assert "--ring-mib 64 is for --transport staging, not 'in-process'" in capsys.readouterr().err


def test_the_8b_run_over_a_transport_with_an_endpoint_fits_an_h200() -> None:
    """`--sessions 2 --cached 32768 --new 2048 --aware --layerwise 8 --transport staging`
    at Llama-8B geometry: eight pools and two copies of the weights (this process's and the
    one generation process's; one process per mode held four) leave room on a 139 GiB H200."""
    from kvferry.bench.agentic import AgenticConfig, pools_bytes
    from kvferry.geometry import Geometry

    cfg = AgenticConfig(
        device="cuda",
        sessions=2,
        cached_tokens=32768,
        new_tokens=2048,
        aware=True,
        layer_groups=8,
        model=Geometry(**LLAMA8B),
        transport="staging",
    )
    weights = cfg.model.weight_elements() * 2
    assert pools_bytes(cfg) + 2 * weights < 125e9, (pools_bytes(cfg), weights)
    assert pools_bytes(cfg) + (1 + len(cfg.modes)) * weights > 149e9  # what one process per mode needed
