"""TransferBook (the per-step batch API), SlicePlan, block_pairs and block_runs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvferry import (
    BlockRange,
    DuplicateTransferError,
    InvalidArgumentError,
    KvFerryError,
    RequestSpec,
    SlicePlan,
    TransferBook,
    TransferLedger,
    UnknownRequestError,
    block_pairs,
    block_runs,
)


def arrays(plan: SlicePlan) -> dict[str, list]:
    return {
        "request_index": plan.request_index.tolist(),
        "request_id": plan.request_id.tolist(),
        "start": plan.start.tolist(),
        "end": plan.end.tolist(),
        "last": plan.last.tolist(),
    }


def snapshot(book: TransferBook, ids: list[int]) -> list[tuple]:
    """Everything observable about the requests, to check that a failed call changed nothing."""
    return [
        (
            book.claimed_blocks(i),
            book.prefix_sent(i),
            book.is_complete(i),
            book.missing(i),
            book.is_cancelled(i),
        )
        for i in ids
    ]


# ---------------------------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------------------------


def test_book_attributes() -> None:
    book = TransferBook(32)
    assert book.tokens_per_block == 32
    assert book.pipelined is True
    assert TransferBook(16, pipelined=False).pipelined is False
    assert len(book) == 0


@pytest.mark.parametrize("tpb", [0, -32])
def test_book_bad_tokens_per_block(tpb: int) -> None:
    with pytest.raises(InvalidArgumentError, match=f"tokens_per_block={tpb}"):
        TransferBook(tpb)


def test_add_contains_len_remove() -> None:
    book = TransferBook(4)
    book.add(7, 32, reused_len=12)
    book.add(8, 20)
    assert len(book) == 2
    assert 7 in book and 8 in book and 9 not in book
    led = book.remove(7)
    assert isinstance(led, TransferLedger)
    assert (led.tokens_per_block, led.prompt_len, led.reused_len) == (4, 32, 12)
    assert len(book) == 1
    assert 7 not in book
    with pytest.raises(UnknownRequestError):
        book.remove(7)
    book.add(7, 16)  # the id may be reused once removed
    assert len(book) == 2 and book.missing(7) == [BlockRange(0, 4)]


def test_add_errors_leave_the_book_unchanged() -> None:
    book = TransferBook(4)
    book.add(1, 32, reused_len=12)
    with pytest.raises(InvalidArgumentError, match="request_id=1"):
        book.add(1, 64)
    assert book.missing(1) == [BlockRange(0, 8)]  # the first registration survives
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt_len": 0}, "prompt_len=0"),
        ({"prompt_len": 32, "reused_len": -1}, "reused_len=-1"),
        ({"prompt_len": 32, "reused_len": 32}, "reused_len=32"),
        ({"prompt_len": 32, "window": 0}, "window=0"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(InvalidArgumentError, match=needle):
            book.add(2, **kwargs)
        assert 2 not in book
    assert len(book) == 1


def test_unknown_request_is_a_key_error() -> None:
    book = TransferBook(4)
    book.add(1, 32)
    for call in (
        lambda: book.remove(5),
        lambda: book.cancel(5),
        lambda: book.is_cancelled(5),
        lambda: book.is_complete(5),
        lambda: book.prefix_sent(5),
        lambda: book.claimed_blocks(5),
        lambda: book.missing(5),
        lambda: book.plan_early([1, 5]),
        lambda: book.plan_chunks([5], [0], [4]),
    ):
        with pytest.raises(UnknownRequestError, match="request_id=5") as info:
            call()
        assert isinstance(info.value, KeyError)
        assert isinstance(info.value, KvFerryError)
    with pytest.raises(KeyError):
        book.remove(5)


def test_remove_returns_ledger_reflecting_the_plan() -> None:
    book = TransferBook(4)
    book.add(1, 32, reused_len=12)
    book.add(2, 32, reused_len=12)
    book.plan_early([1, 2])
    book.plan_chunks([1, 2], [12, 12], [32, 20])
    done = book.remove(1)
    assert done.is_complete and done.prefix_sent and done.claimed_blocks == 8
    partial = book.remove(2)
    assert not partial.is_complete
    assert partial.claimed_blocks == 5
    assert partial.missing() == [BlockRange(5, 8)]
    assert len(book) == 0


# ---------------------------------------------------------------------------------------------
# plan_early
# ---------------------------------------------------------------------------------------------


def test_plan_early_slices_and_arrays() -> None:
    book = TransferBook(32)
    book.add(7, 1000, reused_len=700)
    book.add(8, 100, reused_len=10)  # no complete reused block
    book.add(9, 300, reused_len=64)
    plan = book.plan_early(np.array([8, 7, 9], dtype=np.int64))
    assert plan.num_requests == 3
    assert len(plan) == 2
    assert arrays(plan) == {
        "request_index": [1, 2],
        "request_id": [7, 9],
        "start": [0, 0],
        "end": [21, 2],
        "last": [False, False],
    }
    for name in ("request_index", "request_id", "start", "end"):
        assert getattr(plan, name).dtype == np.int64
    assert plan.last.dtype == np.bool_
    assert plan.total_blocks == 23
    assert plan.slices() == [(7, BlockRange(0, 21), False), (9, BlockRange(0, 2), False)]
    assert book.prefix_sent(7) and book.prefix_sent(9) and not book.prefix_sent(8)
    assert book.claimed_blocks(7) == 21
    # Planned once: the next step plans nothing for them.
    again = book.plan_early([7, 8, 9])
    assert len(again) == 0 and again.num_requests == 3
    assert book.claimed_blocks(7) == 21


def test_plan_early_skips_ineligible_requests() -> None:
    book = TransferBook(4)
    book.add(1, 32, reused_len=12)  # eligible
    book.add(2, 32, reused_len=12, context_only=False)
    book.add(3, 32, reused_len=12)
    book.cancel(3)
    book.add(4, 32, reused_len=12, window=16)  # sliding window: nothing early
    book.add(5, 32, reused_len=12)
    book.plan_chunks([5], [12], [16])  # already past its first chunk
    assert book.is_cancelled(3) and not book.is_cancelled(1)
    before = book.claimed_blocks(5)
    plan = book.plan_early([1, 2, 3, 4, 5])
    assert plan.request_id.tolist() == [1]
    assert plan.request_index.tolist() == [0]
    for rid in (2, 3, 4, 5):
        assert not book.prefix_sent(rid)
    assert book.claimed_blocks(5) == before


def test_plan_early_disabled_when_not_pipelined() -> None:
    book = TransferBook(4, pipelined=False)
    book.add(1, 32, reused_len=12)
    plan = book.plan_early([1])
    assert len(plan) == 0 and plan.num_requests == 1
    assert not book.prefix_sent(1)
    # The whole prompt then leaves with the chunks.
    chunks = book.plan_chunks([1], [12], [24])
    assert chunks.start.tolist() == [0] and chunks.end.tolist() == [6]


def test_first_chunk_starts_at_reuse_boundary_after_early_send() -> None:
    book = TransferBook(4)
    book.add(1, 32, reused_len=12)
    book.add(2, 32, reused_len=12)
    book.plan_early([1])
    plan = book.plan_chunks([1, 2], [12, 12], [24, 24])
    assert plan.start.tolist() == [3, 0]
    assert plan.end.tolist() == [6, 6]


def test_plan_early_empty_and_list_inputs() -> None:
    book = TransferBook(4)
    book.add(1, 32, reused_len=12)
    empty = book.plan_early([])
    assert len(empty) == 0 and empty.num_requests == 0 and empty.total_blocks == 0
    assert empty.start.dtype == np.int64 and empty.last.dtype == np.bool_
    assert book.plan_early(np.array([1], dtype=np.int32)).request_id.tolist() == [1]


# ---------------------------------------------------------------------------------------------
# plan_chunks
# ---------------------------------------------------------------------------------------------


def test_plan_chunks_issue_example_through_the_book() -> None:
    book = TransferBook(32)
    book.add(7, 1000, reused_len=700)
    early = book.plan_early([7])
    assert early.slices() == [(7, BlockRange(0, 21), False)]
    got = []
    for s, e in [(700, 828), (828, 956), (956, 1000)]:
        plan = book.plan_chunks([7], [s], [e])
        got.extend(plan.slices())
    assert got == [
        (7, BlockRange(21, 25), False),
        (7, BlockRange(25, 29), False),
        (7, BlockRange(29, 32), True),
    ]
    assert book.is_complete(7) and book.missing(7) == []


def test_plan_chunks_skips_chunks_that_finish_no_block() -> None:
    book = TransferBook(4)
    book.add(1, 32, reused_len=12)
    book.add(2, 32, window=16)
    book.add(3, 32)
    book.plan_early([1])
    plan = book.plan_chunks([1, 2, 3], [12, 0, 0], [15, 16, 32])
    assert plan.num_requests == 3
    assert arrays(plan) == {
        "request_index": [2],
        "request_id": [3],
        "start": [0],
        "end": [8],
        "last": [True],
    }
    # The skipped requests' chunks were still recorded.
    plan = book.plan_chunks([2, 1], [16, 15], [32, 32])
    assert plan.slices() == [(2, BlockRange(4, 8), True), (1, BlockRange(3, 8), True)]
    assert plan.request_index.tolist() == [0, 1]
    assert all(book.is_complete(i) for i in (1, 2, 3))


@pytest.mark.parametrize(
    ("ids", "starts", "ends", "error", "needle"),
    [
        ([1, 2], [12, 0], [16, 40], InvalidArgumentError, "chunk_end=40"),
        ([1, 2], [12, 0], [16, 0], InvalidArgumentError, "chunk_end=0"),
        ([1, 2], [8, 0], [16, 4], InvalidArgumentError, "chunk_start=8"),
        ([1, 2], [12, 0], [16], InvalidArgumentError, "chunk_ends=<array of length 1>"),
        ([1, 2], [12], [16, 4], InvalidArgumentError, "chunk_starts=<array of length 1>"),
        ([1, 2, 1], [12, 0, 16], [16, 4, 20], InvalidArgumentError, "request_ids=1"),
        ([1, 99], [12, 0], [16, 4], UnknownRequestError, "request_id=99"),
        ([1, 2], [12, 0], [16, 4], DuplicateTransferError, "of request 2"),
    ],
)
def test_failing_plan_chunks_changes_nothing(
    ids: list[int], starts: list[int], ends: list[int], error: type, needle: str
) -> None:
    book = TransferBook(4)
    book.add(1, 32, reused_len=12)
    book.add(2, 32)
    book.add(3, 32)
    if error is DuplicateTransferError:
        book.plan_chunks([2], [0], [4])
    before = snapshot(book, [1, 2, 3])
    with pytest.raises(error, match=needle):
        book.plan_chunks(ids, starts, ends)
    assert snapshot(book, [1, 2, 3]) == before
    # No forward was recorded for request 1: it can still send early.
    assert book.plan_early([1]).slices() == [(1, BlockRange(0, 3), False)]


def test_bad_chunk_error_names_the_request() -> None:
    book = TransferBook(4)
    book.add(1, 32)
    book.add(2, 32)
    with pytest.raises(InvalidArgumentError, match=r"chunk_end=40.*request_id=2"):
        book.plan_chunks([1, 2], [0, 0], [8, 40])


def test_failing_plan_early_changes_nothing() -> None:
    book = TransferBook(4)
    book.add(1, 32, reused_len=12)
    book.add(2, 32, reused_len=16)
    before = snapshot(book, [1, 2])
    with pytest.raises(UnknownRequestError):
        book.plan_early([1, 2, 99])
    with pytest.raises(InvalidArgumentError, match="request_ids=2"):
        book.plan_early([1, 2, 2])
    assert snapshot(book, [1, 2]) == before
    # A failed batch does not poison the next one.
    assert book.plan_early([2, 1]).request_id.tolist() == [2, 1]


def test_batch_type_and_shape_errors() -> None:
    book = TransferBook(4)
    book.add(1, 32)
    before = snapshot(book, [1])
    with pytest.raises(TypeError, match="request_ids"):
        book.plan_early(np.array([1.0]))
    with pytest.raises(TypeError, match="request_ids"):
        book.plan_chunks(np.array([1.0]), [0], [4])
    with pytest.raises(TypeError, match="chunk_starts"):
        book.plan_chunks([1], np.array([0.0]), [4])
    with pytest.raises(TypeError, match="chunk_ends"):
        book.plan_chunks([1], [0], np.array([4.5]))
    with pytest.raises(InvalidArgumentError, match="request_ids=<2-d array>"):
        book.plan_early(np.array([[1]]))
    with pytest.raises(InvalidArgumentError, match="chunk_starts=<2-d array>"):
        book.plan_chunks([1], np.array([[0]]), [4])
    with pytest.raises(InvalidArgumentError, match="chunk_ends=<2-d array>"):
        book.plan_chunks([1], [0], np.array([[4]]))
    assert snapshot(book, [1]) == before


def test_non_contiguous_batch_inputs() -> None:
    book = TransferBook(4)
    for rid in range(4):
        book.add(rid, 32)
    ids = np.array([0, -1, 1, -1, 2, -1, 3], dtype=np.int64)[::2]
    starts = np.zeros((4, 2), dtype=np.int64)[:, 0]
    ends = np.array([[4, 0], [8, 0], [12, 0], [32, 0]], dtype=np.int64)[:, 0]
    plan = book.plan_chunks(ids, starts, ends)
    assert plan.request_id.tolist() == [0, 1, 2, 3]
    assert plan.end.tolist() == [1, 2, 3, 8]
    assert plan.last.tolist() == [False, False, False, True]


def test_large_batch_releases_the_gil_path() -> None:
    # Above the GIL-release threshold the same answers must come out.
    n = 5000
    book = TransferBook(16)
    for rid in range(n):
        book.add(rid, 1000 + rid % 7, reused_len=rid % 300)
    ids = np.arange(n, dtype=np.int64)[::-1].copy()
    early = book.plan_early(ids)
    expected_ids = [rid for rid in ids.tolist() if (rid % 300) // 16 > 0]
    assert early.request_id.tolist() == expected_ids
    assert early.end.tolist() == [(rid % 300) // 16 for rid in expected_ids]
    assert early.request_index.tolist() == [n - 1 - rid for rid in expected_ids]
    starts = ids % 300
    ends = 1000 + ids % 7
    chunks = book.plan_chunks(ids, starts, ends)
    assert len(chunks) == n and bool(chunks.last.all())
    assert all(book.is_complete(rid) for rid in range(0, n, 97))


# ---------------------------------------------------------------------------------------------
# block_pairs / block_runs
# ---------------------------------------------------------------------------------------------


def _two_request_plan() -> tuple[TransferBook, SlicePlan]:
    book = TransferBook(4)
    book.add(10, 16)  # 4 blocks
    book.add(11, 32, reused_len=12)  # 8 blocks, 3 early
    return book, book.plan_early([10, 11])


def test_block_pairs_and_offsets() -> None:
    book = TransferBook(4)
    book.add(10, 16)
    book.add(11, 12)
    plan = book.plan_chunks([11, 10], [0, 0], [12, 8])
    assert plan.slices() == [(11, BlockRange(0, 3), True), (10, BlockRange(0, 2), False)]
    src = np.array([[100, 101, 102, 103], [5, 6, 9, 7]], dtype=np.int64)
    dst = np.array([[0, 1, 2, 3], [40, 41, 42, 50]], dtype=np.int64)
    pairs = block_pairs(plan, src, dst)
    # Row request_index[k] of the tables belongs to slice k: slice 0 is batch row 0 (id 11).
    assert pairs.src.tolist() == [100, 101, 102, 5, 6]
    assert pairs.dst.tolist() == [0, 1, 2, 40, 41]
    assert pairs.offsets.tolist() == [0, 3, 5]
    assert len(pairs) == 5
    for a in (pairs.src, pairs.dst, pairs.offsets):
        assert a.dtype == np.int64


def test_block_runs_coalesce_only_where_both_sides_are_contiguous() -> None:
    book = TransferBook(1)
    book.add(1, 8)
    plan = book.plan_chunks([1], [0], [8])
    src = np.array([[10, 11, 12, 20, 21, 22, 23, 30]], dtype=np.int64)
    dst = np.array([[0, 1, 5, 6, 7, 9, 10, 11]], dtype=np.int64)
    runs = block_runs(plan, src, dst)
    # Pairs: (10,0)(11,1) | (12,5) | (20,6)(21,7) | (22,9)(23,10) | (30,11)
    # (12,5)->(20,6): dst contiguous, src not; (21,7)->(22,9): src contiguous, dst not.
    assert runs.src.tolist() == [10, 12, 20, 22, 30]
    assert runs.dst.tolist() == [0, 5, 6, 9, 11]
    assert runs.len.tolist() == [2, 1, 2, 2, 1]
    assert runs.offsets.tolist() == [0, 5]
    assert len(runs) == 5
    for a in (runs.src, runs.dst, runs.len, runs.offsets):
        assert a.dtype == np.int64


def test_block_runs_never_cross_slices() -> None:
    # Two requests whose physical blocks continue each other still get separate runs.
    book = TransferBook(4)
    book.add(1, 16)
    book.add(2, 16)
    plan = book.plan_chunks([1, 2], [0, 0], [16, 16])
    src = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=np.int64)
    dst = np.array([[10, 11, 12, 13], [14, 15, 16, 17]], dtype=np.int64)
    runs = block_runs(plan, src, dst)
    assert runs.src.tolist() == [0, 4]
    assert runs.dst.tolist() == [10, 14]
    assert runs.len.tolist() == [4, 4]
    assert runs.offsets.tolist() == [0, 1, 2]


def test_block_pairs_of_an_empty_plan() -> None:
    book = TransferBook(4)
    book.add(1, 32)
    plan = book.plan_early([1])  # nothing reused: no slice
    table = np.zeros((1, 8), dtype=np.int64)
    pairs = block_pairs(plan, table, table)
    assert len(pairs) == 0 and pairs.offsets.tolist() == [0]
    runs = block_runs(plan, table, table)
    assert len(runs) == 0 and runs.offsets.tolist() == [0]


def test_block_tables_in_other_layouts() -> None:
    book, plan = _two_request_plan()
    base_src = np.arange(16, dtype=np.int64).reshape(2, 8) * 3
    base_dst = np.arange(16, dtype=np.int64).reshape(2, 8) + 100
    want = block_pairs(plan, base_src, base_dst)
    assert want.src.tolist() == [24, 27, 30]
    layouts: list[tuple[Any, Any]] = [
        (np.asfortranarray(base_src), np.asfortranarray(base_dst)),
        (base_src.astype(np.int32), base_dst.astype(np.int32)),
        (base_src.tolist(), base_dst.tolist()),
        # Column views of a wider table (non-contiguous rows).
        (np.pad(base_src, ((0, 0), (0, 3)))[:, :8], np.pad(base_dst, ((0, 0), (0, 3)))[:, :8]),
    ]
    for src, dst in layouts:
        got = block_pairs(plan, src, dst)
        assert got.src.tolist() == want.src.tolist()
        assert got.dst.tolist() == want.dst.tolist()
        assert got.offsets.tolist() == want.offsets.tolist()


@pytest.mark.parametrize("fn", [block_pairs, block_runs])
@pytest.mark.parametrize("which", ["src_block_table", "dst_block_table"])
def test_block_table_errors(fn, which: str) -> None:
    book, plan = _two_request_plan()  # request 11 (row 1) sends blocks [0, 3)
    good = np.arange(16, dtype=np.int64).reshape(2, 8)

    def call(bad: Any) -> Any:
        if which == "src_block_table":
            return fn(plan, bad, good)
        return fn(plan, good, bad)

    with pytest.raises(InvalidArgumentError, match=f"{which}=<table with 1 rows>"):
        call(good[:1])
    with pytest.raises(InvalidArgumentError, match=f"{which}=<table with 2 columns>"):
        call(good[:, :2].copy())
    negative = good.copy()
    negative[1, 2] = -1
    with pytest.raises(InvalidArgumentError, match=which) as info:
        call(negative)
    assert "-1" in str(info.value)
    with pytest.raises(InvalidArgumentError, match=f"{which}=<1-d array>"):
        call(good[0])
    with pytest.raises(TypeError, match=which):
        call(good.astype(np.float64))


def test_large_plan_pairs_release_the_gil_path() -> None:
    # Above the GIL-release threshold (8192 blocks) the same answers must come out.
    book = TransferBook(1)
    n, p = 12, 1000
    for rid in range(n):
        book.add(rid, p)
    plan = book.plan_chunks(list(range(n)), [0] * n, [p] * n)
    assert plan.total_blocks == n * p
    src = np.arange(n * p, dtype=np.int64).reshape(n, p)
    dst = src[::-1].copy() * 2
    pairs = block_pairs(plan, src, dst)
    assert np.array_equal(pairs.src, src.ravel())
    assert np.array_equal(pairs.dst, dst.ravel())
    runs = block_runs(plan, src, dst)
    assert runs.len.tolist() == [1] * (n * p)  # dst steps by two: nothing coalesces
    runs = block_runs(plan, src, src + 7)
    assert runs.len.tolist() == [p] * n
    assert runs.offsets.tolist() == list(range(n + 1))


def test_slice_plan_arrays_are_copies() -> None:
    # A caller scribbling on the returned arrays cannot corrupt the plan or the pairs.
    book, plan = _two_request_plan()
    start = plan.start
    start[:] = 99
    plan.end[:] = 0
    assert plan.start.tolist() == [0]
    assert plan.end.tolist() == [3]
    table = np.arange(16, dtype=np.int64).reshape(2, 8)
    assert block_pairs(plan, table, table).src.tolist() == [8, 9, 10]


def test_plan_with_tables_emits_pairs_and_refuses_bad_tables_before_claiming() -> None:
    import kvferry

    book = kvferry.TransferBook(4)
    book.add(1, 32, reused_len=12)
    src = np.arange(100, 108)[None, :]
    dst = np.arange(200, 208)[None, :]
    with pytest.raises(kvferry.InvalidArgumentError, match="dst_block_table"):
        book.plan_early([1], src_block_table=src, dst_block_table=dst[:, :2])
    assert not book.prefix_sent(1) and book.claimed_blocks(1) == 0
    with pytest.raises(kvferry.InvalidArgumentError, match="dst_block_table=None"):
        book.plan_early([1], src_block_table=src)
    plan = book.plan_early([1], src_block_table=src, dst_block_table=dst)
    assert plan.pairs is not None
    assert plan.pairs.src.tolist() == [100, 101, 102] and plan.pairs.dst.tolist() == [200, 201, 202]
    with pytest.raises(kvferry.InvalidArgumentError, match="src_block_table"):
        book.plan_chunks([1], [12], [32], src_block_table=-src, dst_block_table=dst)
    assert book.claimed_blocks(1) == 3
    done = book.plan_chunks([1], [12], [32], src_block_table=src, dst_block_table=dst)
    assert done.pairs is not None and done.pairs.dst.tolist() == [203, 204, 205, 206, 207]
    assert book.is_complete(1)
    assert book.plan_early([1]).pairs is None


# ---------------------------------------------------------------------------------------------
# Layer-wise streaming (planner only)
# ---------------------------------------------------------------------------------------------


def test_plan_layers_per_group_then_an_empty_chunk_plan() -> None:
    book = TransferBook(4, layer_groups=2)
    assert book.layer_groups == 2 and TransferBook(4).layer_groups == 1
    assert "layer_groups=2" in repr(book)
    book.add(1, 32, reused_len=12)
    src = np.arange(100, 108)[None, :]
    dst = np.arange(200, 208)[None, :]
    book.plan_early([1])
    plan = book.plan_layers([1], [12], [32], 1, src_block_table=src, dst_block_table=dst)
    assert arrays(plan) == {
        "request_index": [0],
        "request_id": [1],
        "start": [3],
        "end": [8],
        "last": [True],
    }
    assert plan.pairs is not None and plan.pairs.dst.tolist() == [203, 204, 205, 206, 207]
    assert book.claimed_blocks(1) == 3 and not book.is_complete(1)
    assert len(book.plan_layers([1], [12], [32], 1)) == 0
    # Group 0 has not gone yet: a whole-block plan would resend group 1's part.
    before = snapshot(book, [1])
    with pytest.raises(DuplicateTransferError, match="block 3 of request 1"):
        book.plan_chunks([1], [12], [32])
    assert snapshot(book, [1]) == before
    book.plan_layers(np.array([1]), np.array([12]), np.array([32]), 0)
    assert book.is_complete(1)
    assert len(book.plan_chunks([1], [12], [32])) == 0


def test_plan_layers_errors_are_named_and_change_nothing() -> None:
    with pytest.raises(InvalidArgumentError, match=r"invalid layer_groups=0"):
        TransferBook(4, layer_groups=0)
    with pytest.raises(InvalidArgumentError, match=r"invalid layer_groups=1025"):
        TransferBook(4, layer_groups=1025)
    book = TransferBook(4, layer_groups=2)
    book.add(1, 32, reused_len=12)
    before = snapshot(book, [1])
    with pytest.raises(InvalidArgumentError, match=r"invalid layer_group=2"):
        book.plan_layers([1], [12], [32], 2)
    with pytest.raises(InvalidArgumentError, match=r"invalid layer_group=-1"):
        book.plan_layers([1], [12], [32], -1)
    with pytest.raises(TypeError, match="layer_group"):
        book.plan_layers([1], [12], [32], 1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"chunk_end=40"):
        book.plan_layers([1], [12], [40], 0)
    with pytest.raises(UnknownRequestError):
        book.plan_layers([1, 9], [12, 0], [32, 4], 0)
    src = np.arange(100, 108)[None, :]
    with pytest.raises(InvalidArgumentError, match="dst_block_table"):
        book.plan_layers([1], [12], [32], 0, src_block_table=src, dst_block_table=src[:, :2])
    assert snapshot(book, [1]) == before


def test_request_spec_is_a_value_and_add_spec_registers_it_with_its_held_blocks() -> None:
    """`RequestSpec` is frozen, comparable and hashable, with a constructor-style repr;
    `TransferBook.add_spec` registers the request as `add` + `hold` would, all or nothing."""
    spec = RequestSpec(16, reused_len=8, held=[BlockRange(0, 1)], epoch=3)
    same = RequestSpec(16, reused_len=8, window=None, context_only=True, held=(BlockRange(0, 1),), epoch=3)
    assert spec == same and hash(spec) == hash(same) and spec != RequestSpec(16, reused_len=8, epoch=3)
    assert (
        repr(spec) == "RequestSpec(16, reused_len=8, window=None, context_only=True, held=[BlockRange(0, 1)], epoch=3)"
    )
    assert (spec.prompt_len, spec.reused_len, spec.window, spec.context_only, spec.held, spec.epoch) == (
        16,
        8,
        None,
        True,
        [BlockRange(0, 1)],
        3,
    )
    with pytest.raises(AttributeError):
        spec.epoch = 4  # type: ignore[misc]

    book, twin = TransferBook(4), TransferBook(4)
    book.add_spec(1, spec)
    twin.add(1, 16, reused_len=8)
    twin.hold(1, [BlockRange(0, 1)])
    assert book.held_blocks(1) == twin.held_blocks(1) == 1 and book.missing(1) == twin.missing(1)
    assert arrays(book.plan_early([1])) == arrays(twin.plan_early([1]))
    with pytest.raises(InvalidArgumentError, match=r"invalid range=\[3, 9\)"):
        book.add_spec(2, RequestSpec(16, held=[BlockRange(0, 1), BlockRange(3, 9)]))
    assert 2 not in book and len(book) == 1  # refused whole: not registered
