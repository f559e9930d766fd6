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
import dataclasses
import enum
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, NoReturn, Optional, Sequence, TypedDict, Union

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np
import numpy.typing as npt
import torch

from kvferry import affinity
from kvferry._core import RequestSpec, SlicePlan, TransferBook, TransferLedger
from kvferry.checksum import WriteChecksums, checksum_option
from kvferry.engine import CopyEngine, Pending, engine_for
from kvferry.errors import (
    InvalidArgumentError,
    TransferError,
    TransferTimeoutError,
    UnknownRequestError,
    UnqueuedWriteError,
)
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.tiers import Signal, Source, TierOrdering, check_signal, source_ids, tiered_source
from kvferry.transports.base import Transport, TransportFull, Write, kept
from kvferry.transports.inprocess import InProcessTransport

__all__ = ["KVSender", "SenderStage", "TransferRecord", "default_handoff"]

IntArray = npt.ArrayLike
# How often the announcer looks at a write whose engine cannot wake it on completion (CUDA).
PROGRESS_SECONDS = 200e-6
# How often the announcer asks the transport about its receiver while requests are
# registered (a syscall each time for a socket transport).
PEER_CHECK_SECONDS = 5e-3
# How long losing the receiver waits for local copies still reading source blocks, when the
# sender has no timeout of its own.
LOST_PEER_WAIT_SECONDS = 5.0
# Blocks a sender keeps waiting for room in its transport (the backlog: writes planned and
# numbered, not yet handed to the transport) unless told otherwise; a send past it fails the
# requests of its plan with an error naming the bound. A backlogged write holds only ids.
BACKLOG_BLOCKS = 1 << 16
# How long `close` waits for the backlog and the queued copies when the sender has no timeout.
CLOSE_SECONDS = 30.0


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
    checksums: Optional[WriteChecksums] = None


@dataclass
class _Held:
    """A write in the backlog: planned, its notices numbered, waiting for room in the
    transport (no byte of it was read yet)."""

    write: Write
    queued_at: float
    kind: str
    nbytes: int

    @property
    def blocks(self) -> int:
        return len(self.write.src_ids)


@dataclass(frozen=True)
class _Op:
    """One network call into the transport, queued in the outbox: ``call(*args)``; a failure
    loses the receiver, naming ``request_ids`` as unposted (unless ``quiet``: an abandon,
    whose receiver holds nothing of ours once it is gone)."""

    call: Any
    args: tuple[Any, ...]
    request_ids: tuple[int, ...] = ()
    quiet: bool = False
    # The same call where it waits on nothing (`Transport.try_post`): whether it was made.
    nowait: Any = None


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
    because every slice is claimed in the book first.

    The executor's calls never wait on the network or on room in the transport:

    ```
    send_*  -> plan (book) -> write fits the transport? -- yes --> transport.write (a local copy queued)
                                    | no (a full staging ring), or writes already wait
                                    v
                              backlog (in order, notices numbered) --> the announcer submits
                                                                       each as room frees
    notices, fences, announces --> outbox (in order) --> sent by the announcer alone
    ```
    Two locks: ``_lock`` guards the sender's state and is never held across network I/O;
    ``_wire`` serialises every call into the transport (a socket is not shared between two
    threads' reads) and is only ever *tried* by the executor's thread, which leaves the
    write to the backlog (or skips the receiver check) when the announcer holds it. With
    ``progress=False`` there is no announcer: the executor's own calls do that I/O.

    One ``send_*`` call is one plan, whatever its number of requests: it goes to the transport
    as one write (or as few as `Transport.write_blocks` allows), whose notices are posted
    together, so an engine step's small sends cost one submission when made in one call. A
    call is refused whole before anything is claimed (an unknown, failed or cancelled request,
    a bad chunk), or, once claimed, raises `UnqueuedWriteError` naming the requests whose
    writes could not be queued (the rest were)."""

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
        backlog_blocks: int = BACKLOG_BLOCKS,
        handoff: Optional[bool] = None,
        checksum: Optional[bool] = None,
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
        (see the module doc), which are read from it directly.
        ``backlog_blocks``: how many blocks of planned writes may wait for room in the
        transport (see the class doc); the timeout counts a backlogged write's wait too.
        ``handoff``: every write is handed to the transport by the announcer thread, never by
        the caller's: whatever work a transport does when given a write (a NIXL post that
        starts sending, a staging copy queued) then runs on the announcer's cores
        (`kvferry.affinity`), off the engine's. Needs ``progress``. None (the default): on for
        CUDA pools over a transport whose submission is costly (`Transport.costly_submit`:
        NIXL), where handing a write over would otherwise hold the engine's thread, not only
        its core, before the forward; off otherwise (`default_handoff`).
        ``checksum``: every block written is summed over its source (kvferry.checksum) and
        its notice carries the sum, which a receiver that checks sums compares with the
        block it received. None (the default): `kvferry.checksum.CHECKSUM_DEFAULT`, where the
        pool's blocks can be summed; True on a pool whose blocks cannot is refused."""
        pool.check_compatible(transport.geometry())
        if handoff and not progress:
            raise InvalidArgumentError("invalid handoff=True with progress=False: the announcer hands writes over")
        if handoff is None:
            handoff = default_handoff(pool.device.type, transport, progress)
        if isinstance(backlog_blocks, bool) or not isinstance(backlog_blocks, (int, np.integer)) or backlog_blocks < 0:
            raise InvalidArgumentError(f"invalid backlog_blocks={backlog_blocks!r}: must be an int >= 0")
        if isinstance(layer_groups, bool) or not isinstance(layer_groups, (int, np.integer)):
            raise TypeError(f"layer_groups must be an int, got {type(layer_groups).__name__} {layer_groups!r}")
        if not 1 <= layer_groups <= pool.num_layers:
            raise InvalidArgumentError(
                f"invalid layer_groups={layer_groups}: must be in [1, {pool.num_layers}] (the pool's layers)"
            )
        if timeout is not None and not timeout > 0:
            raise InvalidArgumentError(f"invalid timeout={timeout}: must be > 0 or None")
        self.host_pool = host_pool
        self.checksum = checksum_option(checksum, pool)
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
        # Writes planned and numbered that the transport had no room for yet, oldest first;
        # every write after one of them waits behind it (the transport sees them in order).
        self._backlog: deque[_Held] = deque()
        self._backlogged = 0  # blocks in the backlog
        self.backlog_blocks = int(backlog_blocks)
        self.handoff = bool(handoff)
        # What goes to the receiver over the network (posts, abandons, fences, announces), in
        # the order it was decided: `_send_outbox` sends it, holding ``_wire`` and not ``_lock``.
        self._outbox: deque[_Op] = deque()
        self._cuda = pool.device.type == "cuda"
        # Both pools in this process: a post is a method call, which the executor's calls
        # make themselves (as they always did) rather than wait for the announcer.
        self._local_io = isinstance(transport, InProcessTransport)
        # The queue of fences: requests given up before their last notice, in the order they
        # were; each fence is posted once no unfinished copy touches its request.
        self._fences: dict[int, _Request] = {}
        self.records: Optional[list[TransferRecord]] = [] if record else None
        # The executor thread and the announcer thread share the queue of writes.
        self._lock = threading.RLock()
        self._wire = threading.Lock()  # held by whoever calls into the transport (class doc)
        self._changed = threading.Condition(self._lock)  # the announcer made progress
        # Errors found where they could not be raised (the announcer thread, a cancel that
        # posted other requests' writes): each raised by one of the executor's next polls or
        # flushes, oldest first.
        self._deferred: deque[BaseException] = deque()
        self._lost: Optional[TransferError] = None  # the receiver is gone: nothing can be sent
        self._closing = threading.Event()
        self._wake = threading.Event()  # a write was queued, a request added, or close began
        # The oldest write's completion sets ``_wake`` (`_arm`), asked for by the executor's
        # call that submitted it as it ends, or by the announcer.
        self._armed: Optional[Pending] = None
        self._watching = False  # the announcer's last pass saw requests or writes to watch
        self._progress: Optional[threading.Thread] = None
        if progress:
            # The thread holds the sender only weakly: a sender dropped without `close` is
            # collected, and its thread ends (the finalizer wakes it).
            self._progress = affinity.Thread(
                target=_announcer,
                args=(weakref.ref(self), self._wake, self._closing),
                name="kvferry-sender-progress",
                daemon=True,
            )
            weakref.finalize(self, self._wake.set)
            self._progress.start()

    def _announce_step(self, next_check: float) -> tuple[bool, Optional[Pending], bool, bool, float]:
        """One pass of the announcer (`_announcer`): asks the transport about the receiver
        (at most every ``PEER_CHECK_SECONDS``, while requests are registered or writes
        queued), moves every finished write at the head of the queue to the outbox, in
        order, hands backlogged writes to the transport while it has room, times out a
        backlogged write that waited past the sender's timeout, then sends the outbox
        (after letting go of ``_lock``: a receiver that stops reading stalls this thread
        only). Returns whether to stop, the oldest unfinished write, whether the backlog
        waits for room with nothing in flight, whether anything is registered or queued,
        and when to check the receiver next."""
        # The error is queued under the same hold of the lock that found it: a flush on the
        # executor thread that took the lock in between would find neither the write nor its
        # error, and return as if the write had landed.
        with self._lock:
            try:
                watching = bool(self._inflight or self._backlog) or any(r.registered for r in self._requests.values())
                if watching and time.monotonic() >= next_check:
                    # The receiver's cancellations are taken here too, so that a request it
                    # gave up on gets its fence without waiting for the executor.
                    next_check = time.monotonic() + PEER_CHECK_SECONDS
                    self._check_peer()
                while self._inflight and self._inflight[0].pending.done():
                    self._finish(self._inflight.popleft())
                # Only tried, as on the executor's thread: a thread holding ``_wire`` may be
                # waiting for ``_lock`` (a failed send losing the receiver).
                starved = self._submit_backlog(block=False) and not self._inflight
                self._time_out_backlog()
                self._watching = watching
                result = (False, self._inflight[0].pending if self._inflight else None, starved, watching, next_check)
            except TransferError as err:  # its requests are failed already; later writes still post
                self._defer(err)
                # Lost: nothing can be posted; the thread stays while copies still read
                # source blocks, to settle their requests when they end.
                head = self._inflight[0].pending if self._inflight else None
                result = (self._lost is not None and head is None, head, False, True, next_check)
            except BaseException as err:  # handed to the executor thread at its next call
                self._defer(err)
                return True, None, False, False, next_check
        self._send_outbox(raising=False)
        with self._lock:
            self._changed.notify_all()
        return result

    def _wait_for_room(self, timeout: float) -> bool:
        """The announcer, with backlogged writes and none in flight: waits (holding
        ``_wire`` only) until the transport's receiver released room or ``timeout`` passed;
        returns whether it did."""
        with self._wire:
            try:
                return self.transport.wait_for_room(timeout)
            except TransferError as err:
                with self._lock:
                    ids = sorted({n.request_id for h in self._backlog for n in h.write.notices})
                    self._defer(self._lose_peer(err, unposted=ids))
                return True

    def _announcing(self) -> bool:
        """Whether the announcer thread runs (and so does the network I/O)."""
        return self._progress is not None and self._progress.is_alive() and not self._closing.is_set()

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """An executor call: under ``_lock``, then `_kick` (without raising a lost receiver
        over an error already on its way out)."""
        try:
            with self._lock:
                yield
        except BaseException:
            self._kick(raising=False)
            raise
        self._kick(raising=True)

    def _kick(self, raising: bool) -> None:
        """After an executor call: the announcer sends what it queued; with no announcer
        (``progress=False``), or a transport that does no network I/O (in-process: its posts
        are method calls), the caller sends the outbox itself. Either way, a write whose copy
        has ended already (a small one often has by now) is posted by the caller where that
        waits on nothing (`Transport.try_post`): no hand-off to the announcer before its
        notices leave."""
        if self._announcing():
            if not self._local_io:
                self._post_finished()
            # It watches the receiver while requests are registered, sends the outbox and
            # submits the backlog; a write whose completion is armed is posted by it when
            # done (`_copy_done`). A call that left it nothing new (a step's poll) leaves it
            # asleep: its pass would take the executor's GIL and core.
            if not self._announcer_idle():
                self._wake.set()
            if not self._local_io:
                return
        try:
            self._send_outbox(raising=True)
        except TransferError:
            if raising:
                raise

    def _post_finished(self) -> bool:
        """Posts the finished writes at the head of the queue where nothing waits (`_kick`
        at an executor call's end, `_copy_done` as a copy ends), then arms the next one's
        completion. Returns whether it took ``_lock`` (else the announcer, in a pass, holds
        it)."""
        took = self._finish_done()
        self._send_outbox(raising=False, nowait=True)
        self._arm_head()
        return took

    def _announcer_idle(self) -> bool:
        """Whether the announcer has nothing to do until the armed head's copy ends: no post
        or backlogged write waits, its last pass watched the receiver, and the oldest write
        in flight (if any) has its completion armed."""
        return not (self._outbox or self._backlog) and self._watching and self._head_armed()

    def _copy_done(self) -> None:
        """The armed write's copy ended (the copy engine's completion, on its thread): posts
        it there where that waits on nothing (`_post_finished`), with no hand-off to the
        announcer; else, or where anything is left for it, wakes the announcer."""
        try:
            if not self._local_io and self._announcing() and self._post_finished() and self._announcer_idle():
                return
        except BaseException as err:  # never into the engine's thread: the executor's next call raises it
            self._defer(err)
        self._wake.set()

    def _finish_done(self) -> bool:
        """Moves the finished writes at the head of the queue to the outbox, as the announcer
        would (an error is kept for a later call). Under ``_lock``, as every look at a write's
        state (a NIXL write's is not thread-safe); only tried: an announcer holding it is in
        a pass that does this itself. Returns whether it took the lock."""
        if not self._inflight:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            while self._inflight and self._inflight[0].pending.done():
                self._finish(self._inflight.popleft())
        except TransferError as err:  # its requests are failed already
            self._defer(err)
        finally:
            self._lock.release()
        return True

    def _send_outbox(self, raising: bool, nowait: bool = False) -> None:
        """Sends the outbox in order: the one place that posts, abandons, fences and
        announces. Holds ``_wire`` (and ``_lock`` only to pop, never across a send). A
        failure loses the receiver: raised (``raising``, the executor's thread) or kept
        for the executor's next call. ``nowait``: only what waits on nothing (``_wire``
        free, each a post that fits in the connection now: `Transport.try_post`), stopping
        at the first that does not; the announcer sends the rest."""
        if not self._outbox:
            # Nothing to send: ``_wire`` stays free, so an executor call that only tries it
            # hands its write over at once instead of backlogging it.
            return
        if not self._wire.acquire(blocking=not nowait):
            return
        try:
            while self._outbox:
                # Taken off once sent; only a holder of ``_wire`` takes ops off.
                op = self._outbox[0]
                try:
                    if not nowait:
                        op.call(*op.args)
                    elif op.nowait is None or not op.nowait(*op.args):
                        return
                    self._outbox.popleft()
                except TransferError as err:
                    self._outbox.popleft()
                    if op.quiet:
                        continue  # an abandon: the receiver holds nothing of ours any more
                    with self._lock:
                        self._outbox.clear()
                        lost = self._lose_peer(err, unposted=op.request_ids)
                        if not raising:
                            self._defer(lost)
                    if raising:
                        raise lost from err
                    return
        finally:
            self._wire.release()

    def _submit(self, held: _Held) -> bool:
        """Hands one write to the transport (the caller holds ``_wire``); False, changing
        nothing, when it has no room."""
        try:
            submitted = time.monotonic()
            pending = self.transport.write(self.engine, held.write)
        except TransportFull:
            return False
        except TransferError as err:  # its receiver is gone (the staging ring reading a closed socket)
            ids = sorted({n.request_id for n in held.write.notices})
            raise self._lose_peer(err, unposted=ids) from err
        self._inflight.append(
            _Job(pending, tuple(held.write.notices), submitted, held.kind, held.nbytes, held.write.checksums)
        )
        # The copy's completion posts it (`_copy_done`), armed once the executor's call ends
        # (`_kick`: a copy that ended meanwhile is posted by that thread itself), or armed by
        # the announcer where it submitted the write.
        return True

    def _arm(self, head: Pending) -> bool:
        """Has the oldest write's completion post it (`_copy_done`, `Pending.when_done`), once;
        returns whether it will (a copy that cannot tell leaves the announcer to look). The
        executor's call asks as it ends (`_kick`), after posting a copy that ended already."""
        with self._lock:
            if head is self._armed:
                return True
            # Marked first: a copy that has ended calls back at once, and that call may arm
            # the next write before this one returns.
            self._armed = head
            if head.when_done(self._copy_done):
                return True
            if self._armed is head:
                self._armed = None
            return False

    def _arm_head(self) -> None:
        """Arms the oldest write's completion (`_arm`), if a write is in flight; only tried,
        as `_finish_done` (an announcer in its pass arms the head as the pass ends)."""
        if not self._inflight or not self._lock.acquire(blocking=False):
            return
        try:
            if self._inflight:
                self._arm(self._inflight[0].pending)
        finally:
            self._lock.release()

    def _head_armed(self) -> bool:
        """Whether no write is in flight, or the oldest one's completion wakes the announcer."""
        inflight = self._inflight
        return not inflight or inflight[0].pending is self._armed

    def _submit_backlog(self, block: bool) -> bool:
        """Hands backlogged writes to the transport, oldest first, while it has room
        (``block``: waits for ``_wire``; the executor's thread only tries it). Returns
        whether writes still wait for room."""
        if not self._backlog or self._lost is not None:
            return False
        if not self._wire.acquire(blocking=block):
            return True
        try:
            while self._backlog:
                if not self._submit(self._backlog[0]):
                    return True
                self._backlogged -= self._backlog.popleft().blocks
            return False
        finally:
            self._wire.release()

    def _time_out_backlog(self) -> None:
        """Fails the requests of the oldest backlogged write once it waited for room past
        the sender's timeout (nothing of it was read: it is dropped, and so are their other
        backlogged writes). Raises the error (`TransferTimeoutError`)."""
        if not self._backlog or self.timeout is None:
            return
        held = self._backlog[0]
        age = time.monotonic() - held.queued_at
        if age <= self.timeout:
            return
        ids = sorted({n.request_id for n in held.write.notices})
        err = TransferTimeoutError(
            f"write of requests {ids} waited {age:.3f} s for room in the transport (timeout {self.timeout} s;"
            f" {self._backlogged} blocks backlogged): never started; the requests failed and were released"
            f" (peer: {self._peer_name()})",
            request_ids=ids,
            peer=self._peer_name(),
        )
        raise self._fail(ids, err)

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
        with self._call():
            self._check_peer()
            if self._lost is not None:
                raise self._raising(self._lost)
            self._drain()  # copies of an earlier request with this id may just have finished
            earlier = self._requests.get(request_id)
            if earlier is not None and earlier.stage != SenderStage.SENDING:  # a registered one: the book refuses it
                raise InvalidArgumentError(
                    f"invalid request_id={request_id}: its previous transfer is not settled (copies still queued, or "
                    "its failure not acknowledged)"
                )
            self.book.add_spec(request_id, spec)  # with its held blocks, all or nothing
            self._requests[int(request_id)] = _Request(spec.epoch)
            # Sent before any of its notices (the outbox keeps order); a receiver lost by
            # then fails the request with the others.
            rid = int(request_id)
            self._outbox.append(_Op(self.transport.announce, ([(rid, int(spec.epoch))],), (rid,)))

    def send_early(self, request_ids: IntArray, src_block_table: IntArray, dst_block_table: IntArray) -> list[Notice]:
        """Before the context forward: the complete reused blocks of the eligible requests."""
        with self._call():
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
        with self._call():
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
        with self._call():
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
        ids = np.asarray(request_ids).tolist()
        for record in map(self._requests.get, ids):
            if record is not None and record.error is not None:
                raise record.error
        hit = sorted({rid for rid in ids if self._drops(rid)})
        if hit:
            raise InvalidArgumentError(f"invalid request_ids: {hit} were cancelled")

    def _dispatch(self, plan: SlicePlan, kind: str, group: Optional[int] = None) -> list[Notice]:
        """Queues the copy of a plan made with block tables (the book refused bad tables
        before claiming anything, so nothing is marked sent that cannot leave). The transport
        gets the plan in writes of at most `Transport.write_blocks` blocks, each with notices
        for its own part of the slices, so the receiver can take in one write while the next
        is still being copied. A layer slice (``group``) writes and announces only that layer
        group's layers."""
        pairs = plan.pairs
        if not len(plan) or pairs is None:
            return []
        cap = self.transport.write_blocks(plan.total_blocks, self.pool.device)
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
                    end = min(blocks.end, start + cap - (hi - lo))
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
                    if hi - lo == cap:
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
            # Its own type: a caller that sent a batch knows the rest of it was queued.
            failed = UnqueuedWriteError(
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
        """Hands a write to the transport when it has room and no earlier write waits (the
        executor only tries ``_wire``: if the announcer holds it, the write waits its turn;
        with ``handoff`` it never does), else appends it to the backlog, which the announcer
        submits in order as room frees. Never waits. A backlog past ``backlog_blocks``
        refuses the write (`TransferError` naming the bound: `_dispatch` fails the requests
        of its plan)."""
        after = self._ordering.signals_for(src_ids)  # tier copies still writing what it reads
        sums = WriteChecksums(self.source, src_ids, layers) if self.checksum else None
        held = _Held(Write(self.source, src_ids, dst_ids, notices, after, layers, sums), time.monotonic(), kind, nbytes)
        if not self._backlog and not self.handoff and self._wire.acquire(blocking=False):
            try:
                if self._submit(held):
                    return
            finally:
                self._wire.release()
        if self._backlogged + held.blocks > self.backlog_blocks:
            raise TransferError(
                f"the sender's backlog is full (backlog_blocks={self.backlog_blocks}): {self._backlogged} blocks"
                f" wait for room in the transport, {held.blocks} more refused",
                request_ids=sorted({n.request_id for n in notices}),
                peer=self._peer_name(),
            )
        if self._cuda:
            # Submitted later, from the announcer's thread: ordered after the work queued on
            # this (the executor's) stream so far, the forward that produced the blocks.
            event = torch.cuda.current_stream(self.pool.device).record_event()
            held.write = dataclasses.replace(held.write, after=(*held.write.after, event))
        self._backlog.append(held)
        self._backlogged += held.blocks
        self._wake.set()

    def poll(self) -> list[Notice]:
        """Posts the notices of every finished copy not posted yet, oldest first, and returns
        them (with the announcer on, usually none: it posted them already). Raises an error
        the announcer found (a failed write, the receiver's cancellation, a lost receiver),
        and `TransferTimeoutError` when the oldest copy has run past the sender's timeout, or
        the oldest backlogged write waited for room past it (its requests then fail)."""
        with self._call():
            return self._poll()

    def _poll(self) -> list[Notice]:
        self._check_peer()
        self._raise_deferred_error()
        posted: list[Notice] = []
        while self._inflight and self._inflight[0].pending.done():
            posted.extend(self._finish(self._inflight.popleft()))
        self._submit_backlog(block=False)
        self._time_out_backlog()
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
                    f"copies for requests {ids} still running after {age:.3f} s (timeout {self.timeout} s): cancel "
                    f"them (peer: {self._peer_name()})",
                    request_ids=ids,
                    peer=self._peer_name(),
                )
        return posted

    def flush(self, timeout: Optional[float] = None) -> list[Notice]:
        """Waits for every backlogged write to be handed to the transport, every queued
        copy to finish and its notices to be sent, within ``timeout`` seconds."""
        with self._lock:
            return self._flush(timeout)

    def _flush(self, timeout: Optional[float]) -> list[Notice]:
        self._check_peer()
        self._raise_deferred_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        posted: list[Notice] = []
        while self._backlog or self._inflight or self._outbox:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                self._raise_flush_timeout(timeout)
            if self._announcing():  # it posts and submits: wait for its progress
                self._wake.set()
                self._changed.wait(PEER_CHECK_SECONDS if left is None else min(left, PEER_CHECK_SECONDS))
                self._raise_deferred_error()
                continue
            starved = self._submit_backlog(block=True)
            self._time_out_backlog()
            if self._inflight:
                job = self._inflight[0]
                if not job.pending.wait(left):
                    self._raise_flush_timeout(timeout)
                posted.extend(self._finish(self._inflight.popleft()))
            elif starved:
                with self._wire:
                    try:
                        self.transport.wait_for_room(
                            PEER_CHECK_SECONDS if left is None else min(left, PEER_CHECK_SECONDS)
                        )
                    except TransferError as err:
                        ids = sorted({n.request_id for h in self._backlog for n in h.write.notices})
                        raise self._lose_peer(err, unposted=ids) from err
            self._send_outbox(raising=True)
        return posted

    def _raise_flush_timeout(self, timeout: Optional[float]) -> NoReturn:
        notices = (
            self._inflight[0].notices if self._inflight else self._backlog[0].write.notices if self._backlog else ()
        )
        ids = sorted({n.request_id for n in notices})
        raise TransferTimeoutError(
            f"copies for requests {ids} did not finish within {timeout} s"
            f" ({len(self._backlog)} writes backlogged; peer: {self._peer_name()})",
            request_ids=ids,
            peer=self._peer_name(),
        )

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
        # Judged now, after the copy finished: a request revoked while its copy ran (a
        # preemption whose forward overwrote the blocks it read) has its notices dropped,
        # so the receiver never counts blocks read after the revoke.
        revoked = frozenset(rid for rid in ids if self._drops(rid))
        if job.checksums is not None:
            job.notices = job.checksums.stamp(job.notices)
        self._outbox.append(
            _Op(self.transport.post, (job.notices, revoked), tuple(ids), nowait=self.transport.try_post)
        )
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
        """Whether a queued copy, or a backlogged write, still carries blocks of the request
        (finished copies count until their notices are posted)."""
        with self._lock:
            return any(n.request_id == request_id for job in self._inflight for n in job.notices) or any(
                n.request_id == request_id for held in self._backlog for n in held.write.notices
            )

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
        # Only tried: while the announcer talks to the receiver (a send that may block on a
        # receiver that stopped reading), it is the one that checks.
        if not self._wire.acquire(blocking=False):
            return
        try:
            self.transport.check_peer()
            cancels = self.transport.cancel_requests()
        except TransferError as lost:
            raise self._lose_peer(lost) from lost
        finally:
            self._wire.release()
        ids = [rid for rid, epoch in cancels if epoch and self._sending_under(rid, epoch)]
        if ids:
            ids = sorted(set(ids))
            peer = self._peer_name()
            err = TransferError(
                f"requests {ids} cancelled by the {peer}: revoked, their fences follow their last copies",
                request_ids=ids,
                peer=peer,
            )
            self._defer(self._fail(ids, err))

    def check_peer(self) -> None:
        """Raises `TransferError` once the receiver is known to be gone (asking the transport
        when no other thread is talking to it); never blocks on the network."""
        with self._lock:
            self._check_peer()
            if self._lost is not None:
                raise self._lost

    @property
    def backlogged(self) -> int:
        """Blocks of planned writes waiting for room in the transport (see the class doc)."""
        with self._lock:
            return self._backlogged

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
            # After every notice of the request in the outbox (sent in order).
            self._outbox.append(_Op(self.transport.revoke, (request_id, record.epoch), (request_id,)))

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
        self._fail(ids, self._lost)  # their backlogged writes (every one: all are in flight) dropped
        self._outbox.clear()  # nothing can be sent any more
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
        """SENDING -> REVOKED: nothing more is planned, its backlogged writes are dropped
        (never started: they read nothing); its fence is due once its copies end."""
        self.book.cancel(request_id)
        record.stage = SenderStage.REVOKED
        self._fences[request_id] = record
        self._unbacklog(request_id)

    def _unbacklog(self, request_id: int) -> None:
        """Takes a request's part out of every backlogged write (a write of several
        requests keeps the others' blocks and notices, in order)."""
        kept: deque[_Held] = deque()
        for held in self._backlog:
            write = held.write
            mine = [n.request_id == request_id for n in write.notices]
            if not any(mine):
                kept.append(held)
                continue
            self._backlogged -= held.blocks
            if all(mine):
                continue
            lengths = [n.end - n.start for n in write.notices]
            keep = np.repeat(~np.array(mine), lengths)
            rest = [n for n, m in zip(write.notices, mine) if not m]
            nbytes = held.nbytes * int(keep.sum()) // held.blocks
            write = dataclasses.replace(write, src_ids=write.src_ids[keep], dst_ids=write.dst_ids[keep], notices=rest)
            if write.checksums is not None:  # summed afresh over the blocks it keeps
                write = dataclasses.replace(write, checksums=WriteChecksums(write.src, write.src_ids, write.layers))
            kept.append(_Held(write, held.queued_at, held.kind, nbytes))
            self._backlogged += kept[-1].blocks
        self._backlog = kept

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
        self._outbox.append(_Op(self.transport.abandon, (job.notices,), quiet=True))

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
        """Revokes a request: nothing more is planned or announced for it, and its
        backlogged writes are dropped at once (they never started). Waits up to
        ``timeout`` seconds for queued copies that read its blocks, then forgets it and
        returns its ledger; its source blocks are the caller's to free once this returns.
        If those copies outlive the wait, raises `TransferTimeoutError` and keeps the request
        revoked (call again before freeing the blocks)."""
        with self._call():
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
        with self._call():
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
                if self._lost is None and (self._inflight or self._backlog or self._outbox):
                    self._flush(self.timeout if self.timeout is not None else CLOSE_SECONDS)
                elif self._lost is None:
                    self._raise_deferred_error()
        finally:
            with self._lock:
                for job in self._inflight:
                    self._abort(job)  # must not run on into a closed transport
                self._backlog.clear()  # never started: their requests get their fences below
                self._backlogged = 0
            self.engine.close()  # waits for local copies: none reads or writes after this
            with self._lock:
                self._fence_remaining()
            with contextlib.suppress(TransferError):  # the receiver is gone: nothing to tell it
                self._send_outbox(raising=True)
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
        self._post_fences()


def default_handoff(device_type: str, transport: Transport, progress: bool) -> bool:
    """Whether a `KVSender` given no ``handoff`` hands its writes to its announcer: for CUDA
    pools over a transport whose submission is costly (NIXL), with an announcer. On an H200
    an early send of 4 GiB in scattered blocks held the engine's thread 590 ms before its
    forward (docs/benchmarks.md, "The H200 run of 2026-12-05"); with CPU pools the engine's
    forward shares its cores with the transfer whichever thread submits, so nothing moves."""
    return bool(progress) and device_type == "cuda" and bool(getattr(transport, "costly_submit", False))


def _announcer(ref: weakref.ReferenceType[KVSender], wake: threading.Event, closing: threading.Event) -> None:
    """The sender's announcer thread: posts each write's notices as soon as the write
    finished, and submits backlogged writes as room frees (`KVSender._announce_step`). It
    sleeps until the oldest write is done or another write is queued where the copy can say
    when it is done (`Pending.when_done`: a CPU copy's future), else looks every
    ``PROGRESS_SECONDS`` (a CUDA event has no timed wait); with only backlogged writes it
    waits for the receiver's frees; with no write queued it sleeps until one is, waking
    every ``PEER_CHECK_SECONDS`` while requests are registered to take the receiver's
    cancellations."""
    next_check = 0.0
    while not closing.is_set():
        wake.clear()  # before looking: a write queued after the look sets it again
        sender = ref()
        if sender is None:
            return
        stop, head, starved, watching, next_check = sender._announce_step(next_check)
        if stop:
            return
        # Backlogged writes, nothing in flight: the receiver's frees make room.
        room = sender._wait_for_room(PEER_CHECK_SECONDS) if starved else False
        armed = head is not None and not starved and sender._arm(head)
        del sender  # not kept alive while this thread sleeps
        if starved:
            if not room:  # a transport that cannot wait for room: look again shortly
                wake.wait(PROGRESS_SECONDS)
            continue
        if armed:
            wake.wait(PEER_CHECK_SECONDS)
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
