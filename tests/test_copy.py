"""copy_blocks against an independent per-block reference, on random data with a poisoned
destination: every dtype, both block-dimension layouts, odd counts. The fused Triton kernel
runs on CPU under TRITON_INTERPRET=1 (a subprocess, since the flag is read at import) and on
the GPU in the `cuda`-marked tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import Pools
from kvferry.copy import BlockCopies, copy_blocks, copy_blocks_torch
from kvferry.errors import InvalidArgumentError
from kvferry.layout import LayoutMismatchError, PagedKV

POISON = 0x7B
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


def random_pool(
    shape: tuple[int, ...], dtype: torch.dtype, block_dim: int, layers: int = 3, device: str = "cpu", seed: int = 0
) -> PagedKV:
    return Pools(shape, layers, 16, block_dim, dtype).random_bytes(seed, device)


def poisoned(like: PagedKV, num_blocks: int) -> PagedKV:
    return Pools.like(like, num_blocks=num_blocks).filled_bytes(POISON, like.device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def assert_copied(src: PagedKV, dst: PagedKV, s: list[int], d: list[int]) -> None:
    """Every listed block equals its source byte for byte; every other block kept its poison."""
    for sl, dl in zip(src.layers, dst.layers):
        for si, di in zip(s, d):
            assert torch.equal(as_bytes(dl.select(dst.block_dim, di)), as_bytes(sl.select(src.block_dim, si)))
        for b in sorted(set(range(dst.num_blocks)) - set(d)):
            assert bool((as_bytes(dl.select(dst.block_dim, b)) == POISON).all()), f"block {b} was written"


def pick(n: int, src_blocks: int, dst_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.permutation(src_blocks)[:n].tolist(), rng.permutation(dst_blocks)[:n].tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_dim, shape", [(0, (37, 2, 4, 3, 8)), (1, (2, 37, 4, 3, 8))])
@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("fn", [copy_blocks, copy_blocks_torch], ids=["copy_blocks", "torch"])
def test_random_blocks_bit_exact(fn, dtype: torch.dtype, block_dim: int, shape: tuple[int, ...], n: int) -> None:  # type: ignore[no-untyped-def]
    src = random_pool(shape, dtype, block_dim, seed=n)
    dst = poisoned(src, 41)
    s, d = pick(n, 37, 41, seed=n)
    fn(src, dst, np.array(s), torch.tensor(d))
    assert_copied(src, dst, s, d)


@pytest.mark.parametrize("block_dim, shape", [(0, (37, 2, 4, 3, 8)), (1, (2, 37, 4, 3, 8))])
@pytest.mark.parametrize("run", ["destination", "source", "both"])
def test_a_consecutive_run_on_either_side_copies_in_one_pass_bit_exact(
    block_dim: int, shape: tuple[int, ...], run: str
) -> None:
    """A staging ring's slots are one consecutive run: gathered straight into it (destination),
    scattered straight from it (source); the other side's blocks scattered. Blocks before and
    after the run keep their poison; a run of one block and the whole pool too."""
    for n, first in ((1, 0), (9, 3), (37, 0)):
        src = random_pool(shape, torch.bfloat16, block_dim, seed=n)
        dst = poisoned(src, 41 if run != "source" else 37)
        s, d = pick(n, 37, dst.num_blocks, seed=n)
        if run in ("source", "both"):
            s = list(range(first, first + n))
        if run in ("destination", "both"):
            d = list(range(first, first + n))
        copy_blocks(src, dst, np.array(s), np.array(d))
        assert_copied(src, dst, s, d)


def test_segments_not_a_multiple_of_8_bytes_use_byte_words() -> None:
    src = random_pool((9, 3, 5), torch.uint8, 0)  # 15-byte blocks
    dst = poisoned(src, 9)
    copy_blocks(src, dst, [8, 0, 4], [0, 8, 3])
    assert_copied(src, dst, [8, 0, 4], [0, 8, 3])


def test_same_pool_moves_blocks() -> None:
    pool = random_pool((12, 2, 4, 8), torch.float32, 0)
    before = [t.clone() for t in pool.layers]
    copy_blocks(pool, pool, [0, 1], [10, 11])
    for b, t in zip(before, pool.layers):  # bytes: random bit patterns include NaNs
        assert torch.equal(as_bytes(t[10:12]), as_bytes(b[0:2])) and torch.equal(as_bytes(t[:10]), as_bytes(b[:10]))


def test_empty_copy_is_a_no_op() -> None:
    src = random_pool((5, 2, 8), torch.float16, 0)
    dst = poisoned(src, 5)
    copy_blocks(src, dst, [], [])
    assert_copied(src, dst, [], [])


@pytest.mark.parametrize(
    "s, d, error, needle",
    [
        ([0, 1], [0], InvalidArgumentError, "invalid dst_ids=<1 ids>: must be as many as src_ids (2)"),
        ([0, 37], [0, 1], InvalidArgumentError, "invalid src_ids=<block id 37>: must be in [0, 37)"),
        ([0, 1], [0, -1], InvalidArgumentError, "invalid dst_ids=<block id -1>: must be in [0, 41)"),
        ([0, 1], [5, 5], InvalidArgumentError, "invalid dst_ids=<block 5 twice>"),
        ([0.0], [1], TypeError, "src_ids must be an array castable to int64, got dtype float64"),
        ([[0]], [[1]], InvalidArgumentError, "invalid src_ids=<2-d array>"),
    ],
)
def test_bad_ids_rejected_before_any_write(s, d, error, needle: str) -> None:  # type: ignore[no-untyped-def]
    src = random_pool((37, 2, 8), torch.bfloat16, 0)
    dst = poisoned(src, 41)
    with pytest.raises(error) as exc:
        copy_blocks(src, dst, s, d)
    assert needle in str(exc.value)
    assert_copied(src, dst, [], [])


def test_layout_mismatch_rejected_before_any_write() -> None:
    src = random_pool((8, 2, 8), torch.bfloat16, 0)
    dst = poisoned(random_pool((8, 2, 8), torch.float16, 0), 8)
    with pytest.raises(LayoutMismatchError, match="dtype"):
        copy_blocks(src, dst, [0], [0])
    assert all(bool((as_bytes(t) == POISON).all()) for t in dst.layers)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_block_copies_land_each_piece_bit_exact_in_its_own_pool(device: str) -> None:
    """`BlockCopies`: pieces between different pool pairs (two scratch pools taking turns, as
    the staging pipeline uses them), planned together, issued one at a time, in any order."""
    src = random_pool((37, 2, 16, 4, 8), torch.bfloat16, 0, device=device, seed=5)
    a, b = poisoned(src, 12), poisoned(src, 12)
    pieces = [(src, a, [4, 9, 30], [0, 1, 2]), (src, b, [1, 2], [11, 3]), (src, a, [36], [7])]
    copies = BlockCopies(pieces)
    assert len(copies) == 3
    for i in (1, 0, 2):
        copies.issue(i)
    if device == "cuda":
        torch.cuda.synchronize()
    assert_copied(src, a, [4, 9, 30, 36], [0, 1, 2, 7])
    assert_copied(src, b, [1, 2], [11, 3])


def test_block_copies_validate_every_piece_before_any_moves() -> None:
    src = random_pool((8, 2, 8), torch.bfloat16, 0)
    dst = poisoned(src, 4)
    with pytest.raises(InvalidArgumentError, match="4"):
        BlockCopies([(src, dst, [0], [1]), (src, dst, [1], [4])])  # block 4 of a 4-block pool
    with pytest.raises(LayoutMismatchError, match="dtype"):
        BlockCopies([(src, dst, [0], [1]), (src, poisoned(random_pool((8, 2, 8), torch.float16, 0), 4), [1], [0])])
    assert all(bool((as_bytes(t) == POISON).all()) for t in dst.layers)


KERNEL_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from kvferry import _triton_copy
    from test_copy import random_pool, poisoned, pick, assert_copied
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        for block_dim, shape in ((0, (37, 2, 4, 3, 8)), (1, (2, 37, 4, 3, 8))):
            for n in (1, 7):
                for config in (
                    _triton_copy.LaunchConfig(chunk_words=16, block_words=8, num_warps=4, cache_hints=True),
                    _triton_copy.LaunchConfig(chunk_words=64, block_words=64, num_warps=4, cache_hints=False),
                ):
                    src = random_pool(shape, dtype, block_dim, seed=n)
                    dst = poisoned(src, 41)
                    s, d = pick(n, 37, 41, seed=n)
                    assert _triton_copy.supports(src, dst)
                    ids = torch.from_numpy(np.stack([np.array(s), np.array(d)]))
                    _triton_copy.copy_blocks(src, dst, ids, config)
                    assert_copied(src, dst, s, d)
    # The size-based choice of launch shape runs too, and warming up leaves a pool unchanged.
    src = random_pool((9, 2, 4, 8), torch.float16, 0)
    before = [t.clone() for t in src.layers]
    _triton_copy.warm_up(src)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, src.layers))
    dst = poisoned(src, 9)
    _triton_copy.copy_blocks(src, dst, torch.tensor([[0, 8], [8, 0]]))
    assert_copied(src, dst, [0, 8], [8, 0])
    # kvferry.copy.BlockCopies' launches: each copy's (2, n) ids a slice of one flat tensor.
    flat = torch.tensor([3, 5, 0, 1, 7, 2, 4, 4, 6, 8])  # copy 0: 3->0, 5->1; copy 1: 7->4, 2->6, 4->8
    dst = poisoned(src, 9)
    _triton_copy.copy_blocks(src, dst, flat[:4])
    _triton_copy.copy_blocks(src, dst, flat[4:10])
    assert_copied(src, dst, [3, 5, 7, 2, 4], [0, 1, 4, 6, 8])
    assert _triton_copy.pick_config(1 << 30) == _triton_copy.LARGE
    assert _triton_copy.pick_config(34 << 20) == _triton_copy.SMALL
    print("kernel ok")
    """
)


def test_fused_kernel_under_the_triton_interpreter() -> None:
    """The kernel's indexing (layer offsets, segments, chunk tails) checked on CPU."""
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernel ok" in proc.stdout


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_dim, shape", [(0, (37, 2, 16, 4, 64)), (1, (2, 37, 16, 4, 64))])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_cuda_fused_copy_bit_exact(dtype: torch.dtype, block_dim: int, shape: tuple[int, ...], n: int) -> None:
    src = random_pool(shape, dtype, block_dim, layers=5, device="cuda", seed=n)
    dst = poisoned(src, 41)
    s, d = pick(n, 37, 41, seed=n)
    copy_blocks(src, dst, s, d)
    torch.cuda.synchronize()
    assert_copied(src, dst, s, d)


@pytest.mark.cuda
@pytest.mark.parametrize("where", [("cpu", "cuda"), ("cuda", "cpu")])
def test_cuda_host_device_pools(where: tuple[str, str]) -> None:
    src = random_pool((9, 2, 16, 64), torch.bfloat16, 0, device=where[0])
    dst = poisoned(random_pool((11, 2, 16, 64), torch.bfloat16, 0, device=where[1]), 11)
    copy_blocks(src, dst, [8, 0, 3], [1, 10, 4])
    torch.cuda.synchronize()
    assert_copied(src, dst, [8, 0, 3], [1, 10, 4])


@pytest.mark.cuda
def test_cuda_id_ring_reuse_across_paths() -> None:
    """Many copies in a row cycle every staging slot (ids read from pinned host memory for
    small batches, through the slot's device buffer for larger ones, freshly pinned past the
    ring's size), on two streams, without one copy's ids leaking into another's."""
    from kvferry import _triton_copy

    blocks = _triton_copy.RING_PAIRS + 300
    src = random_pool((blocks, 2, 64), torch.float16, 0, layers=2, device="cuda", seed=3)
    sizes = [
        1,
        _triton_copy.HOST_READ_MAX_PAIRS,
        _triton_copy.HOST_READ_MAX_PAIRS + 1,
        700,
        _triton_copy.RING_PAIRS + 1,
    ]
    side = torch.cuda.Stream()
    for round_ in range(3 * _triton_copy.RING_SLOTS // len(sizes) + 1):
        for k, n in enumerate(sizes):
            dst = poisoned(src, blocks)
            s, d = pick(n, blocks, blocks, seed=100 * round_ + k)
            torch.cuda.synchronize()  # the poison is written on the default stream
            with torch.cuda.stream(side if k % 2 else torch.cuda.current_stream()):
                copy_blocks(src, dst, s, d)
            torch.cuda.synchronize()
            for sl, dl in zip(src.layers, dst.layers):
                sl, dl = sl.view(torch.int16), dl.view(torch.int16)  # random bits hold NaNs
                assert torch.equal(dl[d], sl[s])
                untouched = torch.ones(blocks, dtype=torch.bool, device="cuda")
                untouched[d] = False
                assert bool((dl[untouched].view(torch.uint8) == POISON).all())


@pytest.mark.cuda
def test_cuda_small_copies_through_captured_graphs() -> None:
    """Small batches replay a captured launch padded to its size bucket: every size from 1 to
    the largest bucket copies exactly its blocks; graphs die with their pools."""
    import gc

    from kvferry import _triton_copy

    blocks = 300
    src = random_pool((blocks, 2, 64), torch.bfloat16, 0, layers=3, device="cuda", seed=5)
    _triton_copy.warm_up(src)  # graphs need the kernel compiled first
    dst = poisoned(src, blocks)
    torch.cuda.synchronize()
    for n in range(1, _triton_copy.GRAPH_BUCKETS[-1] + 1):
        s, d = pick(n, blocks, blocks, seed=n)
        for layer in dst.layers:
            layer.view(torch.uint8).fill_(POISON)
        copy_blocks(src, dst, s, d)
        torch.cuda.synchronize()
        for sl, dl in zip(src.layers, dst.layers):
            sl, dl = sl.view(torch.int16), dl.view(torch.int16)
            assert torch.equal(dl[d], sl[s]), n
            untouched = torch.ones(blocks, dtype=torch.bool, device="cuda")
            untouched[d] = False
            assert bool((dl[untouched].view(torch.uint8) == POISON).all()), n
    assert (id(src), id(dst)) in _triton_copy._graphs
    key = (id(src), id(dst))
    del dst
    gc.collect()
    assert key not in _triton_copy._graphs


@pytest.mark.cuda
@pytest.mark.parametrize("n", [8, 200])
def test_cuda_copies_queued_behind_a_busy_stream_never_hold_the_host(n: int) -> None:
    """With the stream held by a long kernel, more copies of one pool pair than the id ring
    has slots (graph replays for 8 pairs, ring slots for 200) are all issued without the host
    waiting for the stream (it used to wait for the pair's previous replay, or a slot's last
    launch: for the stream to drain); once it ran, each copy landed its own blocks (disjoint
    destinations) bit exact and nothing else was written."""
    from kvferry import _triton_copy

    copies = 2 * _triton_copy.RING_SLOTS + 2
    blocks = copies * n + 50
    src = random_pool((blocks, 2, 64), torch.bfloat16, 0, layers=2, device="cuda", seed=7)
    dst = poisoned(src, blocks)
    _triton_copy.warm_up(src)
    rng = np.random.default_rng(n)
    order = rng.permutation(blocks)
    plans = [(rng.permutation(blocks)[:n].tolist(), order[i * n : (i + 1) * n].tolist()) for i in range(copies)]
    copy_blocks(src, dst, *plans[0])  # the pair's graph exists before the test
    for layer in dst.layers:
        layer.view(torch.uint8).fill_(POISON)
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(4_000_000_000)  # about 2 s on an H200: the stream is held meanwhile
    busy.record()
    for s, d in plans:
        copy_blocks(src, dst, s, d)
    assert not busy.query(), "the host waited for the stream while issuing the copies"
    torch.cuda.synchronize()
    assert_copied(src, dst, [b for s, _ in plans for b in s], [b for _, d in plans for b in d])
