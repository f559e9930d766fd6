"""Copy engines: where and when the bytes of a planned slice move.

```
CudaCopyEngine:    current stream --event--> copy stream: copy_blocks --event--> done?
ThreadCopyEngine:  caller --queue--> one worker thread: copy_blocks --> future done?
```
Both run jobs in submission order, so completions arrive in order too.

A job may be ordered ``after`` signals of the engine's tier copies (kvferry.tiers): the copy
stream waits on CUDA events without a host sync; host signals (a ``threading.Event``, a
``Future``) are waited for by the worker thread, or, on CUDA, by a launcher thread that
enqueues the job (and every later one, to keep the order) once they completed.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable, Optional, Sequence

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import torch

from kvferry import _streams, affinity
from kvferry.copy import checked_pairs, copy_blocks
from kvferry.errors import TransferError
from kvferry.layout import PagedKV, common_word
from kvferry.tiers import Signal, signal_done, signal_error, wait_signal

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

    def when_done(self, callback: Callable[[], None]) -> bool:
        """Has ``callback`` called (on any thread) once the copy is done, where the copy can
        tell (a future): a sender's announcer then sleeps until the copy is done or a new
        write is queued, instead of looking every few hundred microseconds. Returns whether
        it will be called; False (the default: a CUDA event, a NIXL transfer) leaves the
        caller to look at intervals."""
        return False

    def interval(self) -> Optional[tuple[float, float]]:
        """When the copy ran (``time.monotonic`` seconds), once done, where the engine knows."""
        return None

    def abort(self) -> bool:
        """Calls an unfinished copy off, where that is possible (a NIXL transfer); returns
        whether it was called off and no longer touches either pool. A local copy always
        runs to its end: ``False``, and its source blocks stay busy until it is done."""
        return False


class CopyEngine(ABC):
    def submit(
        self,
        src: PagedKV,
        dst: PagedKV,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        *,
        after: Sequence[Signal] = (),
        before: Optional[Callable[[], None]] = None,
    ) -> Pending:
        """Queues ``copy_blocks(src, dst, src_ids, dst_ids)`` after the caller's pending work
        and after every signal in ``after``; ``before`` runs first, in the same job (the
        sums of the blocks it reads: kvferry.checksum)."""
        nbytes = len(src_ids) * src.block_bytes * src.num_layers

        def copy() -> None:
            if before is not None:
                before()
            copy_blocks(src, dst, src_ids, dst_ids)

        return self.submit_call(copy, after=after, nbytes=nbytes)

    @abstractmethod
    def submit_call(self, work: Callable[[], None], *, after: Sequence[Signal] = (), nbytes: int = 0) -> Pending:
        """Queues ``work`` (which issues copies of ``nbytes`` payload bytes) after the
        caller's pending work and after every signal in ``after`` (kvferry.tiers): on the
        engine's stream for CUDA, on its thread for CPU. A signal that failed (a Future's
        exception) fails the job instead of running it."""

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

    def when_done(self, callback: Callable[[], None]) -> bool:
        self._future.add_done_callback(lambda _: callback())
        return True

    def error(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None

    def interval(self) -> Optional[tuple[float, float]]:
        return self._future.result() if self._future.done() and self._future.exception() is None else None


class ThreadCopyEngine(CopyEngine):
    """CPU pools: one worker thread, so a copy never blocks the scheduler (torch's index ops
    release the GIL while they move bytes).

    ``link_gbps`` emulates a slower link (a NIC on one machine): each copy then takes its
    bytes over that rate, one after another as on a real link. A NIC moves bytes by DMA,
    without the host's compute cores, so the emulated link must not take them from the
    prefill either: a pool-to-pool copy is done in slices of about `LINK_SLICE_BYTES`, each
    by numpy on this one thread (a plain memcpy, no torch thread team) and then paced; and the
    thread runs at the lowest scheduling priority (nice 19, where the OS allows it), so its
    memcpy takes only cycles the forward leaves idle. torch's parallel copy in its place
    spawned a second OpenMP team that contended with the forward's for the same cores: on a
    loaded 2-core machine the early mode's prefill took twice baseline's. A link starved of
    spare cycles arrives late, which the copy's recorded interval shows.

    ```
    link time:  |slice 0|sleep ...|slice 1|sleep ...|slice 2|sleep|   finishes at
                start                                              start + bytes / rate
    ```
    """

    def __init__(self, link_gbps: Optional[float] = None) -> None:
        if link_gbps is not None and link_gbps <= 0:
            raise ValueError(f"invalid link_gbps={link_gbps}: must be > 0")
        self.link_gbps = link_gbps
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="kvferry-copy",
            initializer=_lowest_priority if link_gbps is not None else affinity.pin_current_thread,
        )
        self._closing = threading.Event()

    def submit(
        self,
        src: PagedKV,
        dst: PagedKV,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        *,
        after: Sequence[Signal] = (),
        before: Optional[Callable[[], None]] = None,
    ) -> Pending:
        if self.link_gbps is None or src.device.type != "cpu" or dst.device.type != "cpu":
            return super().submit(src, dst, src_ids, dst_ids, after=after, before=before)

        def paced() -> None:
            if before is not None:
                before()
            _paced_copy(src, dst, src_ids, dst_ids, self.link_gbps or 0.0)

        return self._run(paced, 0, tuple(after))

    def submit_call(self, work: Callable[[], None], *, after: Sequence[Signal] = (), nbytes: int = 0) -> Pending:
        return self._run(work, nbytes, tuple(after))

    def _run(self, work: Callable[[], None], nbytes: int, after: tuple[Signal, ...] = ()) -> Pending:
        """``nbytes``: the payload of an opaque ``work``, paced after it ran (a pool-to-pool
        copy paces itself and passes 0)."""

        def timed() -> tuple[float, float]:
            for signal in after:  # the tier's copies of the blocks this job reads
                await_signal(signal, self._closing)
            start = time.monotonic()
            work()
            if self.link_gbps is not None and nbytes:
                time.sleep(max(0.0, start + nbytes / (self.link_gbps * 1e9) - time.monotonic()))
            return start, time.monotonic()

        return _FuturePending(self._pool.submit(timed))

    def close(self) -> None:
        self._closing.set()  # a job still waiting for a tier signal fails instead of running
        self._pool.shutdown(wait=True)


def _lowest_priority() -> None:
    """Lowers the calling thread (a Linux thread is its own scheduling entity) to nice 19."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or a sandbox that refuses: pacing still holds
        pass


# One slice of an emulated link's copy: small enough that the pacing is smooth (a slice is
# 8 ms at 0.5 GB/s), large enough that the per-slice Python cost is noise.
LINK_SLICE_BYTES = 4 << 20


def _paced_copy(src: PagedKV, dst: PagedKV, src_ids: np.ndarray, dst_ids: np.ndarray, gbps: float) -> None:
    """`copy_blocks` at ``gbps`` on the calling thread alone (see `ThreadCopyEngine`)."""
    s, d = checked_pairs(src, dst, src_ids, dst_ids)
    if not s.size:
        return
    word = common_word(src, dst)
    # numpy views of the same memory; numpy's fancy indexing releases the GIL while it copies.
    src_views = [v.numpy() for v in src.segment_views(word)]
    dst_views = [v.numpy() for v in dst.segment_views(word)]
    per_block = src.block_bytes * src.num_layers
    step = max(1, LINK_SLICE_BYTES // per_block)
    start, rate = time.monotonic(), gbps * 1e9
    for i in range(0, s.size, step):
        si, di = s[i : i + step], d[i : i + step]
        for sv, dv in zip(src_views, dst_views):
            dv[:, di] = sv[:, si]
        # The link is busy until this slice's bytes crossed at its rate.
        time.sleep(max(0.0, start + (i + si.size) * per_block / rate - time.monotonic()))


def await_signal(signal: Signal, closing: threading.Event) -> None:
    """Blocks until the tier's copy behind ``signal`` ended; raises `TransferError` if it
    failed or the engine closes first (the job then never reads its blocks)."""
    while not wait_signal(signal, 0.05):
        if closing.is_set():
            raise TransferError("the copy engine closed while a copy waited for a tier copy of its blocks")
    error = signal_error(signal)
    if error is not None:
        raise TransferError(f"the tier copy this copy was ordered after failed: {error!r}") from error


class _FailedPending(Pending):
    """A job that never ran: a signal it was ordered after had failed."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float]) -> bool:
        return True

    def when_done(self, callback: Callable[[], None]) -> bool:
        callback()
        return True

    def error(self) -> Optional[BaseException]:
        return self._error


# A copy of at most this many payload bytes that can start at once (the stream it waits on
# and the copies before it have ended) is waited for by spinning, not sleeping: the wait is
# then its own copy's, well under a millisecond, and a blocking-sync event's wake-up took
# 50-120 us on an H100 (docs/benchmarks.md, "Small writes on the GPU node"), a good part of a
# small write's cost beside the copy. A copy queued behind a running forward sleeps, whatever its size.
SPIN_WAIT_BYTES = 64 << 20


class _EventWaiter:
    """Tells callers when a CUDA copy finished, without polling: one thread per copy engine
    waits in ``cudaEventSynchronize`` on each completion event it was asked about, in the
    order they were asked, which is their stream's order, and calls the callbacks. The
    events are blocking-sync ones (the thread sleeps instead of spinning a core), except a
    short copy's that can start at once (`SPIN_WAIT_BYTES`), whose wait spins. A sender's
    announcer then posts a small write's notices microseconds after its copy, not at its
    next look (every ``PROGRESS_SECONDS``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: deque[tuple[torch.cuda.Event, Callable[[], None]]] = deque()
        self._thread: Optional[threading.Thread] = None
        self._closing = False

    def watch(self, event: torch.cuda.Event, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._closing:
                return False
            self._queue.append((event, callback))
            if self._thread is None:
                self._thread = affinity.Thread(target=self._run, name="kvferry-cuda-events", daemon=True)
                self._thread.start()
            self._ready.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._ready.wait()
                if not self._queue:
                    return
                event, callback = self._queue.popleft()
            event.synchronize()  # releases the GIL; sleeps (a blocking-sync event) or spins
            callback()

    def close(self) -> None:
        """The thread ends once the events asked about so far completed (never joined: a
        copy that never ends must not hang the caller's close)."""
        with self._lock:
            self._closing = True
            self._ready.notify()


class _EventPending(Pending):
    def __init__(
        self,
        event: torch.cuda.Event,
        started: Optional[torch.cuda.Event] = None,
        clock: Optional[tuple[torch.cuda.Event, float]] = None,
        waiter: Optional[_EventWaiter] = None,
        spins: bool = False,
    ) -> None:
        self._event = event
        self._started = started
        self._clock = clock
        self._waiter = waiter
        self.spins = spins  # ``event`` is not blocking-sync: its waiter spins (`SPIN_WAIT_BYTES`)

    def when_done(self, callback: Callable[[], None]) -> bool:
        return self._waiter is not None and self._waiter.watch(self._event, callback)

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
        self._index = _streams.device_index(device)
        self.stream = torch.cuda.Stream(device=device)
        self._order = torch.cuda.Event()  # the submitter's stream, for jobs enqueued at once
        self._last: Optional[torch.cuda.Event] = None  # the last job's end
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
        # Jobs ordered after host signals still pending wait here, in order, for the
        # launcher thread; while any does, later jobs queue behind it (jobs keep their order).
        self._lock = threading.Lock()
        self._waiting = threading.Condition(self._lock)
        self._deferred: deque[_Deferred] = deque()
        self._launcher: Optional[threading.Thread] = None
        self._closing = threading.Event()
        self._waiter = _EventWaiter()

    def submit_call(self, work: Callable[[], None], *, after: Sequence[Signal] = (), nbytes: int = 0) -> Pending:
        events = [s for s in after if isinstance(s, torch.cuda.Event)]
        host = [s for s in after if not isinstance(s, torch.cuda.Event)]
        failed = next((e for e in map(signal_error, host) if e is not None), None)
        if failed is not None:
            return _FailedPending(TransferError(f"the tier copy this copy was ordered after failed: {failed!r}"))
        current = _streams.current_stream(self._index)
        with self._lock:
            pending_host = [s for s in host if not signal_done(s)]
            if not pending_host and not self._deferred:
                # The forward that produced the blocks, recorded on one reused event: the copy
                # stream's wait is queued at once, and a wait takes the event as recorded when
                # it is queued, so the next job may record it again.
                self._order.record(current)
                return self._enqueue(work, [self._order, *events], current, nbytes)
            # Recorded now, whenever the job is enqueued: an event of its own.
            job = _Deferred(work, [current.record_event(), *events], pending_host)
            self._deferred.append(job)
            if self._launcher is None:
                self._launcher = affinity.Thread(
                    target=self._launch_deferred, name="kvferry-copy-launcher", daemon=True
                )
                self._launcher.start()
            self._waiting.notify()
            return job.pending

    def _enqueue(
        self,
        work: Callable[[], None],
        waits: Sequence[torch.cuda.Event],
        current: Optional[torch.cuda.Stream] = None,
        nbytes: Optional[int] = None,
    ) -> Pending:
        """Queues ``work`` on the copy stream after ``waits`` (caller holds the lock);
        ``current``: the calling thread's current stream on the engine's device, where the
        caller looked it up already; ``nbytes``: the copy's payload, where known (a short
        copy that can start at once is waited for by spinning: `SPIN_WAIT_BYTES`)."""
        stream = self.stream
        # Whether the copy can start at once: what it waits for and the copies queued before
        # it have ended (asked before this one is queued behind them).
        short = (
            nbytes is not None
            and nbytes <= SPIN_WAIT_BYTES
            and (self._last is None or self._last.query())
            and all(event.query() for event in waits)
        )
        for event in waits:
            event.wait(stream)  # no host sync: the stream waits
        started = torch.cuda.Event(enable_timing=True)
        # `_EventWaiter` sleeps on a blocking-sync event; a short copy's is not one: it spins.
        done = torch.cuda.Event(enable_timing=True, blocking=not short)

        def run() -> None:
            started.record(stream)
            work()
            done.record(stream)

        _streams.run_on(stream, current, run)
        self._last = done
        return _EventPending(done, started, self._clock, self._waiter, short)

    def _launch_deferred(self) -> None:
        """The launcher thread: waits for the oldest deferred job's host signals (without the
        lock, so the executor keeps submitting), then enqueues it."""
        while True:
            with self._lock:
                while not self._deferred and not self._closing.is_set():
                    self._waiting.wait()
                if not self._deferred:
                    return
                job = self._deferred[0]
            error: Optional[BaseException] = None
            try:
                for signal in job.host:
                    await_signal(signal, self._closing)
            except TransferError as err:
                error = err
            with self._lock:
                self._deferred.popleft()
                if error is not None:
                    job.pending.fail(error)
                    continue
                try:
                    job.pending.place(self._enqueue(job.work, job.waits))
                except BaseException as err:  # reported by the job, not lost on this thread
                    job.pending.fail(err)

    def close(self) -> None:
        self._closing.set()  # deferred jobs still waiting for a tier signal fail
        with self._lock:
            self._waiting.notify()
            launcher = self._launcher
        if launcher is not None:
            launcher.join()
        self.stream.synchronize()
        self._waiter.close()


class _Deferred:
    """A CUDA job waiting for host signals before it is enqueued."""

    def __init__(self, work: Callable[[], None], waits: list[torch.cuda.Event], host: Sequence[Signal]) -> None:
        self.work = work
        self.waits = waits
        self.host = host
        self.pending = _DeferredPending()


class _DeferredPending(Pending):
    """The job's completion once the launcher enqueued it (or failed it)."""

    def __init__(self) -> None:
        self._placed = threading.Event()
        self._inner: Optional[Pending] = None
        self._error: Optional[BaseException] = None

    def place(self, inner: Pending) -> None:
        self._inner = inner
        self._placed.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._placed.set()

    def done(self) -> bool:
        if not self._placed.is_set():
            return False
        return self._inner is None or self._inner.done()

    def wait(self, timeout: Optional[float]) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._placed.wait(timeout):
            return False
        if self._inner is None:
            return True
        return self._inner.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def error(self) -> Optional[BaseException]:
        if self._error is not None:
            return self._error
        return self._inner.error() if self._inner is not None and self._inner.done() else None

    def interval(self) -> Optional[tuple[float, float]]:
        return self._inner.interval() if self._inner is not None else None


def engine_for(src: PagedKV) -> CopyEngine:
    """The engine that suits the sender's pool."""
    if src.device.type == "cuda":
        return CudaCopyEngine(src.device, warm=src)
    return ThreadCopyEngine()
