"""The Rust planner against the pure-Python reference planner (tests/reference_planner.py) on
random inputs: stateless functions, ledger operation sequences, multi-request book schedules,
block pairs/runs on random block tables, and select_early against a numpy recomputation."""

from __future__ import annotations

from typing import Any, Callable, Optional

import kvferry
import numpy as np
import reference_planner as ref
from hypothesis import given
from hypothesis import strategies as st
from kvferry import (
    BlockRange,
    DuplicateTransferError,
    InvalidArgumentError,
    TransferBook,
    TransferLedger,
)


def as_tuple(r: Optional[BlockRange]) -> ref.Range:
    return None if r is None else (r.start, r.end)


@st.composite
def prompt_shapes(draw: st.DrawFn, max_prompt: int = 3000) -> tuple[int, int, int, Optional[int]]:
    tpb = draw(st.sampled_from([1, 2, 3, 4, 7, 16, 32, 64]) | st.integers(1, 100))
    prompt_len = draw(st.integers(1, max_prompt))
    reused_len = draw(st.integers(0, prompt_len - 1) | st.sampled_from([0, prompt_len - 1]))
    window = draw(st.none() | st.integers(1, prompt_len + 8))
    return tpb, prompt_len, reused_len, window


def chunk_plan(draw: Callable[..., Any], reused_len: int, prompt_len: int) -> list[tuple[int, int]]:
    """Random (uneven) prefill chunks from the reuse boundary to the end of the prompt."""
    bounds = [reused_len]
    while bounds[-1] < prompt_len:
        step = draw(st.integers(1, max(1, (prompt_len - reused_len) // 2 + 1)))
        bounds.append(min(prompt_len, bounds[-1] + step))
    return list(zip(bounds, bounds[1:]))


# ---------------------------------------------------------------------------------------------
# Stateless functions
# ---------------------------------------------------------------------------------------------


@given(st.integers(1, 200), st.integers(0, 20_000))
def test_early_prefix_blocks_matches_reference(tpb: int, reused_len: int) -> None:
    assert as_tuple(kvferry.early_prefix_blocks(tpb, reused_len)) == ref.early_prefix_blocks(tpb, reused_len)


@given(prompt_shapes(), st.booleans(), st.data())
def test_chunk_blocks_matches_reference(shape, prefix_sent: bool, data: st.DataObject) -> None:
    tpb, prompt_len, reused_len, window = shape
    start = data.draw(st.integers(reused_len, prompt_len - 1))
    end = data.draw(st.integers(start + 1, prompt_len))
    args = (tpb, prompt_len, start, end)
    kwargs = {"reused_len": reused_len, "prefix_sent": prefix_sent, "window": window}
    assert as_tuple(kvferry.chunk_blocks(*args, **kwargs)) == ref.chunk_blocks(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# TransferLedger operation sequences
# ---------------------------------------------------------------------------------------------


def ledger_state(led: TransferLedger) -> tuple:
    return (
        led.claimed_blocks,
        led.prefix_sent,
        led.forward_started,
        led.is_complete,
        [as_tuple(r) for r in led.missing()],
    )


def ref_state(led: ref.RefLedger) -> tuple:
    return (
        len(led.claimed),
        led.prefix_sent,
        led.forward_started,
        led.is_complete(),
        led.missing(),
    )


def outcome(call) -> object:
    """A call's result, or the kind of refusal, in a form both planners share."""
    try:
        result = call()
    except (DuplicateTransferError, ref.DuplicateClaim):
        return "duplicate"
    except (InvalidArgumentError, AssertionError):
        return "invalid"
    return as_tuple(result) if isinstance(result, BlockRange) else result


@given(prompt_shapes(max_prompt=600), st.data())
def test_ledger_sequences_match_reference(shape, data: st.DataObject) -> None:
    tpb, prompt_len, reused_len, window = shape
    led = TransferLedger(tpb, prompt_len, reused_len=reused_len, window=window)
    oracle = ref.RefLedger(tpb, prompt_len, reused_len, window)
    assert led.num_blocks == oracle.num_blocks
    assert ledger_state(led) == ref_state(oracle)

    # Mostly a real schedule (early send, then the chunks in order), interleaved with random
    # replays, out-of-range chunks and explicit claims.
    ops: list[tuple[Any, ...]] = []
    if data.draw(st.booleans()):
        ops.append(("early",))
    ops.extend(("chunk", s, e) for s, e in chunk_plan(data.draw, reused_len, prompt_len))
    extra = data.draw(
        st.lists(
            st.one_of(
                st.just(("early",)),
                st.tuples(st.just("chunk"), st.integers(0, prompt_len), st.integers(0, prompt_len + 1)),
                st.tuples(
                    st.just("claim"),
                    st.integers(0, oracle.num_blocks),
                    st.integers(0, oracle.num_blocks),
                ),
            ),
            max_size=6,
        )
    )
    for op in extra:
        ops.insert(data.draw(st.integers(0, len(ops))), op)

    for op in ops:
        kind, *args = op
        if kind == "early":
            got, want = outcome(led.send_early), outcome(oracle.send_early)
        elif kind == "chunk":
            got = outcome(lambda: led.send_chunk(args[0], args[1]))
            want = outcome(lambda: oracle.send_chunk(args[0], args[1]))
        else:
            lo, hi = sorted(args)
            got = outcome(lambda: led.claim(BlockRange(lo, hi)))
            want = outcome(lambda: oracle.claim((lo, hi)))
        assert got == want, op
        assert ledger_state(led) == ref_state(oracle), op


# ---------------------------------------------------------------------------------------------
# TransferBook schedules, with block pairs and runs
# ---------------------------------------------------------------------------------------------


def random_tables(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Block tables whose rows are mostly contiguous with random breaks, so runs form and break
    on either side independently."""

    def table() -> np.ndarray:
        steps = rng.choice([1, 1, 1, 1, 2, 5, -3], size=(rows, cols))
        start = rng.integers(1000, 100_000, size=(rows, 1))
        return np.cumsum(np.concatenate([start, steps[:, 1:]], axis=1), axis=1).astype(np.int64)

    return table(), table()


def check_pairs_and_runs(plan: kvferry.SlicePlan, slices: list, rng: np.random.Generator) -> None:
    cols = max([e for _, _, _, e in slices], default=0) + int(rng.integers(0, 3))
    src, dst = random_tables(rng, plan.num_requests, cols)
    pairs = kvferry.block_pairs(plan, src, dst)
    want_src, want_dst = ref.block_pairs(slices, src, dst)
    assert pairs.src.tolist() == want_src
    assert pairs.dst.tolist() == want_dst
    assert pairs.offsets.tolist() == np.cumsum([0] + [e - s for _, _, s, e in slices]).tolist()

    runs = kvferry.block_runs(plan, src, dst)
    want_runs = ref.block_runs(slices, src, dst)
    assert list(zip(runs.src.tolist(), runs.dst.tolist(), runs.len.tolist())) == want_runs
    per_slice = [len(ref.block_runs([sl], src, dst)) for sl in slices]
    assert runs.offsets.tolist() == np.cumsum([0] + per_slice).tolist()
    # Runs expand back to exactly the pairs.
    expanded_src = [s + j for s, n in zip(runs.src.tolist(), runs.len.tolist()) for j in range(n)]
    assert expanded_src == want_src


def plan_rows(plan: kvferry.SlicePlan) -> list[tuple[int, int, int, int]]:
    return list(
        zip(
            plan.request_index.tolist(),
            plan.request_id.tolist(),
            plan.start.tolist(),
            plan.end.tolist(),
        )
    )


@given(st.data())
def test_book_schedules_match_reference(data: st.DataObject) -> None:
    tpb = data.draw(st.sampled_from([1, 4, 16, 32]) | st.integers(1, 50), label="tpb")
    pipelined = data.draw(st.booleans(), label="pipelined")
    ids = data.draw(st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=10, unique=True), label="ids")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))

    book = TransferBook(tpb, pipelined=pipelined)
    oracle = ref.RefBook(tpb, pipelined=pipelined)
    pending: dict[int, list[tuple[int, int]]] = {}
    prompt: dict[int, int] = {}
    for rid in ids:
        p = data.draw(st.integers(1, 400))
        r = data.draw(st.integers(0, p - 1))
        window = data.draw(st.none() | st.none() | st.integers(1, p + 4))
        context_only = data.draw(st.booleans() | st.just(True))
        book.add(rid, p, reused_len=r, window=window, context_only=context_only)
        oracle.add(rid, p, reused_len=r, window=window, context_only=context_only)
        pending[rid] = chunk_plan(data.draw, r, p)
        prompt[rid] = p
    assert len(book) == len(ids)

    while any(pending.values()):
        live = [rid for rid in ids if pending[rid]]
        if data.draw(st.booleans()):
            victim = data.draw(st.sampled_from(ids))
            book.cancel(victim)
            oracle.cancelled.add(victim)

        # Early pass over a random subset in random order (requests past their first chunk
        # included: they must be skipped).
        batch = data.draw(st.permutations(ids))[: data.draw(st.integers(0, len(ids)))]
        plan = book.plan_early(np.array(batch, dtype=np.int64))
        want = oracle.plan_early(batch)
        assert plan.num_requests == len(batch)
        assert plan_rows(plan) == want
        assert plan.last.tolist() == [False] * len(want)
        if batch:
            check_pairs_and_runs(plan, want, rng)

        # Chunk pass: the next chunk of a random non-empty subset of the live requests.
        batch = data.draw(st.permutations(live))[: data.draw(st.integers(1, len(live)))]
        chunks = [pending[rid].pop(0) for rid in batch]
        starts = np.array([s for s, _ in chunks], dtype=np.int64)
        ends = np.array([e for _, e in chunks], dtype=np.int64)
        plan = book.plan_chunks(np.array(batch, dtype=np.int64), starts, ends)
        want = oracle.plan_chunks(batch, starts, ends)
        assert plan.num_requests == len(batch)
        assert plan_rows(plan) == want
        assert plan.last.tolist() == [int(ends[i]) == prompt[rid] for i, rid, _, _ in want]
        assert plan.total_blocks == sum(e - s for _, _, s, e in want)
        check_pairs_and_runs(plan, want, rng)

        for rid in ids:
            led = oracle.ledgers[rid]
            assert book.claimed_blocks(rid) == len(led.claimed)
            assert book.prefix_sent(rid) == led.prefix_sent
            assert book.is_cancelled(rid) == (rid in oracle.cancelled)

    for rid in ids:
        done = book.remove(rid)
        assert rid not in book
        assert done.is_complete and oracle.ledgers[rid].is_complete()
        assert done.claimed_blocks == len(oracle.ledgers[rid].claimed)
    assert len(book) == 0


# ---------------------------------------------------------------------------------------------
# select_early against numpy
# ---------------------------------------------------------------------------------------------


@given(
    st.integers(1, 128),
    st.integers(0, 64),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["default", "scalar_true", "scalar_false", "array"]),
)
def test_select_early_matches_numpy(tpb: int, n: int, seed: int, pipelined_kind: str) -> None:
    rng = np.random.default_rng(seed)
    reused = rng.integers(0, 4 * tpb + 2, size=n).astype(np.int64)
    context_only = rng.random(n) < 0.8
    cancelled = rng.random(n) < 0.2
    first_chunk = rng.random(n) < 0.7
    kwargs: dict = {}
    pip = np.ones(n, dtype=bool)
    if pipelined_kind == "scalar_true":
        kwargs["pipelined"] = True
    elif pipelined_kind == "scalar_false":
        kwargs["pipelined"] = False
        pip[:] = False
    elif pipelined_kind == "array":
        pip = rng.random(n) < 0.8
        kwargs["pipelined"] = pip
    indices, blocks = kvferry.select_early(
        tpb,
        reused,
        context_only=context_only,
        cancelled=cancelled,
        first_chunk=first_chunk,
        **kwargs,
    )
    per_block = reused // tpb
    eligible = context_only & ~cancelled & first_chunk & pip & (per_block > 0)
    want = np.flatnonzero(eligible)
    assert indices.dtype == np.int64 and blocks.dtype == np.int64
    assert indices.tolist() == want.tolist()
    assert blocks.tolist() == per_block[want].tolist()
    # Agrees with the per-request early slice too.
    early = [kvferry.early_prefix_blocks(tpb, int(reused[i])) for i in want]
    assert blocks.tolist() == [r.end if r is not None else 0 for r in early]
