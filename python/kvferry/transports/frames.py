"""The frames of the transports' control channel, one frozen dataclass per kind, and the
`FrameSet` that turns them into bytes and back through the Rust codec (rust/src/wire/).

A frame's fields are its record's (rust/src/wire/transport.rs lists them, with their wire
widths and bounds; ``kvferry._core.WIRE_FIELDS`` names them and a test holds these classes
to it). The handshake's frames (`Challenge`, `Proof`) and the `Goodbye` are every channel's;
the vLLM rendezvous's own frames live with it (kvferry.vllm.frames). Whoever reads a channel
dispatches on the frame's class through a ``{frame class: handler}`` table (see
`LocalEndpoint.HANDLERS`), never on a kind string.

Block ids arrive as int64 arrays and notices as `Notice` objects; a frame holding an array
compares by identity (``eq=False``), as arrays do not give one truth value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, TypeVar

import numpy as np

from kvferry import _core
from kvferry.errors import InvalidArgumentError
from kvferry.notice import Notice, joined_checksums, stamp

__all__ = [
    "TRANSPORT",
    "Agent",
    "Announce",
    "Cancel",
    "Challenge",
    "Frame",
    "FrameSet",
    "Freed",
    "Goodbye",
    "Hello",
    "Notices",
    "Proof",
    "Revoke",
    "Staged",
]

F = TypeVar("F", bound="Frame")


@dataclass(frozen=True)
class Frame:
    """One frame; ``kind`` is its type's name on the wire (rust/src/wire/mod.rs)."""

    kind: ClassVar[str]

    def fields(self) -> dict[str, Any]:
        """The record's fields as the codec takes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_fields(cls: type[F], fields: dict[str, Any]) -> F:
        return cls(**fields)


@dataclass(frozen=True)
class Challenge(Frame):
    """Handshake: the sender's role (kvferry.transports.wire.ROLE_*) and a fresh nonce."""

    kind: ClassVar[str] = "challenge"
    role: int
    nonce: bytes


@dataclass(frozen=True)
class Proof(Frame):
    """Handshake: an HMAC-SHA256 over the label, the role and both nonces."""

    kind: ClassVar[str] = "proof"
    mac: bytes


@dataclass(frozen=True)
class Goodbye(Frame):
    """Either way: why the connection is about to close (at most 1024 bytes of UTF-8)."""

    kind: ClassVar[str] = "goodbye"
    reason: str


@dataclass(frozen=True, eq=False)
class Hello(Frame):
    """Receiver to sender: the pool's geometry and how to reach it, as one flat dict
    (``pool``: rust/src/py/wire/hello.rs lists its keys by pool kind)."""

    kind: ClassVar[str] = "hello"
    pool: Mapping[str, Any]

    def fields(self) -> dict[str, Any]:
        return dict(self.pool)

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Hello:
        return cls(pool=fields)


@dataclass(frozen=True, eq=False)
class Notices(Frame):
    """Sender to receiver: notices, and the destination blocks their writes used, in notice
    order (``None``: the sender names none, which a request whose lease records its blocks
    refuses). The notices' checksums (`Notice.checksums`) travel as the record's
    ``checksums``, one per block the notices cover, when every notice carries them."""

    kind: ClassVar[str] = "notices"
    notices: Sequence[Notice]
    dst_ids: Optional[np.ndarray] = None

    def fields(self) -> dict[str, Any]:
        return {
            "notices": [n.as_tuple() for n in self.notices],
            "dst_ids": self.dst_ids,
            "checksums": joined_checksums(self.notices),
        }

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Notices:
        return cls(stamp([Notice(*values) for values in fields["notices"]], fields["checksums"]), fields["dst_ids"])


@dataclass(frozen=True)
class Announce(Frame):
    """Sender to receiver: ``(request_id, epoch)`` it will send, before their notices."""

    kind: ClassVar[str] = "announce"
    leases: Sequence[tuple[int, int]]


@dataclass(frozen=True)
class Revoke(Frame):
    """Sender to receiver: a request's fence (nothing more is written for this epoch)."""

    kind: ClassVar[str] = "revoke"
    request_id: int
    epoch: int


@dataclass(frozen=True)
class Cancel(Frame):
    """Receiver to sender: ``(request_id, epoch)`` the receiver gave up on."""

    kind: ClassVar[str] = "cancel"
    leases: Sequence[tuple[int, int]]


@dataclass(frozen=True, eq=False)
class Staged(Frame):
    """Sender to receiver: a staging-ring batch. Ring slots from ``lo`` hold the blocks of
    ``notices`` in order (or more, of which those at ``picked`` go to ``dst_ids``); ``freed``
    slots are free once it is applied. The notices' checksums travel as in `Notices`."""

    kind: ClassVar[str] = "staged"
    notices: Sequence[Notice]
    lo: int
    freed: int
    picked: Optional[np.ndarray]
    dst_ids: np.ndarray

    def fields(self) -> dict[str, Any]:
        return dict(
            super().fields(),
            notices=[n.as_tuple() for n in self.notices],
            checksums=joined_checksums(self.notices),
        )

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Staged:
        sums = fields.pop("checksums")
        return cls(**dict(fields, notices=stamp([Notice(*values) for values in fields["notices"]], sums)))


@dataclass(frozen=True)
class Freed(Frame):
    """Receiver to sender: staging-ring slots freed."""

    kind: ClassVar[str] = "freed"
    freed: int


@dataclass(frozen=True)
class Agent(Frame):
    """Sender to receiver: the NIXL agent it writes with; once, before anything else."""

    kind: ClassVar[str] = "agent"
    agent_name: str


class FrameSet:
    """The frames one kind of channel carries, and their codec: ``encode`` refuses a frame of
    another set or one the codec would refuse (`InvalidArgumentError`); ``decode`` refuses
    bytes that are not one whole, valid frame of this set."""

    def __init__(
        self,
        name: str,
        classes: Sequence[type[Frame]],
        encode: Callable[[str, Any], bytes],
        decode: Callable[[bytes, int], tuple[str, Any]],
    ) -> None:
        self.name = name
        self.classes: dict[str, type[Frame]] = {cls.kind: cls for cls in classes}
        self._encode = encode
        self._decode = decode

    def encode(self, frame: Frame) -> bytes:
        if self.classes.get(frame.kind) is not type(frame):
            raise InvalidArgumentError(f"invalid frame={frame!r}: not a frame of the {self.name}")
        return bytes(self._encode(frame.kind, frame.fields()))

    def decode(self, data: bytes, limit: int) -> Frame:
        kind, fields = self._decode(data, limit)
        return self.classes[kind].from_fields(fields)


TRANSPORT = FrameSet(
    "transport channel",
    (Challenge, Proof, Hello, Notices, Announce, Revoke, Cancel, Staged, Freed, Agent, Goodbye),
    _core.wire_encode,
    _core.wire_decode,
)
