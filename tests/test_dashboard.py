"""The dashboard picture's PromQL subset (kvferry.bench.dashboard) against values worked out
by hand, every panel's query parsed by it, and the picture drawn from a scrape file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from kvferry.bench import dashboard

ROOT = Path(__file__).resolve().parent.parent


def _sample(t: float, server: str, text: str, config: str = "c") -> dict[str, Any]:
    series = dashboard.parse_metrics(text)
    return {
        "t": t,
        "config": config,
        "server": server,
        "series": {(n, tuple(sorted((*ls, ("instance", server))))): v for (n, ls), v in series.items()},
    }


def _hist(name: str, le01: float, le1: float, inf: float, extra: str = "") -> str:
    return "\n".join(f'{name}_bucket{{{extra}le="{le}"}} {v}' for le, v in (("0.1", le01), ("1.0", le1), ("+Inf", inf)))


def test_rate_sum_by_and_division() -> None:
    text0 = 'vllm:x_total{engine="0",reason="a"} 0\nvllm:x_total{engine="0",reason="b"} 10\n'
    text1 = 'vllm:x_total{engine="0",reason="a"} 100\nvllm:x_total{engine="0",reason="b"} 30\n'
    samples = [_sample(0.0, "p", text0), _sample(10.0, "p", text1), _sample(0.0, "d", text0), _sample(10.0, "d", text0)]
    samples.sort(key=lambda r: r["t"])
    last = len(samples) - 1
    assert dashboard.evaluate('sum(rate(vllm:x_total{model_name=~"$model"}[$__rate_interval]))', samples, last) == {
        (): 12.0
    }
    by = dashboard.evaluate("sum by (reason) (rate(vllm:x_total[5m]))", samples, last)
    assert by == {(("reason", "a"),): 10.0, (("reason", "b"),): 2.0}
    ratio = dashboard.evaluate("sum(rate(vllm:x_total[1m])) / sum(vllm:x_total)", samples, last)
    assert ratio == {(): pytest.approx(12.0 / 140.0)}  # each target's newest: p 100 + 30, d 0 + 10
    assert dashboard.evaluate("max(vllm:x_total)", samples, last) == {(): 100.0}


def test_histogram_quantile_interpolates_as_prometheus() -> None:
    samples = [_sample(0.0, "p", _hist("vllm:h", 5, 10, 10))]

    def q(x: float) -> float:
        return dashboard.evaluate(f"histogram_quantile({x}, sum by (le) (vllm:h_bucket))", samples, 0)[()]

    assert q(0.5) == pytest.approx(0.1) and q(0.9) == pytest.approx(0.1 + 0.9 * 4 / 5)
    empty = [_sample(0.0, "p", _hist("vllm:h", 0, 0, 0))]
    assert math.isnan(dashboard.evaluate("histogram_quantile(0.5, sum by (le) (vllm:h_bucket))", empty, 0)[()])


def test_every_panel_query_parses_and_the_picture_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    dash = json.loads((ROOT / "docs" / "grafana" / "kvferry.json").read_text())
    samples = [
        _sample(float(t), "prefill0", f'vllm:kvferry_early_issued_bytes_total{{engine="0"}} {t * 1000}\n')
        for t in range(5)
    ]
    for panel in dash["panels"]:
        for target in panel["targets"]:
            dashboard.evaluate(target["expr"], samples, len(samples) - 1)  # raises on what it cannot read
    assert dashboard.evaluate(dash["panels"][0]["targets"][0]["expr"], samples, 4) == {(): pytest.approx(1000.0)}
    scrapes = tmp_path / "scrapes.jsonl"
    scrapes.write_text(
        "".join(
            json.dumps(
                {
                    "t": s["t"],
                    "config": "c",
                    "server": s["server"],
                    "text": f'vllm:kvferry_early_issued_bytes_total{{engine="0"}} {s["t"] * 1000}\n',
                }
            )
            + "\n"
            for s in samples
        )
    )
    png = tmp_path / "d.png"
    assert dashboard.main([str(scrapes), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
