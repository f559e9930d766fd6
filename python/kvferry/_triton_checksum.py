"""The per-block checksum of a CUDA pool (kvferry.checksum): one Triton launch over the
blocks of a write.

```
grid:     (blocks, layers, segments * chunks_per_segment)
program:  sums CHUNK words of one segment of one block of one layer, mixed with their
          positions, and adds the sum into the block's total (an atomic add: a sum does not
          care in which order the programs land)
address:  base + layer_offset[layer] + segment * segment_stride + block_id * block_stride + w
```
Layers are reached as the copy kernel reaches them (`PagedKV.pointer_table`). Imported only
when a CUDA pool is summed.
"""

from __future__ import annotations

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import torch
import triton
import triton.language as tl

from kvferry.checksum import KEY, M1, M2, WORD_BYTES, device_ids
from kvferry.layout import PagedKV

# Words one program sums, and the vector it sums them in: a 32 KiB segment (Llama-8B's K or
# V of one block of one layer) is one program.
CHUNK_WORDS = 4096
BLOCK_WORDS = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["first_layer", "seg_stride", "block_stride"])
def _checksum_kernel(
    base,
    layer_off,
    ids,
    out,
    first_layer,
    seg_stride,
    block_stride,
    key,
    m1,
    m2,
    SEGMENTS: tl.constexpr,
    SEG_WORDS: tl.constexpr,
    CHUNKS_PER_SEG: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    layer = tl.program_id(1)
    seg = (tl.program_id(2) // CHUNKS_PER_SEG).to(tl.int64)
    chunk = tl.program_id(2) % CHUNKS_PER_SEG
    block = tl.load(ids + i)
    row = tl.load(layer_off + layer) + seg * seg_stride + block * block_stride
    words = base.to(tl.pointer_type(tl.uint64))
    first = ((first_layer + layer).to(tl.int64) * SEGMENTS + seg) * SEG_WORDS
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for j in tl.static_range(0, CHUNK, BLOCK):
        offs = chunk * CHUNK + j + tl.arange(0, BLOCK)
        mask = offs < SEG_WORDS
        x = tl.load(words + row + offs, mask=mask, other=0)
        p = (first + offs).to(tl.uint64)
        z = (x ^ (p * key)) * m1
        z = (z ^ (z >> 32)) * m2
        acc += tl.where(mask, z, tl.zeros_like(z))
    tl.atomic_add(out + i, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def checksums(pool: PagedKV, ids: np.ndarray, layers: tuple[int, int]) -> torch.Tensor:
    """Queues the launch on the current stream; returns the sums as an int64 tensor on the
    pool's device (the bits of the uint64 sums)."""
    lo, hi = layers
    view = pool.layer_slice(lo, hi)
    n = len(ids)
    out = torch.zeros(n, dtype=torch.int64, device=pool.device)
    if n == 0:
        return out
    index = device_ids(ids, pool.device)
    seg_words = pool.segment_bytes // WORD_BYTES
    chunk = min(CHUNK_WORDS, triton.next_power_of_2(seg_words))
    block = min(BLOCK_WORDS, chunk)
    chunks_per_seg = triton.cdiv(seg_words, chunk)
    base, offsets = view.pointer_table
    _checksum_kernel[(n, hi - lo, pool.segments * chunks_per_seg)](
        base,
        offsets,
        index,
        out,
        lo,
        pool.segment_stride // WORD_BYTES,
        pool.block_stride // WORD_BYTES,
        KEY,
        M1,
        M2,
        SEGMENTS=pool.segments,
        SEG_WORDS=seg_words,
        CHUNKS_PER_SEG=chunks_per_seg,
        CHUNK=chunk,
        BLOCK=block,
        num_warps=NUM_WARPS,
    )
    return out
