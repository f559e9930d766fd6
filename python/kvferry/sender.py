"""`KVSender`: the context side. Plans slices with the Rust book, queues their copies on a
copy engine, and posts each slice's notice once its bytes have landed."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np
import numpy.typing as npt

from kvferry._core import SlicePlan, TransferBook, TransferLedger
from kvferry.engine import CopyEngine, Pending, engine_for
from kvferry.errors import InvalidArgumentError, TransferError, TransferTimeoutError, UnknownRequestError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.transport import Transport, TransportFull, kept

__all__ = ["KVSender", "TransferRecord"]

IntArray = npt.ArrayLike
PROGRESS_SECONDS = 200e-6


@dataclass
class _Job:
    pending: Pending
    notices: tuple[Notice, ...]  # a tuple: callers get copies of it, never this one
    submitted_at: float
    kind: str
    nbytes: int


@dataclass(frozen=True)
class TransferRecord:
    """One finished write, for benchmarks and timelines (``KVSender(record=True)``)."""

    kind: str  # "early" (before the forward) or "chunk"
    notices: tuple[Notice, ...]
    nbytes: int
    submitted: float
    started: float  # when the copy ran, where the engine knows; else submitted
    finished: float  # else when the sender saw it done


class KVSender:
    """Owned by the executor thread. ``send_*`` return at once with the notices they will
    post; ``poll`` posts those whose copies finished; a block can never leave twice, because
    every slice is claimed in the book first."""

    def __init__(
        self,
        pool: PagedKV,
        transport: Transport,
        *,
        pipelined: bool = True,
        engine: Optional[CopyEngine] = None,
        timeout: Optional[float] = None,
        record: bool = False,
        progress: bool = False,
    ) -> None:
        """``timeout``: seconds a queued copy may take, counted from its submission (so after
        the forward that produced it: a request in prefill is never timed out).
        ``progress``: a background thread posts each write's notices as soon as it finished,
        instead of at the executor's next `poll` (it matters where the receiver still has
        work to do on arrival, as on the staging path)."""
        pool.check_compatible(transport.geometry())
        self.timeout = timeout
        self.pool = pool
        self.transport = transport
        self.book = TransferBook(pool.tokens_per_block, pipelined=pipelined)
        self.engine = engine if engine is not None else engine_for(pool)
        self._next_slice: dict[int, int] = {}
        self._inflight: deque[_Job] = deque()
        # Cancelled requests whose copies may still be queued: their notices are dropped.
        self._revoked: set[int] = set()
        self.records: Optional[list[TransferRecord]] = [] if record else None
        # The executor thread and the progress thread share the queue of writes.
        self._lock = threading.RLock()
        self._progress_error: Optional[BaseException] = None
        self._closing = threading.Event()
        self._progress: Optional[threading.Thread] = None
        if progress:
            self._progress = threading.Thread(target=self._progress_loop, name="kvferry-sender-progress", daemon=True)
            self._progress.start()

    def _progress_loop(self) -> None:
        while not self._closing.wait(PROGRESS_SECONDS):
            try:
                with self._lock:
                    while self._inflight and self._inflight[0].pending.done():
                        self._finish(self._inflight.popleft())
            except BaseException as err:  # handed to the executor thread at its next call
                self._progress_error = err
                return

    def _raise_progress_error(self) -> None:
        if self._progress_error is not None:
            err, self._progress_error = self._progress_error, None
            raise err

    def add(self, request_id: int, prompt_len: int, *, reused_len: int = 0, window: Optional[int] = None, context_only: bool = True) -> None:
        self.book.add(request_id, prompt_len, reused_len=reused_len, window=window, context_only=context_only)
        self._next_slice[request_id] = 0

    def send_early(self, request_ids: IntArray, src_block_table: IntArray, dst_block_table: IntArray) -> list[Notice]:
        """Before the context forward: the complete reused blocks of the eligible requests."""
        with self._lock:
            self._refuse_revoked(request_ids)
            return self._dispatch(self.book.plan_early(request_ids, src_block_table=src_block_table, dst_block_table=dst_block_table), "early")

    def send_chunks(
        self,
        request_ids: IntArray,
        chunk_starts: IntArray,
        chunk_ends: IntArray,
        src_block_table: IntArray,
        dst_block_table: IntArray,
    ) -> list[Notice]:
        """After a context forward: the blocks each finished chunk completed."""
        with self._lock:
            self._refuse_revoked(request_ids)
            plan = self.book.plan_chunks(request_ids, chunk_starts, chunk_ends, src_block_table=src_block_table, dst_block_table=dst_block_table)
            return self._dispatch(plan, "chunk")

    def _refuse_revoked(self, request_ids: IntArray) -> None:
        if self._revoked:
            hit = self._revoked.intersection(np.asarray(request_ids).tolist())
            if hit:
                raise InvalidArgumentError(f"invalid request_ids: {sorted(hit)} were cancelled")

    def _dispatch(self, plan: SlicePlan, kind: str) -> list[Notice]:
        """Queues the copy of a plan made with block tables (the book refused bad tables
        before claiming anything, so nothing is marked sent that cannot leave)."""
        pairs = plan.pairs
        if not len(plan) or pairs is None:
            return []
        notices = []
        for request_id, blocks, last in plan.slices():
            slice_id = self._next_slice[request_id]
            self._next_slice[request_id] = slice_id + 1
            notices.append(Notice(request_id, slice_id, blocks.start, blocks.end, last))
        pending = self._write(pairs.src, pairs.dst, notices)
        nbytes = plan.total_blocks * self.pool.block_bytes * self.pool.num_layers
        self._inflight.append(_Job(pending, tuple(notices), time.monotonic(), kind, nbytes))
        return notices

    def _write(self, src_ids: np.ndarray, dst_ids: np.ndarray, notices: list[Notice]) -> Pending:
        """Queues a write; a transport out of room gets the oldest writes posted (so its
        receiver can release them) and is waited on, within the sender's timeout."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            try:
                return self.transport.write(self.engine, self.pool, src_ids, dst_ids, notices)
            except TransportFull as full:
                left = 30.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"transport stayed full past the sender's timeout: {full}") from full
                if self._inflight:
                    job = self._inflight[0]
                    if job.pending.wait(left):
                        self._finish(self._inflight.popleft())
                    continue
                if not self.transport.wait_for_room(left) and deadline is None:
                    raise TransferTimeoutError(f"transport full and nothing in flight to wait for: {full}") from full

    def poll(self) -> list[Notice]:
        """Posts the notices of every finished copy, oldest first, and returns them. Raises
        `TransferTimeoutError` when the oldest copy has run past the sender's timeout."""
        with self._lock:
            return self._poll()

    def _poll(self) -> list[Notice]:
        self._raise_progress_error()
        posted: list[Notice] = []
        while self._inflight and self._inflight[0].pending.done():
            posted.extend(self._finish(self._inflight.popleft()))
        if self._inflight and self.timeout is not None:
            job = self._inflight[0]
            age = time.monotonic() - job.submitted_at
            if age > self.timeout:
                ids = sorted({n.request_id for n in job.notices} - self._revoked)
                raise TransferTimeoutError(f"copies for requests {ids} still running after {age:.3f} s (timeout {self.timeout} s): cancel them")
        return posted

    def flush(self, timeout: Optional[float] = None) -> list[Notice]:
        """Waits for every queued copy and posts its notices."""
        with self._lock:
            return self._flush(timeout)

    def _flush(self, timeout: Optional[float]) -> list[Notice]:
        self._raise_progress_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        posted: list[Notice] = []
        while self._inflight:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            job = self._inflight[0]
            if not job.pending.wait(left):
                ids = sorted({n.request_id for n in job.notices})
                raise TransferTimeoutError(f"copies for requests {ids} did not finish within {timeout} s")
            posted.extend(self._finish(self._inflight.popleft()))
        return posted

    def _finish(self, job: _Job) -> tuple[Notice, ...]:
        error = job.pending.error()
        if error is not None:
            self.transport.abandon(job.notices)
            ids = sorted({n.request_id for n in job.notices})
            raise TransferError(f"copy for requests {ids} failed: {error}") from error
        self.transport.post(job.notices, frozenset(self._revoked))
        if self.records is not None:
            started, finished = job.pending.interval() or (job.submitted_at, time.monotonic())
            self.records.append(TransferRecord(job.kind, job.notices, job.nbytes, job.submitted_at, started, finished))
        notices = tuple(kept(job.notices, self._revoked))
        for request_id in {n.request_id for n in job.notices} & self._revoked:
            if request_id not in self._next_slice and not self.in_flight(request_id):
                self._revoked.discard(request_id)  # cancelled and no copy left: forget it
        return notices

    def in_flight(self, request_id: int) -> bool:
        """Whether a queued copy still carries blocks of the request."""
        with self._lock:
            return any(n.request_id == request_id for job in self._inflight for n in job.notices)

    def cancel(self, request_id: int, timeout: Optional[float] = 5.0) -> TransferLedger:
        """Revokes a request: nothing more is planned or announced for it. Waits up to
        ``timeout`` seconds for queued copies that read its blocks, then forgets it and
        returns its ledger; its source blocks are the caller's to free once this returns.
        If those copies outlive the wait, raises `TransferTimeoutError` and keeps the request
        revoked (call again before freeing the blocks)."""
        with self._lock:
            return self._cancel(request_id, timeout)

    def _cancel(self, request_id: int, timeout: Optional[float]) -> TransferLedger:
        if request_id not in self._next_slice:
            raise UnknownRequestError(f"unknown request_id={request_id}: never added or already removed")
        self.book.cancel(request_id)
        self._revoked.add(request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self._inflight):
            if any(n.request_id == request_id for n in job.notices):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not job.pending.wait(left):
                    raise TransferTimeoutError(f"request {request_id}: copies reading its blocks still running after {timeout} s")
        self.poll()
        if not self.in_flight(request_id):
            self._revoked.discard(request_id)
        del self._next_slice[request_id]
        return self.book.remove(request_id)

    def remove(self, request_id: int) -> TransferLedger:
        """Forgets a request whose copies have all finished; returns its ledger."""
        with self._lock:
            return self._remove(request_id)

    def _remove(self, request_id: int) -> TransferLedger:
        self._poll()
        if self.in_flight(request_id):
            raise InvalidArgumentError(f"invalid request_id={request_id}: copies still in flight (flush or wait first)")
        del self._next_slice[request_id]
        return self.book.remove(request_id)

    def close(self) -> None:
        """Finishes queued copies, then releases the engine and the transport."""
        self._closing.set()
        if self._progress is not None:
            self._progress.join(timeout=5)
        try:
            self.flush()
        finally:
            self.engine.close()
            self.transport.close()


def as_table(rows: list[np.ndarray], width: int) -> np.ndarray:
    """Stacks per-request block-id arrays into a ``(len(rows), width)`` table (unused entries
    -1): the shape ``send_*`` take, for callers that keep one array per request."""
    table = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table
