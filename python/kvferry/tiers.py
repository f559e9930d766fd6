"""The host tier as a second source, and ordering against the tier's own copies.

An engine that evicts KV blocks to host memory keeps part of a reused prefix there. The
sender reads those blocks straight from the host pool (no onboarding round trip through the
context GPU), so the source block ids of a request name blocks of either pool:

```
combined source ids:  [0 ............. D)[D ................. D + H)
                       device pool block    host pool block id - D
one write:            its pairs split by tier, both parts copied by one engine job,
                      its notices posted once both parts landed
```
The engine's own tier copies (an offload device -> host writing host blocks, an onboard
host -> device writing device blocks) are declared with `KVSender.order_after(ids, signal)`:
a later copy that reads one of ``ids`` runs only once ``signal`` completed (a block is never
read while it is being written):

```
tier:    offload D7 -> H3 |=========| signal
sender:  order_after([D + 3], signal); send_early(... H3 ...)
copy:                          waits  |copy H3 -> receiver|
```
Signals: a recorded `torch.cuda.Event` (the copy stream waits on it, no host sync), or the
tier's completion signal on the host, a `threading.Event` or a `concurrent.futures.Future`
(the copy waits for it before it reads; a Future that ends in an exception fails the write).

On CUDA the host pool must be pinned: the copy kernels then read it in place through a CUDA
view of the same memory (unified addressing), on the copy stream, so stream order covers
host blocks as it covers device blocks.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import numpy.typing as npt
import torch

from kvferry.errors import InvalidArgumentError, TransferError
from kvferry.layout import LayoutMismatchError, PagedKV, block_id_array

__all__ = [
    "Signal",
    "Source",
    "SourcePart",
    "TierOrdering",
    "TieredSource",
    "check_signal",
    "signal_done",
    "signal_error",
    "source_layers",
    "source_parts",
    "tiered_source",
    "wait_signal",
]

Signal = Union[torch.cuda.Event, threading.Event, "concurrent.futures.Future[Any]"]
SIGNAL_TYPES = "a torch.cuda.Event, a threading.Event or a concurrent.futures.Future"


def check_signal(signal: object, name: str = "signal") -> None:
    """Refuses what cannot order a copy: anything but the three signal types, and a CUDA
    event that was never recorded (waiting on it would not wait for anything)."""
    if isinstance(signal, torch.cuda.Event):
        if not getattr(signal, "cuda_event", 0):
            raise InvalidArgumentError(
                (
                    f"invalid {name}=<torch.cuda.Event never recorded>: record it on the stream of the tier's "
                    "copy, after that copy, first"
                )
            )
        return
    if not isinstance(signal, (threading.Event, concurrent.futures.Future)):
        raise TypeError(f"{name} must be {SIGNAL_TYPES}, got {type(signal).__name__} {signal!r}"[:200])


def signal_done(signal: Signal) -> bool:
    """Whether the tier's copy behind ``signal`` ended (successfully or not); never blocks."""
    if isinstance(signal, torch.cuda.Event):
        return bool(signal.query())
    if isinstance(signal, threading.Event):
        return signal.is_set()
    return signal.done()


def signal_error(signal: Signal) -> Optional[BaseException]:
    """Why the tier's copy failed, once done: a Future's exception (or its cancellation);
    the other signals carry no error."""
    if isinstance(signal, concurrent.futures.Future) and signal.done():
        if signal.cancelled():
            return TransferError("the tier's copy was cancelled: its blocks may be incomplete")
        return signal.exception()
    return None


def wait_signal(signal: Signal, timeout: Optional[float]) -> bool:
    """Blocks until ``signal`` completed or ``timeout`` seconds passed; returns whether it
    completed."""
    if isinstance(signal, threading.Event):
        return signal.wait(timeout)
    if isinstance(signal, concurrent.futures.Future):
        concurrent.futures.wait([signal], timeout=timeout)
        return signal.done()
    if timeout is None:
        signal.synchronize()
        return True
    import time

    deadline = time.monotonic() + timeout
    while not signal.query():  # a CUDA event has no timed wait
        if time.monotonic() >= deadline:
            return False
        time.sleep(50e-6)
    return True


class SourcePart(NamedTuple):
    """The pairs of one write that read one pool: ``src_ids`` are that pool's own ids;
    ``positions`` are the pairs' places in the write (None: all of them, in order)."""

    pool: PagedKV
    src_ids: np.ndarray
    dst_ids: np.ndarray
    positions: Optional[np.ndarray]


@dataclass(frozen=True, eq=False)
class TieredSource:
    """A sender's two source pools behind one id space (see the module doc). ``host_view``
    is the host pool as the device pool's copies address it: a CUDA view of the pinned
    memory when the device pool is on CUDA, else the host pool itself."""

    device: PagedKV
    host: PagedKV
    host_view: PagedKV = field(repr=False)

    @property
    def num_blocks(self) -> int:
        """Blocks of the combined id space: device blocks, then host blocks."""
        return self.device.num_blocks + self.host.num_blocks

    def parts(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> list[SourcePart]:
        """A write's pairs (combined ids, validated by the book) split by tier; a tier
        with no pair in the write gets no part."""
        src_ids, dst_ids = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
        on_host = src_ids >= self.device.num_blocks
        if not on_host.any():
            return [SourcePart(self.device, src_ids, dst_ids, None)]
        if on_host.all():
            return [SourcePart(self.host_view, src_ids - self.device.num_blocks, dst_ids, None)]
        dev, host = np.flatnonzero(~on_host), np.flatnonzero(on_host)
        return [
            SourcePart(self.device, src_ids[dev], dst_ids[dev], dev),
            SourcePart(self.host_view, src_ids[host] - self.device.num_blocks, dst_ids[host], host),
        ]

    def check_compatible(self, other: PagedKV | dict[str, object]) -> None:
        """Both tiers share one layout (checked when the source was built)."""
        self.device.check_compatible(other)

    def layer_slice(self, lo: int, hi: int) -> TieredSource:
        """Both tiers restricted to layers ``[lo, hi)`` (a layer slice's write)."""
        return TieredSource(
            self.device.layer_slice(lo, hi), self.host.layer_slice(lo, hi), self.host_view.layer_slice(lo, hi)
        )


Source = Union[PagedKV, TieredSource]


def source_layers(src: Source, layers: Optional[tuple[int, int]]) -> Source:
    """``src`` restricted to layers ``[lo, hi)``, or whole for ``None``."""
    return src if layers is None else src.layer_slice(*layers)


def source_parts(src: Source, src_ids: np.ndarray, dst_ids: np.ndarray) -> list[SourcePart]:
    """A write's pairs by source pool: one part for a plain pool."""
    if isinstance(src, TieredSource):
        return src.parts(src_ids, dst_ids)
    return [SourcePart(src, np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64), None)]


def tiered_source(pool: PagedKV, host_pool: object) -> TieredSource:
    """Checks ``host_pool`` against the device pool ``pool`` and builds the source: a CPU
    pool of the same block layout, pinned when ``pool`` is on CUDA."""
    if not isinstance(host_pool, PagedKV):
        raise TypeError(f"host_pool must be a PagedKV, got {type(host_pool).__name__}")
    if host_pool.device.type != "cpu":
        raise InvalidArgumentError(
            f"invalid host_pool=<pool on {host_pool.device}>: must be a CPU pool (the engine's host tier)"
        )
    mine, theirs = pool.geometry(), host_pool.geometry()
    for key, value in mine.items():
        if theirs[key] != value:
            raise LayoutMismatchError(
                (
                    f"invalid host_pool: its {key} is {theirs[key]}, the device pool's is {value} (both tiers must "
                    "hold blocks of one layout)"
                )
            )
    if pool.device.type != "cuda":
        return TieredSource(pool, host_pool, host_pool)
    unpinned = [i for i, t in enumerate(host_pool.layers) if not t.is_pinned()]
    if unpinned:
        raise InvalidArgumentError(
            (
                f"invalid host_pool: layers {unpinned[:8]} are not pinned; a CUDA pool's host tier must be "
                "page-locked (tensor.pin_memory(), or cudaHostRegister)"
            )
        )
    return TieredSource(pool, host_pool, cuda_view(host_pool, pool.device))


class _DeviceArray:
    """``__cuda_array_interface__`` over a pinned host tensor's bytes: under unified
    addressing the host address is valid in kernels too, so torch wraps it as a CUDA tensor
    without a copy. Holds the host tensor, so the memory outlives every view of it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        nbytes = tensor.numel() * tensor.element_size()
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def cuda_view(pool: PagedKV, device: torch.device) -> PagedKV:
    """``pool`` (pinned host memory) as CUDA tensors over the same bytes: what the copy
    kernels read, on the copy stream. Refused, naming the pool, where torch would not map
    the memory in place on ``device``."""
    layers = []
    with torch.cuda.device(device):
        for i, t in enumerate(pool.layers):
            try:
                view = torch.as_tensor(_DeviceArray(t), device=device)
            except (RuntimeError, TypeError, ValueError) as err:  # torch could not map it
                raise InvalidArgumentError(
                    f"invalid host_pool: layer {i} cannot be read in place from {device}: {err}"
                ) from err
            if view.data_ptr() != t.data_ptr() or view.device != device:
                raise InvalidArgumentError(
                    (
                        f"invalid host_pool: layer {i} cannot be read in place from {device} (torch mapped it to "
                        f"{view.device})"
                    )
                )
            layers.append(view.view(t.dtype).view(t.shape))
    return pool.with_layers(layers)


def source_ids(name: str, ids: npt.ArrayLike, device_blocks: int, host_blocks: int) -> np.ndarray:
    """A 1-d int64 array of combined source ids, each in ``[0, device_blocks + host_blocks)``;
    refused by name otherwise (floats, bools, 2-d, out of range)."""
    array = block_id_array(name, ids)
    total = device_blocks + host_blocks
    bad = array[(array < 0) | (array >= total)]
    if bad.size:
        tiers = f"device blocks [0, {device_blocks})" + (
            f", host blocks [{device_blocks}, {total})" if host_blocks else ", no host pool"
        )
        raise InvalidArgumentError(f"invalid {name}=<block id {int(bad[0])}>: must be in [0, {total}) ({tiers})")
    return array


class TierOrdering:
    """Declared tier copies not known to have ended: each source block id written until its
    signal completes. Entries go once their signal completed, failed or not (a copy queued
    while it was pending fails with it; afterwards the engine knows its blocks)."""

    def __init__(self) -> None:
        self._entries: list[tuple[Signal, np.ndarray]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, ids: np.ndarray, signal: Signal) -> None:
        self._prune()
        if ids.size:
            self._entries.append((signal, np.unique(ids)))

    def signals_for(self, src_ids: np.ndarray) -> list[Signal]:
        """The pending signals of the blocks a copy of ``src_ids`` reads."""
        self._prune()
        if not self._entries:
            return []
        reads = np.unique(np.asarray(src_ids, dtype=np.int64))
        return [signal for signal, ids in self._entries if np.intersect1d(ids, reads, assume_unique=True).size]

    def _prune(self) -> None:
        if self._entries:
            self._entries = [(s, ids) for s, ids in self._entries if not signal_done(s)]
