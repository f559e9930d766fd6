"""Which input of a decode step differs when disaggregated and aggregated greedy outputs
diverge with identical prompt KV (docs/benchmarks.md, "Output mismatch")? Runs `kvferry
bench agentic` with every process traced (decode_trace/sitecustomize.py), then lines up the
decode steps that had the same position and input token in different workers and prints,
for each pair whose logits differ, the first layer and tensor whose bits differ.

    python benches/probes/gpu_divergence.py --out DIR -- <kvferry bench agentic arguments>
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ATTN = ("q", "k", "v", "mask", "out")


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The first tensor, in the order the forward computes them, whose checksum differs."""
    for layer in range(len(a["attn"])):
        na, nb = a["norm"][2 * layer], b["norm"][2 * layer]
        if na[0] != nb[0]:
            return f"layer {layer}: hidden state entering the layer"
        if na[1] != nb[1]:
            return f"layer {layer}: attention norm output"
        for name, x, y in zip(ATTN, a["attn"][layer], b["attn"][layer]):
            if x != y:
                return f"layer {layer}: attention {name}"
        ma, mb = a["norm"][2 * layer + 1], b["norm"][2 * layer + 1]
        if ma != mb:
            return f"layer {layer}: hidden state after attention (MLP norm input/output)"
    if a["norm"][-1] != b["norm"][-1]:
        return "final norm"
    return "logits only (final projection)" if a["logits"] != b["logits"] else "no difference"


def analyse(trace_dir: Path) -> list[str]:
    steps: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps[(record["start"], record["token"])].append(record)
    lines = []
    for (start, token), records in sorted(steps.items()):
        by_logits: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            by_logits[r["logits"]].append(r)
        if len(by_logits) < 2:
            continue
        groups = list(by_logits.values())
        a = groups[0][0]
        for group in groups[1:]:
            b = group[0]
            lines.append(
                f"position {start}, token {token}: workers {[(r['pid'], r['pool']) for r in groups[0]]} top "
                f"{a['top']} blocks {a['blocks']} vs "
                f"{[(r['pid'], r['pool']) for r in group]} top {b['top']} blocks {b['blocks']}: first "
                f"difference at {first_difference(a, b)}"
            )
    same = sum(1 for records in steps.values() if len({r["logits"] for r in records}) == 1 and len(records) > 1)
    lines.append(
        f"{same} decode steps seen in several workers with identical logits; {len(lines)} with different logits"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="trace folder (emptied first)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="arguments of kvferry bench agentic, after --")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.jsonl"):
        old.unlink()
    env = dict(os.environ, KVFERRY_TRACE_DIR=str(args.out.resolve()))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE / "decode_trace"), env.get("PYTHONPATH", "")) if p)
    bench = [a for a in args.bench if a != "--"]
    subprocess.run([sys.executable, "-m", "kvferry.cli", "bench", "agentic", *bench], env=env, check=False)
    print("\n".join(analyse(args.out)))


if __name__ == "__main__":
    main()
