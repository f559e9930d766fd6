"""Operating kvferry with real vLLM servers: the per-request trace of a two-server run merged
into one timeline (kvferry trace), and the Grafana dashboard's every metric on the servers'
/metrics after that run. One testbed (a prefill and a decode server, the proxy) serves both."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvferry import trace

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not importable (make setup-vllm)")
ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "kvferry.json"
TURNS = 2
LONE = "lone-decode-half"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two turns of one conversation through the proxy, decode-cold for the first (its
    prefix is in the prefill server's cache only: an early send), with tracing on both
    servers and two layer groups on the prefill side; 64-token chunks."""
    if not HAVE_VLLM:
        pytest.skip("vLLM not importable")
    from kvferry.vllm import testbed
    from vllm_harness import wait_until

    root = tmp_path_factory.mktemp("ops")
    tiny = testbed.build_tiny_llama(root)
    (root / "bed").mkdir()
    traces = root / "prefill.trace", root / "decode.trace"
    prefill = testbed.kvferry_config("kv_producer", trace=str(traces[0]), layer_groups=2)
    decode = testbed.kvferry_config("kv_consumer", trace=str(traces[1]))
    engine = testbed.EngineSettings(max_num_batched_tokens=64)
    with testbed.Testbed(tiny, root / "bed", prefill, decode, proxy_connector="kvferry", engine=engine) as bed:
        rng = random.Random(11)
        system = [rng.randrange(3, 500) for _ in range(96)]
        assert (
            testbed.call(
                bed.prefills[0].url, "/v1/completions", {"model": "tiny", "prompt": system, "max_tokens": 1}
            ).status
            == 200
        )
        prompt = system + [rng.randrange(3, 500) for _ in range(100)]
        for _ in range(TURNS):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            answer = testbed.call(bed.url, "/v1/completions", body)
            assert answer.status == 200 and len(answer.token_ids) == 4, answer.body
            prompt = prompt + answer.token_ids + [rng.randrange(3, 500) for _ in range(40)]
        # A decode half whose prefill half never comes: it fails at its own 1 s timeout.
        alone = {"kvferry": {"op": "recv", "transfer": LONE, "timeout_s": 1}}
        lone = {"model": "tiny", "prompt": system, "max_tokens": 1, "kv_transfer_params": alone}
        testbed.call(bed.decodes[0].url, "/v1/completions", lone)

        def published() -> bool:  # vLLM ships connector stats with a later stats record
            return _value(bed.prefills[0].metrics(), "vllm:kvferry_transfers_total") >= TURNS

        wait_until(published, "the prefill server's stats of both transfers")
        failed = lambda: _value(bed.decodes[0].metrics(), "vllm:kvferry_failures_total") >= 1  # noqa: E731
        wait_until(failed, "the decode server's failure count")
        yield {"traces": traces, "metrics": [s.metrics() for s in bed.servers()], "root": root}


def _value(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M))


@needs_vllm
def test_trace_merges_both_servers_into_one_timeline_per_transfer(run: Any) -> None:
    prefill_rows, decode_rows = trace.read([str(run["traces"][0])]), trace.read([str(run["traces"][1])])
    assert {r["side"] for r in prefill_rows} == {"prefill"} and {r["side"] for r in decode_rows} == {"decode"}
    timelines = [tl for tl in trace.merge(prefill_rows + decode_rows) if tl.transfer != LONE]
    assert len(timelines) == TURNS
    for n, tl in enumerate(timelines):
        assert tl.sides == {"prefill", "decode"}, tl.rows
        p = [r for r in tl.rows if r["side"] == "prefill"]
        d = [r for r in tl.rows if r["side"] == "decode"]
        stages = [r["stage"] for r in p]
        # The last chunk's issue can follow its layer groups' landing (they leave during its forward).
        # The plan is traced once the decode endpoint is connected (off the engine thread), so a
        # chunk computed meanwhile can be traced before it; nothing is written or lands before it.
        plan = stages.index("plan")
        assert stages.count("plan") == 1 and stages[-1] == "freed" and stages.count("tail_landed") == 1, stages
        assert all(s == "chunk_issued" for s in stages[:plan]), stages
        assert [r["stage"] for r in d] == ["plan", "tail_landed", "freed"], d
        chunks = [r for r in p if r["stage"] == "chunk_issued"]
        assert [c["chunk"] for c in chunks] == list(range(1, len(chunks) + 1)) and len(chunks) >= (
            2 if n == 0 else 1
        ), chunks
        # Two layer groups: the last chunk left group 1 then group 2.
        # (when the decode endpoint was connected by the last chunk's forward: it is connected off
        # the engine thread, and a chunk computed before that is sent whole after its forward)
        assert sorted({(r["group"], r["groups"]) for r in p if r["stage"] == "layer_landed"}) in (
            [],
            [(0, 2), (1, 2)],
        ), p
        if n == 0:  # decode-cold: the prefix left before the first forward
            assert "early_issued" in stages and any(r["stage"] == "early_landed" for r in p), stages
        else:  # the decode server held the first turn's blocks: they never crossed
            assert p[0]["held"] > 0 and d[0]["held"] == p[0]["held"], (p[0], d[0])
        landed = sum(r["bytes"] for r in p if r["stage"].endswith("_landed") and r["stage"] != "tail_landed")
        tail_p = next(r for r in p if r["stage"] == "tail_landed")
        tail_d = next(r for r in d if r["stage"] == "tail_landed")
        # Exact once, seen from both servers: what the prefill side wrote is what the decode side expected.
        assert landed == tail_p["bytes"] == tail_d["bytes"] > 0, (landed, tail_p, tail_d)
        # Causal order on one clock: the decode side sees the last block after it landed.
        assert tail_p["t"] <= tail_d["t"], tl.rows
        assert all(r["issued_t"] <= r["t"] for r in p if "issued_t" in r)


@needs_vllm
def test_trace_tells_a_failed_transfers_reason(run: Any) -> None:
    (lone,) = trace.merge(trace.read([str(p) for p in run["traces"]]), [LONE])
    stages = [(r["side"], r["stage"]) for r in lone.rows]
    assert stages == [("decode", "plan"), ("decode", "failed"), ("decode", "freed")], lone.rows
    assert lone.rows[1]["reason"] == "its blocks did not all arrive within 1.0 s" and lone.ended("decode") == "failed"
    assert "FAILED: its blocks did not all arrive within 1.0 s" in trace.format_timelines([lone])


@needs_vllm
def test_kvferry_trace_cli_prints_and_draws_the_timelines(run: Any) -> None:
    png = run["root"] / "trace.png"
    paths = [str(p) for p in run["traces"]]
    done = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "trace", *paths, "--png", str(png)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    ids = [tl.transfer for tl in trace.merge(trace.read(paths))]
    heads = [line for line in done.stdout.splitlines() if line.startswith("transfer ")]
    assert [h.split()[1] for h in heads] == ids, done.stdout
    assert all(("prefill tail_landed, decode tail_landed" in h) != (LONE in h) for h in heads), done.stdout
    assert re.search(r"\+\s*\d+\.\d\d ms  decode   tail_landed   every block arrived", done.stdout), done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "trace", *paths, "--transfer", ids[1], "--png", ""],
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0 and [
        line.split()[1] for line in one.stdout.splitlines() if line.startswith("transfer ")
    ] == [ids[1]]


def _panel_metrics() -> dict[str, set[str]]:
    """Per panel title: the metric names its queries read (a name with a colon: vLLM's)."""
    dash = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in dash["panels"]:
        names = set()
        for target in panel["targets"]:
            names |= set(re.findall(r"\b(vllm:[a-z_]+)", target["expr"]))
        out[panel["title"]] = names
    return out


@needs_vllm
def test_every_dashboard_metric_is_on_a_real_servers_metrics(run: Any) -> None:
    text = "\n".join(run["metrics"])
    exported = set(re.findall(r"^(vllm:[a-z_]+)(?:\{|\s)", text, re.M))
    panels = _panel_metrics()
    assert len(panels) >= 8 and all(panels.values()), panels
    for title, names in panels.items():
        missing = sorted(names - exported)
        assert not missing, f"panel {title!r} reads {missing}, which no server exports"
    # The reasons are labels made at start: a failure rate starts from 0, not from nothing.
    from kvferry.vllm.stats import FAILURE_REASONS

    reasons = set(re.findall(r'^vllm:kvferry_failures_total\{[^}]*reason="([a-z_]+)"', text, re.M))
    assert reasons == set(FAILURE_REASONS)
    # The one failure of the run: the lone decode half's timeout, on the decode server.
    decode = run["metrics"][1]
    assert _value(decode, "vllm:kvferry_failures_total") == 1 == _value(text, "vllm:kvferry_failures_total")
    assert re.search(r'^vllm:kvferry_failures_total\{[^}]*reason="timeout"[^}]*\} 1\.0$', decode, re.M), decode


@needs_vllm
def test_failure_reasons_from_kvferrys_error_words() -> None:
    from kvferry.vllm.stats import failure_reason

    for text, reason in [
        ("its blocks did not all arrive within 60.0 s", "timeout"),
        ("the decode request was aborted", "aborted"),
        ("preempted by the prefill engine (its blocks were freed): the transfer is given up", "preempted"),
        ("the prefill side gave up: cannot send to the decode server: connection lost", "peer_gave_up"),
        ("authentication failed with the rendezvous: the two servers hold different keys", "authentication"),
        ("cannot send to the decode server: cannot reach the decode server's rendezvous at 'x'", "peer_lost"),
        ("request refused: the prompt differs from the decode half's", "refused"),
        ("something new", "other"),
    ]:
        assert failure_reason(text) == reason, text


def test_dashboard_is_grafana_json_over_kvferry_and_vllm_metrics() -> None:
    """Without servers: the JSON's shape (what Grafana's import needs) and what it covers."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvferry" and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in dash["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["targets"], panel["title"]
        assert all(t["refId"] and t["expr"] for t in panel["targets"])
    used = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in set().union(*_panel_metrics().values())}
    wanted = {
        f"vllm:kvferry_{n}"
        for n in (
            "early_issued_bytes",
            "chunk_bytes",
            "layer_bytes",
            "hidden_fraction",
            "held_blocks",
            "transfer_seconds",
            "recv_seconds",
            "transfers",
            "failures",
        )
    }
    wanted |= {"vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds", "vllm:num_requests_waiting"}
    assert wanted <= used, sorted(wanted - used)
