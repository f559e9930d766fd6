"""`kvferry plan`: the slice table, exact-once confirmation and one-line errors."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
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
        (["--tokens-per-block", "4", "--prompt", "8", "--reused", "8"], "invalid --reused=8: must be < --prompt (8)"),
        (
            ["--tokens-per-block", "1", "--prompt", str((1 << 24) + 1)],
            f"invalid --prompt={(1 << 24) + 1}: must be at most {1 << 24} tokens",
        ),
        (["--tokens-per-block", str(2**64), "--prompt", "8"], f"invalid --tokens-per-block={2**64}"),
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
    # The user typed flags: no Python parameter name of the ledger reaches them.
    assert not any(name in err for name in ("reused_len", "prompt_len", "tokens_per_block")), err


@pytest.mark.parametrize(
    ("argv", "commands"),
    [
        ([], ("plan", "proxy", "doctor", "trace", "bench")),
        (["bench"], ("copy", "agentic", "vllm", "fanout", "tiers")),
    ],
    ids=["kvferry", "kvferry-bench"],
)
def test_a_bare_command_lists_its_subcommands(
    capsys: pytest.CaptureFixture[str], argv: list[str], commands: tuple[str, ...]
) -> None:
    """A bare ``kvferry`` or ``kvferry bench`` is a usage error (status 2) that lists what it
    takes, each command with its one-line help, instead of "arguments are required"."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "arguments are required" not in err
    assert err.startswith(" ".join(["usage: kvferry", *argv]))
    listed = {line.split()[0]: line.split(None, 1)[1:] for line in err.splitlines() if line.startswith("    ")}
    assert set(commands) <= set(listed) and all(listed[c] for c in commands), err  # each with its help


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    """``kvferry doctor | head -1``: the reader closes the pipe before the report is written.
    Here the pipe has no reader at all, so every write fails: the command stops with status 1
    and no BrokenPipeError traceback (before: "Exception ignored ... BrokenPipeError", 120)."""
    key = tmp_path / "authkey"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvferry.cli", "doctor", "--no-ucx", "--authkey-file", str(key)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 1


def test_proxy_names_its_extra_when_aiohttp_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # an import of it now fails as if absent
    assert main(["proxy", "--prefill", "http://p", "--decode", "http://d", "--port", "8000"]) == 2
    assert capsys.readouterr().err == (
        "kvferry proxy: error: kvferry proxy needs aiohttp, which is not installed: pip install 'kvferry[proxy]'\n"
    )


# Flags several benches share but whose defaults differ on purpose: each sizes its own
# workload (the vLLM bench a smaller model and conversation, as vLLM's CPU build computes them
# several times slower than the reference engine) or names its own output. Every other shared
# flag has one default everywhere (--tokens-per-block once had 16 in one bench, 32 in another).
WORKLOAD_FLAGS = {
    "--blocks": "copy: a list of transfer sizes; tiers: one prefix",
    "--cached": "the vLLM bench's conversations are shorter",
    "--new": "the vLLM bench's conversations are shorter",
    "--output": "fanout: four tokens per request of eight",
    "--chunk": "agentic: unchunked; vllm: vLLM's max_num_batched_tokens; fanout: its 8k prefix in 8",
    "--hidden": "the vLLM bench's model is smaller",
    "--ffn": "the vLLM bench's model is smaller",
    "--heads": "the vLLM bench's model is smaller",
    "--kv-heads": "the vLLM bench's model is smaller",
    "--layers": "copy and tiers: by device (None: 8 on cpu, 32 on cuda)",
    "--transport": "copy: every transport; tiers: by device; agentic, fanout: in-process",
    "--png": "each bench names its own picture",
}


def test_benches_share_one_default_per_flag() -> None:
    from kvferry.cli import _subcommand, build_parser

    defaults: dict[str, dict[str, Any]] = {}
    for name, action, parser in _options(_subcommand(build_parser(), "bench"), "bench"):
        defaults.setdefault(name.split()[-1], {})[name.split()[1]] = action.default
    shared = {flag: by for flag, by in defaults.items() if len(by) > 1}
    assert shared["--tokens-per-block"] == {"agentic": 32, "fanout": 32}
    differ = {flag for flag, by in shared.items() if len({repr(v) for v in by.values()}) > 1}
    assert differ <= set(WORKLOAD_FLAGS), {f: shared[f] for f in differ - set(WORKLOAD_FLAGS)}


def test_bench_vllm_prints_no_internal_targets() -> None:
    """The table speaks to users: the project's own targets stay in the JSON."""
    from kvferry.bench.vllm_figures import CASES
    from kvferry.bench.vllm_report import format_vllm_bench

    figures = {
        "ttft_ms_p50": 900.0, "ttft_vs_nixl": None, "kv_ready_ms_p50": 800.0, "ideal_kv_ready_ms_p50": 700.0,
        "kv_over_ideal": None, "prefill_ms_p50": 600.0, "link_bytes_per_turn": 1 << 20,
        "early_bytes_per_turn": 1 << 19, "held_blocks_per_turn": None, "outputs_equal": True,
        "losses_ms_p50": {"admission": 50.0, "prefill_slowed": 30.0, "after_prefill": 20.0, "first_token": 10.0},
    }  # fmt: skip
    missed = {"case": CASES[1], "config": "kvferry-early", "figure": "kv_over_ideal", "limit": 1.1, "value": 1.3,
              "met": False, "largest_loss": {"name": "admission", "ms": 50.0}}  # fmt: skip
    result = {
        "config": {"sessions": 1, "turns": 2, "cached_tokens": 64, "new_tokens": 8, "output_tokens": 2,
                   "model": {"layers": 2, "kv_heads": 2, "head_dim": 32}, "decode_netns": None},
        "kv_bytes_per_token": 512, "machine": "m", "date": "d", "placement": "p",
        "load_average": {"before": [0.5], "after": [0.6]}, "link": {"how": "one host", "bytes_per_s": 1e9},
        "configs": {"kvferry-early": {case: figures for case in CASES}},
        "cases": {case: {"best_nixl": None, "load": {"slots": []}, "verdict_configs": []} for case in CASES},
        "targets": [missed], "kv_blocks_left": {"kvferry-early": 0},
    }  # fmt: skip
    table = format_vllm_bench(result)
    assert "kvferry-early" in table and "KV blocks left allocated at the end: none" in table
    assert "target" not in table and "MISSED" not in table and "met" not in table.split()


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
        "only the cuda-ipc and staging transports' receivers move there; drop --transport nixl"
    )
    assert problem("cuda:1", "cuda", ("copy", "cuda-ipc")) is None
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
    # tpb 32 (the default): a 264-token prompt is 8 full prefix blocks + 1 own block; the prefix
    # crosses once.
    assert result["without_dedup"]["blocks_sent"] == 3 * 9
    assert result["with_dedup"]["blocks_sent"] == 8 + 3
    assert result["bytes_ratio"] == pytest.approx(11 / 27)
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
