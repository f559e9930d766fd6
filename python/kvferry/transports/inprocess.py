"""The in-process transport: both pools in one process; writes are direct copies and
notices are method calls."""

from __future__ import annotations

from collections import deque
from typing import AbstractSet, Hashable, Optional, Sequence

import numpy as np

from kvferry.engine import CopyEngine, Pending
from kvferry.errors import ChecksumError
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transports.base import Transport, Write

__all__ = ["InProcessTransport"]


class InProcessTransport(Transport):
    """Both pools in one process, on any devices: writes are direct copies and notices are
    method calls that name the destination blocks each write used (as a cross-process
    transport's frames do), so the receiver checks a write's checksums where it landed."""

    peer = "receiver in this process"

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self.dst = receiver.pool
        # The receiver's cancellations of requests no connection owns (in-process senders
        # deliver without a source); the sender keeps those whose epoch it issued to a
        # request of its own.
        self._cancels: deque[tuple[int, int]] = deque()
        self._unsubscribe = receiver.on_cancel(self._on_cancel)
        # Destination ids of the writes queued and not yet posted, oldest first (writes are
        # posted or abandoned in the order they were queued).
        self._written: deque[np.ndarray] = deque()

    def _on_cancel(self, source: Optional[Hashable], request_id: int, epoch: int) -> None:
        if source is None:
            self._cancels.append((request_id, epoch))

    def cancel_requests(self) -> list[tuple[int, int]]:
        out = []
        while self._cancels:
            out.append(self._cancels.popleft())
        return out

    def write(self, engine: CopyEngine, job: Write) -> Pending:
        pending = super().write(engine, job)
        self._written.append(np.asarray(job.dst_ids, dtype=np.int64).reshape(-1))
        return pending

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        dst = self._written.popleft() if self._written else None
        at = 0
        for notice in batch:
            n = notice.end - notice.start
            if notice.request_id not in revoked:
                ids = None if dst is None else dst[at : at + n]
                try:
                    self.receiver.deliver(notice, dst_ids=ids)
                except ChecksumError:
                    # Recorded, and its request failed, by the receiver; the sender's other
                    # requests go on, as over a cross-process transport (the endpoint
                    # records a refusal and reads on).
                    pass
            at += n

    def abandon(self, batch: Sequence[Notice]) -> None:
        if self._written:
            self._written.popleft()

    def revoke(self, request_id: int, epoch: int) -> None:
        self.receiver.revoked(request_id, epoch)

    def close(self) -> None:
        self._unsubscribe()
