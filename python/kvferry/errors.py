"""The kvferry exception hierarchy. ``kvferry._core`` raises these classes.

Every error is a :class:`KvFerryError`; invalid arguments are also ``ValueError`` and unknown
request ids also ``KeyError``, so callers that catch the builtins keep working.
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = [
    "KvFerryError",
    "InvalidArgumentError",
    "DuplicateTransferError",
    "UnknownRequestError",
    "TransferError",
    "ChecksumError",
    "TransferTimeoutError",
    "UnqueuedWriteError",
    "MissingDependencyError",
    "SharedMemoryError",
]


class KvFerryError(Exception):
    """Base class of every error kvferry raises."""


class InvalidArgumentError(KvFerryError, ValueError):
    """An argument is outside its domain; the message names the argument and its value."""


class DuplicateTransferError(KvFerryError):
    """A block was claimed a second time. Sending it again would be a silent resend."""


class UnknownRequestError(KvFerryError, KeyError):
    """A request id that was never added, or was already removed."""

    def __str__(self) -> str:
        # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class TransferError(KvFerryError):
    """A transfer failed (a copy raised, a peer went away, a notice was refused).

    ``request_ids`` lists the requests it failed (empty where it concerns none in
    particular) and ``peer`` names the other side, so a caller can release exactly those
    requests without parsing the message."""

    def __init__(self, message: str = "", *, request_ids: Iterable[int] = (), peer: Optional[str] = None) -> None:
        super().__init__(message)
        self.request_ids: tuple[int, ...] = tuple(int(r) for r in request_ids)
        self.peer = peer


class ChecksumError(TransferError):
    """A block's bytes where its write landed are not the bytes its sender summed
    (kvferry.checksum): corrupted in flight, or overwritten before its notice arrived. Its
    request fails (vLLM: the connector's load-failure policy); the message names the
    request, the block (``block``: its index in the request), its destination block and
    both checksums."""

    def __init__(
        self, message: str = "", *, request_ids: Iterable[int] = (), peer: Optional[str] = None, block: int = -1
    ) -> None:
        super().__init__(message, request_ids=request_ids, peer=peer)
        self.block = block


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within its deadline."""


class UnqueuedWriteError(TransferError):
    """A `KVSender` ``send_*`` call claimed its plan in the book but could not queue all of
    its writes (the sender's backlog full): the requests it names (``request_ids``) failed,
    and every other request of the call had all its writes queued. Any other error from a
    ``send_*`` call was raised before anything of the call was claimed, or is the loss of
    the receiver (which fails every request)."""


class SharedMemoryError(KvFerryError, MemoryError):
    """A pool or a staging ring does not fit in /dev/shm. Raised when it is created, before
    any page is touched (a page past a full tmpfs would kill the process with SIGBUS); the
    message gives the bytes asked for, those free, and the two ways out."""


class MissingDependencyError(KvFerryError, ImportError):
    """An optional dependency is not installed. The message is one line that names the
    extra which brings it (``pip install 'kvferry[torch]'``); ``name`` is the missing module,
    as on any ``ImportError``."""
