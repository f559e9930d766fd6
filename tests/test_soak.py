"""The soak driver (kvferry.refengine.soak), short: a few hundred requests through the hook
and the reference engine leave no block leaked, doubly owned or delivered twice, and every
cancellation stage and both timeouts were exercised: a sender timeout cancels from the
context side, a receiver timeout from the generation side (its release asks the sender to
cancel and waits for the fence). benches/python/soak.py runs 10,000."""

from __future__ import annotations

from collections import Counter
from typing import Iterator

import pytest
import torch
from kvferry.refengine.cache import BlockAllocator
from kvferry.refengine.soak import BlockAudit, CancelAt, Soak, SoakConfig, SoakReport, audit_allocator


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # The soak's model is tiny: a second torch thread only adds synchronisation.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(config: SoakConfig) -> SoakReport:
    soak = Soak(config)
    try:
        return soak.run()
    finally:
        soak.close()


def test_short_soak_leaks_nothing_and_exercises_cancellations_and_timeouts() -> None:
    report = _run(SoakConfig(requests=400, seed=1, rss_every=100))
    assert report.failures() == []
    assert report.requests == 400 and report.completed + sum(report.cancelled.values()) == 400
    assert (report.leaked_blocks, report.double_owned_blocks, report.duplicate_blocks) == (0, 0, 0)
    assert report.kv_checked == report.completed > 0 and report.kv_mismatch_blocks == 0
    for stage in CancelAt:
        assert report.cancelled[stage.value] > 0, stage
    assert report.cancelled_with_early > 0
    assert report.sender_timeouts > 0 and report.cancelled["sender timeout"] > 0
    assert report.receiver_timeouts > 0 and report.cancelled["receiver timeout"] > 0
    # Most receiver timeouts reach the sender before its last notice (the rest completed
    # meanwhile); each of those was revoked at the sender and fenced.
    assert 0 < report.receiver_cancels <= report.receiver_timeouts
    assert report.early_slices > 0 and report.chunked > 0 and report.unaligned_reuse > 0
    assert len(report.memory) == 4


def test_short_soak_over_shared_memory() -> None:
    """Notices, fences and the receiver's cancellations cross a socket; copies land in a
    shared segment. No notice is ever refused (a late one cannot outrun its request's fence;
    one that arrives after the receiver gave up is discarded, `SoakReport.late_notices`)."""
    report = _run(SoakConfig(requests=150, seed=2, transport="shm", rss_every=50))
    assert report.failures() == []
    assert report.kv_checked > 0 and sum(report.cancelled.values()) > 0 and report.receiver_cancels > 0


@pytest.mark.parametrize("transport", ["in-process", "shm"])
def test_every_counted_event_is_forced_not_left_to_timing(transport: str) -> None:
    """With no random cancellation and no random slow-lane request, every event the soak's
    report counts still happens, once each (`FORCED_ROLES`): each cancellation stage (one with
    an early slice out), a sender timeout on a held write and a receiver timeout that the
    sender hears of before its last notice. None depends on how fast the machine is."""
    report = _run(SoakConfig(requests=30, seed=5, p_slow=0.0, p_cancel=0.0, transport=transport, rss_every=10))
    assert report.failures() == []
    assert dict(report.cancelled) == {stage.value: 1 for stage in CancelAt} | {
        "sender timeout": 1,
        "receiver timeout": 1,
    }
    assert report.cancelled_with_early >= 1
    assert (report.receiver_timeouts, report.receiver_cancels) == (1, 1)
    # The held request's earlier writes may also outlive the timeout on a loaded machine:
    # a timeout of its own on top of the forced one, never none.
    assert report.sender_timeouts >= 1
    assert report.completed == 30 - 6 and report.kv_checked == report.completed


def test_soak_reports_a_block_the_engine_forgets_to_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit is not vacuous: a generation worker that keeps one block of every 20th
    request it releases shows up as leaked blocks."""
    soak = Soak(SoakConfig(requests=60, seed=3, p_slow=0.0))
    release = soak.gen.alloc.release
    calls = 0

    def leaky(blocks: list[int], cached: list[bool]) -> None:
        nonlocal calls
        calls += 1
        if calls % 20 == 0 and len(blocks) > 1:
            blocks, cached = blocks[:-1], cached[:-1]
        release(blocks, cached)

    monkeypatch.setattr(soak.gen.alloc, "release", leaky)
    try:
        report = soak.run()
    finally:
        soak.close()
    assert report.leaked_blocks > 0
    assert any("leaked_blocks" in f for f in report.failures())


def test_audit_tells_leaked_from_doubly_owned_blocks() -> None:
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    assert audit_allocator(alloc, Counter({a: 1, b: 1}), lambda block: False) == BlockAudit(0, 0)
    # b still referenced, but no live request holds it.
    assert audit_allocator(alloc, Counter({a: 1}), lambda block: False) == BlockAudit(leaked=1, double_owned=0)
    # A live request holds b after it was released: the allocator may hand it out again.
    alloc.release([b], [False])
    assert audit_allocator(alloc, Counter({a: 1, b: 1}), lambda block: False).double_owned == 1
    # Two live requests share a block only through the prefix cache.
    assert audit_allocator(alloc, Counter({a: 2}), lambda block: False).double_owned == 1
    # An idle (kept for reuse) block that the cache no longer maps can never be found again.
    alloc.release([a], [True])
    assert audit_allocator(alloc, Counter(), lambda block: False).leaked == 1
    assert audit_allocator(alloc, Counter(), lambda block: block == a) == BlockAudit(0, 0)
