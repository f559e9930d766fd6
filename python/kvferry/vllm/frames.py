"""The rendezvous's frames (kvferry.vllm.rendezvous), one frozen dataclass per kind, and the
`RENDEZVOUS` frame set: the transports' codec does not know them (rust/src/wire/rendezvous.rs
holds their records, with each field's width and bound). The handshake's frames and the
goodbye are every channel's (kvferry.transports.frames). Every question (lookup, abandon,
offer) carries a ``call``, its number on its connection, and every answer the ``call`` of
the question it answers: one connection carries many questions at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Sequence

import numpy as np

from kvferry import _core
from kvferry.transports.frames import Challenge, Frame, FrameSet, Goodbye, Proof

__all__ = ["RENDEZVOUS", "Abandon", "Abandoned", "Accepted", "Destination", "Lookup", "Offer", "Refused"]


@dataclass(frozen=True)
class Lookup(Frame):
    """Prefill side to the rendezvous: ``transfer``'s destination, please, waiting at most
    ``wait_ms`` for the decode request to publish it; ``sender`` is the prefill engine."""

    kind: ClassVar[str] = "lookup"
    transfer: str
    wait_ms: int
    sender: str
    # The asking side's number for the question (the answer's: the question it answers): one
    # connection carries many questions at once, answered in any order.
    call: int = 0


@dataclass(frozen=True, eq=False)
class Destination(Frame):
    """Rendezvous to the prefill side: where a looked-up transfer's blocks go (what the
    decode worker published, and the URL of the looking-up engine's endpoint)."""

    kind: ClassVar[str] = "destination"
    request_id: int
    epoch: int
    prompt_len: int
    block_size: int
    held_blocks: int
    dst_blocks: Sequence[int] | np.ndarray
    digest: str
    engine: str
    endpoint: str
    call: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The destination as the connector reads it: plain ints, ``dst_blocks`` a list (no
        ``call``: that numbered the question on its connection)."""
        fields = self.fields()
        del fields["call"]
        return dict(fields, dst_blocks=[int(b) for b in self.dst_blocks])


# What a decode worker publishes: a destination without its endpoint (added per lookup) or
# the number of the lookup it answers.
PUBLISHED_KEYS = frozenset(f.name for f in fields(Destination)) - {"endpoint", "call"}


@dataclass(frozen=True)
class Refused(Frame):
    """Rendezvous to the prefill side: why a lookup gets no destination."""

    kind: ClassVar[str] = "refused"
    error: str
    call: int = 0


@dataclass(frozen=True)
class Abandon(Frame):
    """Prefill side to the rendezvous: it gave ``transfer`` up, and why. ``epoch``: the epoch
    of the destination the abandoning request took (0: it took none); a transfer already
    taken is given up only by the request that took it."""

    kind: ClassVar[str] = "abandon"
    transfer: str
    reason: str
    epoch: int = 0
    call: int = 0


@dataclass(frozen=True)
class Abandoned(Frame):
    """Rendezvous to the prefill side: the abandon is recorded."""

    kind: ClassVar[str] = "abandoned"
    call: int = 0


@dataclass(frozen=True)
class Offer(Frame):
    """Decode side to a prefill server's rendezvous: ``transfer``'s destination is published
    at ``peer`` (the decode server's rendezvous, one URL per rank, separated by spaces),
    which ``peer_mac`` signs (kvferry.vllm.trust). A router that sends the decode request
    the prefill server's address, not the other way round, is served this way."""

    kind: ClassVar[str] = "offer"
    transfer: str
    peer: str
    peer_mac: str
    call: int = 0


@dataclass(frozen=True)
class Accepted(Frame):
    """A prefill server's rendezvous to the decode side: the offer is taken."""

    kind: ClassVar[str] = "accepted"
    call: int = 0


RENDEZVOUS = FrameSet(
    "rendezvous",
    (Challenge, Proof, Lookup, Destination, Refused, Abandon, Abandoned, Offer, Accepted, Goodbye),
    _core.rendezvous_encode,
    _core.rendezvous_decode,
)
