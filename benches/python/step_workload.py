"""The scheduler step that the Python benchmarks time, shared by bench_step.py (pytest-benchmark)
and step_report.py (the perf_counter_ns script whose table goes into docs/benchmarks.md).

One step of 256 requests, prompt 32768 tokens, 32 tokens per block (1024 blocks a request):

```
early half (128):  |<----- reused R = 30000 ----->|<- first chunk (not run yet) ->|P
                   early slice [0, 937)            (partial block 937 stays with prefill)
chunk half (128):  |<- chunk 0 ->|<- chunk 1 ->|<- chunk 2 ->|<- last chunk ->|P
                    planned in earlier steps (setup)          [768, 1024) this step
```

Planning claims blocks, so every timed round starts from a freshly built book; building it
(256 ``add`` calls plus the earlier chunks of the chunk half) is setup, never timed. The
pair/run benchmarks use a plan of early slices only (256 requests x 937 blocks = 239,872
pairs, about the "1000 pairs per request" of issue 2) and do not mutate it, so one plan serves
every round.

The reference (tests/reference_planner.py) gets the same ids and chunk bounds as Python lists
and its block tables as nested lists: indexing a numpy array from a Python loop would make
the baseline several times slower than a pure-Python planner needs to be.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvferry
import numpy as np

# The reference planner lives with the tests it is an oracle for; the benches borrow it.
_TESTS = Path(__file__).resolve().parents[2] / "tests"
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

import reference_planner as ref  # noqa: E402

NUM_REQUESTS = 256
PROMPT_LEN = 32768
TOKENS_PER_BLOCK = 32
REUSED_LEN = 30000  # 937 complete blocks; block 937 is partial and stays with prefill
CHUNK_LEN = 8192  # the chunk half is on its 4th and last chunk
MAX_BLOCKS = PROMPT_LEN // TOKENS_PER_BLOCK
EARLY_BLOCKS = REUSED_LEN // TOKENS_PER_BLOCK


@dataclass(frozen=True)
class Step:
    """Request ids and chunk bounds of one mixed step (numpy for kvferry, lists for the
    reference)."""

    early_ids: np.ndarray
    chunk_ids: np.ndarray
    chunk_starts: np.ndarray
    chunk_ends: np.ndarray

    def as_lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        return (
            self.early_ids.tolist(),
            self.chunk_ids.tolist(),
            self.chunk_starts.tolist(),
            self.chunk_ends.tolist(),
        )


def make_step(seed: int = 0) -> Step:
    """Scattered 40-bit request ids (as a server hands them out), half early, half chunk."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(1 << 40, size=NUM_REQUESTS, replace=False).astype(np.int64)
    half = NUM_REQUESTS // 2
    chunk_ids = ids[half:].copy()
    return Step(
        early_ids=ids[:half].copy(),
        chunk_ids=chunk_ids,
        chunk_starts=np.full(len(chunk_ids), PROMPT_LEN - CHUNK_LEN, dtype=np.int64),
        chunk_ends=np.full(len(chunk_ids), PROMPT_LEN, dtype=np.int64),
    )


def _earlier_chunks(step: Step) -> list[tuple[np.ndarray, np.ndarray]]:
    n = len(step.chunk_ids)
    return [
        (np.full(n, s, dtype=np.int64), np.full(n, s + CHUNK_LEN, dtype=np.int64))
        for s in range(0, PROMPT_LEN - CHUNK_LEN, CHUNK_LEN)
    ]


def rust_book(step: Step) -> kvferry.TransferBook:
    """A book with the step's requests registered and the chunk half's earlier chunks planned."""
    book = kvferry.TransferBook(TOKENS_PER_BLOCK)
    for rid in step.early_ids.tolist():
        book.add(rid, PROMPT_LEN, reused_len=REUSED_LEN)
    for rid in step.chunk_ids.tolist():
        book.add(rid, PROMPT_LEN)
    for starts, ends in _earlier_chunks(step):
        book.plan_chunks(step.chunk_ids, starts, ends)
    return book


def ref_book(step: Step) -> ref.RefBook:
    """The same book in the pure-Python reference."""
    book = ref.RefBook(TOKENS_PER_BLOCK)
    early, chunk, _, _ = step.as_lists()
    for rid in early:
        book.add(rid, PROMPT_LEN, reused_len=REUSED_LEN)
    for rid in chunk:
        book.add(rid, PROMPT_LEN)
    for starts, ends in _earlier_chunks(step):
        book.plan_chunks(chunk, starts.tolist(), ends.tolist())
    return book


def rust_plan_step(book: kvferry.TransferBook, step: Step) -> tuple[Any, Any]:
    """The timed planning of one step: early slices, then the finished chunks."""
    early = book.plan_early(step.early_ids)
    chunks = book.plan_chunks(step.chunk_ids, step.chunk_starts, step.chunk_ends)
    return early, chunks


def ref_plan_step(book: ref.RefBook, lists: tuple[list[int], ...]) -> tuple[Any, Any]:
    early_ids, chunk_ids, starts, ends = lists
    return book.plan_early(early_ids), book.plan_chunks(chunk_ids, starts, ends)


# --- pairs and runs: 256 early slices of 937 blocks -------------------------------------


@dataclass(frozen=True)
class PairsCase:
    """An all-early plan of 256 requests and the block tables its pairs are read from."""

    ids: np.ndarray
    plan: Any  # kvferry.SlicePlan
    ref_slices: list[tuple[int, int, int, int]]

    @property
    def num_pairs(self) -> int:
        return int(self.plan.total_blocks)


def all_early_book(ids: np.ndarray) -> kvferry.TransferBook:
    book = kvferry.TransferBook(TOKENS_PER_BLOCK)
    for rid in ids.tolist():
        book.add(rid, PROMPT_LEN, reused_len=REUSED_LEN)
    return book


def all_early_ref_book(ids: list[int]) -> ref.RefBook:
    book = ref.RefBook(TOKENS_PER_BLOCK)
    for rid in ids:
        book.add(rid, PROMPT_LEN, reused_len=REUSED_LEN)
    return book


def make_pairs_case(seed: int = 0) -> PairsCase:
    ids = make_step(seed)
    all_ids = np.concatenate([ids.early_ids, ids.chunk_ids])
    plan = all_early_book(all_ids).plan_early(all_ids)
    ref_slices = all_early_ref_book(all_ids.tolist()).plan_early(all_ids.tolist())
    assert plan.total_blocks == NUM_REQUESTS * EARLY_BLOCKS == sum(e - s for _, _, s, e in ref_slices)
    return PairsCase(ids=all_ids, plan=plan, ref_slices=ref_slices)


def random_tables(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Each side's pool of 256 x 1024 blocks handed out in a random order: no two
    neighbouring logical blocks are physically adjacent (almost), so runs have length ~1."""
    rng = np.random.default_rng(seed)
    pool = NUM_REQUESTS * MAX_BLOCKS
    src = rng.permutation(pool).reshape(NUM_REQUESTS, MAX_BLOCKS).astype(np.int64)
    dst = rng.permutation(pool).reshape(NUM_REQUESTS, MAX_BLOCKS).astype(np.int64)
    return src, dst


def contiguous_tables() -> tuple[np.ndarray, np.ndarray]:
    """Each request's blocks contiguous on both sides: one run per slice."""
    pool = NUM_REQUESTS * MAX_BLOCKS
    src = np.arange(pool, dtype=np.int64).reshape(NUM_REQUESTS, MAX_BLOCKS)
    dst = (src + pool)[::-1].copy()  # other rows order, still contiguous within a row
    return src, dst
