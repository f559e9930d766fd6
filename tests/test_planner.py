"""The stateless planner: early_prefix_blocks, chunk_blocks and select_early.

Examples are the ones in the issue, verbatim; properties check the tiling invariants for any
tpb, prompt, reuse and chunk size.
"""

from __future__ import annotations

from typing import Any

import kvferry
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvferry import BlockRange, InvalidArgumentError, chunk_blocks, early_prefix_blocks, select_early


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_bounds(reused_len: int, prompt_len: int, chunk: int) -> list[tuple[int, int]]:
    """Prefill chunks of `chunk` tokens from the reuse boundary to the end of the prompt."""
    return [(s, min(s + chunk, prompt_len)) for s in range(reused_len, prompt_len, chunk)]


# ---------------------------------------------------------------------------------------------
# Issue examples
# ---------------------------------------------------------------------------------------------


def test_issue_example_chunks_without_reuse() -> None:
    # tpb=4, P=32: chunks (0,6),(6,12),(12,32) give [0,1),[1,3),[3,8).
    got = [chunk_blocks(4, 32, s, e) for s, e in [(0, 6), (6, 12), (12, 32)]]
    assert got == [BlockRange(0, 1), BlockRange(1, 3), BlockRange(3, 8)]


def test_issue_example_reuse_12() -> None:
    # R=12, chunk (12,24) gives [0,6); after an early send it gives [3,6).
    assert early_prefix_blocks(4, 12) == BlockRange(0, 3)
    assert chunk_blocks(4, 32, 12, 24, reused_len=12) == BlockRange(0, 6)
    assert chunk_blocks(4, 32, 12, 24, reused_len=12, prefix_sent=True) == BlockRange(3, 6)


def test_issue_example_unaligned_reuse_chunks_of_128() -> None:
    # tpb=32, P=1000, R=700, chunks of 128 with early send: [0,21), [21,25), [25,29), [29,32).
    early = early_prefix_blocks(32, 700)
    chunks = [chunk_blocks(32, 1000, s, e, reused_len=700, prefix_sent=True) for s, e in chunk_bounds(700, 1000, 128)]
    assert chunk_bounds(700, 1000, 128) == [(700, 828), (828, 956), (956, 1000)]
    assert [early, *chunks] == [
        BlockRange(0, 21),
        BlockRange(21, 25),
        BlockRange(25, 29),
        BlockRange(29, 32),
    ]


def test_issue_example_unaligned_reuse_without_early_send() -> None:
    # Without the early send the first chunk carries the whole prefix, boundary block included.
    got = [chunk_blocks(32, 1000, s, e, reused_len=700) for s, e in chunk_bounds(700, 1000, 128)]
    assert got == [BlockRange(0, 25), BlockRange(25, 29), BlockRange(29, 32)]


def test_issue_example_sliding_window() -> None:
    # SWA W=16: chunk (0,16) gives nothing, (16,32) gives [4,8).
    assert chunk_blocks(4, 32, 0, 16, window=16) is None
    assert chunk_blocks(4, 32, 16, 32, window=16) == BlockRange(4, 8)


def test_issue_example_select_early() -> None:
    indices, num_blocks = select_early(
        32,
        np.array([0, 0, 128, 128]),
        context_only=np.array([True, True, True, True]),
        cancelled=np.array([False, False, False, True]),
        first_chunk=np.array([False, True, True, True]),
    )
    assert indices.dtype == np.int64 and num_blocks.dtype == np.int64
    assert indices.tolist() == [2]
    assert num_blocks.tolist() == [4]


# ---------------------------------------------------------------------------------------------
# early_prefix_blocks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tpb", "reused", "expected"),
    [
        (32, 0, None),
        (32, 31, None),  # the partial boundary block stays with prefill
        (32, 32, BlockRange(0, 1)),
        (32, 63, BlockRange(0, 1)),
        (32, 700, BlockRange(0, 21)),
        (1, 5, BlockRange(0, 5)),
    ],
)
def test_early_prefix_blocks(tpb: int, reused: int, expected: BlockRange | None) -> None:
    assert early_prefix_blocks(tpb, reused) == expected


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((0, 10), "tokens_per_block=0"),
        ((-4, 10), "tokens_per_block=-4"),
        ((4, -1), "reused_len=-1"),
    ],
)
def test_early_prefix_blocks_errors(args: tuple[int, int], needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        early_prefix_blocks(*args)


# ---------------------------------------------------------------------------------------------
# chunk_blocks
# ---------------------------------------------------------------------------------------------


def test_chunk_that_finishes_no_block_sends_nothing() -> None:
    # Tokens [13, 15) of a 32-token prompt complete no block of 4 (block 3 is [12, 16)).
    assert chunk_blocks(4, 32, 13, 15, reused_len=12, prefix_sent=True) is None


def test_last_chunk_always_yields_a_range() -> None:
    # A 1-token last chunk still sends the (partial) final block.
    assert chunk_blocks(4, 30, 29, 30, reused_len=29, prefix_sent=True) == BlockRange(7, 8)
    assert chunk_blocks(4, 32, 31, 32, reused_len=31, prefix_sent=True) == BlockRange(7, 8)


def test_first_chunk_without_early_send_covers_the_prefix() -> None:
    assert chunk_blocks(4, 32, 12, 13, reused_len=12) == BlockRange(0, 3)
    assert chunk_blocks(4, 32, 12, 13, reused_len=12, prefix_sent=True) is None


def test_window_covering_the_prompt_is_full_attention() -> None:
    for window in (32, 33, 10_000):
        assert chunk_blocks(4, 32, 0, 6, window=window) == BlockRange(0, 1)
        assert chunk_blocks(4, 32, 12, 32, window=window) == BlockRange(3, 8)


def test_sliding_window_live_window_boundaries() -> None:
    # Live window [max(0, floor((P + 1 - W)/tpb)), ceil(P/tpb)).
    # W=1: the next token attends only to itself; on a block boundary no prompt block is
    # live, so nothing is sent (never an empty range).
    assert chunk_blocks(4, 32, 0, 32, window=1) is None
    assert chunk_blocks(4, 30, 0, 30, window=1) == BlockRange(7, 8)
    assert chunk_blocks(4, 32, 0, 32, window=31) == BlockRange(0, 8)
    assert chunk_blocks(4, 30, 0, 30, window=7) == BlockRange(6, 8)
    # Reuse does not change what a windowed group sends, and nothing leaves before the end.
    assert chunk_blocks(4, 32, 12, 24, reused_len=12, window=16) is None
    assert chunk_blocks(4, 32, 24, 32, reused_len=12, prefix_sent=True, window=16) == BlockRange(4, 8)


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        ((0, 32, 0, 4), {}, "tokens_per_block=0"),
        ((-1, 32, 0, 4), {}, "tokens_per_block=-1"),
        ((4, 0, 0, 4), {}, "prompt_len=0"),
        ((4, -5, 0, 4), {}, "prompt_len=-5"),
        ((4, 32, 0, 4), {"reused_len": -1}, "reused_len=-1"),
        ((4, 32, 32, 32), {"reused_len": 32}, "reused_len=32"),
        ((4, 32, 33, 34), {"reused_len": 33}, "reused_len=33"),
        ((4, 32, 8, 16), {"reused_len": 12}, "chunk_start=8"),
        ((4, 32, -1, 16), {}, "chunk_start=-1"),
        ((4, 32, 32, 33), {}, "chunk_start=32"),
        ((4, 32, 12, 12), {"reused_len": 12}, "chunk_end=12"),
        ((4, 32, 12, 11), {"reused_len": 12}, "chunk_end=11"),
        ((4, 32, 12, 33), {"reused_len": 12}, "chunk_end=33"),
        ((4, 32, 0, 4), {"window": 0}, "window=0"),
        ((4, 32, 0, 4), {"window": -3}, "window=-3"),
    ],
)
def test_chunk_blocks_errors(args: tuple[int, ...], kwargs: dict, needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle) as info:
        chunk_blocks(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, kvferry.KvFerryError)


# ---------------------------------------------------------------------------------------------
# select_early
# ---------------------------------------------------------------------------------------------


def _flags(n: int, value: bool) -> np.ndarray:
    return np.full(n, value, dtype=bool)


def test_select_early_each_condition_excludes() -> None:
    n = 6
    reused = np.array([64, 64, 64, 64, 64, 31], dtype=np.int64)
    context_only = _flags(n, True)
    cancelled = _flags(n, False)
    first_chunk = _flags(n, True)
    pipelined = _flags(n, True)
    context_only[0] = False
    cancelled[1] = True
    first_chunk[2] = False
    pipelined[3] = False
    # index 4 is eligible; index 5 has no complete reused block
    indices, blocks = select_early(
        32,
        reused,
        context_only=context_only,
        cancelled=cancelled,
        first_chunk=first_chunk,
        pipelined=pipelined,
    )
    assert indices.tolist() == [4]
    assert blocks.tolist() == [2]


@pytest.mark.parametrize("off", [False, np.bool_(False), np.array([False, False])])
def test_select_early_pipelined_off(off: Any) -> None:
    indices, blocks = select_early(
        4,
        [8, 12],
        context_only=[True, True],
        cancelled=[False, False],
        first_chunk=[True, True],
        pipelined=off,
    )
    assert indices.tolist() == [] and blocks.tolist() == []
    assert indices.dtype == np.int64 and blocks.dtype == np.int64


def test_select_early_default_pipelined_is_on_and_lists_work() -> None:
    indices, blocks = select_early(
        4, [8, 3, 12], context_only=[True] * 3, cancelled=[False] * 3, first_chunk=[True] * 3
    )
    assert indices.tolist() == [0, 2]
    assert blocks.tolist() == [2, 3]


def test_select_early_empty_batch() -> None:
    indices, blocks = select_early(4, [], context_only=[], cancelled=[], first_chunk=[])
    assert indices.shape == (0,) and blocks.shape == (0,)
    assert indices.dtype == np.int64 and blocks.dtype == np.int64


def test_select_early_strided_and_int32_inputs() -> None:
    reused = np.array([64, -999, 0, -999, 96], dtype=np.int64)[::2]  # non-contiguous view
    indices, blocks = select_early(
        32,
        reused,
        context_only=np.array([True, True, True]),
        cancelled=np.array([False, False, False]),
        first_chunk=np.array([True, True, True]),
    )
    assert indices.tolist() == [0, 2] and blocks.tolist() == [2, 3]
    indices, blocks = select_early(
        32,
        np.array([64, 0, 96], dtype=np.int32),
        context_only=[True] * 3,
        cancelled=[False] * 3,
        first_chunk=[True] * 3,
    )
    assert indices.tolist() == [0, 2] and blocks.tolist() == [2, 3]


def test_select_early_errors() -> None:
    ok: dict[str, Any] = dict(context_only=[True, True], cancelled=[False, False], first_chunk=[True, True])
    with pytest.raises(InvalidArgumentError, match="tokens_per_block=0"):
        select_early(0, [4, 8], **ok)
    with pytest.raises(InvalidArgumentError, match="reused_len=-5"):
        select_early(4, [4, -5], **ok)
    for name in ("context_only", "cancelled", "first_chunk"):
        bad = dict(ok)
        bad[name] = [True]
        with pytest.raises(InvalidArgumentError, match=f"{name}=<array of length 1>"):
            select_early(4, [4, 8], **bad)
    with pytest.raises(InvalidArgumentError, match="pipelined=<array of length 3>"):
        select_early(4, [4, 8], pipelined=[True, True, True], **ok)


def test_select_early_type_and_shape_errors() -> None:
    ok: dict[str, Any] = dict(context_only=[True, True], cancelled=[False, False], first_chunk=[True, True])
    with pytest.raises(TypeError, match="reused_len"):
        select_early(4, np.array([4.0, 8.0]), **ok)
    with pytest.raises(InvalidArgumentError, match="reused_len=<2-d array>"):
        select_early(4, np.array([[4, 8]]), **ok)
    bad = dict(ok)
    bad["cancelled"] = np.array([0.0, 1.0])
    with pytest.raises(TypeError, match="cancelled"):
        select_early(4, [4, 8], **bad)
    bad = dict(ok)
    bad["first_chunk"] = np.array([[True, True]])
    with pytest.raises(InvalidArgumentError, match="first_chunk=<2-d array>"):
        select_early(4, [4, 8], **bad)


# ---------------------------------------------------------------------------------------------
# Properties: exact-once tiling, early slice inside the reused prefix, no unfinished block
# ---------------------------------------------------------------------------------------------


@st.composite
def prompts(draw: st.DrawFn) -> tuple[int, int, int, int]:
    tpb = draw(st.integers(1, 64))
    prompt_len = draw(st.integers(1, 4000))
    reused_len = draw(st.integers(0, prompt_len - 1))
    chunk = draw(st.integers(1, prompt_len))
    return tpb, prompt_len, reused_len, chunk


@given(prompts(), st.booleans())
def test_property_exact_once_tiling(shape: tuple[int, int, int, int], early: bool) -> None:
    tpb, prompt_len, reused_len, chunk = shape
    num_blocks = cdiv(prompt_len, tpb)
    slices: list[BlockRange] = []

    first = early_prefix_blocks(tpb, reused_len) if early else None
    if first is not None:
        # The early slice lies inside the complete reused blocks.
        assert first.start == 0 and first.end <= reused_len // tpb
        assert first.end == reused_len // tpb
        slices.append(first)
    prefix_sent = first is not None

    bounds = chunk_bounds(reused_len, prompt_len, chunk)
    for i, (s, e) in enumerate(bounds):
        got = chunk_blocks(tpb, prompt_len, s, e, reused_len=reused_len, prefix_sent=prefix_sent)
        final = i == len(bounds) - 1
        if final:
            assert got is not None, "the last chunk always yields a range"
            assert got.end == num_blocks
        if got is None:
            continue
        assert len(got) > 0
        if not final:
            # A non-final slice never holds a block the chunk has not finished.
            assert got.end * tpb <= e
        slices.append(got)

    covered = [b for r in slices for b in range(r.start, r.end)]
    assert sorted(covered) == list(range(num_blocks)), "blocks tile the prompt exactly once"
    assert len(covered) == len(set(covered))
    # Slices come out in block order.
    assert all(a.end == b.start for a, b in zip(slices, slices[1:]))


@given(prompts(), st.data())
def test_property_sliding_window_sends_live_window_on_last_chunk(
    shape: tuple[int, int, int, int], data: st.DataObject
) -> None:
    tpb, prompt_len, reused_len, chunk = shape
    window = data.draw(st.integers(1, prompt_len + 5))
    bounds = chunk_bounds(reused_len, prompt_len, chunk)
    got = [
        chunk_blocks(tpb, prompt_len, s, e, reused_len=reused_len, prefix_sent=p, window=window)
        for s, e in bounds
        for p in (False, True)
    ]
    if window >= prompt_len:
        # Full attention: the window changes nothing.
        assert got == [
            chunk_blocks(tpb, prompt_len, s, e, reused_len=reused_len, prefix_sent=p)
            for s, e in bounds
            for p in (False, True)
        ]
        return
    lo, hi = max(0, (prompt_len + 1 - window) // tpb), cdiv(prompt_len, tpb)
    live = BlockRange(lo, hi) if hi > lo else None
    assert all(r is None for r in got[:-2])
    assert got[-2:] == [live, live]
