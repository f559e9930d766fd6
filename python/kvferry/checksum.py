"""Per-block checksums: end-to-end integrity of the bytes a write puts into a block.

The sender sums each block it writes over its source, once the block is final (on the copy
engine, after the write's copy); the notice carries one 64-bit checksum per block; the
receiver sums the destination block once the write landed, before the block counts as
arrived. A block whose sums differ fails its request, naming the block (`ChecksumError`).

```
block (its written layers [lo, hi)):  layer l, segment s, 8-byte word w, little-endian
position:   p = (l * segments + s) * segment_words + w      (l counts from layer 0)
checksum:   sum of mix(word, p) mod 2**64,  mix(x, p) = ((x ^ p*KEY) * M1 ^ >>32) * M2
```
The function is the Rust core's (rust/src/checksum.rs documents why it finds any one
corrupted word); a CPU pool is summed there, in place and without the GIL; a CUDA pool by
one Triton launch over the blocks of a write (kvferry._triton_checksum), or by the torch
formulation below where Triton cannot run. Both sides sum the same bytes at the same
positions whatever their strides: a pool's block, read layer by layer and segment by
segment, is what `PagedKV.geometry` says it is, and pools exchange blocks only when their
geometries match (head slices included: each side sums its slice's own segments).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import torch

from kvferry import _core
from kvferry.engine import Pending
from kvferry.errors import ChecksumError, InvalidArgumentError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice, stamp
from kvferry.tiers import Source, source_parts

__all__ = [
    "CHECKSUM_DEFAULT",
    "ChecksumError",
    "WriteChecksums",
    "block_checksums",
    "checksum_option",
    "device_checksums",
    "reference_checksums",
    "supports",
]

# Whether senders and receivers sum blocks when not told, by the pool's device type: on where
# they cost under 2% of the transfer they guard, which they do nowhere measured
# (docs/benchmarks.md, "Checksums"). On CPU they cost the order of the copy itself. On CUDA (one
# H100, Llama-8B geometry) both sides' sums came to 49-68% of a cuda-ipc transfer and 2.4-3.5%
# of a staging one, and turning them on made those transfers 100-207% and 7-17% slower:
# off, `checksum=True` asks for them. A device type not named: off.
CHECKSUM_DEFAULT: dict[str, bool] = {"cpu": False, "cuda": False}

WORD_BYTES = 8
KEY = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (the same bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def supports(pool: PagedKV) -> bool:
    """Whether ``pool``'s blocks can be summed: segments of whole 8-byte words, at
    word-aligned strides and layer addresses (a CPU pool needs only the first)."""
    if pool.segment_bytes % WORD_BYTES:
        return False
    if pool.device.type == "cpu":
        return True
    return all(n % WORD_BYTES == 0 for n in (pool.segment_stride, pool.block_stride)) and all(
        t.data_ptr() % WORD_BYTES == 0 for t in pool.layers
    )


def checksum_option(value: Optional[bool], pool: PagedKV, name: str = "checksum") -> bool:
    """``value`` (a sender's or receiver's ``checksum`` option) resolved for ``pool``: None
    follows `CHECKSUM_DEFAULT` for the pool's device, where the pool `supports` it; True on a pool that does not is
    refused, naming the pool's segment size."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {type(value).__name__} {value!r}")
    if value is None:
        return CHECKSUM_DEFAULT.get(pool.device.type, False) and supports(pool)
    if value and not supports(pool):
        raise InvalidArgumentError(
            f"invalid {name}=True: the pool's blocks cannot be summed in 8-byte words (segments of "
            f"{pool.segment_bytes} bytes, strides {pool.segment_stride} and {pool.block_stride})"
        )
    return value


def _layers(pool: PagedKV, layers: Optional[tuple[int, int]]) -> tuple[int, int]:
    return (0, pool.num_layers) if layers is None else layers


def summed(job: Any, work: Callable[[], None]) -> Callable[[], None]:
    """``work`` (a write's copy) preceded by the sums of the write's source blocks, when
    ``job`` (a `Write`) carries `WriteChecksums`: one engine job does both."""
    sums = job.checksums
    if sums is None:
        return work

    def both() -> None:
        sums.compute()
        work()

    return both


def block_checksums(
    pool: PagedKV, ids: np.ndarray, layers: Optional[tuple[int, int]] = None, stream: Any = None
) -> np.ndarray:
    """The checksum of blocks ``ids`` of ``pool`` over ``layers`` (all of them: None), as a
    uint64 array. A CUDA pool's are summed on ``stream`` (None: the current one) and waited
    for there only: a receiver passes a stream of its own, so its sums never wait behind the
    engine's work on the default stream."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if pool.device.type == "cpu":
        lo, hi = _layers(pool, layers)
        views = [v.detach().numpy() for v in pool.layer_slice(lo, hi).segment_views(torch.uint8)]
        return np.asarray(_core.block_checksums(views, ids, lo), dtype=np.uint64)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        host = to_host(device_checksums(pool, ids, layers))
        torch.cuda.current_stream(pool.device).synchronize()
    return as_uint64(host)


def to_host(sums: torch.Tensor) -> torch.Tensor:
    """Queues the copy of device sums into page-locked host memory on the current stream
    (no wait: read them once the stream passed this point)."""
    host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
    host.copy_(sums, non_blocking=True)
    return host


def as_uint64(sums: torch.Tensor) -> np.ndarray:
    """Host sums (int64, the same bits) as a uint64 array."""
    return sums.numpy().view(np.uint64)


def device_ids(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """Block ids on ``device``, uploaded on the current stream without a wait (from
    page-locked memory: a copy from pageable memory would wait for the stream's earlier work,
    the forward a sender's write is ordered after)."""
    index = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def device_checksums(pool: PagedKV, ids: np.ndarray, layers: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Queues the sums of blocks ``ids`` of a CUDA pool on the current stream; returns an
    int64 tensor on the pool's device (the bits of the uint64 sums), final once the stream
    reaches this point. One Triton launch where Triton runs, else `reference_checksums`."""
    if _triton() is not None:
        from kvferry import _triton_checksum

        return _triton_checksum.checksums(pool, ids, _layers(pool, layers))
    return reference_checksums(pool, ids, layers)


@functools.lru_cache(maxsize=1)
def _triton() -> Any:
    try:
        import triton
    except ImportError:
        return None
    return triton


def reference_checksums(pool: PagedKV, ids: np.ndarray, layers: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The same sums in torch, on the pool's device (int64: the bits of the uint64 sums).
    The reference the GPU kernel is tested against; a layer at a time, so it holds one
    layer's gathered blocks, not the whole write."""
    lo, hi = _layers(pool, layers)
    index = device_ids(ids, pool.device)
    segments, words = pool.segments, pool.segment_bytes // WORD_BYTES
    within = torch.arange(segments * words, dtype=torch.int64, device=pool.device).view(segments, 1, words)
    key, m1, m2 = _signed(KEY), _signed(M1), _signed(M2)
    total = torch.zeros(len(index), dtype=torch.int64, device=pool.device)
    views = pool.segment_views(torch.int64)
    for layer in range(lo, hi):
        x = views[layer].index_select(1, index)  # (segments, n, words)
        z = (x ^ ((within + layer * segments * words) * key)) * m1
        z = (z ^ ((z >> 32) & 0xFFFFFFFF)) * m2
        total += z.sum(dim=(0, 2))
    return total


@dataclass
class _Part:
    sums: Any  # a uint64 array (CPU), or an int64 page-locked host tensor its job fills (CUDA)
    positions: Optional[np.ndarray]  # the part's places in the write (None: all, in order)


class WriteChecksums:
    """The checksums of one write's source blocks (`Write.checksums`). The transport runs
    `compute` on the copy engine in the write's own job, before its copy: the blocks are
    final then (the job runs after the forward that produced them and the tier copies it
    waits for), and the sums are done once the write is. A transport whose write is no job
    of the engine's (NIXL) queues `compute` as a job of its own (``pending``). `stamp` puts
    the sums on the write's notices."""

    def __init__(self, src: Source, src_ids: np.ndarray, layers: Optional[tuple[int, int]]) -> None:
        self.src = src
        self.src_ids = np.asarray(src_ids, dtype=np.int64)
        self.layers = layers
        self._parts: Optional[list[_Part]] = None
        self.pending: Optional[Pending] = None  # a job of its own running `compute` (NIXL)

    def done(self) -> bool:
        """Whether the sums can be read: their own job (``pending``) ended, or, summed in the
        write's job (whose end the caller waited for), they were computed."""
        return self.pending.done() if self.pending is not None else self._parts is not None

    def error(self) -> Optional[BaseException]:
        """What the job summing the blocks raised, once done."""
        return None if self.pending is None else self.pending.error()

    def compute(self) -> None:
        """Sums the blocks. A CUDA part is queued on the current stream (the engine's), its
        sums copied to page-locked host memory on it too: read once the job is done, with no
        wait on another stream."""
        parts = []
        for part in source_parts(self.src, self.src_ids, self.src_ids):
            if part.pool.device.type == "cpu":
                sums: Any = block_checksums(part.pool, part.src_ids, self.layers)
            else:
                sums = to_host(device_checksums(part.pool, part.src_ids, self.layers))
            parts.append(_Part(sums, part.positions))
        self._parts = parts

    def values(self) -> np.ndarray:
        """One uint64 per block of the write, in its order (after the job finished)."""
        if self._parts is None:
            raise TransferError("checksums of a write read before they were computed")
        out = np.empty(len(self.src_ids), dtype=np.uint64)
        for part in self._parts:
            sums = part.sums if isinstance(part.sums, np.ndarray) else as_uint64(part.sums)
            if part.positions is None:
                out[:] = sums
            else:
                out[part.positions] = sums
        return out

    def stamp(self, notices: Sequence[Notice]) -> tuple[Notice, ...]:
        """``notices`` (the write's, in order) carrying their blocks' checksums."""
        return tuple(stamp(notices, self.values()))


def mismatch(notice: Notice, dst_ids: np.ndarray, got: np.ndarray) -> Optional[ChecksumError]:
    """The error for the first block of ``notice`` whose sum ``got`` (the receiver's, over
    destination blocks ``dst_ids``) is not the one the notice carries; None when all agree."""
    want = notice.sums()
    bad = np.flatnonzero(want != got)
    if not len(bad):
        return None
    i = int(bad[0])
    more = f" ({len(bad)} of its {len(want)} blocks differ)" if len(bad) > 1 else ""
    group = "" if notice.whole else f", layer group {notice.group} of {notice.groups}"
    return ChecksumError(
        f"request {notice.request_id}: block {notice.start + i} (destination block {int(dst_ids[i])}{group}) "
        f"arrived with checksum {int(got[i]):#018x}, its sender summed {int(want[i]):#018x}{more}: corrupted in "
        "flight",
        request_ids=(notice.request_id,),
        block=notice.start + i,
    )


def write_layers(notice: Notice, pool: PagedKV) -> Optional[tuple[int, int]]:
    """The layers a notice's write put into its blocks (None: all of them)."""
    return None if notice.whole else pool.group_layers(notice.group, notice.groups)


def sums_for(pool: PagedKV, notices: Sequence[Notice], dst_ids: Sequence[np.ndarray]) -> list[Optional[np.ndarray]]:
    """The receiver's sums of each notice's destination blocks (None for a notice that
    carries no checksums)."""
    return [
        None if n.checksums is None else block_checksums(pool, ids, write_layers(n, pool))
        for n, ids in zip(notices, dst_ids)
    ]
