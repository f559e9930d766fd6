"""Copy engines: where and when the bytes of a planned slice move.

```
CudaCopyEngine:    current stream --event--> copy stream: copy_blocks --event--> done?
ThreadCopyEngine:  caller --queue--> one worker thread: copy_blocks --> future done?
```
Both run jobs in submission order, so completions arrive in order too.
"""

from __future__ import annotations

import concurrent.futures
import time
from abc import ABC, abstractmethod
from typing import Callable, Optional

import numpy as np
import torch

from kvferry.copy import copy_blocks
from kvferry.layout import PagedKV

__all__ = ["CopyEngine", "CudaCopyEngine", "Pending", "ThreadCopyEngine", "engine_for"]


class Pending(ABC):
    """One submitted copy."""

    @abstractmethod
    def done(self) -> bool:
        """True once the copy finished (successfully or not); never blocks."""

    @abstractmethod
    def wait(self, timeout: Optional[float]) -> bool:
        """Blocks until done or ``timeout`` seconds passed; returns ``done()``."""

    def error(self) -> Optional[BaseException]:
        """The exception the copy raised, once done; ``None`` on success."""
        return None

    def interval(self) -> Optional[tuple[float, float]]:
        """When the copy ran (``time.monotonic`` seconds), once done, where the engine knows."""
        return None

    def abort(self) -> bool:
        """Calls an unfinished copy off, where that is possible (a NIXL transfer); returns
        whether it was called off and no longer touches either pool. A local copy always
        runs to its end: ``False``, and its source blocks stay busy until it is done."""
        return False


class CopyEngine(ABC):
    def submit(self, src: PagedKV, dst: PagedKV, src_ids: np.ndarray, dst_ids: np.ndarray) -> Pending:
        """Queues ``copy_blocks(src, dst, src_ids, dst_ids)`` after the caller's pending work."""
        return self.submit_call(lambda: copy_blocks(src, dst, src_ids, dst_ids))

    @abstractmethod
    def submit_call(self, work: Callable[[], None]) -> Pending:
        """Queues ``work`` (which issues copies) after the caller's pending work: on the
        engine's stream for CUDA, on its thread for CPU."""

    def close(self) -> None:
        """Finishes queued copies and releases the engine's resources."""


class _FuturePending(Pending):
    def __init__(self, future: concurrent.futures.Future[Optional[tuple[float, float]]]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: Optional[float]) -> bool:
        concurrent.futures.wait([self._future], timeout=timeout)
        return self._future.done()

    def error(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None

    def interval(self) -> Optional[tuple[float, float]]:
        return self._future.result() if self._future.done() and self._future.exception() is None else None


class ThreadCopyEngine(CopyEngine):
    """CPU pools: one worker thread, so a copy never blocks the scheduler (torch's index ops
    release the GIL while they move bytes). ``link_gbps`` emulates a slower link (a NIC on
    one machine): each copy then takes at least its bytes over that rate, one after another
    as on a real link."""

    def __init__(self, link_gbps: Optional[float] = None) -> None:
        if link_gbps is not None and link_gbps <= 0:
            raise ValueError(f"invalid link_gbps={link_gbps}: must be > 0")
        self.link_gbps = link_gbps
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-copy")

    def submit(self, src: PagedKV, dst: PagedKV, src_ids: np.ndarray, dst_ids: np.ndarray) -> Pending:
        nbytes = len(src_ids) * src.block_bytes * src.num_layers
        return self._run(lambda: copy_blocks(src, dst, src_ids, dst_ids), nbytes)

    def submit_call(self, work: Callable[[], None]) -> Pending:
        return self._run(work, 0)

    def _run(self, work: Callable[[], None], nbytes: int) -> Pending:
        def timed() -> tuple[float, float]:
            start = time.monotonic()
            work()
            if self.link_gbps is not None:
                time.sleep(max(0.0, start + nbytes / (self.link_gbps * 1e9) - time.monotonic()))
            return start, time.monotonic()

        return _FuturePending(self._pool.submit(timed))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _EventPending(Pending):
    def __init__(self, event: torch.cuda.Event, started: Optional[torch.cuda.Event] = None, clock: Optional[tuple[torch.cuda.Event, float]] = None) -> None:
        self._event = event
        self._started = started
        self._clock = clock

    def interval(self) -> Optional[tuple[float, float]]:
        if self._started is None or self._clock is None or not self._event.query():
            return None
        base, at = self._clock
        return at + base.elapsed_time(self._started) / 1e3, at + base.elapsed_time(self._event) / 1e3

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self, timeout: Optional[float]) -> bool:
        if timeout is None:
            self._event.synchronize()
            return True
        # CUDA events cannot be waited on with a deadline: poll with a short sleep.
        deadline = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
        return True


class CudaCopyEngine(CopyEngine):
    """CUDA pools: copies run on a dedicated stream, each ordered after the work queued so
    far on the submitting thread's current stream (the forward that produced the blocks).
    ``warm`` (the sender's pool) gets the copy kernel compiled for its geometry up front."""

    def __init__(self, device: torch.device, warm: Optional[PagedKV] = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # A device event taken at a known host time turns later events into host times.
        base = torch.cuda.Event(enable_timing=True)
        base.record(self.stream)
        base.synchronize()
        self._clock = (base, time.monotonic())
        if warm is not None:
            from kvferry import _triton_copy

            with torch.cuda.stream(self.stream):
                _triton_copy.warm_up(warm)
            self.stream.synchronize()

    def submit_call(self, work: Callable[[], None]) -> Pending:
        produced = torch.cuda.current_stream(self.device).record_event()
        self.stream.wait_event(produced)
        started = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            started.record()
            work()
            done.record()
        return _EventPending(done, started, self._clock)

    def close(self) -> None:
        self.stream.synchronize()


def engine_for(src: PagedKV) -> CopyEngine:
    """The engine that suits the sender's pool."""
    if src.device.type == "cuda":
        return CudaCopyEngine(src.device, warm=src)
    return ThreadCopyEngine()
