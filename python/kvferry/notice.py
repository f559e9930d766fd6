"""The completion notice a sender posts after the writes of one slice have landed."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Notice"]


@dataclass(frozen=True)
class Notice:
    """Blocks ``[start, end)`` of ``request_id`` are resident at the receiver. ``slice_id``
    counts a request's slices from 0 in the order they were planned; ``last`` marks the
    slice that finishes the prompt."""

    request_id: int
    slice_id: int
    start: int
    end: int
    last: bool

    def as_tuple(self) -> tuple[int, int, int, int, bool]:
        """The wire form (five plain values; no pickled classes cross a process boundary)."""
        return (self.request_id, self.slice_id, self.start, self.end, self.last)

    @classmethod
    def from_tuple(cls, values: tuple[int, int, int, int, bool]) -> Notice:
        request_id, slice_id, start, end, last = values
        return cls(int(request_id), int(slice_id), int(start), int(end), bool(last))
