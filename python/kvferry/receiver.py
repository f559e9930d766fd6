"""`KVReceiver`: the generation side. It owns the destination pool, expects requests, and
counts a request complete only when every expected block has landed exactly once.

Every notice is checked against the request's own ledger before it counts: a notice for a
request not expected here, for blocks outside the request, for no blocks, or for blocks that
already arrived (for a layer-group notice: blocks that arrived whole or in that group) is
refused whole (nothing is marked arrived), recorded in `refused`, and fails
the request (its `wait` raises at once instead of at its timeout). A transport that knows
which sender a notice came from passes it as ``source``: a request then belongs to the first
sender that announced it (`bind`, or its first notice), a notice from any other sender is
refused without failing it, and `fail_source` fails what a lost sender still owed.

Leases (docs/faults.md, "Leases, epochs and fences"). `expect` issues each request an epoch,
1, 2, ... per receiver, never reused; the sender stamps it on every notice. A message of an
epoch that is not the request's current one (the request was released, its id reused) is
stale: discarded and counted (`discarded`), never applied and never failing the live
request. The destination blocks of an incomplete request are reusable only once the request
is *fenced*: its sender posted ``revoked(request_id, epoch)`` after its last write, or the
sender's connection ended. `release` waits for that (bounded), and asks the sender to cancel
first when the receiver gives up on its own.

Each request is in one `ReceiverStage` (the record's ``stage``); its error, once it has one, is
kept apart (a failed request may still be in any stage: `wait` raises it):

```
                     every block arrived
expect -> PENDING --------------------------------------------------> COMPLETE
           |  |  \\ its sender's connection ended                          ^
           |  |   `---------------------> ENDED --every block arrived-----'
           |  |  its sender's fence         |  its sender's fence, or a cancel
           |  `------------------------.    v
           |  cancel (or release):      `-> FENCED
           |  its sender is asked             ^
           v                                  |
        CANCELLED --its sender's fence, or its connection ended
    ENDED, FENCED and COMPLETE are fenced (stage >= ENDED): `release` forgets them at once.
    CANCELLED and FENCED discard notices; PENDING and ENDED count them (a NIXL notification
    of a write that finished may arrive after its sender's socket ended).
```

What a sender's message (a notice, an announce, a revoke) does is decided in one place
(`_judge`): an old epoch's is discarded; one for a request that belongs to another sender is
refused and recorded, and changes nothing of that request (only its own sender may fail it,
docs/security.md); an epoch never issued is refused and fails the request; a notice for a
request in a discarding stage is discarded; else it applies.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
import torch

from kvferry._core import BlockRange, TransferLedger
from kvferry.checksum import block_checksums, checksum_option, write_layers
from kvferry.checksum import mismatch as mismatch_error
from kvferry.errors import (
    DuplicateTransferError,
    InvalidArgumentError,
    KvFerryError,
    TransferError,
    TransferTimeoutError,
    UnknownRequestError,
)
from kvferry.layout import PagedKV
from kvferry.notice import Notice

__all__ = ["CancelHandler", "Discard", "KVReceiver", "Landing", "LeaseError", "ReceiverStage", "Refusal"]

# Refused and discarded messages kept for inspection; a sender that keeps sending bad or late
# ones cannot grow the receiver without bound (``refused_count`` / ``discarded_count`` still
# count every one).
REFUSALS_KEPT = 1024
DISCARDS_KEPT = 1024
# How long `release` waits, by default, for the fence of an incomplete request.
RELEASE_SECONDS = 30.0
# How often a release looks again at writes still landing in its request's blocks (a CUDA
# copy signals nobody when it ends).
LANDING_POLL_SECONDS = 0.001

# Called (outside the receiver's lock) when the receiver gives up on a request:
# ``(source, request_id, epoch)``; an endpoint passes it on to that sender.
CancelHandler = Callable[[Optional[Hashable], int, int], None]


class LeaseError(InvalidArgumentError):
    """A notice names destination blocks other than those its request's lease holds
    (`KVReceiver.expect(..., dst_blocks=...)`): refused whole before it counts."""


class Landing:
    """A write that a transport copies into the pool itself (the staging ring), admitted for
    its requests' blocks (`KVReceiver.admits` with ``landing=``) and maybe still copying:
    those requests are not released, fenced or not, until it `landed`. So a write admitted
    just before the receiver gave a request up never lands after its blocks were handed on.

    ```
    connection thread:  admits(..., landing) --- copy (or queue it on a stream) --- copied(event)
    engine thread:                cancel, release ........ waits ........ forgets the request
    ```
    """

    def __init__(self) -> None:
        self._copied = False
        self._event: Any = None  # a CUDA event recorded after the copies, once queued

    def copied(self, event: Any = None) -> None:
        """The copies are done (``event`` None) or queued, ending at ``event`` (a CUDA event)."""
        self._event = event
        self._copied = True

    def landed(self) -> bool:
        return self._copied and (self._event is None or bool(self._event.query()))


class ReceiverStage(enum.IntEnum):
    """Where a request is (the module's diagram). Ordered so that "fenced" (no sender writes
    its destination blocks any more: they may be released) is one comparison,
    ``stage >= ReceiverStage.ENDED``."""

    PENDING = 0  # its sender writes; notices count
    CANCELLED = 1  # the receiver gave up: notices are discarded; its sender is asked to stop
    ENDED = 2  # its sender's connection ended: nothing more is written; late notices count
    FENCED = 3  # revoked by its sender, or cancelled and its sender gone: notices are discarded
    COMPLETE = 4  # every block arrived

    @property
    def fenced(self) -> bool:
        return self >= ReceiverStage.ENDED

    @property
    def discards(self) -> bool:
        """Whether a notice of the request's current epoch is dropped, not counted."""
        return self in (ReceiverStage.CANCELLED, ReceiverStage.FENCED)


@dataclass
class _Expected:
    request_id: int
    ledger: TransferLedger
    epoch: int
    stage: ReceiverStage = ReceiverStage.PENDING
    slices: int = 0
    error: Optional[KvFerryError] = None
    arrived_at: Optional[float] = None
    notices: list[Notice] = field(default_factory=list)
    source: Optional[Hashable] = None  # the sender it belongs to, once one announced it
    # Blocks that arrive with another request's transfer (in-flight dedup): (owner request,
    # blocks), dropped once they have arrived there.
    awaits: list[tuple[int, BlockRange]] = field(default_factory=list)
    awaited_at: float = 0.0  # when the last awaited block arrived
    # The destination block of each of the request's blocks (the lease's blocks), when the
    # engine said which: a write naming others is refused.
    dst_blocks: Optional[np.ndarray] = None
    # Writes admitted into its blocks that may still be copying (`Landing`).
    landing: list[Landing] = field(default_factory=list)
    revoked: bool = False  # fenced by its sender's revoke (not by a failure seen here)


@dataclass(frozen=True)
class Refusal:
    """A notice the receiver refused, why, and from which sender (``None``: not known)."""

    notice: Notice
    error: KvFerryError
    source: Optional[str] = None


@dataclass(frozen=True)
class Discard:
    """A stale message, dropped without failing anything: a ``notice``, an ``announce`` or
    a ``revoke`` of an epoch that is no longer the request's, or a notice for a request the
    receiver cancelled or its sender revoked."""

    kind: str
    request_id: int
    epoch: int
    reason: str
    source: Optional[str] = None
    notice: Optional[Notice] = None


class KVReceiver:
    """Tracks arrivals per request in its own ledger. Notices may come from another thread
    (a transport's listener); every method is safe to call concurrently."""

    def __init__(self, pool: PagedKV, *, checksum: Optional[bool] = None) -> None:
        """``checksum``: a notice that carries its blocks' checksums (kvferry.checksum) is
        checked against the blocks where its write landed before they count (a block that
        differs fails the request, `ChecksumError`, and counts in ``checksum_failures``).
        None (the default): `kvferry.checksum.CHECKSUM_DEFAULT`, where the pool's blocks can
        be summed. A notice without checksums (its sender sums nothing) is taken as before."""
        if not isinstance(pool, PagedKV):
            raise TypeError(f"pool must be a PagedKV, got {type(pool).__name__}")
        self.pool = pool
        self.checksum = checksum_option(checksum, pool)
        # A CUDA pool's sums run on a stream of their own: on the default stream they would
        # wait behind the engine's queued forward before a notice could count.
        self._sum_stream: Any = torch.cuda.Stream(pool.device) if self.checksum and pool.device.type == "cuda" else None
        self.checksum_failures = 0  # blocks' notices refused for a checksum mismatch
        self.checksummed_blocks = 0  # blocks whose checksums were checked and agreed
        self._requests: dict[int, _Expected] = {}
        self._cond = threading.Condition()
        self._next_epoch = 1
        self._refused: deque[Refusal] = deque(maxlen=REFUSALS_KEPT)
        self.refused_count = 0
        self.duplicate_count = 0  # of refused_count: notices for blocks that had already arrived
        self._discarded: deque[Discard] = deque(maxlen=DISCARDS_KEPT)
        self.discarded_count = 0
        self._cancel_handlers: list[CancelHandler] = []
        # owner -> requests awaiting some of its blocks (in-flight dedup), so forgetting a
        # request visits only its dependents, not every live request.
        self._dependents: dict[int, set[int]] = {}
        # Requests whose `wait` may now return or raise at once, since the last `take_settled`
        # (live ones only: `_forget` drops an id, so a receiver nobody polls does not grow it).
        self._settled: set[int] = set()

    def expect(
        self,
        request_id: int,
        prompt_len: int,
        *,
        window: Optional[int] = None,
        held: Sequence[BlockRange] = (),
        awaits: Sequence[tuple[int, BlockRange]] = (),
        dst_blocks: Optional[Sequence[int] | np.ndarray] = None,
    ) -> int:
        """Registers a request before its first notice and returns its epoch, which the
        engine passes to the context side with the destination blocks (`KVSender.add`).
        ``held`` lists blocks this worker already holds: they count as arrived and must never
        be sent. ``awaits`` lists ``(owner, blocks)``: blocks of this request that arrive
        with request ``owner``'s transfer into the same destination blocks (in-flight dedup);
        they are never sent for this request either, and it completes only once they arrived
        there (it fails if ``owner`` fails or is released first). ``dst_blocks``: the
        destination block of each of the request's blocks, in order (the blocks the engine
        gave it). With them the lease records its blocks, and a notice over a transport that
        names the blocks its write used (every cross-process one) is refused unless they are
        exactly the lease's (`LeaseError`): a sender cannot make blocks of another request
        count, and the staging receiver copies nothing outside the lease."""
        ledger = TransferLedger(self.pool.tokens_per_block, prompt_len, window=window)
        lease = None if dst_blocks is None else self._lease_blocks(dst_blocks, ledger.num_blocks, ledger.missing())
        for blocks in [*held, *(blocks for _, blocks in awaits)]:
            ledger.claim(blocks)
        with self._cond:
            if request_id in self._requests:
                raise InvalidArgumentError(f"invalid request_id={request_id}: already expected")
            for owner, _ in awaits:
                if owner not in self._requests or owner == request_id:
                    raise InvalidArgumentError(
                        f"invalid awaits: owner request_id={owner} is not another expected request"
                    )
            epoch = self._next_epoch
            self._next_epoch += 1
            expected = _Expected(request_id, ledger, epoch, awaits=list(awaits), dst_blocks=lease)
            for owner, _ in awaits:
                self._dependents.setdefault(owner, set()).add(request_id)
            if ledger.is_complete:  # everything was held: nothing will arrive
                self._to_complete(expected)
            self._requests[request_id] = expected
            return epoch

    def _lease_blocks(
        self, dst_blocks: Sequence[int] | np.ndarray, num_blocks: int, needed: Sequence[BlockRange]
    ) -> np.ndarray:
        """``needed``: the blocks that can arrive (all of them, or a sliding window's live
        ones): each must be a distinct block. Outside it an engine may repeat a placeholder
        (vLLM's null block for blocks that left the window), which no notice can name."""
        try:
            ids = np.asarray(dst_blocks)
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(f"invalid dst_blocks: not an array of block ids ({err})") from None
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgumentError(
                f"invalid dst_blocks: a 1-d array of integer block ids, got shape {ids.shape} of {ids.dtype}"
            )
        ids = ids.astype(np.int64)
        if len(ids) != num_blocks:
            raise InvalidArgumentError(f"invalid dst_blocks: {len(ids)} ids, the request has {num_blocks} blocks")
        outside = ids[(ids < 0) | (ids >= self.pool.num_blocks)]
        if outside.size:
            raise InvalidArgumentError(
                f"invalid dst_blocks: block {int(outside[0])} is outside the pool's [0, {self.pool.num_blocks})"
            )
        lease = np.full_like(ids, -1)  # -1: no block of the pool, so no write there is ever admitted
        for r in needed:
            lease[r.start : r.end] = ids[r.start : r.end]
        live = lease[lease >= 0]
        if len(np.unique(live)) != len(live):
            raise InvalidArgumentError("invalid dst_blocks: a destination block appears twice")
        return lease

    @staticmethod
    def _lease_mismatch(
        expected: _Expected, notice: Notice, dst_ids: Optional[np.ndarray], source: Optional[Hashable]
    ) -> Optional[str]:
        """Why the blocks a notice's write used are not its lease's, or ``None`` (also when
        the lease records no blocks). A range that runs past the lease is a mismatch: its
        write may have landed in another request's blocks."""
        lease = expected.dst_blocks
        if lease is None or (dst_ids is None and source is None):
            return None
        if not 0 <= notice.start < notice.end <= len(lease):
            return f"covers blocks [{notice.start}, {notice.end}), outside the lease's {len(lease)} blocks"
        want = lease[notice.start : notice.end]
        if dst_ids is None:
            return f"names no destination blocks, and the lease holds {want.tolist()}"
        got = np.asarray(dst_ids, dtype=np.int64)
        if got.shape != want.shape or not np.array_equal(got, want):
            return (
                f"wrote destination blocks {got.tolist()[:16]}, the lease holds {want.tolist()[:16]} for blocks "
                f"[{notice.start}, {notice.end})"
            )
        return None

    def lease_admits(self, notice: Notice, dst_ids: np.ndarray) -> bool:
        """Whether the destination blocks ``dst_ids`` are the lease's for the notice's blocks
        (a lease without recorded blocks admits any); changes nothing. `admits` with
        ``dst_ids`` asks this and the rest in one call."""
        with self._cond:
            expected = self._requests.get(notice.request_id)
            return expected is None or self._lease_mismatch(expected, notice, dst_ids, None) is None

    def epoch(self, request_id: int) -> int:
        """The request's current epoch."""
        with self._cond:
            return self._get(request_id).epoch

    def _stale(self, request_id: int, epoch: int, expected: Optional[_Expected]) -> Optional[str]:
        """Why a message of ``epoch`` for the request is stale, or ``None``. Epochs only grow,
        so one that was issued and is not the request's current one belongs to a request
        that is gone. Raises for an epoch this receiver never issued."""
        if epoch == 0:  # the sender was given no epoch: nothing to compare
            return None
        if not 0 < epoch < self._next_epoch:
            raise InvalidArgumentError(
                (
                    f"invalid epoch={epoch} for request {request_id}: never issued by this receiver (last issued: "
                    f"{self._next_epoch - 1})"
                )
            )
        if expected is None:
            return f"epoch {epoch} of request {request_id}, which was released"
        if expected.epoch != epoch:
            return f"epoch {epoch} of request {request_id}, which is now epoch {expected.epoch} (its id was reused)"
        return None

    def _judge(
        self,
        kind: str,
        request_id: int,
        epoch: int,
        source: Optional[Hashable],
        expected: Optional[_Expected],
        notice: Optional[Notice] = None,
    ) -> Optional[str]:
        """The one place that decides what a sender's message (``kind``: ``"notice"``,
        ``"announce"`` or ``"revoke"``) about a request does (lock held). Returns ``None``: it
        applies; a reason: it is discarded (the caller records it). Raises if it is refused:
        a message from a sender other than the one the request belongs to changes nothing of
        the request (only the connection that holds a request may fail it); an epoch never
        issued fails it; a notice for a request not expected fails nothing."""
        foreign = (
            expected is not None and source is not None and expected.source is not None and expected.source != source
        )
        try:
            reason = self._stale(request_id, epoch, expected)
        except KvFerryError as err:
            if expected is not None and not foreign:
                self._fail_locked(expected, err)
            raise
        if reason is not None:
            return reason
        if expected is None:
            if kind == "revoke":
                return f"request {request_id} was released"
            if kind == "notice":
                raise UnknownRequestError(
                    f"unknown request_id={request_id}: notice {notice} for a request not expected"
                )
            self._raise_unknown(request_id)
        assert expected is not None
        if kind == "notice" and expected.stage.discards:
            why = (
                "was cancelled by the receiver"
                if expected.stage == ReceiverStage.CANCELLED
                else "was revoked by its sender, or cancelled after its sender ended"
            )
            return f"request {request_id} {why}"
        if foreign:
            what = {"notice": f"notice {notice} from", "announce": "announced by", "revoke": "revoked by"}[kind]
            raise TransferError(
                f"request {request_id}: {what} {source}, but it belongs to {expected.source}",
                request_ids=(request_id,),
                peer=str(source),
            )
        return None

    def deliver(
        self, notice: Notice, source: Optional[Hashable] = None, *, dst_ids: Optional[np.ndarray] = None
    ) -> bool:
        """Records a notice; returns whether the request is now complete. A stale notice (an
        old epoch, a request cancelled here or revoked by its sender) is discarded: kept in
        `discarded`, nothing else changes. A notice for an unknown request, for no blocks or
        blocks outside the prompt, for blocks that already arrived, for an epoch never issued
        or from a sender other than the one the request belongs to is refused (raised, and
        kept in `refused`); a refused notice for a known request fails it. ``dst_ids``: the
        destination blocks the notice's write used; a notice from a ``source`` (a
        cross-process sender) for a request whose lease records its blocks must name exactly
        those, or it is refused (`LeaseError`)."""
        landed = self._landed_sums(notice, dst_ids)
        with self._cond:
            expected = self._requests.get(notice.request_id)
            try:
                reason = self._judge("notice", notice.request_id, notice.epoch, source, expected, notice)
            except KvFerryError as err:
                raise self._refuse(notice, source, expected, err) from None
            if reason is None:
                assert expected is not None
                return self._claim(expected, notice, source, dst_ids, landed)
            self._discard(Discard("notice", notice.request_id, notice.epoch, reason, _name(source), notice))
            # A notice of the current epoch for a request cancelled before any sender had
            # announced it: that sender is the one to ask (a stale epoch binds nothing).
            ask = expected is not None and notice.epoch in (0, expected.epoch) and self._bind_late(expected, source)
        if ask:
            assert expected is not None
            self._ask_cancel(notice.request_id, expected)
        return False

    def _landed_sums(self, notice: Notice, dst_ids: Optional[np.ndarray]) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """``(destination ids, their sums)`` of the blocks a notice's write landed in, when
        the notice carries checksums and this receiver checks them; summed before the lock
        is taken (a large write is a read of every block it wrote). The blocks are the ones
        the write named, else the lease's. None where there is nothing to check, or where
        the notice is malformed (`_claim` refuses it for that)."""
        if not self.checksum or notice.checksums is None:
            return None
        if dst_ids is None:
            with self._cond:
                expected = self._requests.get(notice.request_id)
                lease = None if expected is None else expected.dst_blocks
            if lease is None or not 0 <= notice.start < notice.end <= len(lease):
                return None
            dst_ids = lease[notice.start : notice.end]
        ids = np.asarray(dst_ids, dtype=np.int64)
        n = notice.end - notice.start
        if ids.shape != (n,) or len(notice.checksums) != 8 * n or not n:
            return None
        if ids.min() < 0 or ids.max() >= self.pool.num_blocks:
            return None
        try:
            layers = write_layers(notice, self.pool)
        except KvFerryError:
            return None
        return ids, block_checksums(self.pool, ids, layers, self._sum_stream)

    def _claim(
        self,
        expected: _Expected,
        notice: Notice,
        source: Optional[Hashable],
        dst_ids: Optional[np.ndarray] = None,
        landed: Optional[tuple[np.ndarray, np.ndarray]] = None,
    ) -> bool:
        if source is not None and expected.source is None:
            expected.source = source  # bound even if refused below: it may have written
        mismatch = self._lease_mismatch(expected, notice, dst_ids, source)
        if mismatch is not None:
            err = LeaseError(f"invalid dst_ids for request {notice.request_id}: notice {notice} {mismatch}")
            raise self._refuse(notice, source, expected, err) from None
        if landed is not None:
            corrupt = mismatch_error(notice, *landed)
            if corrupt is not None:
                corrupt.peer = _name(source)
                self.checksum_failures += 1
                raise self._refuse(notice, source, expected, corrupt) from None
            self.checksummed_blocks += len(landed[0])
        try:
            blocks = _blocks_of(notice)
            if notice.whole:
                expected.ledger.claim(blocks)  # all or nothing: a refused claim marks nothing
            else:
                # A layer slice: the group must name layers of this pool; a block counts as
                # arrived once every group's layers of it did.
                self.pool.group_layers(notice.group, notice.groups)
                expected.ledger.claim_layer(blocks, notice.group, notice.groups)
        except KvFerryError as err:
            raise self._refuse(notice, source, expected, err) from None
        expected.slices += 1
        expected.notices.append(notice)
        complete = expected.ledger.is_complete
        if complete:
            self._to_complete(expected)
        # Blocks that requests await (in-flight dedup) may have arrived with this notice.
        self._settled.update(self._dependents.get(notice.request_id, ()))
        # Every arrival: a request awaiting these blocks (in-flight dedup) may be done too.
        self._cond.notify_all()
        return complete

    def admits(
        self,
        notice: Notice,
        source: Optional[Hashable] = None,
        *,
        dst_ids: Optional[np.ndarray] = None,
        landing: Optional[Landing] = None,
    ) -> bool:
        """Whether `deliver` would take the notice's request and epoch as live (not stale,
        not cancelled or revoked, from its owner) and, given the destination blocks
        ``dst_ids`` its write is to use, its whole range as inside the request and its
        lease. A transport that applies writes itself (the staging ring) asks this before
        any byte of a notice's blocks moves, with the write's ``landing``: an admitted request
        is then not released until that write landed (`Landing`); nothing else changes."""
        with self._cond:
            expected = self._requests.get(notice.request_id)
            try:
                if self._judge("notice", notice.request_id, notice.epoch, source, expected, notice) is not None:
                    return False
            except KvFerryError:
                return False
            assert expected is not None
            if not 0 <= notice.start < notice.end <= expected.ledger.num_blocks:
                return False
            if dst_ids is not None and self._lease_mismatch(expected, notice, dst_ids, source) is not None:
                return False
            if landing is not None:
                expected.landing = [w for w in expected.landing if not w.landed()] + [landing]
            return True

    @staticmethod
    def _landing(expected: _Expected) -> bool:
        """(lock held) Whether a write admitted into the request's blocks is still copying."""
        expected.landing = [w for w in expected.landing if not w.landed()]
        return bool(expected.landing)

    def _refuse(
        self, notice: Notice, source: Optional[Hashable], expected: Optional[_Expected], error: KvFerryError
    ) -> KvFerryError:
        """Records a refused notice and fails its request, unless the notice came from a
        sender the request does not belong to; returns the error to raise."""
        self._refused.append(Refusal(notice, error, _name(source)))
        self.refused_count += 1
        if isinstance(error, DuplicateTransferError):
            self.duplicate_count += 1
        if expected is not None and (source is None or expected.source in (None, source)):
            self._fail_locked(expected, error)
        return error

    def _fail_locked(self, expected: _Expected, error: KvFerryError) -> bool:
        """Records the request's error unless it has one (lock held); whether it did. The
        failure bookkeeping: no stage changes here."""
        if expected.error is not None:
            return False
        expected.error = error
        self._settled.add(expected.request_id)
        self._settled.update(self._dependents.get(expected.request_id, ()))  # their waits raise too
        self._cond.notify_all()
        return True

    # One transition per edge of the module's diagram (lock held).

    def _to_complete(self, expected: _Expected) -> None:
        expected.stage = ReceiverStage.COMPLETE
        expected.arrived_at = time.monotonic()
        self._settled.add(expected.request_id)

    def _to_cancelled(self, expected: _Expected) -> None:
        """PENDING -> CANCELLED, ENDED -> FENCED (a sender that is gone has nothing to stop)."""
        expected.stage = ReceiverStage.CANCELLED if expected.stage == ReceiverStage.PENDING else ReceiverStage.FENCED

    def _to_ended(self, expected: _Expected) -> None:
        """PENDING -> ENDED, CANCELLED -> FENCED; a fenced request stays as it is."""
        if expected.stage == ReceiverStage.PENDING:
            expected.stage = ReceiverStage.ENDED
        elif expected.stage == ReceiverStage.CANCELLED:
            expected.stage = ReceiverStage.FENCED

    def _to_revoked(self, expected: _Expected) -> None:
        """PENDING, CANCELLED or ENDED -> FENCED."""
        expected.stage = ReceiverStage.FENCED

    def _discard(self, record: Discard) -> None:
        self._discarded.append(record)
        self.discarded_count += 1

    def refused(self) -> list[Refusal]:
        """The most recent refused notices (up to ``REFUSALS_KEPT``), oldest first."""
        with self._cond:
            return list(self._refused)

    def discarded(self) -> list[Discard]:
        """The most recent stale messages dropped (up to ``DISCARDS_KEPT``), oldest first."""
        with self._cond:
            return list(self._discarded)

    def bind(self, request_id: int, source: Hashable, epoch: int = 0) -> None:
        """Records that ``source`` will send the request (before its first notice), so that
        losing that sender fails the request at once (`fail_source`). An announce of a stale
        epoch is discarded. For a request another sender already owns the call raises and
        changes nothing of the request."""
        with self._cond:
            expected = self._requests.get(request_id)
            reason = self._judge("announce", request_id, epoch, source, expected)
            if reason is not None:
                self._discard(Discard("announce", request_id, epoch, reason, _name(source)))
                return
            assert expected is not None
            ask = self._bind_late(expected, source)
        if ask:
            self._ask_cancel(request_id, expected)

    def _bind_late(self, expected: _Expected, source: Optional[Hashable]) -> bool:
        """Binds a request that had no sender yet; returns whether that sender must now be
        asked to cancel it (the receiver gave up before it knew whom to ask)."""
        if source is None or expected.source is not None:
            return False
        expected.source = source
        return expected.stage == ReceiverStage.CANCELLED  # cancelled while no sender could be asked

    def revoked(self, request_id: int, epoch: int, source: Optional[Hashable] = None) -> bool:
        """The fence: the request's sender writes nothing more into its blocks. A request
        not complete fails (its `wait` raises) and may be released at once. A fence of a
        stale epoch, or for a request already released, is discarded; one from a sender the
        request does not belong to is refused (raised) and changes nothing. Returns whether
        the request was fenced by this call."""
        with self._cond:
            expected = self._requests.get(request_id)
            reason = self._judge("revoke", request_id, epoch, source, expected)
            if reason is not None:
                self._discard(Discard("revoke", request_id, epoch, reason, _name(source)))
                return False
            assert expected is not None
            if expected.stage in (ReceiverStage.FENCED, ReceiverStage.COMPLETE):
                return False
            self._to_revoked(expected)
            expected.revoked = True
            who = "its sender" if source is None else str(source)
            self._fail_locked(
                expected,
                TransferError(
                    f"request {request_id}: revoked by {who} before all its blocks arrived",
                    request_ids=(request_id,),
                    peer=_name(source),
                ),
            )
            self._cond.notify_all()
            return True

    def landing(self, request_id: int) -> bool:
        """Whether a write admitted into the request's blocks may still be copying (`release`
        waits for it)."""
        with self._cond:
            return self._landing(self._get(request_id))

    def revoked_by_sender(self, request_id: int) -> bool:
        """Whether the request's sender revoked it (`revoked`) before all its blocks arrived:
        its fence came, so no write of its epoch lands any more. A decode server may expect
        it again under a new epoch (a prefill engine that preempted it sends it again)."""
        with self._cond:
            return self._get(request_id).revoked

    def fenced(self, request_id: int) -> bool:
        """Whether no sender writes the request's destination blocks any more: it completed,
        its sender revoked it, or its sender's connection ended."""
        with self._cond:
            return self._get(request_id).stage.fenced

    def stage(self, request_id: int) -> ReceiverStage:
        """The request's current `ReceiverStage`."""
        with self._cond:
            return self._get(request_id).stage

    def owns_unfinished(self, source: Hashable) -> bool:
        """Whether sender ``source`` still writes a request here (one it announced is
        `ReceiverStage.PENDING`): closing its connection would fail that request."""
        with self._cond:
            return any(e.source == source and e.stage is ReceiverStage.PENDING for e in self._requests.values())

    def on_cancel(self, handler: CancelHandler) -> Callable[[], None]:
        """Calls ``handler(source, request_id, epoch)`` whenever the receiver gives up on a
        request (`cancel`, `release` of an incomplete one). Returns the unsubscribe call."""
        with self._cond:
            self._cancel_handlers.append(handler)

        def unsubscribe() -> None:
            with self._cond:
                if handler in self._cancel_handlers:
                    self._cancel_handlers.remove(handler)

        return unsubscribe

    def cancel(self, request_id: int, reason: str = "the generation side gave up on it") -> bool:
        """The receiver gives up on an incomplete request: its `wait` raises, later notices
        for it are discarded, and its sender is asked to cancel it (a transport with a way
        back passes that on; the sender then posts its fence). Returns whether this call
        cancelled it (``False``: complete, revoked or cancelled already)."""
        with self._cond:
            expected = self._get(request_id)
            if expected.stage in (ReceiverStage.CANCELLED, ReceiverStage.FENCED, ReceiverStage.COMPLETE):
                return False
            self._to_cancelled(expected)
            peer = None if expected.source is None else str(expected.source)
            self._fail_locked(
                expected,
                TransferError(
                    f"request {request_id}: cancelled by the receiver ({reason})", request_ids=(request_id,), peer=peer
                ),
            )
            self._cond.notify_all()
            ask = expected.stage == ReceiverStage.CANCELLED  # a sender that is gone has nothing to stop
        if ask:
            self._ask_cancel(request_id, expected)
        return True

    def _ask_cancel(self, request_id: int, expected: _Expected) -> None:
        with self._cond:
            # Unbound, only in-process senders hear it: a sender that announces the request
            # later is asked then (`_bind_late`).
            handlers, source, epoch = list(self._cancel_handlers), expected.source, expected.epoch
        for handler in handlers:
            handler(source, request_id, epoch)

    def fail(self, request_id: int, error: KvFerryError) -> bool:
        """Marks a request failed (the transport lost its peer, say); `wait` raises `error`.
        A request already complete or already failed is left as it is. Returns whether the
        request was failed by this call."""
        with self._cond:
            expected = self._requests.get(request_id)
            if expected is None or expected.stage == ReceiverStage.COMPLETE:
                return False
            return self._fail_locked(expected, error)

    def fence_source(self, source: Hashable) -> list[int]:
        """``source`` can write nothing more (its process is gone, or closed its connection
        after its copies ended): every request it owns is fenced, and may be released at
        once. Nothing is failed here. Returns their ids, in order."""
        with self._cond:
            owned = sorted(rid for rid, e in self._requests.items() if e.source == source)
            for rid in owned:
                self._to_ended(self._requests[rid])
            self._cond.notify_all()
        return owned

    def fail_source(self, source: Hashable, reason: str, *, fenced: bool = False) -> list[int]:
        """Fails every incomplete request that belongs to ``source`` (a sender that went
        away): their waits raise at once. ``fenced``: the sender can write nothing more
        (`fence_source` first). Returns the failed ids, in order."""
        if fenced:
            self.fence_source(source)
        with self._cond:
            owned = sorted(rid for rid, e in self._requests.items() if e.source == source)
        failed = []
        for rid in owned:
            if self.fail(rid, TransferError(f"request {rid}: {reason}", request_ids=(rid,), peer=str(source))):
                failed.append(rid)
        return failed

    def take_settled(self) -> set[int]:
        """The ids of the requests that completed or failed since the last call: a poller
        waits (``wait(request_id, 0)``) on these only, so a step costs O(changes), not one
        wait per request still arriving. Each such request is named at least once (a request
        awaiting another's blocks may be named before it is done: `wait` decides); a request
        released since may be among them."""
        with self._cond:
            settled, self._settled = self._settled, set()
        return settled

    def is_complete(self, request_id: int) -> bool:
        with self._cond:
            return self._get(request_id).ledger.is_complete

    def notices(self, request_id: int) -> list[Notice]:
        """The notices that arrived for a request, in arrival order."""
        with self._cond:
            return list(self._get(request_id).notices)

    def wait(self, request_id: int, timeout: Optional[float] = None) -> float:
        """Blocks until every expected block of the request arrived; returns the monotonic
        time it completed. Raises at once the request's error (a refused notice, its sender's fence or
        the loss of its sender before the last block, a cancellation, an awaited owner that
        failed or was released), `UnknownRequestError` for a request not expected, and
        `TransferTimeoutError` after ``timeout`` seconds, saying what the receiver knows:
        which blocks are missing, whether any sender announced the request, how many notices
        came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                expected = self._get(request_id)
                if expected.error is not None:
                    peer = getattr(expected.error, "peer", None)
                    raise TransferError(
                        f"request {request_id} failed: {expected.error}", request_ids=(request_id,), peer=peer
                    ) from expected.error
                if expected.ledger.is_complete and self._settle_awaits(request_id, expected):
                    assert expected.arrived_at is not None
                    return max(expected.arrived_at, expected.awaited_at)
                peer = None if expected.source is None else str(expected.source)
                # A request fenced by its sender's end (not revoked) still waits: a NIXL
                # notification of a write that finished may arrive after the socket's EOF.
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    missing = (
                        expected.ledger.missing()
                        if not expected.ledger.is_complete
                        else [blocks for _, blocks in expected.awaits]
                    )
                    raise TransferTimeoutError(
                        (
                            f"request {request_id}: blocks {missing} did not arrive within {timeout} s; "
                            f"{self._known(expected)} (epoch {expected.epoch})"
                        ),
                        request_ids=(request_id,),
                        peer=peer,
                    )
                self._cond.wait(left)

    @staticmethod
    def _known(expected: _Expected) -> str:
        """What the receiver knows of a request's senders, for an error message."""
        who = "no sender announced it" if expected.source is None else f"its sender is {expected.source}"
        if expected.awaits and expected.ledger.is_complete:
            owners = sorted({owner for owner, _ in expected.awaits})
            return f"{who}; its own blocks arrived, it waits for blocks arriving with requests {owners}"
        return f"{who}; {expected.slices} notices arrived"

    def _forget(self, request_id: int) -> None:
        """Drops a request (lock held). Requests awaiting its blocks keep those that arrived;
        the others fail at their next `wait`."""
        for other in self._dependents.pop(request_id, ()):
            self._settled.add(other)  # its awaited blocks arrived, or it fails at its next wait
            theirs = self._requests.get(other)
            if theirs is not None and theirs.awaits:
                try:
                    self._settle_awaits(other, theirs)
                except TransferError:
                    pass  # recorded on that request: its wait raises
        del self._requests[request_id]
        self._settled.discard(request_id)  # so the set holds live requests only, taken or not
        self._cond.notify_all()

    def _settle_awaits(self, request_id: int, expected: _Expected) -> bool:
        """Drops the awaited blocks that have arrived with their owner's transfer; True when
        none is left. An owner that failed or was forgotten first fails this request."""
        for owner, blocks in list(expected.awaits):
            theirs = self._requests.get(owner)
            missing = theirs is not None and any(
                m.start < blocks.end and blocks.start < m.end for m in theirs.ledger.missing()
            )
            if theirs is None or theirs.error is not None:
                why = "was released" if theirs is None else f"failed ({theirs.error})"
                expected.error = TransferError(
                    (
                        f"request {request_id}: blocks {blocks} were to arrive with request {owner}'s transfer, "
                        f"which {why} before they did"
                    ),
                    request_ids=(request_id,),
                )
                raise TransferError(
                    f"request {request_id} failed: {expected.error}", request_ids=(request_id,)
                ) from expected.error
            if not missing:
                expected.awaits.remove((owner, blocks))
                expected.awaited_at = max(
                    expected.awaited_at, time.monotonic() if theirs.arrived_at is None else theirs.arrived_at
                )
        return not expected.awaits

    def release(self, request_id: int, timeout: Optional[float] = RELEASE_SECONDS) -> TransferLedger:
        """Forgets a request; its destination blocks are the caller's to reuse once this
        returns. A fenced request (complete, revoked by its sender, or whose sender's
        connection ended) goes at once. Otherwise the receiver gives up on it (`cancel`:
        its sender is asked to stop) and waits up to ``timeout`` seconds for the fence; if
        none comes, raises `TransferTimeoutError` and keeps the request (cancelled): call
        again, or `release_unfenced` once no sender can write its blocks."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.cancel(request_id)  # no-op for a fenced request
        with self._cond:
            while True:
                expected = self._get(request_id)
                landing = self._landing(expected)
                if expected.stage.fenced and not landing:
                    self._forget(request_id)
                    return expected.ledger
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if landing and expected.stage.fenced:
                        raise self._still_landing(request_id, expected)
                    who = (
                        "no sender has announced it" if expected.source is None else f"its sender is {expected.source}"
                    )
                    raise TransferTimeoutError(
                        f"request {request_id} (epoch {expected.epoch}): no fence within {timeout} s ({who}), "
                        "so a write may still land in its "
                        "destination blocks; they are not released: call release again, or release_unfenced "
                        "once no sender can write them",
                        request_ids=(request_id,),
                        peer=None if expected.source is None else str(expected.source),
                    )
                if landing:  # a CUDA copy signals nobody when it ends: looked at again soon
                    left = LANDING_POLL_SECONDS if left is None else min(LANDING_POLL_SECONDS, left)
                self._cond.wait(left)

    @staticmethod
    def _still_landing(request_id: int, expected: _Expected) -> TransferTimeoutError:
        return TransferTimeoutError(
            f"request {request_id} (epoch {expected.epoch}): a write admitted into its blocks before it was given up"
            " is still copying; they are not released: call again (it ends with the copy)",
            request_ids=(request_id,),
        )

    def release_unfenced(self, request_id: int, timeout: Optional[float] = None) -> TransferLedger:
        """Forgets a request, fenced or not (its sender is still asked to cancel), once no
        write this receiver admitted into its blocks is still copying (`Landing`; at most
        ``timeout`` seconds, None: until then; past it `TransferTimeoutError`, the request
        kept, cancelled). The caller vouches that no sender writes its destination blocks any
        more: it never handed them out, or it keeps them out of use. A late notice for it is
        discarded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.cancel(request_id)
        with self._cond:
            while True:
                expected = self._get(request_id)
                if not self._landing(expected):
                    self._forget(request_id)
                    return expected.ledger
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._still_landing(request_id, expected)
                self._cond.wait(LANDING_POLL_SECONDS if left is None else min(LANDING_POLL_SECONDS, left))

    def __len__(self) -> int:
        with self._cond:
            return len(self._requests)

    def _get(self, request_id: int) -> _Expected:
        expected = self._requests.get(request_id)
        if expected is None:
            self._raise_unknown(request_id)
        return expected  # type: ignore[return-value]

    @staticmethod
    def _raise_unknown(request_id: int) -> None:
        raise UnknownRequestError(f"unknown request_id={request_id}: never expected or already released")


def _name(source: Optional[Hashable]) -> Optional[str]:
    return None if source is None else str(source)


def _blocks_of(notice: Notice) -> BlockRange:
    """The notice's range; an empty or unrepresentable one is refused like any other bad
    range (a sender never announces an empty slice)."""
    try:
        blocks = BlockRange(notice.start, notice.end)
    except (OverflowError, TypeError) as err:
        raise InvalidArgumentError(f"invalid notice range=[{notice.start}, {notice.end}): {err}") from None
    if notice.end <= notice.start:
        raise InvalidArgumentError(f"invalid notice range=[{notice.start}, {notice.end}): announces no blocks")
    return blocks
