"""The completion notice a sender posts after the writes of one slice have landed."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NOTICE_FIELDS", "Notice"]

# Values in a notice's wire form (`Notice.as_tuple`).
NOTICE_FIELDS = 6


@dataclass(frozen=True)
class Notice:
    """Blocks ``[start, end)`` of ``request_id`` are resident at the receiver. ``slice_id``
    counts a request's slices from 0 in the order they were planned; ``last`` marks the
    slice that finishes the prompt. ``epoch`` is the lease the receiver issued for the
    request (`KVReceiver.expect`): a notice of an older epoch is discarded, never counted
    for a later request with the same id. 0: the sender was given no epoch (unfenced)."""

    request_id: int
    slice_id: int
    start: int
    end: int
    last: bool
    epoch: int = 0

    def as_tuple(self) -> tuple[int, int, int, int, bool, int]:
        """The wire form (six plain values; no pickled classes cross a process boundary)."""
        return (self.request_id, self.slice_id, self.start, self.end, self.last, self.epoch)

    @classmethod
    def from_tuple(cls, values: tuple[int, int, int, int, bool, int]) -> Notice:
        """Refuses (``ValueError``, ``TypeError``) anything but six integer-like values."""
        request_id, slice_id, start, end, last, epoch = values
        return cls(int(request_id), int(slice_id), int(start), int(end), bool(last), int(epoch))
