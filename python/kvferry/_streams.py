"""The current CUDA stream and device, each in one call into torch's extension.

A small write's submission is mostly host time (docs/benchmarks.md, "Where a lone small
write's time goes"): ``torch.cuda.current_stream(device)`` runs about a dozen Python calls
(lazy init, device-index normalising, a `Stream` built through the device guard), and the
``torch.cuda.stream`` context manager two of those lookups and more. The copy path asks for
the current stream three or four times a write; these ask torch's extension directly.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import torch

__all__ = ["current_device", "current_stream", "device_index", "run_on"]

T = TypeVar("T")

_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)  # noqa: SLF001
_set_stream = getattr(torch._C, "_cuda_setStream", None)  # noqa: SLF001
_get_device = getattr(torch._C, "_cuda_getDevice", None)  # noqa: SLF001


def current_device() -> int:
    """The calling thread's current CUDA device index."""
    if _get_device is None:  # a torch without the binding: its public call
        return int(torch.cuda.current_device())
    return int(_get_device())


def device_index(device: torch.device) -> int:
    """``device``'s index, the current device's where it names none (``torch.device("cuda")``)."""
    return device.index if device.index is not None else current_device()


def current_stream(index: int) -> torch.cuda.Stream:
    """The calling thread's current stream on CUDA device ``index`` (an int)."""
    if _get_stream is None:
        return torch.cuda.current_stream(index)
    stream_id, device_index, device_type = _get_stream(index)
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)


def run_on(stream: torch.cuda.Stream, current: Optional[torch.cuda.Stream], work: Callable[[], T]) -> T:
    """Runs ``work`` with ``stream`` current and makes ``current`` (the calling thread's
    current stream on ``stream``'s device, already looked up) current again afterwards.
    Setting a stream also makes its device the current one, so this takes the short way only
    where that device is current already; else torch's own guards."""
    if _set_stream is None or current is None or current_device() != stream.device_index:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            return work()
    _set_stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)
    try:
        return work()
    finally:
        _set_stream(stream_id=current.stream_id, device_index=current.device_index, device_type=current.device_type)
