"""The Grafana dashboard (docs/grafana/kvferry.json) drawn without Grafana: `Scraper` samples
every server's /metrics during a run (``kvferry bench vllm --scrape FILE``), and `render`
evaluates each panel's own PromQL over those samples and draws the panels with matplotlib.

```
kvferry bench vllm --scrape scrapes.jsonl        one JSON line per server per sample
python -m kvferry.bench.dashboard scrapes.jsonl --png dashboard.png
```
The evaluator takes the PromQL the dashboard uses, no more: ``sum``, ``max``, ``sum by
(labels)``, ``rate(m[...])``, ``histogram_quantile(q, ...)``, one ``/`` between two such terms,
and selectors whose matchers are template variables (``$model``: every series). A rate is
taken over the last `RATE_SAMPLES` samples of each series, as Grafana's ``$__rate_interval``
spans a few scrape intervals. Each server is one Prometheus target (its own ``instance``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["RATE_SAMPLES", "Scraper", "evaluate", "load", "parse_metrics", "render"]

RATE_SAMPLES = 4
DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "kvferry.json"
Labels = tuple[tuple[str, str], ...]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, Labels], float]:
    """Prometheus text exposition -> {(name, sorted labels): value}."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


class Scraper:
    """Samples each server's /metrics every ``interval_s`` (and once at the end) into
    ``path`` as JSON lines ``{"t", "config", "server", "text"}``, in a thread; a context
    manager. A sampler, as Prometheus is: what it records does not steer the run."""

    def __init__(self, servers: Sequence[Any], path: Optional[str], config: str, interval_s: float = 1.0) -> None:
        self.servers, self.path, self.config, self.interval_s = list(servers), path, config, interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> Scraper:
        if self.path is not None:
            self._thread = threading.Thread(target=self._run, name="kvferry-scraper", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def _sample(self) -> None:
        assert self.path is not None
        with open(self.path, "a", encoding="utf-8") as f:
            for s in self.servers:
                try:
                    with urllib.request.urlopen(s.url + "/metrics", timeout=10) as r:
                        text = r.read().decode()
                except OSError:  # a server stopping: that sample is missing, as in Prometheus
                    continue
                f.write(json.dumps({"t": time.time(), "config": self.config, "server": s.name, "text": text}) + "\n")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()
        self._sample()


def load(path: str) -> list[dict[str, Any]]:
    """The scrape file's samples, each with its parsed series. Each server of each
    configuration is a target of its own (``instance`` = config/server): a configuration's
    servers are new processes, their counters start again from 0."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            series = parse_metrics(row.pop("text"))
            row["server"] = f"{row['config']}/{row['server']}"
            row["series"] = {(n, tuple(sorted((*ls, ("instance", row["server"]))))): v for (n, ls), v in series.items()}
            rows.append(row)
    return rows


# -- the PromQL subset ------------------------------------------------------------------------

Vector = dict[Labels, float]


class _Parser:
    def __init__(self, expr: str) -> None:
        self.tokens = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*|\d+(?:\.\d+)?|\{[^}]*\}|\[[^\]]*\]|[(),/]", expr)
        self.i = 0

    def peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, want: Optional[str] = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise ValueError(f"PromQL: expected {want or 'a token'} at {tok!r} in {' '.join(self.tokens)}")
        self.i += 1
        return tok

    def expr(self) -> Any:
        left = self.term()
        if self.peek() == "/":
            self.take("/")
            return ("div", left, self.term())
        return left

    def term(self) -> Any:
        head = self.take()
        if head in ("sum", "max"):
            by: Optional[tuple[str, ...]] = None
            if self.peek() == "by":
                self.take("by")
                self.take("(")
                names = []
                while self.peek() != ")":
                    names.append(self.take())
                    if self.peek() == ",":
                        self.take(",")
                self.take(")")
                by = tuple(names)
            self.take("(")
            inner = self.expr()
            self.take(")")
            return (head, by, inner)
        if head == "rate":
            self.take("(")
            name = self.take()
            if self.peek() and self.peek().startswith("{"):  # type: ignore[union-attr]
                self.take()
            self.take()  # the range: [$__rate_interval]
            self.take(")")
            return ("rate", name)
        if head == "histogram_quantile":
            self.take("(")
            q = float(self.take())
            self.take(",")
            inner = self.expr()
            self.take(")")
            return ("quantile", q, inner)
        if self.peek() and self.peek().startswith("{"):  # type: ignore[union-attr]
            self.take()
        return ("series", head)


def _live(samples: Sequence[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """Samples up to ``i`` of the targets still running then: those of sample ``i``'s
    configuration (an earlier configuration's servers have stopped: their series are stale)."""
    return [row for row in samples[: i + 1] if row["config"] == samples[i]["config"]]


def _instant(samples: Sequence[dict[str, Any]], i: int, name: str) -> Vector:
    """The newest value of each series called ``name`` at sample time ``i`` (each target's own)."""
    latest: dict[str, dict[Labels, float]] = {}
    for row in _live(samples, i):
        latest[row["server"]] = {ls: v for (n, ls), v in row["series"].items() if n == name}
    return {ls: v for per in latest.values() for ls, v in per.items()}


def _rate(samples: Sequence[dict[str, Any]], i: int, name: str) -> Vector:
    out: Vector = {}
    by_server: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in _live(samples, i):
        by_server[row["server"]].append(row)
    for rows in by_server.values():
        window = rows[-RATE_SAMPLES:]
        if len(window) < 2:
            continue
        a, b = window[0], window[-1]
        for (n, ls), v in b["series"].items():
            if n == name and (n, ls) in a["series"]:
                out[ls] = max(v - a["series"][(n, ls)], 0.0) / (b["t"] - a["t"])
    return out


def _quantile(q: float, v: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for ls, value in v.items():
        d = dict(ls)
        le = d.pop("le", None)
        if le is not None:
            groups[tuple(sorted(d.items()))].append((math.inf if le == "+Inf" else float(le), value))
    out: Vector = {}
    for ls, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1] if buckets else 0.0
        if total <= 0:
            out[ls] = math.nan
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for upper, count in buckets:
            if count >= rank:
                if math.isinf(upper):  # Prometheus: the highest finite bound
                    out[ls] = lower
                else:
                    out[ls] = lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 1.0)
                break
            lower, below = upper, count
    return out


def _eval(node: Any, samples: Sequence[dict[str, Any]], i: int) -> Vector:
    kind = node[0]
    if kind == "series":
        return _instant(samples, i, node[1])
    if kind == "rate":
        return _rate(samples, i, node[1])
    if kind == "quantile":
        return _quantile(node[1], _eval(node[2], samples, i))
    if kind == "div":
        a, b = _eval(node[1], samples, i), _eval(node[2], samples, i)
        return {ls: (a[ls] / b[ls] if b[ls] else math.nan) for ls in a if ls in b}
    op, by, inner = node
    groups: dict[Labels, list[float]] = defaultdict(list)
    for ls, value in _eval(inner, samples, i).items():
        groups[tuple((k, val) for k, val in ls if by is not None and k in by)].append(value)
    return {ls: (sum(vs) if op == "sum" else max(vs)) for ls, vs in groups.items()}


def evaluate(expr: str, samples: Sequence[dict[str, Any]], i: int) -> Vector:
    """``expr`` (the dashboard's PromQL subset) at sample ``i`` of ``samples``."""
    p = _Parser(expr)
    node = p.expr()
    if p.peek() is not None:
        raise ValueError(f"PromQL: unexpected {p.peek()!r} in {expr!r}")
    return _eval(node, samples, i)


def render(dashboard: dict[str, Any], samples: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Every panel at its grid place, each target one line per series over the run's time."""
    from kvferry._optional import require

    matplotlib = require("matplotlib", "the dashboard picture")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = sorted(samples, key=lambda r: r["t"])
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) // 8
    fig, axes = plt.subplots(rows, 2, figsize=(13, 2.9 * rows), squeeze=False)
    # Each configuration's samples on one axis, one after the other: the time its servers took
    # to start (no samples) is left out, and no line joins two configurations.
    spans: list[tuple[str, float, float]] = []
    x_of: list[float] = []
    for row in samples:
        if not spans or spans[-1][0] != row["config"]:
            start = spans[-1][2] + 2.0 if spans else 0.0
            spans.append((row["config"], start, start))
            first = row["t"]
        x = spans[-1][1] + row["t"] - first
        spans[-1] = (spans[-1][0], spans[-1][1], x)
        x_of.append(x)
    scale = {"Bps": (1 / 2**20, "MiB/s"), "s": (1e3, "ms"), "percentunit": (1.0, "fraction"), "reqps": (1.0, "per s")}
    for panel in panels:
        ax = axes[panel["gridPos"]["y"] // 8][panel["gridPos"]["x"] // 12]
        factor, unit = scale.get(panel["fieldConfig"]["defaults"]["unit"], (1.0, ""))
        for target in panel["targets"]:
            lines: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
            for i, row in enumerate(samples):
                if i and row["config"] != samples[i - 1]["config"]:
                    for points in lines.values():
                        points.append((x_of[i], math.nan))  # a break between configurations
                for ls, value in evaluate(target["expr"], samples, i).items():
                    lines[ls].append((x_of[i], value * factor))
            for ls, points in sorted(lines.items()):
                label = re.sub(r"\{\{(\w+)\}\}", lambda m: dict(ls).get(m.group(1), ""), target["legendFormat"])
                if all(math.isnan(y) or y == 0 for _, y in points) and "{{" in target["legendFormat"]:
                    continue  # a zero failure reason: not drawn, as Grafana hides a flat-zero series on request
                ax.plot([x for x, _ in points], [y for _, y in points], label=label, linewidth=1.2)
        for n, (name, a, b) in enumerate(spans):
            ax.axvspan(a, b, color="#000000", alpha=0.05 if n % 2 else 0.0)
            ax.text((a + b) / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=6)
        ax.set_title(panel["title"], fontsize=8, pad=12)
        ax.set_ylabel(unit, fontsize=7)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left", frameon=False)
    for ax in axes[-1]:
        ax.set_xlabel("s of each configuration's run (its servers' start left out), one after the other", fontsize=7)
    fig.suptitle(title or dashboard["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.bench.dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("scrapes", help="the scrape file of a run (kvferry bench vllm --scrape FILE)")
    parser.add_argument(
        "--dashboard", default=str(DASHBOARD), help="the dashboard JSON (default: docs/grafana/kvferry.json)"
    )
    parser.add_argument("--png", default="dashboard.png", help="where the picture goes (default: %(default)s)")
    parser.add_argument("--title", default="", help="the picture's title (default: the dashboard's)")
    args = parser.parse_args(argv)
    render(json.loads(Path(args.dashboard).read_text()), load(args.scrapes), args.png, args.title)
    print(f"dashboard: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
