"""A hypothesis state machine over the batch API: requests are added, sent early, chunked,
cancelled, completed and removed in random orders, and the Rust book must agree with the
pure-Python reference at every step (slices, claims, completion, errors)."""

from __future__ import annotations

import numpy as np
import reference_planner as ref
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvferry import DuplicateTransferError, InvalidArgumentError, TransferBook, UnknownRequestError

TPB = 4


def _as_tuples(plan) -> list[tuple[int, int, int, int]]:  # type: ignore[no-untyped-def]
    """(batch index, request id, start, end) per slice: the reference planner's shape."""
    return [(i, r, b.start, b.end) for (r, b, _), i in zip(plan.slices(), plan.request_index.tolist())]


class BookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = TransferBook(TPB)
        self.ref = ref.RefBook(TPB)
        self.pos: dict[int, int] = {}  # next chunk start per live request
        self.prompt: dict[int, int] = {}
        self.next_id = 0

    @rule(
        prompt=st.integers(1, 80),
        reuse=st.floats(0, 1),
        window=st.one_of(st.none(), st.integers(1, 90)),
        context_only=st.booleans(),
    )
    def add(self, prompt: int, reuse: float, window: int | None, context_only: bool) -> None:
        rid = self.next_id
        self.next_id += 1
        reused = min(int(reuse * prompt), prompt - 1)
        self.book.add(rid, prompt, reused_len=reused, window=window, context_only=context_only)
        self.ref.add(rid, prompt, reused_len=reused, window=window, context_only=context_only)
        self.pos[rid], self.prompt[rid] = reused, prompt

    def _pick(self, data: st.DataObject) -> list[int]:
        live = sorted(self.pos)
        return data.draw(st.lists(st.sampled_from(live), unique=True, max_size=len(live))) if live else []

    @rule(data=st.data())
    def plan_early(self, data: st.DataObject) -> None:
        ids = self._pick(data)
        got = self.book.plan_early(np.array(ids, dtype=np.int64))
        want = self.ref.plan_early(ids)
        assert _as_tuples(got) == want

    @rule(data=st.data(), size=st.integers(1, 30))
    def plan_chunks(self, data: st.DataObject, size: int) -> None:
        ids = [r for r in self._pick(data) if self.pos[r] < self.prompt[r]]
        starts = [self.pos[r] for r in ids]
        ends = [min(self.pos[r] + size, self.prompt[r]) for r in ids]
        got = self.book.plan_chunks(
            np.array(ids, dtype=np.int64), np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
        )
        want = self.ref.plan_chunks(ids, starts, ends)
        assert _as_tuples(got) == want
        for r, e in zip(ids, ends):
            self.pos[r] = e

    @precondition(lambda self: any(self.pos[r] > self.book_reused(r) for r in self.pos))
    @rule(data=st.data())
    def resend_is_refused_and_changes_nothing(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([r for r in sorted(self.pos) if self.pos[r] > self.book_reused(r)]))
        before = self.book.claimed_blocks(rid)
        start = self.book_reused(rid)
        try:
            self.book.plan_chunks(np.array([rid]), np.array([start]), np.array([self.pos[rid]]))
        except DuplicateTransferError:
            pass
        else:  # only a chunk that sends nothing again may pass (a window, or no finished block)
            assert self.book.claimed_blocks(rid) == before
        assert self.book.claimed_blocks(rid) == before

    def book_reused(self, rid: int) -> int:
        return self.ref.ledgers[rid].reused_len

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ids = self._pick(data)
        for rid in ids[:1]:
            self.book.cancel(rid)
            self.ref.cancelled.add(rid)
            assert self.book.is_cancelled(rid)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        ids = self._pick(data)
        for rid in ids[:1]:
            ledger = self.book.remove(rid)
            want = self.ref.ledgers.pop(rid)
            assert ledger.is_complete == want.is_complete()
            assert ledger.claimed_blocks == len(want.claimed)
            del self.pos[rid], self.prompt[rid]
            try:
                self.book.remove(rid)
            except UnknownRequestError:
                pass
            else:
                raise AssertionError("a removed request was removed twice")

    @rule()
    def bad_batches_change_nothing(self) -> None:
        snapshot = {r: self.book.claimed_blocks(r) for r in self.pos}
        for call in (
            lambda: self.book.plan_early(np.array([self.next_id + 7])),
            lambda: self.book.plan_chunks(np.array([0, 0]), np.array([0]), np.array([1])),
        ):
            try:
                call()
            except (UnknownRequestError, InvalidArgumentError):
                pass
            else:
                raise AssertionError("a bad batch was accepted")
        assert snapshot == {r: self.book.claimed_blocks(r) for r in self.pos}

    @invariant()
    def agrees_with_the_reference(self) -> None:
        assert len(self.book) == len(self.pos)
        for rid in self.pos:
            want = self.ref.ledgers[rid]
            assert self.book.claimed_blocks(rid) == len(want.claimed)
            assert self.book.is_complete(rid) == want.is_complete()
            assert self.book.prefix_sent(rid) == want.prefix_sent
            assert [(r.start, r.end) for r in self.book.missing(rid)] == want.missing()
            if self.pos[rid] == self.prompt[rid]:
                assert self.book.is_complete(rid)  # every chunk done: every needed block sent once


TestBookMachine = BookMachine.TestCase
TestBookMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
