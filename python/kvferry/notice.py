"""The completion notice a sender posts after the writes of one slice have landed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

NoticeTuple = tuple[int, int, int, int, bool, int, int, int]

__all__ = ["NOTICE_FIELDS", "Notice", "NoticeTuple", "joined_checksums", "stamp"]

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
    (layer-wise streaming, `PagedKV.group_layers`); group 0 of 1 is every layer.
    ``checksums``: each block's checksum over the layers written (kvferry.checksum), as
    little-endian uint64 bytes, or None (the sender summed nothing); they travel beside the
    eight values (a frame's ``checksums``), and two notices that differ only there are equal."""

    request_id: int
    slice_id: int
    start: int
    end: int
    last: bool
    epoch: int = 0
    group: int = 0
    groups: int = 1
    checksums: Optional[bytes] = field(default=None, compare=False, repr=False)

    @property
    def whole(self) -> bool:
        """Whether the notice covers every layer of its blocks."""
        return self.groups == 1

    def sums(self) -> np.ndarray:
        """The checksums as a uint64 array, one per block (`ValueError` when there are none)."""
        if self.checksums is None:
            raise ValueError(f"notice {self} carries no checksums")
        return np.frombuffer(self.checksums, dtype="<u8")

    def with_checksums(self, sums: np.ndarray) -> Notice:
        """This notice carrying ``sums`` (one per block: `ValueError` for another count)."""
        values = np.ascontiguousarray(sums, dtype="<u8")
        if values.shape != (self.end - self.start,):
            raise ValueError(
                f"{values.shape[0] if values.ndim else 0} checksums for notice {self} of {self.end - self.start} blocks"
            )
        return dataclasses.replace(self, checksums=values.tobytes())

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


def stamp(notices: Sequence[Notice], sums: Optional[np.ndarray]) -> list[Notice]:
    """Each notice with its blocks' share of ``sums`` (one per block the notices cover, in
    order: a frame's ``checksums``); None leaves them as they are."""
    if sums is None:
        return list(notices)
    values = np.asarray(sums, dtype=np.uint64)
    out, at = [], 0
    for notice in notices:
        n = notice.end - notice.start
        out.append(notice.with_checksums(values[at : at + n]))
        at += n
    return out


def joined_checksums(notices: Sequence[Notice]) -> Optional[np.ndarray]:
    """The notices' checksums end to end (a frame's ``checksums``), or None unless every
    notice carries them."""
    if not notices or any(n.checksums is None for n in notices):
        return None
    return np.concatenate([n.sums() for n in notices])
