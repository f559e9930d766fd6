"""`KVSender`: the context side. Plans slices with the Rust book, queues their copies on a
copy engine, and posts each slice's notice once its bytes have landed.

Failures. A request fails when its write fails, when its write outlives ``timeout`` and the
transport can abort it (NIXL), or when the receiver is lost (every request then fails: one
sender serves one receiver). A failed request is revoked, its book entry released as soon as
no copy reads its blocks any more, and its error raised once (naming the requests and the
peer) and kept in `failures` until `remove` or `cancel` acknowledges it; sending it again
raises that error. docs/faults.md has the whole picture.

Leases (docs/faults.md, "Leases, epochs and fences"). A request's source blocks are leased to
the sender from `add` until `remove` or `cancel` returns (`leased`): the engine must not
free, evict or reuse them before. Its destination blocks are leased under the epoch the
receiver issued (``add(..., epoch=...)``, stamped on every notice): when the sender gives a
request up before its last notice (cancel, failure, a removal of an incomplete request, the
receiver asking), it posts the fence ``revoke(request_id, epoch)`` down the notices' channel
once no copy touches the request any more, and the receiver may hand the blocks out again.

Host tier (kvferry.tiers). ``KVSender(..., host_pool=...)`` reads blocks evicted to host
memory straight from the host pool: source ids ``[0, D)`` name device-pool blocks, ``[D, D +
H)`` host-pool blocks ``id - D``. ``order_after(ids, signal)`` orders every later copy that
reads one of ``ids`` after the tier's own copy writing them (an offload, an onboard). A
request's lease covers its blocks in either pool.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, TypedDict, Union

import numpy as np
import numpy.typing as npt

from kvferry._core import RequestSpec, SlicePlan, TransferBook, TransferLedger
from kvferry.engine import CopyEngine, Pending, engine_for
from kvferry.errors import InvalidArgumentError, TransferError, TransferTimeoutError, UnknownRequestError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.tiers import Signal, Source, TierOrdering, check_signal, source_ids, tiered_source
from kvferry.transports.base import Transport, TransportFull, Write, kept

__all__ = ["KVSender", "SenderStage", "TransferRecord"]

IntArray = npt.ArrayLike
# How often the announcer looks at a write whose engine cannot wake it on completion (CUDA).
PROGRESS_SECONDS = 200e-6
# How often the announcer asks the transport about its receiver while requests are
# registered (a syscall each time for a socket transport).
PEER_CHECK_SECONDS = 5e-3
# How long losing the receiver waits for local copies still reading source blocks, when the
# sender has no timeout of its own.
LOST_PEER_WAIT_SECONDS = 5.0


class _Tables(TypedDict):
    """The book's block-table arguments (`KVSender._tables`)."""

    src_block_table: IntArray
    dst_block_table: IntArray
    src_blocks: int
    dst_blocks: int


class SenderStage(enum.IntEnum):
    """Where a request is on the sender. Ordered (as vLLM's ``RequestStatus``) so that "in
    the book" (registered: later sends plan it, its source blocks are leased) is one
    comparison, ``stage <= REVOKED``; from ``DRAINING`` on the request is out of the book and
    waits only for its queued copies, its fence, or the acknowledgement of its failure.

    ```
    add -> SENDING --cancel, a failure, the receiver's cancellation--> REVOKED
              |                                                           |           |
              | remove                         cancel returns (or remove) |           | failed, and no
              v                                                           |           v copy reads it
           DRAINING <-----------------------------------------------------'        SETTLED
              |  its queued copies posted, its fence (if due) posted                  | remove or cancel
              v                                                                       v acknowledges it
          (forgotten) <---------------------------------------------------------------'
    ```
    """

    SENDING = 0  # registered: slices are planned, their notices posted
    REVOKED = 1  # cancelled or failed, still in the book: nothing more is planned, its notices dropped
    DRAINING = 2  # out of the book (cancel, remove): its queued copies' notices dropped, its fence follows
    SETTLED = 3  # failed and out of the book (no copy reads it): its error waits for remove or cancel


@dataclass
class _Request:
    """The sender's one record of a request, from `KVSender.add` until it is forgotten."""

    epoch: int  # the receiver's lease, stamped on every notice and on the fence
    stage: SenderStage = SenderStage.SENDING
    next_slice: int = 0
    # Failure bookkeeping, apart from the stages: the error (kept until remove or cancel
    # acknowledges it) and, once no copy reads its blocks, its ledger out of the book.
    error: Optional[TransferError] = None
    ledger: Optional[TransferLedger] = None

    @property
    def registered(self) -> bool:
        return self.stage <= SenderStage.REVOKED

    @property
    def drops_notices(self) -> bool:
        return self.stage in (SenderStage.REVOKED, SenderStage.DRAINING)


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

    kind: str  # "early" (before the forward), "chunk" (after it) or "layer" (during it)
    notices: tuple[Notice, ...]
    nbytes: int
    submitted: float
    started: float  # when the copy ran, where the engine knows; else submitted
    finished: float  # else when the sender saw it done


class KVSender:
    """Owned by the executor thread. ``send_*`` return at once with the notices they will
    post; each is posted once its copy finished (by the announcer thread, or by `poll` with
    ``progress=False``), in the order the copies were queued; a block can never leave twice,
    because every slice is claimed in the book first."""

    def __init__(
        self,
        pool: PagedKV,
        transport: Transport,
        *,
        pipelined: bool = True,
        engine: Optional[CopyEngine] = None,
        timeout: Optional[float] = None,
        record: bool = False,
        progress: bool = True,
        layer_groups: int = 1,
        host_pool: Optional[PagedKV] = None,
    ) -> None:
        """``timeout``: seconds a queued copy may take, counted from its submission (so after
        the forward that produced it: a request in prefill is never timed out).
        ``progress`` (default on): a background thread, the announcer, posts each write's
        notices as soon as the write finished, and the fences that follow them, so a copy
        reaches the receiver without further calls; `poll` stays cheap and may still be
        called every step (it posts what the announcer has not yet, raises what the announcer
        found, and times writes out). ``progress=False``: notices are posted only by `poll`, `flush`, `remove`
        and `cancel`, on the executor's thread. ``layer_groups``: the pool's layers
        split into that many consecutive groups (`PagedKV.group_layers`) that may stream
        separately (`send_layers`).
        ``host_pool``: the engine's host tier, a CPU pool of ``pool``'s block layout (pinned
        when ``pool`` is on CUDA); source ids from ``pool.num_blocks`` on name its blocks
        (see the module doc), which are read from it directly."""
        pool.check_compatible(transport.geometry())
        if isinstance(layer_groups, bool) or not isinstance(layer_groups, (int, np.integer)):
            raise TypeError(f"layer_groups must be an int, got {type(layer_groups).__name__} {layer_groups!r}")
        if not 1 <= layer_groups <= pool.num_layers:
            raise InvalidArgumentError(
                f"invalid layer_groups={layer_groups}: must be in [1, {pool.num_layers}] (the pool's layers)"
            )
        if timeout is not None and not timeout > 0:
            raise InvalidArgumentError(f"invalid timeout={timeout}: must be > 0 or None")
        self.host_pool = host_pool
        # What writes read: the pool, or the pool and its host tier behind one id space.
        self.source: Source = pool if host_pool is None else tiered_source(pool, host_pool)
        transport.check_source(self.source)
        self.timeout = timeout
        self.pool = pool
        self.transport = transport
        self.book = TransferBook(pool.tokens_per_block, pipelined=pipelined, layer_groups=int(layer_groups))
        self.layer_groups = int(layer_groups)
        # Tier copies the engine declared (order_after) whose signals have not completed.
        self._ordering = TierOrdering()
        self.engine = engine if engine is not None else engine_for(pool)
        # One record per request (`_Request`); the rest below is the sender's, not a request's.
        self._requests: dict[int, _Request] = {}
        self._inflight: deque[_Job] = deque()  # the queue of writes, in the order they were queued
        # The queue of fences: requests given up before their last notice, in the order they
        # were; each fence is posted once no unfinished copy touches its request.
        self._fences: dict[int, _Request] = {}
        self.records: Optional[list[TransferRecord]] = [] if record else None
        # The executor thread and the announcer thread share the queue of writes.
        self._lock = threading.RLock()
        # Errors found where they could not be raised (the announcer thread, a cancel that
        # posted other requests' writes): each raised by one of the executor's next polls or
        # flushes, oldest first.
        self._deferred: deque[BaseException] = deque()
        self._lost: Optional[TransferError] = None  # the receiver is gone: nothing can be sent
        self._closing = threading.Event()
        self._wake = threading.Event()  # a write was queued, a request added, or close began
        self._progress: Optional[threading.Thread] = None
        if progress:
            # The thread holds the sender only weakly: a sender dropped without `close` is
            # collected, and its thread ends (the finalizer wakes it).
            self._progress = threading.Thread(
                target=_announcer,
                args=(weakref.ref(self), self._wake, self._closing),
                name="kvferry-sender-progress",
                daemon=True,
            )
            weakref.finalize(self, self._wake.set)
            self._progress.start()

    def _announce_step(self, next_check: float) -> tuple[bool, Optional[Pending], bool, float]:
        """One pass of the announcer (`_announcer`): asks the transport about the receiver
        (at most every ``PEER_CHECK_SECONDS``, while requests are registered or writes
        queued), posts every finished write at the head of the queue, in order, under the
        same lock as `poll`. Returns whether to stop, the oldest unfinished write, whether
        anything is registered or queued, and when to check the receiver next."""
        # The error is queued under the same hold of the lock that found it: a flush on the
        # executor thread that took the lock in between would find neither the write nor its
        # error, and return as if the write had landed.
        with self._lock:
            try:
                watching = bool(self._inflight) or any(r.registered for r in self._requests.values())
                if watching and time.monotonic() >= next_check:
                    # The receiver's cancellations are taken here too, so that a request it
                    # gave up on gets its fence without waiting for the executor.
                    next_check = time.monotonic() + PEER_CHECK_SECONDS
                    self._check_peer()
                while self._inflight and self._inflight[0].pending.done():
                    self._finish(self._inflight.popleft())
                return False, self._inflight[0].pending if self._inflight else None, watching, next_check
            except TransferError as err:  # its requests are failed already; later writes still post
                self._defer(err)
                return self._lost is not None, None, True, next_check  # lost: nothing can be posted
            except BaseException as err:  # handed to the executor thread at its next call
                self._defer(err)
                return True, None, False, next_check

    def _defer(self, err: BaseException) -> None:
        # Each error is raised once, in the order found (a lost receiver is one error however
        # many writes it ended, so it is kept once).
        with self._lock:
            if all(err is not kept for kept in self._deferred):
                self._deferred.append(err)

    def _raising(self, err: TransferError) -> TransferError:
        """``err``, about to be raised on the executor's thread: out of the queue of errors
        found elsewhere (the announcer may have queued the same loss), so it is raised once."""
        with contextlib.suppress(ValueError):
            self._deferred.remove(err)
        return err

    def _raise_deferred_error(self) -> None:
        if self._deferred:
            raise self._deferred.popleft()

    def add(self, request_id: int, spec: Union[RequestSpec, int, None] = None, **fields: Any) -> None:
        """Registers a request and announces it to the receiver. ``spec``: its `RequestSpec`,
        or its prompt length with the spec's other fields as keywords (``reused_len``,
        ``window``, ``context_only``, ``held``, ``epoch``; ``prompt_len`` too). ``held``: blocks the receiver
        already holds (it advertised them before prefill, by block hash): they count as sent
        and never cross. ``epoch``: the lease `KVReceiver.expect` issued for the request's
        destination blocks, stamped on its notices and its fence (0: none given; then a late
        notice cannot be told from a fresh one). Its source blocks are leased from now on
        (`leased`). Nothing is registered if any argument is refused or the receiver is gone."""
        spec = request_spec(spec, fields)
        with self._lock:
            self._check_peer()
            if self._lost is not None:
                raise self._raising(self._lost)
            self._drain()  # copies of an earlier request with this id may just have finished
            earlier = self._requests.get(request_id)
            if earlier is not None and earlier.stage != SenderStage.SENDING:  # a registered one: the book refuses it
                raise InvalidArgumentError(
                    f"invalid request_id={request_id}: its previous transfer is not settled (copies still queued, or its failure not acknowledged)"
                )
            self.book.add_spec(request_id, spec)  # with its held blocks, all or nothing
            try:
                self.transport.announce([(request_id, spec.epoch)])
            except TransferError as err:  # the receiver is gone
                self.book.remove(request_id)
                raise self._lose_peer(err) from err
            except BaseException:
                self.book.remove(request_id)
                raise
            self._requests[int(request_id)] = _Request(spec.epoch)
            self._wake.set()  # the announcer watches for the receiver's cancellations now

    def send_early(self, request_ids: IntArray, src_block_table: IntArray, dst_block_table: IntArray) -> list[Notice]:
        """Before the context forward: the complete reused blocks of the eligible requests."""
        with self._lock:
            self._refuse_revoked(request_ids)
            return self._dispatch(
                self.book.plan_early(request_ids, **self._tables(src_block_table, dst_block_table)), "early"
            )

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
            plan = self.book.plan_chunks(
                request_ids, chunk_starts, chunk_ends, **self._tables(src_block_table, dst_block_table)
            )
            return self._dispatch(plan, "chunk")

    def send_layers(
        self,
        request_ids: IntArray,
        chunk_starts: IntArray,
        chunk_ends: IntArray,
        group: int,
        src_block_table: IntArray,
        dst_block_table: IntArray,
    ) -> list[Notice]:
        """During a context forward, once layer group ``group``'s layers of it ran: that
        group's layers of the blocks each chunk ``[start, end)`` completes (layer-wise
        streaming, normally on the last chunk). Each block crosses once per group; the
        chunk's `send_chunks` afterwards sends only the blocks no group sent."""
        with self._lock:
            self._refuse_revoked(request_ids)
            plan = self.book.plan_layers(
                request_ids, chunk_starts, chunk_ends, group, **self._tables(src_block_table, dst_block_table)
            )
            return self._dispatch(plan, "layer", int(group))

    def _tables(self, src_block_table: IntArray, dst_block_table: IntArray) -> _Tables:
        """The book's block-table arguments, with both pools' sizes: a planned id outside
        its pool, or a destination planned twice, fails the call before anything is claimed
        (after the claim the copy would refuse it, and the blocks would count as sent)."""
        return {
            "src_block_table": src_block_table,
            "dst_block_table": dst_block_table,
            "src_blocks": self.source.num_blocks,
            "dst_blocks": self.transport.num_blocks,
        }

    def order_after(self, src_ids: IntArray, signal: Signal) -> None:
        """Declares that the engine's tier is writing source blocks ``src_ids`` (combined
        ids: an onboard writing device blocks, an offload writing host blocks) until
        ``signal`` completes: a recorded `torch.cuda.Event` (the copy stream waits on it),
        or a `threading.Event` / `concurrent.futures.Future` the tier completes (the copy
        waits for it before it reads; a Future's exception fails the write). Every copy
        queued after this call that reads one of those blocks runs after the signal;
        copies queued before are not affected (the lease keeps the tier from writing the
        blocks they read). The declaration is dropped once the signal completed."""
        host_blocks = 0 if self.host_pool is None else self.host_pool.num_blocks
        ids = source_ids("src_ids", src_ids, self.pool.num_blocks, host_blocks)
        check_signal(signal)
        with self._lock:
            self._ordering.add(ids, signal)

    def _refuse_revoked(self, request_ids: IntArray) -> None:
        """Before anything is claimed: refuses to send after the receiver was lost, or for
        requests that failed or were cancelled."""
        self._check_peer()
        if self._lost is not None:
            raise self._raising(self._lost)
        records = [r for r in map(self._requests.get, np.asarray(request_ids).tolist()) if r is not None]
        for record in records:
            if record.error is not None:
                raise record.error
        hit = sorted(rid for rid in set(np.asarray(request_ids).tolist()) if self._drops(rid))
        if hit:
            raise InvalidArgumentError(f"invalid request_ids: {hit} were cancelled")

    def _dispatch(self, plan: SlicePlan, kind: str, group: Optional[int] = None) -> list[Notice]:
        """Queues the copy of a plan made with block tables (the book refused bad tables
        before claiming anything, so nothing is marked sent that cannot leave). A transport
        with a `Transport.max_write_blocks` gets the plan in writes of at most that many
        blocks, each with notices for its own part of the slices, so the receiver can take in
        one write while the next is still being copied. A layer slice (``group``) writes and
        announces only that layer group's layers."""
        pairs = plan.pairs
        if not len(plan) or pairs is None:
            return []
        limit = self.transport.max_write_blocks or plan.total_blocks
        groups = 1 if group is None else self.layer_groups
        layers = None if groups == 1 else self.pool.group_layers(group or 0, groups)
        block_bytes = self.pool.block_bytes * (self.pool.num_layers if layers is None else layers[1] - layers[0])
        notices: list[Notice] = []
        piece: list[Notice] = []
        slices = list(plan.slices())
        lo = hi = 0  # the current write's pairs
        try:
            for at, (request_id, blocks, last) in enumerate(slices):
                start = blocks.start
                while start < blocks.end:
                    end = min(blocks.end, start + limit - (hi - lo))
                    record = self._requests[request_id]
                    slice_id, record.next_slice = record.next_slice, record.next_slice + 1
                    piece.append(
                        Notice(
                            request_id,
                            slice_id,
                            start,
                            end,
                            last and end == blocks.end,
                            record.epoch,
                            group or 0,
                            groups,
                        )
                    )
                    hi += end - start
                    start = end
                    if hi - lo == limit:
                        self._queue(pairs.src[lo:hi], pairs.dst[lo:hi], piece, kind, (hi - lo) * block_bytes, layers)
                        notices += piece
                        piece, lo = [], hi
            if piece:
                at = len(slices)
                self._queue(pairs.src[lo:hi], pairs.dst[lo:hi], piece, kind, (hi - lo) * block_bytes, layers)
                notices += piece
        except TransferError as err:
            if self._lost is not None:
                raise
            # Claimed in the book but never queued: those requests cannot complete any more.
            ids = sorted({n.request_id for n in piece} | {r for r, _, _ in slices[at:]})
            failed = type(err)(
                f"{err}; requests {ids} failed (claimed, never written)", request_ids=ids, peer=self._peer_name()
            )
            raise self._fail(ids, failed) from err
        return notices

    def _queue(
        self,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        notices: list[Notice],
        kind: str,
        nbytes: int,
        layers: Optional[tuple[int, int]],
    ) -> None:
        pending, submitted = self._write(src_ids, dst_ids, notices, layers)
        self._inflight.append(_Job(pending, tuple(notices), submitted, kind, nbytes))
        self._wake.set()

    def _write(
        self, src_ids: np.ndarray, dst_ids: np.ndarray, notices: list[Notice], layers: Optional[tuple[int, int]]
    ) -> tuple[Pending, float]:
        """Queues a write; returns it and when it was handed to the transport (before: the
        engine may start it at once, and a record must not show it starting before it was
        submitted). A transport out of room gets the oldest writes posted (so its receiver
        can release them) and is waited on, within the sender's timeout. A transport that
        finds its receiver gone (the staging ring reading a closed socket) fails every
        request here and now, this write's included."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        ids = sorted({n.request_id for n in notices})
        after = self._ordering.signals_for(src_ids)  # tier copies still writing what it reads
        while True:
            try:
                submitted = time.monotonic()
                return self.transport.write(
                    self.engine, Write(self.source, src_ids, dst_ids, notices, after, layers)
                ), submitted
            except TransportFull as full:
                left = 30.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"transport stayed full past the sender's timeout: {full}") from full
                if self._inflight:
                    job = self._inflight[0]
                    if job.pending.wait(left):
                        try:
                            self._finish(self._inflight.popleft())
                        except TransferError as err:  # that write's requests failed, not these
                            if self._lost is not None:
                                raise
                            self._defer(err)
                    continue
                try:
                    room = self.transport.wait_for_room(left)
                except TransferError as err:
                    raise self._lose_peer(err, unposted=ids) from err
                if not room and deadline is None:
                    raise TransferTimeoutError(f"transport full and nothing in flight to wait for: {full}") from full
            except TransferError as err:
                raise self._lose_peer(err, unposted=ids) from err

    def poll(self) -> list[Notice]:
        """Posts the notices of every finished copy not posted yet, oldest first, and returns
        them (with the announcer on, usually none: it posted them already). Raises an error
        the announcer found (a failed write, the receiver's cancellation, a lost receiver),
        and `TransferTimeoutError` when the oldest copy has run past the sender's timeout."""
        with self._lock:
            return self._poll()

    def _poll(self) -> list[Notice]:
        self._check_peer()
        self._raise_deferred_error()
        posted: list[Notice] = []
        while self._inflight and self._inflight[0].pending.done():
            posted.extend(self._finish(self._inflight.popleft()))
        if self._inflight and self.timeout is not None:
            job = self._inflight[0]
            age = time.monotonic() - job.submitted_at
            if age > self.timeout:
                ids = sorted(rid for rid in {n.request_id for n in job.notices} if not self._drops(rid))
                if self._abort(job):
                    # A write that can be called off (NIXL to a hung peer): its requests fail
                    # now instead of waiting on a peer that may never answer.
                    self._inflight.remove(job)
                    self._abandon(job)
                    self._post_fences()  # the cancelled requests it carried
                    if not ids:  # it only carried cancelled requests: nobody to tell
                        return posted
                    err = TransferTimeoutError(
                        f"write of requests {ids} still running after {age:.3f} s (timeout {self.timeout} s): aborted; "
                        f"the requests failed and were released (peer: {self._peer_name()})",
                        request_ids=ids,
                        peer=self._peer_name(),
                    )
                    raise self._fail(ids, err)
                raise TransferTimeoutError(
                    f"copies for requests {ids} still running after {age:.3f} s (timeout {self.timeout} s): cancel them (peer: {self._peer_name()})",
                    request_ids=ids,
                    peer=self._peer_name(),
                )
        return posted

    def flush(self, timeout: Optional[float] = None) -> list[Notice]:
        """Waits for every queued copy and posts its notices."""
        with self._lock:
            return self._flush(timeout)

    def _flush(self, timeout: Optional[float]) -> list[Notice]:
        self._check_peer()
        self._raise_deferred_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        posted: list[Notice] = []
        while self._inflight:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            job = self._inflight[0]
            if not job.pending.wait(left):
                ids = sorted({n.request_id for n in job.notices})
                raise TransferTimeoutError(
                    f"copies for requests {ids} did not finish within {timeout} s (peer: {self._peer_name()})",
                    request_ids=ids,
                    peer=self._peer_name(),
                )
            posted.extend(self._finish(self._inflight.popleft()))
        return posted

    def _finish(self, job: _Job) -> tuple[Notice, ...]:
        ids = sorted({n.request_id for n in job.notices})
        if self._lost is not None:  # its requests failed with the receiver: only settle them
            self._abandon(job)
            self._settle(ids)
            return ()
        error = job.pending.error()
        if error is not None:
            self._abandon(job)
            self._check_peer()  # a write fails when its receiver died: then every request fails
            err = TransferError(
                f"write of requests {ids} failed: {error} (peer: {self._peer_name()})",
                request_ids=ids,
                peer=self._peer_name(),
            )
            raise self._fail(ids, err) from error
        revoked = frozenset(rid for rid in ids if self._drops(rid))
        try:
            self.transport.post(job.notices, revoked)
        except TransferError as err:  # the transport lost its receiver
            raise self._lose_peer(err, unposted=ids) from err
        if self.records is not None:
            started, finished = job.pending.interval() or (job.submitted_at, time.monotonic())
            self.records.append(TransferRecord(job.kind, job.notices, job.nbytes, job.submitted_at, started, finished))
        notices = tuple(kept(job.notices, revoked))
        for request_id in revoked:
            self._tidy(request_id)  # cancelled and no copy left: forgotten
        self._settle(ids)
        self._post_fences()
        return notices

    def in_flight(self, request_id: int) -> bool:
        """Whether a queued copy still carries blocks of the request (finished copies count
        until their notices are posted)."""
        with self._lock:
            return any(n.request_id == request_id for job in self._inflight for n in job.notices)

    def _reading(self, request_id: int) -> bool:
        """Whether a queued copy that carries the request's blocks has not finished."""
        return any(
            not job.pending.done() for job in self._inflight if any(n.request_id == request_id for n in job.notices)
        )

    def leased(self, request_id: int) -> bool:
        """Whether the request's source blocks are leased to the sender: it is registered (a
        later send reads them) or an unfinished copy reads them. The engine may free, evict
        or reuse them only while this is false: once `remove` or `cancel` returned (a
        `cancel` that raised keeps the lease), or, for a failed request, once its copies
        ended. Host-tier blocks included: while leased, the tier must not overwrite, evict
        or move them either."""
        with self._lock:
            record = self._requests.get(request_id)
            return (record is not None and record.registered) or self._reading(request_id)

    def failures(self) -> dict[int, TransferError]:
        """Requests that failed and that `remove` or `cancel` has not acknowledged yet, with
        their errors. Their source blocks are free once `leased` is false for them."""
        with self._lock:
            return {rid: r.error for rid, r in self._requests.items() if r.error is not None}

    def stage(self, request_id: int) -> SenderStage:
        """The request's current `SenderStage` (`UnknownRequestError` once it is forgotten)."""
        with self._lock:
            return self._record(request_id).stage

    def _record(self, request_id: int) -> _Request:
        record = self._requests.get(request_id)
        if record is None:
            raise UnknownRequestError(f"unknown request_id={request_id}: never added or already removed")
        return record

    def _drops(self, request_id: int) -> bool:
        """Whether the request's notices are dropped (cancelled or failed: revoked)."""
        record = self._requests.get(request_id)
        return record is not None and record.drops_notices

    def _peer_name(self) -> str:
        return self.transport.peer

    def _check_peer(self) -> None:
        """Asks the transport whether its receiver is still there (the first time it is not,
        fails every request and raises), then takes the receiver's cancellations: each
        request it gave up on fails (the error is raised by the next `poll` or `flush`) and
        gets its fence once its copies end. A cancellation names the epoch it was issued
        for, so one meant for an earlier request with the same id is ignored."""
        if self._lost is not None:
            return
        try:
            self.transport.check_peer()
        except TransferError as lost:
            raise self._lose_peer(lost) from lost
        ids = [rid for rid, epoch in self.transport.cancel_requests() if epoch and self._sending_under(rid, epoch)]
        if ids:
            ids = sorted(set(ids))
            peer = self._peer_name()
            err = TransferError(
                f"requests {ids} cancelled by the {peer}: revoked, their fences follow their last copies",
                request_ids=ids,
                peer=peer,
            )
            self._defer(self._fail(ids, err))

    def _sending_under(self, request_id: int, epoch: int) -> bool:
        record = self._requests.get(request_id)
        return record is not None and record.epoch == epoch and record.stage == SenderStage.SENDING

    def _post_fences(self) -> None:
        """Posts the fence of every request given up whose copies have all ended."""
        due = list(self._fences.items())
        if self._lost is not None:  # the receiver is gone: its connection's end is the fence
            self._fences.clear()
            for request_id, _ in due:
                self._tidy(request_id)
            return
        for request_id, record in due:
            if self._reading(request_id):
                continue
            del self._fences[request_id]
            self._tidy(request_id)
            try:
                self.transport.revoke(request_id, record.epoch)
            except TransferError as err:
                raise self._lose_peer(err) from err

    def _lose_peer(self, cause: TransferError, unposted: Sequence[int] = ()) -> TransferError:
        """The receiver is gone: every request fails (a sender has one receiver) except those
        whose every block had been posted, every queued write is waited for (they read
        source blocks) or aborted, then dropped unposted. ``unposted``: requests of a write
        whose notices could not be posted."""
        if self._lost is not None:
            return self._raising(self._lost)
        ids = sorted(
            r
            for r, rec in self._requests.items()
            if rec.registered and (r in unposted or self.in_flight(r) or not self.book.is_complete(r))
        )
        self._fences.clear()
        self._lost = TransferError(
            f"{cause}; requests {ids} failed and were released", request_ids=ids, peer=self._peer_name()
        )
        self._fail(ids, self._lost)
        deadline = time.monotonic() + (self.timeout if self.timeout is not None else LOST_PEER_WAIT_SECONDS)
        while self._inflight:
            job = self._inflight[0]
            if not job.pending.wait(max(0.0, deadline - time.monotonic())) and not self._abort(job):
                break  # still reading source blocks: settled by a later poll
            self._inflight.popleft()
            self._abandon(job)
        self._settle(ids)
        return self._raising(self._lost)

    def _fail(self, request_ids: list[int], error: TransferError) -> TransferError:
        """Fails requests: revoked at once (no more notices), released from the book once no
        copy reads their blocks. Returns ``error``."""
        for request_id in request_ids:
            record = self._requests.get(request_id)
            if record is not None and record.registered and record.error is None:
                self._to_revoked(request_id, record)
                record.error = error
        self._settle(request_ids)
        return error

    # The edges of `SenderStage`'s diagram, one method each; `_leave_book` is the clean-up
    # that settle, cancel and remove share, `_tidy` forgets what has nothing left to do.

    def _to_revoked(self, request_id: int, record: _Request) -> None:
        """SENDING -> REVOKED: nothing more is planned; its fence is due once its copies end."""
        self.book.cancel(request_id)
        record.stage = SenderStage.REVOKED
        self._fences[request_id] = record

    def _leave_book(self, request_id: int, record: _Request) -> TransferLedger:
        """REVOKED or SENDING -> SETTLED (failed) or DRAINING: out of the book; returns its
        ledger. Then the fences that are due are posted, and the record forgotten if nothing
        is left to do for it."""
        ledger = self.book.remove(request_id)
        if record.error is not None:
            record.stage, record.ledger = SenderStage.SETTLED, ledger
        else:
            record.stage = SenderStage.DRAINING
            if not ledger.is_complete:
                self._fences.setdefault(request_id, record)
        self._post_fences()
        self._tidy(request_id)
        return ledger

    def _tidy(self, request_id: int) -> None:
        """Forgets a request out of the book with no copy queued and no fence due (a failed
        one waits for its acknowledgement)."""
        record = self._requests.get(request_id)
        if (
            record is not None
            and record.stage == SenderStage.DRAINING
            and request_id not in self._fences
            and not self.in_flight(request_id)
        ):
            del self._requests[request_id]

    def _settle(self, request_ids: list[int]) -> None:
        """Releases the book entries of failed requests that no copy reads any more."""
        for request_id in request_ids:
            record = self._requests.get(request_id)
            if record is not None and record.error is not None and record.registered and not self.in_flight(request_id):
                self._leave_book(request_id, record)
        self._post_fences()

    def _abort(self, job: _Job) -> bool:
        # Only some writes can be called off (a NIXL transfer); a local copy always runs to
        # its end, so its source blocks stay busy until then.
        return job.pending.abort()

    def _abandon(self, job: _Job) -> None:
        try:
            self.transport.abandon(job.notices)
        except TransferError:
            pass  # the receiver is gone: it holds nothing of ours any more

    def _drain(self) -> None:
        """Posts finished writes; their failures (and a lost receiver) are kept for the next
        poll: the caller asked about one request, not about these."""
        try:
            self._check_peer()
        except TransferError as err:
            self._defer(err)
        while self._inflight and self._inflight[0].pending.done():
            try:
                self._finish(self._inflight.popleft())
            except TransferError as err:
                self._defer(err)

    def _acknowledge(self, request_id: int) -> TransferLedger:
        """Forgets a failed request whose copies are all done; returns its ledger."""
        self._drain()
        self._settle([request_id])
        record = self._requests[request_id]
        if record.ledger is None:
            raise InvalidArgumentError(
                f"invalid request_id={request_id}: failed ({record.error}), "
                "but copies reading its blocks are still in flight"
            )
        del self._requests[request_id]  # SETTLED -> forgotten
        return record.ledger

    def cancel(self, request_id: int, timeout: Optional[float] = 5.0) -> TransferLedger:
        """Revokes a request: nothing more is planned or announced for it. Waits up to
        ``timeout`` seconds for queued copies that read its blocks, then forgets it and
        returns its ledger; its source blocks are the caller's to free once this returns.
        If those copies outlive the wait, raises `TransferTimeoutError` and keeps the request
        revoked (call again before freeing the blocks)."""
        with self._lock:
            return self._cancel(request_id, timeout)

    def _cancel(self, request_id: int, timeout: Optional[float]) -> TransferLedger:
        record = self._registered(request_id)
        if record.error is not None:
            self._wait_for(request_id, timeout)
            return self._acknowledge(request_id)
        if record.stage == SenderStage.SENDING:  # not a second call after a timeout
            self._to_revoked(request_id, record)
        self._wait_for(request_id, timeout)
        self._drain()
        if record.error is not None:  # one of the writes just drained failed it
            return self._acknowledge(request_id)
        return self._leave_book(request_id, record)  # its copies ended: the receiver may reuse its blocks

    def _registered(self, request_id: int) -> _Request:
        """The record of a request in the book, or of a failure not yet acknowledged."""
        record = self._requests.get(request_id)
        if record is None or not (record.registered or record.error is not None):
            raise UnknownRequestError(f"unknown request_id={request_id}: never added or already removed")
        return record

    def _wait_for(self, request_id: int, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self._inflight):
            if any(n.request_id == request_id for n in job.notices):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not job.pending.wait(left):
                    raise TransferTimeoutError(
                        f"request {request_id}: copies reading its blocks still running after {timeout} s",
                        request_ids=(request_id,),
                        peer=self._peer_name(),
                    )

    def remove(self, request_id: int) -> TransferLedger:
        """Forgets a request whose copies have all finished (or that failed: acknowledges its
        failure); returns its ledger. A request removed before all its blocks were sent gets
        its fence: nothing more will come for it."""
        with self._lock:
            return self._remove(request_id)

    def _remove(self, request_id: int) -> TransferLedger:
        self._drain()
        record = self._registered(request_id)
        if record.error is not None:
            return self._acknowledge(request_id)
        if self.in_flight(request_id):
            raise InvalidArgumentError(f"invalid request_id={request_id}: copies still in flight (flush or wait first)")
        return self._leave_book(request_id, record)  # an incomplete one gets its fence

    def close(self) -> None:
        """Finishes queued copies (within the sender's timeout, if it has one), posts the
        fence of every request still registered that the receiver cannot complete, then
        releases the engine and the transport. After the receiver was lost there is nothing
        to post."""
        self._closing.set()
        self._wake.set()
        if self._progress is not None:
            self._progress.join(timeout=5)
        try:
            with self._lock:
                if self._lost is None and self._inflight:
                    self._flush(self.timeout)
                elif self._lost is None:
                    self._raise_deferred_error()
        finally:
            with self._lock:
                for job in self._inflight:
                    self._abort(job)  # must not run on into a closed transport
            self.engine.close()  # waits for local copies: none reads or writes after this
            with self._lock:
                self._fence_remaining()
            self.transport.close()

    def _fence_remaining(self) -> None:
        """At close: registered requests whose last notice was not posted get their fences
        (a cross-process receiver would also see the connection end; one in this process
        would not)."""
        if self._lost is not None:
            return
        for request_id, record in self._requests.items():
            if record.registered and (
                record.drops_notices or self.in_flight(request_id) or not self.book.is_complete(request_id)
            ):
                self._fences.setdefault(request_id, record)
        try:
            self._post_fences()
        except TransferError:
            pass  # the receiver is gone: nothing to tell it


def _announcer(ref: weakref.ReferenceType[KVSender], wake: threading.Event, closing: threading.Event) -> None:
    """The sender's announcer thread: posts each write's notices as soon as the write
    finished (`KVSender._announce_step`). It sleeps in the oldest write's `Pending.wait`
    where the engine wakes it on completion (a CPU copy's future), else looks every
    ``PROGRESS_SECONDS`` (a CUDA event has no timed wait); with no write queued it sleeps
    until one is, waking every ``PEER_CHECK_SECONDS`` while requests are registered to take
    the receiver's cancellations."""
    next_check = 0.0
    while not closing.is_set():
        wake.clear()  # before looking: a write queued after the look sets it again
        sender = ref()
        if sender is None:
            return
        stop, head, watching, next_check = sender._announce_step(next_check)
        del sender  # not kept alive while this thread sleeps
        if stop:
            return
        if head is not None and head.wakes_on_done:
            head.wait(PEER_CHECK_SECONDS)
        elif head is not None:
            wake.wait(PROGRESS_SECONDS)
        else:
            wake.wait(PEER_CHECK_SECONDS if watching else None)


def request_spec(spec: Union[RequestSpec, int, None], fields: Mapping[str, Any]) -> RequestSpec:
    """``spec`` itself, or (the keyword form every ``add`` also takes) a `RequestSpec` of
    prompt length ``spec`` (or ``fields["prompt_len"]``) and the other fields in ``fields``."""
    if isinstance(spec, RequestSpec):
        if fields:
            raise TypeError(f"spec is a RequestSpec already: {', '.join(sorted(fields))} cannot be given again")
        return spec
    return RequestSpec(**fields) if spec is None else RequestSpec(spec, **fields)


def as_table(rows: list[np.ndarray], width: int) -> np.ndarray:
    """Stacks per-request block-id arrays into a ``(len(rows), width)`` table (unused entries
    -1): the shape ``send_*`` take, for callers that keep one array per request."""
    table = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table
