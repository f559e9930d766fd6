"""`KVReceiver`: the generation side. It owns the destination pool, expects requests, and
counts a request complete only when every expected block has landed exactly once.

Every notice is checked against the request's own ledger before it counts: a notice for a
request not expected here, for blocks outside the request, for no blocks, or for blocks that
already arrived is refused whole (nothing is marked arrived), recorded in `refused`, and fails
the request (its `wait` raises at once instead of at its timeout). A transport that knows
which sender a notice came from passes it as ``source``: a request then belongs to the first
sender that announced it (`bind`, or its first notice), a notice from any other sender is
refused, and `fail_source` fails what a lost sender still owed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from kvferry._core import BlockRange, TransferLedger
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError, TransferTimeoutError, UnknownRequestError
from kvferry.layout import PagedKV
from kvferry.notice import Notice

__all__ = ["KVReceiver", "Refusal"]

# Refused notices kept for inspection; a sender that keeps sending bad ones cannot grow the
# receiver without bound (``refused_count`` still counts every one).
REFUSALS_KEPT = 1024


@dataclass
class _Expected:
    ledger: TransferLedger
    slices: int = 0
    error: Optional[KvFerryError] = None
    arrived_at: Optional[float] = None
    notices: list[Notice] = field(default_factory=list)
    source: Optional[Hashable] = None  # the sender it belongs to, once one announced it


@dataclass(frozen=True)
class Refusal:
    """A notice the receiver refused, why, and from which sender (``None``: not known)."""

    notice: Notice
    error: KvFerryError
    source: Optional[str] = None


class KVReceiver:
    """Tracks arrivals per request in its own ledger. Notices may come from another thread
    (a transport's listener); every method is safe to call concurrently."""

    def __init__(self, pool: PagedKV) -> None:
        if not isinstance(pool, PagedKV):
            raise TypeError(f"pool must be a PagedKV, got {type(pool).__name__}")
        self.pool = pool
        self._requests: dict[int, _Expected] = {}
        self._cond = threading.Condition()
        self._refused: deque[Refusal] = deque(maxlen=REFUSALS_KEPT)
        self.refused_count = 0

    def expect(self, request_id: int, prompt_len: int, *, window: Optional[int] = None, held: Sequence[BlockRange] = ()) -> None:
        """Registers a request before its first notice. ``held`` lists blocks this worker
        already holds: they count as arrived and must never be sent."""
        ledger = TransferLedger(self.pool.tokens_per_block, prompt_len, window=window)
        for blocks in held:
            ledger.claim(blocks)
        with self._cond:
            if request_id in self._requests:
                raise InvalidArgumentError(f"invalid request_id={request_id}: already expected")
            expected = _Expected(ledger)
            if ledger.is_complete:  # everything was held: nothing will arrive
                expected.arrived_at = time.monotonic()
            self._requests[request_id] = expected

    def deliver(self, notice: Notice, source: Optional[Hashable] = None) -> bool:
        """Records a notice; returns whether the request is now complete. A notice for an
        unknown request, for no blocks or blocks outside the prompt, for blocks that already
        arrived, or from a sender other than the one the request belongs to is refused
        (raised, and kept in `refused`); a refused notice for a known request fails it."""
        with self._cond:
            expected = self._requests.get(notice.request_id)
            if expected is None:
                raise self._refuse(notice, source, None, UnknownRequestError(f"unknown request_id={notice.request_id}: notice {notice} for a request not expected"))
            if source is not None:
                if expected.source is None:
                    expected.source = source
                elif expected.source != source:
                    err = TransferError(
                        f"request {notice.request_id}: notice {notice} from {source}, but the request belongs to {expected.source}",
                        request_ids=(notice.request_id,),
                        peer=str(source),
                    )
                    raise self._refuse(notice, source, expected, err)
            try:
                blocks = _blocks_of(notice)
                expected.ledger.claim(blocks)  # all or nothing: a refused claim marks nothing
            except KvFerryError as err:
                raise self._refuse(notice, source, expected, err) from None
            expected.slices += 1
            expected.notices.append(notice)
            complete = expected.ledger.is_complete
            if complete:
                expected.arrived_at = time.monotonic()
                self._cond.notify_all()
            return complete

    def _refuse(self, notice: Notice, source: Optional[Hashable], expected: Optional[_Expected], error: KvFerryError) -> KvFerryError:
        """Records a refused notice and fails its request; returns the error to raise."""
        self._refused.append(Refusal(notice, error, None if source is None else str(source)))
        self.refused_count += 1
        if expected is not None and expected.error is None:
            expected.error = error
            self._cond.notify_all()
        return error

    def refused(self) -> list[Refusal]:
        """The most recent refused notices (up to ``REFUSALS_KEPT``), oldest first."""
        with self._cond:
            return list(self._refused)

    def bind(self, request_id: int, source: Hashable) -> None:
        """Records that ``source`` will send the request (before its first notice), so that
        losing that sender fails the request at once (`fail_source`). A request another
        sender already owns is failed and the call raises."""
        with self._cond:
            expected = self._get(request_id)
            if expected.source is not None and expected.source != source:
                err = TransferError(f"request {request_id}: announced by {source}, but it belongs to {expected.source}", request_ids=(request_id,), peer=str(source))
                if expected.error is None:  # two senders claim it: neither can be trusted with it
                    expected.error = err
                    self._cond.notify_all()
                raise err
            expected.source = source

    def fail(self, request_id: int, error: KvFerryError) -> bool:
        """Marks a request failed (the transport lost its peer, say); `wait` raises `error`.
        A request already complete or already failed is left as it is. Returns whether the
        request was failed by this call."""
        with self._cond:
            expected = self._requests.get(request_id)
            if expected is None or expected.error is not None or expected.ledger.is_complete:
                return False
            expected.error = error
            self._cond.notify_all()
            return True

    def fail_source(self, source: Hashable, reason: str) -> list[int]:
        """Fails every incomplete request that belongs to ``source`` (a sender that went
        away): their waits raise at once. Returns their ids, in order."""
        with self._cond:
            owned = sorted(rid for rid, e in self._requests.items() if e.source == source)
        failed = []
        for rid in owned:
            if self.fail(rid, TransferError(f"request {rid}: {reason}", request_ids=(rid,), peer=str(source))):
                failed.append(rid)
        return failed

    def is_complete(self, request_id: int) -> bool:
        with self._cond:
            return self._get(request_id).ledger.is_complete

    def notices(self, request_id: int) -> list[Notice]:
        """The notices that arrived for a request, in arrival order."""
        with self._cond:
            return list(self._get(request_id).notices)

    def wait(self, request_id: int, timeout: Optional[float] = None) -> float:
        """Blocks until every expected block of the request arrived; returns the monotonic
        time it completed. Raises the request's error, or `TransferTimeoutError`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                expected = self._get(request_id)
                if expected.error is not None:
                    peer = getattr(expected.error, "peer", None)
                    raise TransferError(f"request {request_id} failed: {expected.error}", request_ids=(request_id,), peer=peer) from expected.error
                if expected.ledger.is_complete:
                    assert expected.arrived_at is not None
                    return expected.arrived_at
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    missing = expected.ledger.missing()
                    peer = None if expected.source is None else str(expected.source)
                    raise TransferTimeoutError(f"request {request_id}: blocks {missing} did not arrive within {timeout} s", request_ids=(request_id,), peer=peer)
                self._cond.wait(left)

    def release(self, request_id: int) -> TransferLedger:
        """Forgets a request (complete, failed or cancelled); its destination blocks are the
        caller's to reuse once this returns."""
        with self._cond:
            expected = self._requests.pop(request_id, None)
        if expected is None:
            self._raise_unknown(request_id)
        return expected.ledger  # type: ignore[union-attr]

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
