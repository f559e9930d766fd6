"""Soak: requests through the executor hook and the reference engine (random prompt sizes,
prefix reuse, chunking, cancellations, timeouts), audited after every request; the driver is
kvferry.refengine.soak. Not part of CI (tests/test_soak.py runs a short variant):

    python benches/python/soak.py [--requests 10000] [--seed 0] [--json PATH]
        [--transport NAME (kvferry.transports.registry, CPU)]

Exits 1 when an invariant fails: a leaked or doubly owned block, a block delivered twice,
KV that differs between the workers, an error, or resident memory growing by 5% or more
from the end of the first thousand requests to the end of the last.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
from kvferry.refengine.soak import Soak, SoakConfig, SoakReport
from kvferry.transports import registry

MAX_RSS_GROWTH = 0.05


def _progress(started: float, total: int):  # type: ignore[no-untyped-def]
    def show(report: SoakReport) -> None:
        if report.requests % 500 and report.requests != total:
            return
        rate = report.requests / (time.monotonic() - started)
        rss = report.memory[-1].rss / 2**20 if report.memory else 0.0
        print(
            f"\r{report.requests}/{total} requests  {rate:.0f}/s  cancelled {sum(report.cancelled.values())}"
            f"  timeouts {report.sender_timeouts}+{report.receiver_timeouts}  leaked {report.leaked_blocks}"
            f"  rss {rss:.0f} MiB",
            end="",
            file=sys.stderr,
            flush=True,
        )

    return show


def _summary(report: SoakReport) -> str:
    memory = report.memory
    growth = report.rss_growth
    lines = [
        f"requests {report.requests} in {report.seconds:.1f} s ({report.requests / report.seconds:.0f}/s): "
        f"{report.completed} completed, {sum(report.cancelled.values())} cancelled",
        "cancelled by stage/cause: " + ", ".join(f"{k} {v}" for k, v in sorted(report.cancelled.items())),
        f"cancelled after an early slice left: {report.cancelled_with_early}",
        f"timeouts: sender {report.sender_timeouts}, receiver {report.receiver_timeouts}, cancel waits "
        f"{report.cancel_timeouts} (+{report.misattributed_cancel_timeouts} naming another request's copy)",
        f"early slices {report.early_slices}, chunked {report.chunked}, unaligned reuse {report.unaligned_reuse}",
        f"KV compared bit for bit: {report.kv_checked} requests, {report.kv_mismatch_blocks} blocks differ",
        f"leaked blocks {report.leaked_blocks}, doubly owned {report.double_owned_blocks}, "
        f"duplicate deliveries {report.duplicate_blocks}, late notices {report.late_notices}",
    ]
    if memory:
        first, last = memory[0], memory[-1]
        lines.append(
            f"RSS after request {first.requests}: {first.rss / 2**20:.1f} MiB, after request {last.requests}: "
            f"{last.rss / 2**20:.1f} MiB, growth {'n/a' if growth is None else f'{growth:+.2%}'}"
        )
        per_request = report.py_blocks_per_request
        if per_request is not None:
            lines.append(f"Python heap blocks: {first.py_blocks} -> {last.py_blocks} ({per_request:+.3f} per request)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", choices=registry.names(device="cpu"), default="in-process")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (one: the model is tiny)")
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = SoakConfig(requests=args.requests, seed=args.seed, transport=args.transport)
    soak = Soak(config, progress=_progress(time.monotonic(), args.requests))
    try:
        report = soak.run()
    finally:
        soak.close()
    print(file=sys.stderr)
    print(_summary(report))
    failures = report.failures(MAX_RSS_GROWTH)
    if args.json:
        out = report.as_dict()
        out.update(machine=platform.processor() or platform.machine(), torch=torch.__version__, failures=failures)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
