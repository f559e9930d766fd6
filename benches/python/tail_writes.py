"""Staging with a plan's last writes halved (`Transport.min_tail_blocks`, the default) against
plain full writes, taking turns round by round in one process, so both see the same machine.

    python benches/python/tail_writes.py [--rounds 3] [bench copy's flags, e.g. --device cuda]

Each round runs `kvferry bench copy --transport staging` once each way (its own median of
``--reps``); the table gives every round's GB/s and the ratio of the medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from kvferry import sender
from kvferry.cli import main as cli

HALVED = sender.next_write_blocks


def _full_writes(remaining: int, limit: int, floor: object) -> int:
    return HALVED(remaining, limit, None)


def run(flags: list[str], halved: bool, out: Path) -> dict[int, float]:
    """One `bench copy` of staging; GB/s per block count."""
    sender.next_write_blocks = HALVED if halved else _full_writes  # type: ignore[assignment]
    try:
        code = cli(["bench", "copy", "--transport", "staging", "--json", str(out), *flags])
    finally:
        sender.next_write_blocks = HALVED  # type: ignore[assignment]
    if code != 0:
        raise SystemExit(f"bench copy exited {code}")
    rows = json.loads(out.read_text())["rows"]
    return {int(r["blocks"]): float(r["gbps"]) for r in rows if r["transport"] == "staging"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args, flags = parser.parse_known_args()
    if args.rounds < 1:
        parser.error(f"invalid --rounds={args.rounds}: must be >= 1")
    results: dict[str, list[dict[int, float]]] = {"halved": [], "full": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            # The order flips each round, so neither way always runs first.
            for way in ("halved", "full") if r % 2 == 0 else ("full", "halved"):
                results[way].append(run(flags, way == "halved", Path(tmp) / f"{way}{r}.json"))
                print(
                    f"round {r + 1}, {way}: "
                    + ", ".join(f"{n} blocks {g:.1f} GB/s" for n, g in results[way][-1].items())
                )
    print("| blocks | halved tail, GB/s per round | full writes, GB/s per round | halved / full (medians) |")
    print("|---:|---|---|---:|")
    for n in sorted(results["halved"][0]):
        h = [round(x[n], 1) for x in results["halved"]]
        f = [round(x[n], 1) for x in results["full"]]
        print(f"| {n} | {h} | {f} | {statistics.median(h) / statistics.median(f):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
