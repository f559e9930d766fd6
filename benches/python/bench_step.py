"""One scheduler step of 256 requests through the Python API, against the pure-Python
reference planner. Run with

    python -m pytest benches/python --benchmark-only

Groups: ``plan`` (early + chunk slices, no pairs), ``pairs`` (physical (src, dst) ids of 256
early slices of 937 blocks), ``runs-random`` and ``runs-contiguous`` (coalesced runs of the
same plan on random-permutation and contiguous block tables). Each benchmark's extra_info
carries the counts, and the pair/run groups their ns per pair, so the JSON report
(--benchmark-json) can be read on its own. The figures in docs/benchmarks.md come from
step_report.py, which times the same things.
"""

from __future__ import annotations

import kvferry
import pytest
import step_workload as w

RUST_PLAN_ROUNDS = 2000
REF_PLAN_ROUNDS = 30
RUST_PAIRS_ROUNDS = 300
REF_PAIRS_ROUNDS = 10


@pytest.fixture(scope="module")
def step() -> w.Step:
    return w.make_step()


@pytest.fixture(scope="module")
def case() -> w.PairsCase:
    return w.make_pairs_case()


@pytest.fixture(scope="module")
def random_tables() -> tuple:
    return w.random_tables()


@pytest.fixture(scope="module")
def contiguous_tables() -> tuple:
    return w.contiguous_tables()


def _per_pair(benchmark, num_pairs: int) -> None:
    benchmark.extra_info["pairs"] = num_pairs
    benchmark.extra_info["ns_per_pair_median"] = benchmark.stats.stats.median * 1e9 / num_pairs


# --- planning: a fresh book per round, built in (untimed) setup ------------------------


# Each planner: its book factory, its step, the inputs the step takes, rounds and warm-up rounds.
PLANNERS = {
    "rust": (w.rust_book, w.rust_plan_step, lambda step: step, RUST_PLAN_ROUNDS, 20),
    "reference": (w.ref_book, w.ref_plan_step, lambda step: step.as_lists(), REF_PLAN_ROUNDS, 2),
}


@pytest.mark.benchmark(group="plan")
@pytest.mark.parametrize("planner", sorted(PLANNERS))
def bench_plan(benchmark, step, planner):
    new_book, plan_step, inputs, rounds, warmup = PLANNERS[planner]
    given = inputs(step)

    def setup():
        return (new_book(step), given), {}

    early, chunks = benchmark.pedantic(plan_step, setup=setup, rounds=rounds, iterations=1, warmup_rounds=warmup)
    assert len(early) == len(chunks) == w.NUM_REQUESTS // 2
    benchmark.extra_info["slices"] = len(early) + len(chunks)


# --- pairs and runs: one frozen plan, nothing to rebuild between rounds ----------------


@pytest.mark.benchmark(group="pairs")
def bench_pairs_rust(benchmark, case, random_tables):
    src, dst = random_tables
    pairs = benchmark.pedantic(
        kvferry.block_pairs,
        args=(case.plan, src, dst),
        rounds=RUST_PAIRS_ROUNDS,
        iterations=1,
        warmup_rounds=5,
    )
    assert len(pairs) == case.num_pairs
    _per_pair(benchmark, case.num_pairs)


@pytest.mark.benchmark(group="pairs")
def bench_pairs_reference(benchmark, case, random_tables):
    src, dst = (t.tolist() for t in random_tables)
    out_src, _ = benchmark.pedantic(
        w.ref.block_pairs,
        args=(case.ref_slices, src, dst),
        rounds=REF_PAIRS_ROUNDS,
        iterations=1,
        warmup_rounds=1,
    )
    assert len(out_src) == case.num_pairs
    _per_pair(benchmark, case.num_pairs)


@pytest.mark.parametrize("impl", ["rust", "reference"])
@pytest.mark.parametrize("layout", ["random", "contiguous"])
def bench_runs(benchmark, case, random_tables, contiguous_tables, layout, impl):
    benchmark.group = f"runs-{layout}"
    src, dst = random_tables if layout == "random" else contiguous_tables
    if impl == "rust":
        fn, args, rounds = kvferry.block_runs, (case.plan, src, dst), RUST_PAIRS_ROUNDS
    else:
        fn, args, rounds = w.ref.block_runs, (case.ref_slices, src.tolist(), dst.tolist()), REF_PAIRS_ROUNDS
    runs = benchmark.pedantic(fn, args=args, rounds=rounds, iterations=1, warmup_rounds=1)
    benchmark.extra_info["runs"] = len(runs)
    if layout == "contiguous":
        assert len(runs) == w.NUM_REQUESTS
    _per_pair(benchmark, case.num_pairs)
