"""Transports: one-sided writes into the receiver's pool, then a completion notice.

A transport gives the sender: ``geometry``, the receiver pool's layout to check against
before any byte moves; ``write``, which queues the copy of block pairs into the receiver's
pool; ``post``, which hands notices to the receiver once the writes they describe have
landed; and ``revoke``, the fence: posted down the same ordered channel as the notices once
the sender will write nothing more for a request it cancelled or failed, it tells the
receiver that the request's destination blocks may be reused (docs/faults.md, "Leases,
epochs and fences"). Copy-based transports (in-process, shared memory, CUDA IPC) address the
receiver's pool as ``dst`` and write with a copy engine; NIXL writes through its own agent and
carries the notices with the write.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, AbstractSet, Optional, Sequence

import numpy as np

from kvferry.checksum import summed
from kvferry.copy import copy_blocks
from kvferry.engine import CopyEngine, Pending
from kvferry.errors import KvFerryError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.tiers import Signal, Source, source_layers, source_parts

if TYPE_CHECKING:
    import torch

    from kvferry.checksum import WriteChecksums

__all__ = ["Transport", "TransportFull", "WouldWait", "Write", "kept"]


class TransportFull(KvFerryError):
    """The transport has no room for a write until earlier writes are posted and the
    receiver releases them (a bounded staging ring, say). Nothing was queued."""


class WouldWait(Exception):
    """Inside `Transport.try_post`: the post's frame would wait on the receiver; nothing was
    sent or changed. Never leaves the transport."""


@dataclass(frozen=True)
class Write:
    """One write, as the sender hands it to `Transport.write`: copy blocks ``src_ids`` of
    ``src`` (a pool, or a device pool and its host tier behind one id space:
    kvferry.tiers) into blocks ``dst_ids`` of the receiver's pool, after every signal in
    ``after``, in layers ``[lo, hi)`` only when ``layers`` is given (a layer slice);
    ``notices`` describe it (a transport that carries them with the write uses them)."""

    src: Source
    src_ids: np.ndarray
    dst_ids: np.ndarray
    notices: Sequence[Notice]
    after: Sequence[Signal] = ()
    layers: Optional[tuple[int, int]] = None
    checksums: Optional[WriteChecksums] = None


class Transport(ABC):
    """The sender's view of one receiver. The base class is the copy-based transport: the
    receiver's pool is addressable here as ``dst``."""

    dst: PagedKV
    # The most blocks one write may carry; the sender cuts larger plans into several writes
    # (None: no limit). A transport whose receiver has work to do per write sets it, so that
    # work overlaps the copy of the next write.
    max_write_blocks: Optional[int] = None
    # Names the receiver in errors (a cross-process transport says which socket and pid).
    peer: str = "receiver"
    # Whether a write's notices leave with the write itself (NIXL's notification) rather than
    # by `post` after its copy finished: then revoking a request cannot drop the notices of a
    # write already issued, and whoever overwrites its source blocks waits for that write.
    carries_notices: bool = False
    # Whether handing this transport a write costs its caller time that grows with the
    # write's scattered blocks (NIXL builds and posts one descriptor per run of blocks per
    # layer: about 8 us each for scattered blocks on an H200, 268 ms for 1024 blocks of 32
    # layers). A `KVSender` over CUDA pools then hands its writes to its announcer thread by
    # default, so an early send never holds the engine's thread before its forward.
    costly_submit: bool = False

    def write_blocks(self, total: int, device: torch.device) -> int:
        """The most blocks each write of a ``total``-block plan from a pool on ``device``
        carries: `max_write_blocks`, or the whole plan without one. The sender cuts a larger
        plan into writes of at most that many."""
        return self.max_write_blocks or total

    def check_peer(self) -> None:
        """Raises `TransferError` naming the receiver once it is known to be gone; never
        blocks. A transport that cannot tell returns."""

    def announce(self, requests: Sequence[tuple[int, int]]) -> None:
        """Tells the receiver, before any notice, that these ``(request_id, epoch)`` come
        from this sender, so that losing the sender fails them at once."""

    def cancel_requests(self) -> list[tuple[int, int]]:
        """The ``(request_id, epoch)`` pairs the receiver asked this sender to cancel since
        the last call (it gave up on them); a transport without a way back returns none."""
        return []

    def geometry(self) -> dict[str, object]:
        """The receiver pool's layout (see `PagedKV.geometry`)."""
        return self.dst.geometry()

    @property
    def num_blocks(self) -> int:
        """Blocks in the receiver's pool."""
        return self.dst.num_blocks

    def check_source(self, src: Source) -> None:
        """Refuses, before anything is sent, a source this transport cannot read (a NIXL
        transport reads only the pools it registered). Copy-based transports read any."""

    def write(self, engine: CopyEngine, job: Write) -> Pending:
        """Queues ``job`` (`Write`) on ``engine``. One write is one job: its notices are
        posted once every part of it landed."""
        layers, after = job.layers, job.after
        src, dst = source_layers(job.src, layers), self.dst if layers is None else self.dst.layer_slice(*layers)
        sums = None if job.checksums is None else job.checksums.compute
        if isinstance(src, PagedKV):
            return engine.submit(src, dst, job.src_ids, job.dst_ids, after=after, before=sums)
        parts = source_parts(src, job.src_ids, job.dst_ids)

        def copy() -> None:
            for part in parts:
                copy_blocks(part.pool, dst, part.src_ids, part.dst_ids)

        return engine.submit_call(
            summed(job, copy), after=after, nbytes=len(job.src_ids) * src.device.block_bytes * src.device.num_layers
        )

    @abstractmethod
    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        """Called once per finished write, in order, with every notice the write carried:
        delivers those whose request is not in ``revoked`` (cancelled requests)."""

    def try_post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> bool:
        """`post`, where it waits on nothing (its frame fits in the connection now): True once
        posted; False, nothing sent or changed, where it would wait, or where the transport
        cannot tell. A thread that must not wait on the receiver (the engine's) tries it and
        otherwise leaves the post to one that may."""
        return False

    @abstractmethod
    def revoke(self, request_id: int, epoch: int) -> None:
        """The fence: this sender writes nothing more into the request's destination blocks
        (every write that touched them finished or was called off, and was posted or
        abandoned). Delivered after every notice posted before it."""

    def wait_for_room(self, timeout: float) -> bool:
        """After `TransportFull`: blocks until the receiver released room or ``timeout``
        seconds passed; returns whether room was released."""
        return False

    def abandon(self, batch: Sequence[Notice]) -> None:
        """Called instead of `post` when a write failed: releases what it held."""

    def close(self) -> None:
        """Releases the transport's resources (connections, mappings)."""


def kept(batch: Sequence[Notice], revoked: AbstractSet[int]) -> list[Notice]:
    """The notices of a batch whose requests were not cancelled."""
    return [n for n in batch if n.request_id not in revoked]
