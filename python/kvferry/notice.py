"""The completion notice a sender posts after the writes of one slice have landed."""

from __future__ import annotations

from dataclasses import dataclass

NoticeTuple = tuple[int, int, int, int, bool, int, int, int]

__all__ = ["NOTICE_FIELDS", "Notice", "NoticeTuple"]

# Values in a notice's wire form (`Notice.as_tuple`).
NOTICE_FIELDS = 8


@dataclass(frozen=True)
class Notice:
    """Blocks ``[start, end)`` of ``request_id`` are resident at the receiver. ``slice_id``
    counts a request's slices from 0 in the order they were planned; ``last`` marks the
    slice that finishes the prompt. ``epoch`` is the lease the receiver issued for the
    request (`KVReceiver.expect`): a notice of an older epoch is discarded, never counted
    for a later request with the same id. 0: the sender was given no epoch (unfenced).
    ``group`` of ``groups``: the notice covers only that layer group's layers of the blocks
    (layer-wise streaming, `PagedKV.group_layers`); group 0 of 1 is every layer."""

    request_id: int
    slice_id: int
    start: int
    end: int
    last: bool
    epoch: int = 0
    group: int = 0
    groups: int = 1

    @property
    def whole(self) -> bool:
        """Whether the notice covers every layer of its blocks."""
        return self.groups == 1

    def as_tuple(self) -> NoticeTuple:
        """The wire form (eight plain values; no pickled classes cross a process boundary)."""
        return (self.request_id, self.slice_id, self.start, self.end, self.last, self.epoch, self.group, self.groups)

    @classmethod
    def from_tuple(cls, values: NoticeTuple) -> Notice:
        """Refuses (``ValueError``, ``TypeError``) anything but eight integer-like values."""
        request_id, slice_id, start, end, last, epoch, group, groups = values
        return cls(
            int(request_id), int(slice_id), int(start), int(end), bool(last), int(epoch), int(group), int(groups)
        )
