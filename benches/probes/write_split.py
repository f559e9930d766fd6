"""Staging with plans cut in equal writes by a write's fixed cost (`WRITE_OVERHEAD_BYTES`, the
default for dma legs) against full writes (0), and other costs beside them, taking turns round
by round in one process, so every way sees the same machine.

    python benches/probes/write_split.py [--rounds 3] [--overhead-mib 0,32] [bench copy's flags]

Each round runs `kvferry bench copy --transport staging` once per way (its own median of
``--reps``); the table gives every round's GB/s and each way's ratio of medians against full
writes (the first way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from kvferry.cli import main as cli
from kvferry.transports import staging


def run(flags: list[str], overhead_mib: int, out: Path) -> dict[int, float]:
    """One `bench copy` of staging with writes cut by ``overhead_mib``; GB/s per block count."""
    saved = staging.WRITE_OVERHEAD_BYTES
    staging.WRITE_OVERHEAD_BYTES = overhead_mib << 20
    try:
        code = cli(["bench", "copy", "--transport", "staging", "--json", str(out), *flags])
    finally:
        staging.WRITE_OVERHEAD_BYTES = saved
    if code != 0:
        raise SystemExit(f"bench copy exited {code}")
    rows = json.loads(out.read_text())["rows"]
    return {int(r["blocks"]): float(r["gbps"]) for r in rows if r["transport"] == "staging"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overhead-mib", default="0,32", help="ways to take turns, the first the baseline")
    args, flags = parser.parse_known_args()
    if args.rounds < 1:
        parser.error(f"invalid --rounds={args.rounds}: must be >= 1")
    try:
        ways = [int(w) for w in args.overhead_mib.split(",")]
    except ValueError:
        parser.error(f"invalid --overhead-mib={args.overhead_mib!r}: comma-separated whole MiB")
    if len(ways) < 2 or min(ways) < 0:
        parser.error(f"invalid --overhead-mib={args.overhead_mib!r}: at least two values, each >= 0")
    results: dict[int, list[dict[int, float]]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            # The order reverses each round, so no way always runs first.
            for w in ways if r % 2 == 0 else ways[::-1]:
                results[w].append(run(flags, w, Path(tmp) / f"{w}-{r}.json"))
                got = ", ".join(f"{n} blocks {g:.1f} GB/s" for n, g in results[w][-1].items())
                print(f"round {r + 1}, overhead {w} MiB: {got}", flush=True)
    base = ways[0]
    print("| blocks | " + " | ".join(f"overhead {w} MiB, GB/s per round" for w in ways) + " | " +
          " | ".join(f"{w} / {base}" for w in ways[1:]) + " |")  # fmt: skip
    print("|---:|" + "---|" * len(ways) + "---:|" * (len(ways) - 1))
    for n in sorted(results[base][0]):
        per = {w: [round(x[n], 1) for x in results[w]] for w in ways}
        ratios = [statistics.median(per[w]) / statistics.median(per[base]) for w in ways[1:]]
        print(
            f"| {n} | " + " | ".join(str(per[w]) for w in ways) + " | " + " | ".join(f"{x:.3f}" for x in ratios) + " |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
