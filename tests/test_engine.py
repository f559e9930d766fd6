"""`ThreadCopyEngine`'s emulated link: the bytes of `copy_blocks`, paced to the link rate,
moved in slices by numpy on the copy thread alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvferry.copy import copy_blocks
from kvferry.engine import LINK_SLICE_BYTES, ThreadCopyEngine, _paced_copy
from kvferry.errors import InvalidArgumentError
from kvferry.layout import PagedKV
from test_copy import as_bytes, poisoned, random_pool

LAYOUTS = [
    ((40, 2, 16, 4, 8), torch.bfloat16, 0),  # (blocks, K/V, tokens, heads, dims)
    ((2, 40, 16, 4, 8), torch.float32, 1),  # K and V outermost: two segments per block
    ((40, 16, 3, 5), torch.uint8, 0),  # segments of 240 bytes: copied as bytes, not words
]


@pytest.mark.parametrize("shape, dtype, block_dim", LAYOUTS, ids=["bf16", "kv-outer", "odd-bytes"])
def test_link_copy_moves_exactly_the_bytes_of_copy_blocks(
    shape: tuple[int, ...], dtype: torch.dtype, block_dim: int
) -> None:
    src = random_pool(shape, dtype, block_dim)
    want, got = poisoned(src, 40), poisoned(src, 40)
    rng = np.random.default_rng(0)
    src_ids = rng.permutation(40)[:25].astype(np.int64)
    dst_ids = rng.permutation(40)[:25].astype(np.int64)
    copy_blocks(src, want, src_ids, dst_ids)
    engine = ThreadCopyEngine(link_gbps=50.0)
    try:
        job = engine.submit(src, got, src_ids, dst_ids)
        assert job.wait(60) and job.error() is None
    finally:
        engine.close()
    for a, b in zip(got.layers, want.layers):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_link_copy_spans_at_least_its_bytes_over_the_rate() -> None:
    """Pacing sleeps until each slice's bytes crossed at the rate, so a job's interval is never
    shorter than its bytes over the rate (a lower bound only: the machine may be slower)."""
    src = random_pool((256, 2, 16, 8, 16), torch.float32, 0, layers=4)
    dst = poisoned(src, 256)
    ids = np.arange(256, dtype=np.int64)
    nbytes = 256 * src.block_bytes * src.num_layers
    assert nbytes >= 4 * LINK_SLICE_BYTES  # several slices
    gbps = nbytes / 0.05 / 1e9  # 50 ms of link
    engine = ThreadCopyEngine(link_gbps=gbps)
    try:
        job = engine.submit(src, dst, ids, ids)
        assert job.wait(60) and job.error() is None
        start, end = job.interval()  # type: ignore[misc]
    finally:
        engine.close()
    assert end - start >= nbytes / (gbps * 1e9)


def test_link_copy_of_bad_ids_fails_the_job_not_the_pool() -> None:
    src = random_pool((8, 2, 16, 4, 8), torch.float32, 0)
    dst = poisoned(src, 8)
    engine = ThreadCopyEngine(link_gbps=1.0)
    try:
        job = engine.submit(src, dst, np.array([0, 9], dtype=np.int64), np.array([0, 1], dtype=np.int64))
        assert job.wait(60)
        assert isinstance(job.error(), InvalidArgumentError) and "9" in str(job.error())
    finally:
        engine.close()
    assert bool((dst.layers[0].view(torch.uint8) == 0x7B).all())  # nothing was written


def test_link_copy_uses_no_torch_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated link's copy is numpy's: a torch index op on the copy thread would start a
    second OpenMP team that fights the forward's for the cores (the bug this replaced)."""
    src = random_pool((8, 2, 16, 4, 8), torch.float32, 0)
    dst = poisoned(src, 8)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch index op on the emulated link")

    monkeypatch.setattr(torch.Tensor, "index_copy_", refuse)
    monkeypatch.setattr(torch, "index_select", refuse)
    _paced_copy(src, dst, np.arange(8, dtype=np.int64), np.arange(8, dtype=np.int64), 100.0)
    assert torch.equal(dst.layers[2].view(torch.uint8), src.layers[2].view(torch.uint8))


def test_link_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="invalid link_gbps=0"):
        ThreadCopyEngine(link_gbps=0)


def test_raw_engine_still_copies_through_copy_blocks() -> None:
    src = random_pool((8, 2, 16, 4, 8), torch.float32, 0)
    dst: PagedKV = poisoned(src, 8)
    engine = ThreadCopyEngine()
    try:
        job = engine.submit(src, dst, np.array([3, 1], dtype=np.int64), np.array([0, 7], dtype=np.int64))
        assert job.wait(60) and job.error() is None
    finally:
        engine.close()
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731  (random bytes hold NaNs)
    assert same(dst.layers[1][7], src.layers[1][1]) and same(dst.layers[1][0], src.layers[1][3])


@pytest.mark.cuda
def test_cuda_a_short_copy_that_can_start_at_once_is_waited_by_spinning_one_behind_a_forward_sleeps() -> None:
    """The copy engine's waiter spins on a small copy whose stream and earlier copies have
    ended (its wait is its own copy's), and sleeps on one queued behind work still running on
    the submitting stream (a forward: spinning would hold a core all the while) or larger than
    `SPIN_WAIT_BYTES`. Each lands bit exact and tells its completion either way."""
    import threading

    from kvferry.engine import SPIN_WAIT_BYTES, CudaCopyEngine

    src = random_pool((40, 2, 16, 4, 8), torch.bfloat16, 0, device="cuda")
    dst = poisoned(src, 40)
    engine = CudaCopyEngine(src.device, warm=src)
    try:
        ids = np.arange(4)
        torch.cuda.synchronize()
        quick = engine.submit(src, dst, ids, ids)
        told = threading.Event()
        assert quick.when_done(told.set)
        assert told.wait(30)
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the current stream
        behind = engine.submit(src, dst, ids + 4, ids + 4)
        assert (quick.spins, behind.spins) == (True, False)  # type: ignore[attr-defined]
        assert behind.wait(60)
        torch.cuda.synchronize()
        big = engine.submit_call(lambda: copy_blocks(src, dst, ids + 8, ids + 8), nbytes=SPIN_WAIT_BYTES + 1)
        assert not big.spins  # type: ignore[attr-defined]
        assert big.wait(60)
        for s_layer, d_layer in zip(src.layers, dst.layers):  # as bytes: random bits hold NaNs
            assert torch.equal(as_bytes(d_layer[:12]), as_bytes(s_layer[:12]))
    finally:
        engine.close()
