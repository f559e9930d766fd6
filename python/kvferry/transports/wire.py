"""The control channel of the cross-process transports: addresses, the handshake, frames.

Addresses are URLs. ``unix:///path`` is a socket on this host (``unix://`` alone: a fresh
socket in a new 0700 directory, the default); ``tcp://host:port`` reaches across hosts, with
IPv6 hosts in brackets (``tcp://[::1]:7000``). An endpoint binds loopback unless told
otherwise (``tcp://:0`` is ``tcp://127.0.0.1:0``), and port 0 picks a free port; the address
it advertises carries the port it got.
A wildcard bind (``tcp://0.0.0.0:port``, ``tcp://[::]:port``) advertises no host of its
own: the caller names the one its peers reach it by (``advertise="10.0.0.5"``).

The handshake proves, both ways, that the peer holds the session's key (at least 32 bytes),
before the endpoint sends anything about its pool and before either side decodes anything
but the handshake's own fixed-size frames:

```
endpoint                                          sender
CHALLENGE (role endpoint, nonce_e) ------------->
          <------------------------------------- CHALLENGE (role sender, nonce_s)
          <------------------------------------- PROOF MAC(sender, E, nonce_e, nonce_s)
checks it; only then:
PROOF MAC(endpoint, E, nonce_s, nonce_e) ------->  checks it
HELLO (how to reach the pool) ------------------>

MAC(role, E, theirs, mine) = HMAC-SHA256(key, label | version | role | len(E) | E | theirs | mine)
```
Nonces are 32 fresh random bytes per side and connection, so no proof can be replayed; the
role inside each MAC means a proof cannot be reflected back to the side that made it, and
the endpoint proves itself only to a sender that proved itself first.
``E`` is the channel binding: the endpoint's URL as the sender meant it (the address it was
told to connect to, canonical: `Address.url`), which the endpoint checks against the URLs it
is reached by (its advertised address). A relay that a sender was sent to (a TCP forwarder
to a real endpoint) gets a proof over the relay's own address, which the real endpoint
refuses, and the sender refuses whatever the endpoint proves over another address: no
relayed handshake completes, so nothing after it reaches the relay's owner. The sender has
no address of its own worth binding (an ephemeral port, NAT'd across hosts); its identity in
the MAC is its role. ``version`` is the handshake's (`HANDSHAKE_VERSION`) and the codec's
frame version: a peer of another version fails the proof instead of misreading frames. The whole handshake
must finish within ``handshake_timeout`` seconds or the connection is closed, having
changed nothing. After it, every message is a frame of the Rust codec (kvferry._core,
rust/src/wire/), one frozen dataclass per kind (kvferry.transports.frames): nothing from
the wire is ever unpickled.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import ipaddress
import math
import os
import secrets
import select
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence, TypeVar

from kvferry import _core
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.transports.frames import TRANSPORT, Challenge, Frame, FrameSet, Goodbye, Proof

__all__ = [
    "DEFAULT_HANDSHAKE_SECONDS",
    "MIN_AUTHKEY_BYTES",
    "Address",
    "AuthenticationError",
    "Channel",
    "ProtocolError",
    "check_authkey",
    "check_timeout",
    "connect",
    "binding",
    "encode",
    "handshake",
    "listen",
    "parse_address",
    "recv_frame",
]

MIN_AUTHKEY_BYTES = 32
# How long a peer may take over the whole handshake before the connection is dropped.
DEFAULT_HANDSHAKE_SECONDS = 10.0
NONCE_BYTES = 32
# v2: the MAC binds the endpoint's URL and the protocol version (channel binding); a v1 peer's
# proof fails. The frames' layout is unchanged, so the codec's version stays.
HANDSHAKE_VERSION = 2
MAC_LABEL = b"kvferry-auth-v2"
MAX_BINDING_BYTES = 4096
ROLE_ENDPOINT = 1
ROLE_SENDER = 2


class AuthenticationError(KvFerryError):
    """The peer did not prove it holds the session's key (a wrong key, garbage, a stall,
    or a frame that is not the handshake's)."""


def check_authkey(authkey: object, name: str = "authkey") -> bytes:
    """The key as bytes; refuses anything shorter than ``MIN_AUTHKEY_BYTES``."""
    if not isinstance(authkey, (bytes, bytearray)):
        raise TypeError(f"{name} must be bytes, got {type(authkey).__name__}")
    if len(authkey) < MIN_AUTHKEY_BYTES:
        raise InvalidArgumentError(
            f"invalid {name}: {len(authkey)} bytes, need at least {MIN_AUTHKEY_BYTES} (secrets.token_bytes(32))"
        )
    return bytes(authkey)


def check_timeout(seconds: object, name: str = "handshake_timeout") -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise InvalidArgumentError(f"invalid {name}={seconds!r}: must be a finite number of seconds > 0")
    return float(seconds)


@dataclass(frozen=True)
class Address:
    """A parsed endpoint address: ``scheme`` "unix" (``path``; empty: a fresh private
    socket) or "tcp" (``host``, ``port``)."""

    scheme: str
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def family(self) -> int:
        if self.scheme == "unix":
            return socket.AF_UNIX
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    @property
    def wildcard(self) -> bool:
        return self.scheme == "tcp" and self.host in ("0.0.0.0", "::")

    def url(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def __str__(self) -> str:
        return self.url()


def parse_address(text: object, name: str = "address") -> Address:
    """Parses ``unix:///path`` or ``tcp://host:port`` (``tcp://[v6]:port``)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str URL (unix:///path or tcp://host:port), got {type(text).__name__}")
    if text.startswith("unix://"):
        path = text[len("unix://") :]
        if path and not path.startswith("/"):
            raise InvalidArgumentError(
                f"invalid {name}={text!r}: a unix address takes an absolute path (unix:///run/kvferry.sock)"
            )
        if "\0" in path:
            raise InvalidArgumentError(f"invalid {name}={text!r}: NUL in the path")
        return Address("unix", path=path)
    if text.startswith("tcp://"):
        rest = text[len("tcp://") :]
        if rest.startswith("["):
            host, sep, tail = rest[1:].partition("]")
            if not sep or not tail.startswith(":"):
                raise InvalidArgumentError(f"invalid {name}={text!r}: an IPv6 address is written tcp://[::1]:port")
            port_text = tail[1:]
            try:
                if ipaddress.ip_address(host).version != 6:
                    raise ValueError(host)
            except ValueError:
                raise InvalidArgumentError(
                    f"invalid {name}={text!r}: {host!r} inside brackets is not an IPv6 address"
                ) from None
        else:
            host, sep, port_text = rest.rpartition(":")
            if not sep or ":" in host:
                raise InvalidArgumentError(
                    f"invalid {name}={text!r}: expected tcp://host:port (IPv6 in brackets: tcp://[::1]:port)"
                )
            host = host or "127.0.0.1"  # tcp://:port: loopback, as an endpoint binds unless told otherwise
        if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            raise InvalidArgumentError(f"invalid {name}={text!r}: the port must be a number in [0, 65535]")
        if "/" in host or not host:
            raise InvalidArgumentError(f"invalid {name}={text!r}: expected tcp://host:port, no path")
        return Address("tcp", host=host, port=int(port_text))
    raise InvalidArgumentError(f"invalid {name}={text!r}: expected unix:///path or tcp://host:port")


def listen(
    address: Address, *, advertise: Optional[str] = None, backlog: int = 64
) -> tuple[socket.socket, Address, Optional[str]]:
    """A listening socket for ``address``; returns it, the address peers are to use (the
    bound port, the advertised host), and for ``unix://`` the private directory it made (the
    caller removes it)."""
    directory = None
    if address.scheme == "unix":
        if advertise is not None:
            raise InvalidArgumentError(f"invalid advertise={advertise!r}: only for a tcp:// address")
        if not address.path:
            directory = tempfile.mkdtemp(prefix="kvferry-")  # 0700: other users cannot connect
            address = Address("unix", path=os.path.join(directory, "notices.sock"))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(address.path)
            sock.listen(backlog)
        except OSError:
            sock.close()
            if directory is not None:
                os.rmdir(directory)
            raise
        return sock, address, directory
    if advertise is not None:
        if not isinstance(advertise, str) or not advertise or any(c in advertise for c in "/[] "):
            raise InvalidArgumentError(
                f"invalid advertise={advertise!r}: a host name or IP address peers reach this endpoint by"
            )
    elif address.wildcard:
        raise InvalidArgumentError(
            (
                f"invalid address={address.url()!r}: a wildcard bind needs advertise= (the host name or IP address "
                "peers reach this endpoint by)"
            )
        )
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if address.family == socket.AF_INET6 and address.host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # [::] takes IPv4 too
        sock.bind((address.host, address.port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    host = advertise if advertise is not None else address.host
    if advertise is not None and ":" in advertise:
        try:
            ipaddress.IPv6Address(advertise)
        except ValueError:
            sock.close()
            raise InvalidArgumentError(f"invalid advertise={advertise!r}: not a host name or IP address") from None
    return sock, Address("tcp", host=host, port=port), None


def connect(address: Address, timeout: float) -> socket.socket:
    """A connected stream socket (TCP without Nagle: frames are small and latency-bound)."""
    if address.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(address.path)
        except OSError:
            sock.close()
            raise
        return sock
    sock = socket.create_connection((address.host, address.port), timeout=timeout)
    tune(sock)
    return sock


def tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def peer_pid(sock: socket.socket) -> Optional[int]:
    """The peer's pid on a Unix socket (Linux), else ``None``."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):  # not Linux
        return None
    return int(struct.unpack("3i", creds)[0])


def peer_name(sock: socket.socket) -> str:
    """How logs name the other end: its pid on a Unix socket, its address over TCP."""
    if sock.family == socket.AF_UNIX:
        return f"pid {peer_pid(sock)}"
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "tcp peer"
    return f"tcp {Address('tcp', host=host, port=port).url()[6:]}"


# The frame header (rust/src/wire/mod.rs describes every frame): magic, version, type, body
# length, little-endian. Here only to build frames by hand in tests; the codec is the core's.
MAGIC = b"KVFW"
VERSION = _core.WIRE_VERSION
HEADER = struct.Struct("<4sHHI")
CHALLENGE, PROOF, HELLO, NOTICES = 1, 2, 3, 4
# The largest frame body either side accepts once the peer is authenticated, and before:
# nothing longer than the handshake's own frames (a role and a nonce).
MAX_FRAME_BYTES = _core.WIRE_MAX_FRAME_BYTES
HANDSHAKE_LIMIT = 1 + NONCE_BYTES


class ProtocolError(TransferError):
    """A peer sent a frame that breaks the protocol (malformed, of an unknown version or
    type, or one this side does not take): the connection is closed."""


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("handshake deadline")
            sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(
    sock: socket.socket, limit: int = MAX_FRAME_BYTES, deadline: Optional[float] = None, frames: FrameSet = TRANSPORT
) -> Frame:
    """Reads one frame of ``frames``: the header first, checked (magic, version, type,
    length within ``limit``) before a byte of the body is read; then the body, decoded and
    validated by the core. Raises `ProtocolError` for a bad frame (or one of another
    channel's set), ``EOFError`` at the end."""
    header = _recv_exact(sock, _core.WIRE_HEADER_BYTES, deadline)
    try:
        _, length = _core.wire_header(header, limit)
        body = _recv_exact(sock, length, deadline) if length else b""
        return frames.decode(header + body, limit)
    except InvalidArgumentError as err:
        raise ProtocolError(str(err)) from None


MAX_PASSED_FDS = 4


def send_frame_fds(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    """An encoded frame with descriptors riding on its first byte (``SCM_RIGHTS``; a Unix
    socket only): how an endpoint hands a sender a segment that has no name."""
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame_fds(
    sock: socket.socket, limit: int = MAX_FRAME_BYTES, frames: FrameSet = TRANSPORT
) -> tuple[Frame, list[int]]:
    """`recv_frame` on a Unix socket, also taking the descriptors that came with the frame
    (at most ``MAX_PASSED_FDS``; more, or a truncated set, are closed and refused). The
    caller owns (and closes) the descriptors returned."""
    fds: list[int] = []
    header = b""
    try:
        while len(header) < _core.WIRE_HEADER_BYTES:
            room = socket.CMSG_SPACE(MAX_PASSED_FDS * 4)
            data, ancillary, flags, _ = sock.recvmsg(_core.WIRE_HEADER_BYTES - len(header), room)
            for level, cmsg, payload in ancillary:
                if level == socket.SOL_SOCKET and cmsg == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                    fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError(f"more than {MAX_PASSED_FDS} descriptors came with a frame")
            if not data:
                raise EOFError("the peer closed the connection")
            header += data
        try:
            _, length = _core.wire_header(header, limit)
            body = _recv_exact(sock, length) if length else b""
            frame = frames.decode(header + body, limit)
        except InvalidArgumentError as err:
            raise ProtocolError(str(err)) from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return frame, fds


def encode(frame: Frame, frames: FrameSet = TRANSPORT) -> bytes:
    """One encoded frame (InvalidArgumentError for a frame the codec would refuse)."""
    return frames.encode(frame)


class Channel:
    """Frames of one set (``frames``: the transports' unless told) over one connected socket,
    after the handshake. `send` may be called from any thread; `recv` and `poll` from one
    reader."""

    def __init__(self, sock: socket.socket, limit: int = MAX_FRAME_BYTES, frames: FrameSet = TRANSPORT) -> None:
        self.sock = sock
        self.limit = limit
        self.frames = frames
        self._send_lock = threading.Lock()

    def send(self, frame: Frame) -> None:
        self.send_frame(self.frames.encode(frame))

    def send_frame(self, data: bytes) -> None:
        """An encoded frame, whole: frames from several threads never interleave."""
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self) -> Frame:
        return recv_frame(self.sock, self.limit, frames=self.frames)

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        """Whether a frame (or the end of the connection) is waiting."""
        # poll(2), not select(2): select refuses descriptors >= 1024, which a busy process has.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))

    def goodbye(self, reason: str) -> None:
        """Tells the peer why the connection is closing (best effort: it may be gone)."""
        try:
            self.send(Goodbye(reason.encode()[:1000].decode(errors="ignore")))  # the codec's bound is 1024 bytes
        except (OSError, KvFerryError):
            pass


def _mac(key: bytes, role: int, binding: bytes, theirs: bytes, mine: bytes) -> bytes:
    versions = struct.pack("<HHB", HANDSHAKE_VERSION, _core.WIRE_VERSION, role)
    prefix = MAC_LABEL + versions + struct.pack("<H", len(binding))
    return hmac.new(key, prefix + binding + theirs + mine, hashlib.sha256).digest()


def binding(endpoint: object, name: str = "endpoint") -> bytes:
    """The channel binding of an endpoint URL: its canonical form (`Address.url`), UTF-8."""
    data = parse_address(endpoint, name).url().encode()
    if len(data) > MAX_BINDING_BYTES:
        raise InvalidArgumentError(f"invalid {name}={str(endpoint)[:100]!r}...: longer than {MAX_BINDING_BYTES} bytes")
    return data


H = TypeVar("H", Challenge, Proof)


def _expect(sock: socket.socket, kind: type[H], deadline: float) -> H:
    # Before the proof, the peer may be anything (a port a forged address pointed at): what
    # it sent is never quoted back, only what kind of thing it was (no port scanner).
    header = _recv_exact(sock, _core.WIRE_HEADER_BYTES, deadline)
    magic, version, _, _ = HEADER.unpack(header)
    if magic != MAGIC:
        raise AuthenticationError("not a kvferry handshake: the peer's first bytes are not a kvferry frame")
    if version != VERSION:
        raise AuthenticationError(
            f"not a kvferry handshake this side speaks: the peer's frames are of wire version {version}, not {VERSION}"
        )
    try:
        _, length = _core.wire_header(header, HANDSHAKE_LIMIT)
        body = _recv_exact(sock, length, deadline) if length else b""
        got = TRANSPORT.decode(header + body, HANDSHAKE_LIMIT)
    except InvalidArgumentError:
        why = f"not a kvferry handshake: a malformed or oversized frame where a {kind.kind} was due"
        raise AuthenticationError(why) from None
    if not isinstance(got, kind):
        raise AuthenticationError(f"a {got.kind} frame during the handshake, expected a {kind.kind}")
    return got


def handshake(sock: socket.socket, key: bytes, role: int, timeout: float, endpoint: str | Sequence[str]) -> str:
    """Runs the mutual handshake (module doc) as ``role`` within ``timeout`` seconds;
    raises `AuthenticationError` (the caller closes the socket) on any failure.
    ``endpoint``: for a sender, the URL it meant to reach; for an endpoint, the URLs it is
    reached by (its advertised address first). Returns the URL both proofs bound."""
    deadline = time.monotonic() + timeout
    names = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    if not names or (role == ROLE_SENDER and len(names) != 1):
        raise InvalidArgumentError(f"invalid endpoint={endpoint!r}: a sender names one URL, an endpoint at least one")
    bindings = [binding(n) for n in names]
    mine = secrets.token_bytes(NONCE_BYTES)
    peer_role = ROLE_SENDER if role == ROLE_ENDPOINT else ROLE_ENDPOINT
    proved = False
    try:
        sock.sendall(encode(Challenge(role, mine)))
        challenge = _expect(sock, Challenge, deadline)
        got_role, theirs = challenge.role, challenge.nonce
        if got_role != peer_role:
            raise AuthenticationError(f"the peer claims role {got_role}, expected {peer_role} (a reflected challenge?)")
        if role == ROLE_SENDER:
            sock.sendall(encode(Proof(_mac(key, role, bindings[0], theirs, mine))))
            proved = True
        proof = _expect(sock, Proof, deadline).mac
        bound = next((b for b in bindings if hmac.compare_digest(proof, _mac(key, peer_role, b, mine, theirs))), None)
        if bound is None:
            if role == ROLE_ENDPOINT:
                raise AuthenticationError(
                    "the peer's proof is wrong: it does not hold this session's key, or it meant another endpoint than"
                    f" {names[0]} (a relay?), or speaks another handshake version than v{HANDSHAKE_VERSION}"
                )
            raise AuthenticationError(
                f"the peer's proof is wrong: it does not hold this session's key, or it is not the endpoint {names[0]}"
                f" (a relay to another endpoint?), or speaks another handshake version than v{HANDSHAKE_VERSION}"
            )
        if role == ROLE_ENDPOINT:
            sock.sendall(encode(Proof(_mac(key, role, bound, theirs, mine))))
        return bound.decode()
    except AuthenticationError:
        raise
    except socket.timeout:
        raise AuthenticationError(f"no complete handshake within {timeout} s") from None
    except EOFError:
        if proved:
            raise AuthenticationError(
                "the peer closed the connection after our proof: it refused our key (not this session's?)"
                " or the address we meant (reached through a relay, or by another name than it advertises?)"
            ) from None
        raise AuthenticationError("the peer closed the connection during the handshake") from None
    except OSError as err:
        raise AuthenticationError(f"handshake failed: {type(err).__name__} ({err.strerror or 'no detail'})") from None
    finally:
        sock.settimeout(None)
