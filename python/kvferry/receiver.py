"""`KVReceiver`: the generation side. It owns the destination pool, expects requests, and
counts a request complete only when every expected block has landed exactly once."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from kvferry._core import BlockRange, TransferLedger
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError, TransferTimeoutError, UnknownRequestError
from kvferry.layout import PagedKV
from kvferry.notice import Notice

__all__ = ["KVReceiver"]


@dataclass
class _Expected:
    ledger: TransferLedger
    slices: int = 0
    error: Optional[KvFerryError] = None
    arrived_at: Optional[float] = None
    notices: list[Notice] = field(default_factory=list)


class KVReceiver:
    """Tracks arrivals per request in its own ledger. Notices may come from another thread
    (a transport's listener); every method is safe to call concurrently."""

    def __init__(self, pool: PagedKV) -> None:
        self.pool = pool
        self._requests: dict[int, _Expected] = {}
        self._cond = threading.Condition()

    def expect(self, request_id: int, prompt_len: int, *, window: Optional[int] = None, held: Sequence[BlockRange] = ()) -> None:
        """Registers a request before its first notice. ``held`` lists blocks this worker
        already holds: they count as arrived and must never be sent."""
        ledger = TransferLedger(self.pool.tokens_per_block, prompt_len, window=window)
        for blocks in held:
            ledger.claim(blocks)
        with self._cond:
            if request_id in self._requests:
                raise InvalidArgumentError(f"invalid request_id={request_id}: already expected")
            self._requests[request_id] = _Expected(ledger)

    def deliver(self, notice: Notice) -> bool:
        """Records a notice; returns whether the request is now complete. A notice for an
        unknown request, outside the prompt, or for blocks that already arrived is refused,
        and the request is marked failed (its `wait` raises)."""
        with self._cond:
            expected = self._requests.get(notice.request_id)
            if expected is None:
                raise UnknownRequestError(f"unknown request_id={notice.request_id}: notice {notice} for a request not expected")
            try:
                expected.ledger.claim(BlockRange(notice.start, notice.end))
            except KvFerryError as err:
                expected.error = err
                self._cond.notify_all()
                raise
            expected.slices += 1
            expected.notices.append(notice)
            complete = expected.ledger.is_complete
            if complete:
                expected.arrived_at = time.monotonic()
                self._cond.notify_all()
            return complete

    def fail(self, request_id: int, error: KvFerryError) -> None:
        """Marks a request failed (the transport lost its peer, say); `wait` raises `error`."""
        with self._cond:
            expected = self._requests.get(request_id)
            if expected is not None and expected.error is None:
                expected.error = error
                self._cond.notify_all()

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
                    raise TransferError(f"request {request_id} failed: {expected.error}") from expected.error
                if expected.ledger.is_complete:
                    assert expected.arrived_at is not None
                    return expected.arrived_at
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    missing = expected.ledger.missing()
                    raise TransferTimeoutError(f"request {request_id}: blocks {missing} did not arrive within {timeout} s")
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
