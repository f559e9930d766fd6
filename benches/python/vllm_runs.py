"""Medians over several `kvferry bench vllm` runs (their --json files), as docs/benchmarks.md
reports them: per configuration and case, the median over runs of each run's TTFT p50 and
KV-ready p50, with every run's TTFT p50 beside it, each run's ratio of medians against the
better NIXL connector of that run (then their median), KV-ready over the ideal bound, bytes
per turn and whether every output was equal.

    python benches/python/vllm_runs.py run1.json run2.json run3.json
"""

from __future__ import annotations

import json
import statistics
import sys

CASES = ("decode-warm", "decode-cold")


def table(runs: list[dict], case: str) -> str:
    names = list(runs[0]["configs"])
    out = [
        f"{case}:",
        "",
        (
            "| configuration | TTFT p50 (median of runs) | each run | vs better NIXL (each run) | KV-ready "
            "p50 | KV-ready / ideal | admission / prefill slowed / after prefill (ms) | link / turn | "
            "held blocks / turn | outputs equal |"
        ),
        "|---|---:|---|---|---:|---:|---|---:|---:|---|",
    ]
    for name in names:
        per = [r["configs"][name][case] for r in runs]
        ttft = [f["ttft_ms_p50"] for f in per]
        ratios = [f["ttft_vs_nixl"]["ratio"] for f in per if f.get("ttft_vs_nixl")]
        ideal = [f["kv_over_ideal"]["ratio"] for f in per]
        held = per[0]["held_blocks_per_turn"]
        out.append(
            f"| {name} | {statistics.median(ttft):.0f} ms | {', '.join(f'{t:.0f}' for t in ttft)} | "
            f"{', '.join(f'{x:.2f}' for x in ratios) or '-'} | "
            f"{statistics.median(f['kv_ready_ms_p50'] for f in per):.0f} ms | {statistics.median(ideal):.2f} | "
            f"{_losses(per)} | "
            f"{statistics.median(f['link_bytes_per_turn'] for f in per) / 2**20:.2f} MiB | "
            f"{'-' if held is None else f'{held:.0f}'} | "
            f"{'yes' if all(f['outputs_equal'] for f in per) else 'NO'} |"
        )
    return "\n".join(out)


def _losses(per: list[dict]) -> str:
    """The median over runs of each run's median loss per turn, in ms."""
    keys = ("admission", "prefill_slowed", "after_prefill")
    if not all(k in per[0].get("losses_ms_p50", {}) for k in keys):
        return "-"
    return " / ".join(f"{statistics.median(f['losses_ms_p50'][k] for f in per):.0f}" for k in keys)


def runs_lines(paths: list[str], runs: list[dict]) -> list[str]:
    """One line per run: when, the load, the link, each case's quiet-machine verdict, and the
    targets as that run reported them."""
    out = []
    for path, r in zip(paths, runs):
        load = r["load_average"]
        link = r["link"]
        verdicts = "; ".join(
            f"{case} {'TOO BUSY' if c['load']['busy'] else 'quiet'} ({c['load']['prefill_spread']:.2f}x)"
            for case, c in r["cases"].items()
        )
        targets = ", ".join(
            f"{t['case']} {t['config']} {t['value']:.2f} {'met' if t['met'] else 'missed'}" for t in r["targets"]
        )
        rate = f"{link['bytes_per_s'] / 1e6:.0f} MB/s"
        if link.get("mbit"):
            rate += f" (tbf {link['mbit']:.0f} Mbit/s" + (", receive steered)" if link.get("receive_cores") else ")")
        out.append(
            f"- {path}: {r['date']}, load {load['before'][0]:.1f} before / {load['after'][0]:.1f} after; link "
            f"{rate}; verdict: {verdicts}; targets: {targets}"
        )
    return out


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [json.load(open(p)) for p in paths]
    print(
        (
            f"{len(runs)} runs: {', '.join(r['date'] for r in runs)}; {runs[0]['machine']}; "
            f"{runs[0].get('placement', 'one host')}"
        )
    )
    for case in CASES:
        print()
        print(table(runs, case))
    left = {p: {n: k for n, k in r["kv_blocks_left"].items() if k} for p, r in zip(paths, runs)}
    print()
    print(f"KV blocks left allocated: {({p: v for p, v in left.items() if v}) or 'none, in every run'}")
    print()
    print("\n".join(runs_lines(paths, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
