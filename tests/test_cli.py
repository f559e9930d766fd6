"""`kvferry plan`: the slice table, exact-once confirmation and one-line errors."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from typing import Any

import pytest
from helpers import TINY_MODEL, cli_argv
from kvferry.cli import LLAMA8B_BYTES_PER_TOKEN, main, plan_request

# A reference model small enough for a bench run in a test, over a slow simulated link, its KV
# checked against the aggregated run's.
CHECKED_SMALL_MODEL = {
    "tokens_per_block": 16,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "link_gbps": 0.05,
    "check_kv": True,
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_issue_example_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "plan", "--tokens-per-block", "32", "--prompt", "1000", "--reused", "700", "--chunk", "128"
    )
    assert code == 0 and err == ""
    rows = [line.split() for line in out.splitlines() if line.startswith(("early", "chunk"))]
    blocks = [" ".join(r[-5:-3]) for r in rows]  # the "blocks" column
    assert blocks == ["[0, 21)", "[21, 25)", "[25, 29)", "[29, 32)"]
    assert "exact-once: 32 of 32 needed blocks sent, none twice" in out
    # Default block bytes: Llama-3-8B geometry, 32 tokens per block -> 4 MiB per block.
    assert LLAMA8B_BYTES_PER_TOKEN * 32 == 4 * 1024 * 1024
    assert "84.0 MiB" in out


def test_no_early_sends_prefix_with_first_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "plan",
        "--tokens-per-block",
        "32",
        "--prompt",
        "1000",
        "--reused",
        "700",
        "--chunk",
        "128",
        "--no-early",
    )
    assert code == 0
    assert not any(line.startswith("early") for line in out.splitlines())
    assert "[0, 25)" in out
    assert "0 (0.0%) before the first forward" in out


def test_window_and_block_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "plan",
        "--tokens-per-block",
        "4",
        "--prompt",
        "32",
        "--chunk",
        "16",
        "--window",
        "16",
        "--block-bytes",
        "1024",
    )
    assert code == 0
    assert "[4, 8)" in out and "4.0 KiB" in out
    assert "4 of 4 needed blocks" in out


def test_plan_request_covers_every_block_once() -> None:
    plan = plan_request(16, 5000, 3333, 300)
    covered = [b for s in plan.slices for b in range(s.blocks.start, s.blocks.end)]
    assert covered == list(range(plan.ledger.num_blocks))
    assert plan.needed_blocks == plan.ledger.num_blocks


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--tokens-per-block", "0", "--prompt", "5"], "--tokens-per-block: must be > 0, got 0"),
        (["--tokens-per-block", "x", "--prompt", "5"], "expected an integer, got 'x'"),
        (["--tokens-per-block", "4", "--prompt", "8", "--reused", "8"], "invalid reused_len=8"),
        (["--tokens-per-block", "4", "--prompt", "8", "--reused", "-1"], "must be >= 0, got -1"),
        (["--tokens-per-block", "4"], "--prompt"),
    ],
)
def test_bad_arguments_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        code = main(["plan", *argv])
        raise SystemExit(code)
    assert exc.value.code == 2
    _, err = capsys.readouterr()
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err


def test_console_script_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "plan", "--tokens-per-block", "4", "--prompt", "32", "--reused", "12"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "early" in proc.stdout and "[0, 3)" in proc.stdout


def test_bench_copy_small_run_writes_json(capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import json

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    out = tmp_path / "copy.json"
    code = main(
        ["bench", "copy", "--blocks", "2,5", "--layers", "2", "--block-kib", "4", "--reps", "1", "--json", str(out)]
    )
    assert code == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["ceiling_gbps"] > 0
    got = {(r["transport"], r["blocks"]) for r in result["rows"]}
    # The bare copies and every transport serving CPU pools (kvferry.transports.registry).
    assert got == {(t, n) for t in ("torch", "copy", "in-process", "shm", "staging", "nixl") for n in (2, 5)}
    for row in result["rows"]:
        assert row["payload_bytes"] == row["blocks"] * 2 * 4 * 1024
        assert row["gbps"] > 0 and "of ceiling" in table


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--transport", "carrier-pigeon"], "unknown transport ['carrier-pigeon']"),
        (["--blocks", "8,0"], "must be > 0, got 0"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_bench_copy_bad_options(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "copy", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_bench_copy_receiver_device_is_checked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--receiver-device`` (the staging receiver on a second GPU): each way it cannot run is
    named, as on a machine with two CUDA devices (the count is the one thing stood in for)."""
    from kvferry import cli

    monkeypatch.setattr(cli, "_cuda_count", lambda: 2)
    problem = cli._receiver_device_problem
    assert problem("cuda:1", "cuda", ("copy", "staging")) is None
    assert problem("cuda:1", "cpu", ("staging",)) == "a second GPU is for --device cuda, not 'cpu'"
    assert problem("cuda:1", "cuda", ("staging", "nixl", "cuda-ipc")) == (
        "only the staging transport's receiver moves there; drop --transport cuda-ipc,nixl"
    )
    assert problem("gpu1", "cuda", ("staging",)) == "must be cuda:N"
    assert problem("cuda:x", "cuda", ("staging",)) == "must be cuda:N"
    assert problem("cuda:2", "cuda", ("staging",)) == "this machine has 2 CUDA device(s)"
    assert problem("cuda:0", "cuda", ("staging",)) == "cuda:0 is the sender's GPU (the default); name another"


def _small_agentic_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, *flags: str, output: int, layers: int
) -> tuple[dict[str, Any], str, Any]:
    """``bench agentic`` on `CHECKED_SMALL_MODEL` (2 sessions of one turn, 160 cached + 40
    new tokens) with ``flags``: its JSON result, its table, and the path of its PNG."""
    import json

    out, png = tmp_path / "agentic.json", tmp_path / "timeline.png"
    argv = cli_argv(
        "bench",
        "agentic",
        sessions=2,
        turns=1,
        cached=160,
        new=40,
        output=output,
        layers=layers,
        **CHECKED_SMALL_MODEL,
        json=str(out),
        png=str(png),
    )
    assert main([*argv, *flags]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out, png


def test_bench_agentic_small_run(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    result, table, png = _small_agentic_run(capsys, tmp_path, output=3, layers=2)
    assert result["outputs_match"] is True and result["duplicate_blocks"] == 0
    assert result["kv_mismatch_blocks"] == 0 and result["output_divergences"] == []
    assert result["prefill_mismatch_blocks"] == 0 and result["reuse_mismatches"] == 0
    assert "0 blocks differ between the workers, 0 between" in table
    assert 0.0 <= result["hidden_fraction"] <= 1.0
    for mode in ("baseline", "early", "ideal"):
        assert (
            result[mode]["kv_ready_ms_p50"] > 0 and result[mode]["kv_ready_ms_p90"] >= result[mode]["kv_ready_ms_p50"]
        )
    assert result["baseline"]["early_bytes"] == 0 and result["early"]["early_bytes"] > 0
    # Both modes move the same bytes in all; early moves most of them before the forward.
    assert result["baseline"]["after_bytes"] == result["early"]["early_bytes"] + result["early"]["after_bytes"]
    early = [r for r in result["requests"] if r["mode"] == "early"]
    assert all(r["reused_len"] >= 160 - 40 for r in early) and len(early) == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "outputs match aggregated: True" in table
    # The ideal bound is a bound: no request was ready before it.
    assert all(r["ideal_kv_ready_ms"] <= r["kv_ready_ms"] for r in result["requests"])
    assert len(result["turns"]) == 1 and result["early_over_baseline"] == result["turns"][0]["early_over_baseline"]
    assert set(result["load"]) == {"busy", "prefill_spread", "worst_turn", "worst_spread", "threshold"}


@pytest.mark.parametrize("flag, groups", [(["--layerwise"], 3), (["--layerwise", "2"], 2)], ids=["per-layer", "G2"])
def test_bench_agentic_layerwise_small_run(
    capsys: pytest.CaptureFixture[str], tmp_path, flag: list[str], groups: int
) -> None:  # type: ignore[no-untyped-def]
    """A third run, early + layer-wise: its own figures in the JSON and the table, outputs and
    KV checked like the others, every byte sent once (early + layer slices + after the
    forward add up to what baseline sends)."""
    result, table, png = _small_agentic_run(capsys, tmp_path, *flag, output=2, layers=3)
    assert result["outputs_match"] is True and result["duplicate_blocks"] == 0 and result["output_divergences"] == []
    assert result["kv_mismatch_blocks"] == 0 and result["prefill_mismatch_blocks"] == 0
    lw, early, base = result["layerwise"], result["early"], result["baseline"]
    assert lw["layer_groups"] == groups and lw["duplicate_blocks"] == 0
    assert set(early) <= set(lw)  # shaped like early
    assert lw["kv_ready_ms_p50"] > 0 and lw["ideal_kv_ready_ms_p50"] > 0 and 0.0 <= lw["hidden_fraction"] <= 1.0
    assert lw["layer_bytes"] > 0 and early["layer_bytes"] == 0 and lw["early_bytes"] == early["early_bytes"]
    assert lw["early_bytes"] + lw["layer_bytes"] + lw["after_bytes"] == base["after_bytes"]
    rows = [r for r in result["requests"] if r["mode"] == "layerwise"]
    assert len(rows) == 2 and all(r["bars"]["layer"] for r in rows)
    assert f"layer-wise ({groups} layer groups): KV-ready p50/p90" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_agentic_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "agentic", "--heads", "6", "--kv-heads", "4"]) == 2
    assert "multiple of --kv-heads" in capsys.readouterr().err
    assert main(["bench", "agentic", "--layers", "4", "--layerwise", "5"]) == 2
    assert "--layerwise 5 must be <= --layers 4" in capsys.readouterr().err


def test_bench_fanout_small_run(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    out = tmp_path / "fanout.json"
    argv = cli_argv("bench", "fanout", requests=3, prefix=256, suffix=8, output=2, chunk=64, link_gbps=0, json=str(out))
    assert main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["outputs_match"] is True and result["kv_mismatch_blocks"] == 0
    # tpb 16: a 264-token prompt is 16 full prefix blocks + 1 own block; the prefix crosses once.
    assert result["without_dedup"]["blocks_sent"] == 3 * 17
    assert result["with_dedup"]["blocks_sent"] == 16 + 3
    assert result["bytes_ratio"] == pytest.approx(19 / 51)
    assert "outputs match aggregated: True" in table


def test_bench_tiers_small_run(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Both modes move the same bytes over the link; only onboard-then-send moves the host
    blocks to the device first; both deliver the prefix bit exact. The ratio reported is the
    one of the medians reported (how large it is, a timing, is for docs/benchmarks.md)."""
    import json

    out = tmp_path / "tiers.json"
    argv = cli_argv(
        "bench",
        "tiers",
        blocks=32,
        host_fraction=0.25,
        layers=2,
        block_kib=64,
        reps=2,
        link_gbps=0.5,
        host_gbps=0.5,
        json=str(out),
    )
    assert main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    direct, onboard = result["direct"], result["onboard_then_send"]
    block = 2 * 64 * 1024
    assert result["host_blocks"] == 8 and result["block_bytes"] == block
    assert direct["link_bytes"] == onboard["link_bytes"] == 33 * block
    assert (direct["link_bytes_from_host"], direct["host_to_device_bytes"]) == (8 * block, 0)
    assert (onboard["link_bytes_from_host"], onboard["host_to_device_bytes"]) == (0, 8 * block)
    assert direct["kv_bit_exact"] is True and onboard["kv_bit_exact"] is True
    assert len(direct["kv_ready_ms"]) == len(onboard["kv_ready_ms"]) == 2
    assert all(t > 0 for t in direct["kv_ready_ms"] + onboard["kv_ready_ms"])
    assert direct["kv_ready_ms_median"] == statistics.median(direct["kv_ready_ms"])
    assert onboard["kv_ready_ms_median"] == statistics.median(onboard["kv_ready_ms"])
    assert result["ratio"] == onboard["kv_ready_ms_median"] / direct["kv_ready_ms_median"]
    assert f"onboard-then-send / direct: {result['ratio']:.2f}x" in table


def _options(
    parser: argparse.ArgumentParser, path: str = "kvferry"
) -> list[tuple[str, argparse.Action, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _options(sub, f"{path} {name}")
        elif action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            found.append((f"{path} {action.option_strings[-1]}", action, parser))
    return found


def test_every_option_has_help_showing_its_default() -> None:
    from kvferry.cli import build_parser

    options = _options(build_parser())
    assert len(options) > 40
    for name, action, parser in options:
        assert action.help, f"{name} has no help text"
        shown = parser._get_formatter()._expand_help(action)
        assert "default" in shown or "required" in shown, f"{name}: {shown!r} shows no default"


def test_help_renders_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "agentic", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--sessions N concurrent conversations" in out and "(default: 3)" in out
    assert "--aware also run early transfer" in out and "(default: off)" in out
    with pytest.raises(SystemExit):
        main(["bench", "copy", "--help"])
    assert "(default: 8,64,1024,4096)" in " ".join(capsys.readouterr().out.split())


def test_bench_agentic_header_and_progress_agree(capsys: pytest.CaptureFixture[str]) -> None:
    argv = cli_argv("bench", "agentic", sessions=2, turns=2, cached=64, new=16, output=2, **TINY_MODEL, png="")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    phrase = "2 sessions x 3 turns (1 warm-up + 2 measured)"
    assert phrase in out.splitlines()[0] and phrase in err
    assert "baseline turn 0 (warm-up)" in err and "early turn 2 of 2" in err and "turn 3" not in err
    header = next(line for line in out.splitlines() if line.startswith("mode "))
    assert "prefill ms" in header and "KV-ready ms" in header and "early MiB" in header
    rows = [line for line in out.splitlines() if line.startswith(("baseline ", "early "))]
    assert len(rows) == 2 * 2 * 2 and not any(field.endswith("m") for row in rows for field in row.split()[5:])
    assert "early/baseline KV-ready" in out and "median over 2 measured turns" in out
    assert ("WARNING: the machine was too busy" in out) != (
        "load: the modes' prefill of a turn, the same computation, agreed" in out
    )


def test_bench_copy_table_shows_the_staging_rows_against_the_link_both_ways() -> None:
    """With the both-ways ceiling measured (CUDA runs), the table names it and gives each
    staging row's share of it beside its share of the one-way host link."""
    from kvferry.bench.copy import format_table

    row = {"transport": "staging", "blocks": 1024, "payload_bytes": 4 << 30, "seconds": 0.1, "gbps": 40.0}
    result = {
        "machine": "m",
        "date": "d",
        "ceiling_gbps": 2000.0,
        "host_link_gbps": 50.0,
        "duplex_link_gbps": 44.0,
        "rows": [{**row, "share_of_ceiling": 0.8}, {**row, "transport": "copy", "share_of_ceiling": 0.02}],
    }
    lines = format_table(result).splitlines()
    assert "both ways at once: 44.0 GB/s each way" in lines[2]
    staging, copy = lines[-2], lines[-1]
    assert staging.endswith("80%  (91% of both ways)")
    assert "both ways" not in copy
    assert "both ways" not in format_table({**result, "duplex_link_gbps": None})
    # A ring or a receiver GPU chosen by hand is named on the staging rows only.
    config = {"config": {"ring_bytes": 64 << 20, "receiver_device": "cuda:1"}}
    staging, copy = format_table({**result, **config}).splitlines()[-2:]
    assert staging.endswith("(91% of both ways)  (ring 64 MiB)  (receiver on cuda:1)"), staging
    assert "ring" not in copy and "receiver" not in copy


@pytest.mark.cuda
def test_the_link_both_ways_is_measured_on_the_gpu() -> None:
    """The both-ways ceiling runs on a GPU and gives a rate, as the one-way one does."""
    import torch
    from kvferry.bench.copy import duplex_link_gbps, pinned_link_gbps

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert duplex_link_gbps(64 << 20, 3) > 0 and pinned_link_gbps(64 << 20, 3) > 0
