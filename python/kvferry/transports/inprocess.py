"""The in-process transport: both pools in one process; writes are direct copies and
notices are method calls."""

from __future__ import annotations

from collections import deque
from typing import AbstractSet, Hashable, Optional, Sequence

from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transports.base import Transport, kept

__all__ = ["InProcessTransport"]


class InProcessTransport(Transport):
    """Both pools in one process, on any devices: writes are direct copies and notices are
    method calls."""

    peer = "receiver in this process"

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self.dst = receiver.pool
        # The receiver's cancellations of requests no connection owns (in-process senders
        # deliver without a source); the sender keeps those whose epoch it issued to a
        # request of its own.
        self._cancels: deque[tuple[int, int]] = deque()
        self._unsubscribe = receiver.on_cancel(self._on_cancel)

    def _on_cancel(self, source: Optional[Hashable], request_id: int, epoch: int) -> None:
        if source is None:
            self._cancels.append((request_id, epoch))

    def cancel_requests(self) -> list[tuple[int, int]]:
        out = []
        while self._cancels:
            out.append(self._cancels.popleft())
        return out

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        for notice in kept(batch, revoked):
            self.receiver.deliver(notice)

    def revoke(self, request_id: int, epoch: int) -> None:
        self.receiver.revoked(request_id, epoch)

    def close(self) -> None:
        self._unsubscribe()
