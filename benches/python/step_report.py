"""Times one 256-request scheduler step (see step_workload.py) with time.perf_counter_ns and
prints the markdown table that docs/benchmarks.md records:

    python benches/python/step_report.py [--runs 5] [--rounds 2000] [--ref-rounds 30]

Every row is timed over many rounds (a fresh book per planning round, built untimed); a run
reports each row's p50 and p90, and the table gives the median over --runs runs of those, with
the spread of p50 across runs. Ratios are taken within a run (Rust and reference measured in
the same run), then their median over runs. The same figures come from bench_step.py under
pytest-benchmark; this script exists so the doc's table has one reproducible source.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Callable, Optional

import kvferry
import numpy as np
import step_workload as w

Setup = Optional[Callable[[], tuple[Any, ...]]]


def measure(fn: Callable[..., Any], setup: Setup, rounds: int, warmup: int = 3) -> tuple[float, float]:
    """(p50, p90) in microseconds of ``fn(*setup())`` over ``rounds`` rounds; setup untimed.

    The collector is off while a row is timed (as pytest-benchmark's --benchmark-disable-gc):
    a gc.collect() between rounds walks the ~500k list items of the reference's tables and
    leaves the caches cold, which alone costs an empty kvferry call ~7 us.
    """
    samples = []
    gc.collect()
    gc.disable()
    try:
        for k in range(warmup + rounds):
            args = setup() if setup else ()
            t0 = time.perf_counter_ns()
            fn(*args)
            t1 = time.perf_counter_ns()
            if k >= warmup:
                samples.append(t1 - t0)
    finally:
        gc.enable()
    samples.sort()
    return samples[len(samples) // 2] / 1e3, samples[(len(samples) * 9) // 10] / 1e3


def one_run(rounds: int, ref_rounds: int, pair_rounds: int) -> dict[str, tuple[float, float]]:
    step = w.make_step()
    lists = step.as_lists()
    case = w.make_pairs_case()
    rnd = w.random_tables()
    con = w.contiguous_tables()
    rnd_lists = tuple(t.tolist() for t in rnd)
    con_lists = tuple(t.tolist() for t in con)
    empty = np.zeros(0, dtype=np.int64)
    idle = kvferry.TransferBook(w.TOKENS_PER_BLOCK)
    all_ids = case.ids
    r: dict[str, tuple[float, float]] = {}

    # Planning a mixed step, and its two calls apart.
    r["plan"] = measure(w.rust_plan_step, lambda: (w.rust_book(step), step), rounds)
    r["plan_ref"] = measure(w.ref_plan_step, lambda: (w.ref_book(step), lists), ref_rounds)
    r["plan_early"] = measure(lambda b: b.plan_early(step.early_ids), lambda: (w.rust_book(step),), rounds)
    r["plan_chunks"] = measure(
        lambda b: b.plan_chunks(step.chunk_ids, step.chunk_starts, step.chunk_ends),
        lambda: (w.rust_book(step),),
        rounds,
    )
    # The floor of a call: crossing into Rust and back with nothing to plan.
    r["empty_early"] = measure(lambda: idle.plan_early(empty), None, rounds)
    r["empty_chunks"] = measure(lambda: idle.plan_chunks(empty, empty, empty), None, rounds)

    # Pairs of 256 early slices (239,872 pairs): the call alone, and planning + pairs.
    src, dst = rnd
    r["plan256"] = measure(lambda b: b.plan_early(all_ids), lambda: (w.all_early_book(all_ids),), rounds)
    r["plan256_pairs"] = measure(
        lambda b: kvferry.block_pairs(b.plan_early(all_ids), src, dst),
        lambda: (w.all_early_book(all_ids),),
        pair_rounds,
    )
    r["pairs"] = measure(kvferry.block_pairs, lambda: (case.plan, src, dst), pair_rounds)
    r["pairs_ref"] = measure(w.ref.block_pairs, lambda: (case.ref_slices, *rnd_lists), ref_rounds)
    # What numpy needs to produce the same two arrays: a memory-bound floor.
    n = w.EARLY_BLOCKS
    r["numpy_copy"] = measure(lambda: (src[:, :n].copy(), dst[:, :n].copy()), None, pair_rounds)
    r["runs_random"] = measure(kvferry.block_runs, lambda: (case.plan, src, dst), pair_rounds)
    r["runs_random_ref"] = measure(w.ref.block_runs, lambda: (case.ref_slices, *rnd_lists), ref_rounds)
    r["runs_contig"] = measure(kvferry.block_runs, lambda: (case.plan, *con), pair_rounds)
    r["runs_contig_ref"] = measure(w.ref.block_runs, lambda: (case.ref_slices, *con_lists), ref_rounds)
    return r


ROWS = [
    # key, label, reference key (for the ratio), per-pair?
    ("plan", "plan a step: plan_early(128) + plan_chunks(128)", "plan_ref", False),
    ("plan_ref", "  reference (RefBook)", None, False),
    ("plan_early", "  plan_early(128) alone", None, False),
    ("plan_chunks", "  plan_chunks(128) alone", None, False),
    ("empty_early", "  plan_early(empty) (call floor)", None, False),
    ("empty_chunks", "  plan_chunks(empty x3) (call floor)", None, False),
    ("plan256", "plan_early(256), the pairs' plan", None, False),
    ("plan256_pairs", "plan_early(256) + block_pairs", None, False),
    ("pairs", "block_pairs, random tables", "pairs_ref", True),
    ("pairs_ref", "  reference block_pairs", None, True),
    ("numpy_copy", "  numpy: copy the same 2 x 239,872 ids (floor)", None, True),
    ("runs_random", "block_runs, random tables", "runs_random_ref", True),
    ("runs_random_ref", "  reference block_runs, random", None, True),
    ("runs_contig", "block_runs, contiguous tables", "runs_contig_ref", True),
    ("runs_contig_ref", "  reference block_runs, contiguous", None, True),
]


def report(runs: list[dict[str, tuple[float, float]]], num_pairs: int) -> str:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    lines = [
        "| what | p50 us | p90 us | p50 min..max over runs | vs reference | ns/pair (p50) |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for key, label, ref_key, per_pair in ROWS:
        p50s = [run[key][0] for run in runs]
        p90s = [run[key][1] for run in runs]
        ratio = f"{med([run[ref_key][0] / run[key][0] for run in runs]):.0f}x" if ref_key else ""
        npp = f"{med(p50s) * 1e3 / num_pairs:.2f}" if per_pair else ""
        lines.append(
            f"| {label} | {med(p50s):.1f} | {med(p90s):.1f} | {min(p50s):.1f}..{max(p50s):.1f} | {ratio} | {npp} |"
        )
    on_top = [(run["plan256_pairs"][0] - run["plan256"][0]) * 1e3 / num_pairs for run in runs]
    lines.append("")
    lines.append(
        f"Pairs on top of planning: (p50[plan_early(256) + block_pairs] - p50[plan_early(256)]) "
        f"/ {num_pairs:,} pairs = {med(on_top):.2f} ns/pair "
        f"(runs: {', '.join(f'{x:.2f}' for x in on_top)})."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="independent runs (default 5)")
    p.add_argument("--rounds", type=int, default=2000, help="rounds per Rust planning row")
    p.add_argument("--pair-rounds", type=int, default=300, help="rounds per Rust pairs/runs row")
    p.add_argument("--ref-rounds", type=int, default=20, help="rounds per reference row")
    a = p.parse_args()
    case = w.make_pairs_case()
    print(
        f"step: {w.NUM_REQUESTS} requests, prompt {w.PROMPT_LEN}, tpb {w.TOKENS_PER_BLOCK}, "
        f"128 early slices of {w.EARLY_BLOCKS} blocks + 128 last chunks of "
        f"{w.CHUNK_LEN // w.TOKENS_PER_BLOCK} blocks; pairs: {case.num_pairs:,} "
        f"(256 x {w.EARLY_BLOCKS}); runs {a.runs}, rounds {a.rounds}/{a.pair_rounds}/{a.ref_rounds}"
    )
    runs = [one_run(a.rounds, a.ref_rounds, a.pair_rounds) for _ in range(a.runs)]
    print()
    print(report(runs, case.num_pairs))


if __name__ == "__main__":
    main()
