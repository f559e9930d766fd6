"""Transports: one-sided writes into the receiver's pool, then a completion notice.

A transport gives the sender two things: ``dst``, the receiver's pool as this process can
address it (the same tensors in-process, an attached shared-memory mapping across processes),
and ``post``, which hands notices to the receiver once the writes they describe have landed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver

__all__ = ["InProcessTransport", "Transport"]


class Transport(ABC):
    """The sender's view of one receiver."""

    dst: PagedKV

    @abstractmethod
    def post(self, notices: Sequence[Notice]) -> None:
        """Delivers notices whose writes are complete, in order."""

    def close(self) -> None:
        """Releases the transport's resources (connections, mappings)."""


class InProcessTransport(Transport):
    """Both pools in one process, on any devices: writes are direct copies and notices are
    method calls."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self.dst = receiver.pool

    def post(self, notices: Sequence[Notice]) -> None:
        for notice in notices:
            self.receiver.deliver(notice)
