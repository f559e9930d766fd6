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
    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: Optional[float]) -> bool:
        concurrent.futures.wait([self._future], timeout=timeout)
        return self._future.done()

    def error(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None


class ThreadCopyEngine(CopyEngine):
    """CPU pools: one worker thread, so a copy never blocks the scheduler (torch's index ops
    release the GIL while they move bytes)."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-copy")

    def submit_call(self, work: Callable[[], None]) -> Pending:
        return _FuturePending(self._pool.submit(work))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _EventPending(Pending):
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

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
    far on the submitting thread's current stream (the forward that produced the blocks)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def submit_call(self, work: Callable[[], None]) -> Pending:
        produced = torch.cuda.current_stream(self.device).record_event()
        self.stream.wait_event(produced)
        with torch.cuda.stream(self.stream):
            work()
            return _EventPending(self.stream.record_event())

    def close(self) -> None:
        self.stream.synchronize()


def engine_for(src: PagedKV) -> CopyEngine:
    """The engine that suits the sender's pool."""
    if src.device.type == "cuda":
        return CudaCopyEngine(src.device)
    return ThreadCopyEngine()
