"""PagedKV: validation, geometry, and the sender/receiver compatibility check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import Pools
from kvferry.copy import checked_pairs
from kvferry.errors import InvalidArgumentError, KvFerryError
from kvferry.layout import LayoutMismatchError, PagedKV


def pool(
    layers: int = 2,
    shape: tuple[int, ...] = (10, 2, 4, 3, 8),
    dtype: torch.dtype = torch.bfloat16,
    tpb: int = 4,
    block_dim: int = 0,
) -> PagedKV:
    return Pools(shape, layers, tpb, block_dim, dtype).zeros()


def test_geometry_block_dim_0() -> None:
    p = pool()
    assert (p.num_layers, p.num_blocks, p.segments) == (2, 10, 1)
    assert p.segment_bytes == 2 * 4 * 3 * 8 * 2
    assert p.block_bytes == p.segment_bytes
    assert p.dtype == torch.bfloat16 and p.device.type == "cpu"


def test_geometry_block_dim_1_has_k_and_v_segments() -> None:
    p = pool(shape=(2, 10, 4, 3, 8), block_dim=1)
    assert (p.num_blocks, p.segments, p.segment_bytes) == (10, 2, 4 * 3 * 8 * 2)
    assert p.block_bytes == 2 * p.segment_bytes


def test_stacked_splits_layers_on_dim_0() -> None:
    t = torch.zeros(3, 2, 10, 4, 8)
    p = PagedKV.stacked(t, tokens_per_block=4, block_dim=2)
    assert (p.num_layers, p.num_blocks, p.segments, p.block_dim) == (3, 10, 2, 1)
    assert p.layers[1].data_ptr() == t[1].data_ptr()  # views, not copies
    with pytest.raises(InvalidArgumentError, match="block_dim=0"):
        PagedKV.stacked(t, tokens_per_block=4, block_dim=0)


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: PagedKV((), 4), "layers=()"),
        (lambda: PagedKV(torch.zeros(2, 3), 4), "layers=Tensor"),  # type: ignore[arg-type]
        (lambda: PagedKV((torch.zeros(4, 2),), 0), "tokens_per_block=0"),
        (lambda: PagedKV((torch.zeros(4, 2),), 4, block_dim=2), "block_dim=2"),
        (lambda: PagedKV((torch.zeros(4, 2), torch.zeros(5, 2)), 4), "layers[1].shape=(5, 2)"),
        (
            lambda: PagedKV((torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.float16)), 4),
            "layers[1].dtype=torch.float16",
        ),
        (lambda: PagedKV((torch.zeros(4, 2), torch.zeros(2, 4).t()), 4), "layers[1]: must be contiguous"),
    ],
)
def test_invalid_pools_name_the_argument(build, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError) as exc:
        build()
    assert needle in str(exc.value)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, KvFerryError)


@pytest.mark.parametrize(
    "other, field",
    [
        (pool(layers=3), "num_layers"),
        (pool(tpb=8), "tokens_per_block"),
        (pool(dtype=torch.float16), "dtype"),
        (pool(shape=(10, 2, 4, 3, 4)), "segment_bytes"),
        (pool(shape=(2, 10, 4, 3, 4), block_dim=1), "segments"),
    ],
)
def test_compatibility_names_the_first_mismatch(other: PagedKV, field: str) -> None:
    with pytest.raises(LayoutMismatchError, match=f"layout mismatch: {field} is"):
        pool().check_compatible(other)


def test_compatible_pools_may_differ_in_block_count() -> None:
    pool().check_compatible(pool(shape=(99, 2, 4, 3, 8)))


def test_block_ids_are_checked_against_each_pool() -> None:
    p = pool()
    assert checked_pairs(p, p, [0, 9, 3], [1, 2, 4])[0].dtype == np.int64
    assert checked_pairs(p, p, torch.tensor([1, 2], dtype=torch.int32), [3, 4])[0].tolist() == [1, 2]
    assert checked_pairs(p, p, [], [])[0].size == 0
    for bad, error, needle in (
        ([10], InvalidArgumentError, "src_ids=<block id 10>: must be in [0, 10)"),
        ([-1], InvalidArgumentError, "src_ids=<block id -1>"),
        ([1.5], TypeError, "src_ids must be an array castable to int64, got dtype float64"),
        ([[1]], InvalidArgumentError, "src_ids=<2-d array>"),
    ):
        with pytest.raises(error) as exc:
            checked_pairs(p, p, bad, [0])
        assert needle in str(exc.value)


def _layer_at(offset: int, blocks: int, segment: int) -> torch.Tensor:
    """A ``(blocks, segment)`` byte layer whose first byte is ``offset`` bytes past a page."""
    raw = torch.empty(blocks * segment + 2 * 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096 + offset
    return raw[start : start + blocks * segment].view(blocks, segment)


@pytest.mark.parametrize(
    ("offset", "segment", "want"),
    [(0, 64, 64), (4, 64, 4), (8, 64, 8), (0, 48, 16), (0, 6, 2)],
    ids=["aligned", "base-off-by-4", "base-off-by-8", "48-byte-segments", "6-byte-segments"],
)
def test_alignment_is_the_widest_word_every_address_and_stride_allows(offset: int, segment: int, want: int) -> None:
    """A pool's alignment is the widest power of two dividing every layer's base address,
    its segment bytes and its strides (the copy kernel's fast path asks it on each launch)."""
    pool = PagedKV((_layer_at(0, 4, segment), _layer_at(offset, 4, segment)), tokens_per_block=1)
    assert pool.alignment == want
