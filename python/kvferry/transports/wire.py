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
(a wrong proof: GOODBYE "refused: wrong proof" -> and the end of the connection instead)

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
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

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
    "StalledError",
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
# After the handshake: a frame whose first byte came must arrive whole within FRAME_SECONDS;
# a send that moves nothing for SEND_SECONDS (the peer stopped reading) cuts the peer off.
FRAME_SECONDS = 30.0
SEND_SECONDS = 10.0
# An endpoint's channels never block a sender of theirs: at most this much waits for a peer
# that does not read (`Channel` with ``queue_bytes``); more, and the peer is cut off.
QUEUE_BYTES = 1 << 20
# How often a channel's writer thread, waiting for room, looks whether the channel closed.
WRITER_SLICE_SECONDS = 0.1
# v2: the MAC binds the endpoint's URL and the protocol version (channel binding); a v1 peer's
# proof fails. The frames' layout is unchanged, so the codec's version stays.
HANDSHAKE_VERSION = 2
MAC_LABEL = b"kvferry-auth-v2"
MAX_BINDING_BYTES = 4096
ROLE_ENDPOINT = 1
ROLE_SENDER = 2


class AuthenticationError(KvFerryError):
    """The peer did not prove it holds the session's key (a wrong key, garbage, a stall,
    or a frame that is not the handshake's). ``wrong_key``: the peer answered, and its proof
    (or its refusal of ours, `REFUSED_PROOF`) says the two sides hold different keys; False
    for a stall, a reset or a closed connection, which say nothing about the key (a busy or
    dying peer). ``stalled``: the deadline passed with the connection still open (the peer
    is alive but did not do its part: starved, stopped or stuck)."""

    def __init__(self, message: str, wrong_key: bool = False, stalled: bool = False) -> None:
        super().__init__(message)
        self.wrong_key = wrong_key
        self.stalled = stalled


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
# What an endpoint says, in a goodbye, to a sender whose proof is wrong, before it closes
# (fits the handshake's frame bound).
REFUSED_PROOF = "refused: wrong proof"
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


def _wait(sock: socket.socket, events: int, deadline: Optional[float], what: str = "deadline") -> None:
    """Blocks until ``sock`` is ready for ``events`` (poll(2) flags), or raises
    ``socket.timeout`` at ``deadline`` (monotonic; None: no bound). A shutdown wakes it."""
    poller = select.poll()
    poller.register(sock, events)
    while True:
        if deadline is None:
            left_ms = -1
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(what)
            left_ms = max(1, math.ceil(left * 1000))
        if poller.poll(left_ms):
            return


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """``n`` bytes, by ``deadline`` (monotonic; None: the socket's own blocking or timeout).
    With a deadline each read waits in poll(2) and never blocks in recv(2), so the socket's
    mode is never changed: another thread may be sending on it."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            _wait(sock, select.POLLIN, deadline)
            try:
                chunk = sock.recv(min(n - got, 1 << 20), socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
        else:
            chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _frame_after(header: bytes, whole: Callable[[int], bytes], limit: int, frames: FrameSet) -> Frame:
    """The frame ``header`` begins: the header checked (magic, version, type, length within
    ``limit``) before ``whole(length)`` reads the rest and returns the whole frame (header
    and body); then decoded and validated by the core. `ProtocolError` for a bad frame."""
    try:
        _, length = _core.wire_header(header, limit)
        return frames.decode(whole(length), limit)
    except InvalidArgumentError as err:
        raise ProtocolError(str(err)) from None


def _with_body(sock: socket.socket, header: bytes, deadline: Optional[float]) -> Callable[[int], bytes]:
    """`_frame_after`'s ``whole`` for a frame read straight off ``sock``."""
    return lambda length: header + _recv_exact(sock, length, deadline) if length else header


def recv_frame(
    sock: socket.socket,
    limit: int = MAX_FRAME_BYTES,
    deadline: Optional[float] = None,
    frames: FrameSet = TRANSPORT,
    *,
    whole_s: Optional[float] = None,
) -> Frame:
    """Reads one frame of ``frames``: the header first, checked (magic, version, type,
    length within ``limit``) before a byte of the body is read; then the body, decoded and
    validated by the core. ``deadline`` (monotonic): by when the frame must have come (None:
    no bound); with ``whole_s``, ``deadline`` bounds only its first byte, and the rest must
    follow within ``whole_s`` seconds of it (a peer that starts a frame and stalls is cut off).
    Raises `ProtocolError` for a bad frame (or one of another channel's set), ``EOFError`` at
    the end, ``socket.timeout`` past a deadline."""
    if whole_s is not None:
        _wait(sock, select.POLLIN, deadline)
        deadline = time.monotonic() + whole_s
    header = _recv_exact(sock, _core.WIRE_HEADER_BYTES, deadline)
    return _frame_after(header, _with_body(sock, header, deadline), limit, frames)


MAX_PASSED_FDS = 4
# What one read of a channel takes at most beyond the frame it needs: a notice frame and the
# frames behind it, not a whole large body ahead of its header's check.
READ_BYTES = 16 << 10


def _send_some(sock: socket.socket, data: memoryview, fds: Sequence[int]) -> int:
    """What of ``data`` fits in the socket now (never blocks; 0 when nothing does), with
    descriptors riding on its first byte (``SCM_RIGHTS``; a Unix socket only)."""
    try:
        if fds:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            return sock.sendmsg([data], ancillary, socket.MSG_DONTWAIT)
        return sock.send(data, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0


def _send_until(sock: socket.socket, data: bytes, deadline: float) -> None:
    """The whole of ``data`` by ``deadline`` (monotonic), else ``socket.timeout``."""
    view = memoryview(data)
    while view:
        sent = _send_some(sock, view, ())
        if not sent:
            _wait(sock, select.POLLOUT, deadline)
        view = view[sent:]


def recv_frame_fds(
    sock: socket.socket, limit: int = MAX_FRAME_BYTES, frames: FrameSet = TRANSPORT, deadline: Optional[float] = None
) -> tuple[Frame, list[int]]:
    """`recv_frame` on a Unix socket, also taking the descriptors that came with the frame
    (at most ``MAX_PASSED_FDS``; more, or a truncated set, are closed and refused), whole by
    ``deadline`` (monotonic; None: no bound). The caller owns (and closes) the descriptors
    returned."""
    fds: list[int] = []
    header = b""
    try:
        while len(header) < _core.WIRE_HEADER_BYTES:
            if deadline is not None:
                _wait(sock, select.POLLIN, deadline)
            room = socket.CMSG_SPACE(MAX_PASSED_FDS * 4)
            try:
                data, ancillary, flags, _ = sock.recvmsg(
                    _core.WIRE_HEADER_BYTES - len(header), room, socket.MSG_DONTWAIT if deadline is not None else 0
                )
            except BlockingIOError:
                continue
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
        frame = _frame_after(header, _with_body(sock, header, deadline), limit, frames)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return frame, fds


def encode(frame: Frame, frames: FrameSet = TRANSPORT) -> bytes:
    """One encoded frame (InvalidArgumentError for a frame the codec would refuse)."""
    return frames.encode(frame)


class StalledError(ConnectionError):
    """The peer stopped reading: a send moved nothing for the channel's ``send_timeout``, or
    more than its ``queue_bytes`` waited for a peer that does not read. The channel has shut
    the connection down (its reader sees the end) and refuses every later send."""


class ChannelClosedError(StalledError):
    """A send on a channel already closed: nothing of the frame was written."""


class Channel:
    """Frames of one set (``frames``: the transports' unless told) over one connected socket,
    after the handshake. `send` may be called from any thread; `recv` and `poll` from one
    reader. No call waits on the peer without a bound:

    - `recv` reads a frame whose first byte came within its ``timeout`` (None: no bound) in
      at most ``frame_timeout`` seconds more;
    - `send` blocks the calling thread (frames whole, in order) until the frame is sent, but
      a peer that takes nothing for ``send_timeout`` seconds is cut off (`StalledError`);
      `try_send_frame` sends only where the socket takes the frame's first bytes now (its
      rest, if any, then goes by a writer thread, as below), so a thread that must not wait
      (an engine's step posting a notice) tries it and otherwise leaves the frame to one
      that may;
    - with ``queue_bytes`` (an endpoint's channels) `send` never blocks at all: what does not
      fit in the socket now waits in a queue that a writer thread of the channel's own sends
      on, and a peer that lets more than ``queue_bytes`` wait, or takes nothing for
      ``send_timeout`` seconds, is cut off. So a thread that must not wait on a peer (a decode
      engine's step passing on a cancellation) can still tell it something.

    ```
    send() --fits now--> socket            (the usual case: no thread, no copy)
       |
       +--the rest--> queue (<= queue_bytes) --writer thread--> socket
                         full, or nothing moved for send_timeout: broken, shut down
    ```
    """

    def __init__(
        self,
        sock: socket.socket,
        limit: int = MAX_FRAME_BYTES,
        frames: FrameSet = TRANSPORT,
        *,
        queue_bytes: Optional[int] = None,
        send_timeout: Optional[float] = None,
        frame_timeout: Optional[float] = None,
    ) -> None:
        self.sock = sock
        self.limit = limit
        self.frames = frames
        self.queue_bytes = queue_bytes
        self.send_timeout = SEND_SECONDS if send_timeout is None else send_timeout
        self.frame_timeout = FRAME_SECONDS if frame_timeout is None else frame_timeout
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[tuple[memoryview, Sequence[int]]] = deque()
        self._queued = 0
        self._moved = 0.0  # when the queue last moved (or began waiting)
        self._writer: Optional[threading.Thread] = None
        self._closed = False
        self.broken: Optional[str] = None  # why the channel cut the peer off
        # Bytes read and not yet returned as a frame (the reader's only): a read takes what
        # has arrived, up to `READ_BYTES`, so a frame's header and body usually come in one
        # call, and a frame that arrived behind it needs none.
        self._read = bytearray()

    @property
    def waiting(self) -> int:
        """Bytes queued for a peer that has not taken them yet (queue mode)."""
        with self._lock:
            return self._queued

    def send(self, frame: Frame) -> None:
        self.send_frame(self.frames.encode(frame))

    def send_frame(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """An encoded frame, whole (frames from several threads never interleave), with
        descriptors riding on its first byte (``SCM_RIGHTS``, a Unix socket). Raises
        `StalledError` once the peer is cut off (see the class), ``OSError`` if the
        connection failed."""
        view = memoryview(data)
        with self._lock:
            self._check_open()
            if self.queue_bytes is None:
                self._drain()  # the rest of a frame `try_send_frame` began goes first
                self._send_blocking(view, fds)
                return
            if not self._queue:
                sent = _send_some(self.sock, view, fds)
                if sent == len(view):
                    return
                view, fds = view[sent:], (fds if not sent else ())
                self._moved = time.monotonic()
            if self._queued + len(view) > self.queue_bytes and self._queued:
                self._cut_off(
                    f"the peer stopped reading: {self._queued} bytes already waited for it (at most {self.queue_bytes})"
                )
                raise StalledError(self.broken)
            self._enqueue(view, fds)

    def try_send_frame(self, data: bytes) -> bool:
        """An encoded frame, whole, on a channel without ``queue_bytes``, where that needs no
        wait: True once the socket took its first bytes (any rest follows by the writer
        thread, ahead of every later frame); False, nothing sent, where the socket takes
        none now or another thread is sending. Raises as `send_frame` does."""
        view = memoryview(data)
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._check_open()
            if self._queue:
                return False
            sent = _send_some(self.sock, view, ())
            if not sent:
                return False
            if sent < len(view):
                self._moved = time.monotonic()
                self._enqueue(view[sent:], ())
            return True
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        """(lock held) Raises `StalledError` once the peer was cut off, `ChannelClosedError`
        once the channel closed."""
        if self.broken is not None:
            raise StalledError(self.broken)
        if self._closed:
            raise ChannelClosedError("the channel is closed")

    def _enqueue(self, view: memoryview, fds: Sequence[int]) -> None:
        """(lock held) ``view`` to the writer thread, after what waits for it already."""
        self._queue.append((view, fds))
        self._queued += len(view)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="kvferry-writer", daemon=True)
            self._writer.start()
        self._changed.notify_all()

    def _drain(self) -> None:
        """(lock held) Waits until the writer thread sent what waits for it (it cuts the peer
        off after ``send_timeout`` without progress); raises `StalledError` once it did."""
        while self._queue and self.broken is None and not self._closed:
            self._changed.wait()
        self._check_open()

    def drain(self) -> None:
        """Waits until what waits for the writer thread was sent, or the peer was cut off
        (then raises `StalledError`)."""
        with self._lock:
            self._drain()

    def _send_blocking(self, view: memoryview, fds: Sequence[int]) -> None:
        """(lock held) The whole of ``view``, waiting for room at most ``send_timeout`` at a time."""
        moved = time.monotonic()
        while view:
            sent = _send_some(self.sock, view, fds)
            now = time.monotonic()
            if sent:
                view, fds, moved = view[sent:], (), now
                continue
            try:
                _wait(self.sock, select.POLLOUT, moved + self.send_timeout)
            except socket.timeout:
                self._cut_off(f"the peer took nothing for {self.send_timeout:g} s (it stopped reading)")
                raise StalledError(self.broken) from None

    def _write(self) -> None:
        """The writer thread (queue mode): sends what waits, in order, never holding the lock
        while it waits for room; cuts the peer off after ``send_timeout`` without progress."""
        with self._lock:
            while True:
                while not self._queue and not self._closed and self.broken is None:
                    self._changed.wait()
                if self._closed or self.broken is not None:
                    return
                view, fds = self._queue[0]
                try:
                    sent = _send_some(self.sock, view, fds)
                except OSError as err:
                    self._cut_off(f"sending failed: {type(err).__name__} ({err.strerror or err})")
                    return
                if sent:
                    self._queued -= sent
                    self._moved = time.monotonic()
                    if sent == len(view):
                        self._queue.popleft()
                        if not self._queue:
                            self._changed.notify_all()  # a send waiting for the queue to drain
                    else:
                        self._queue[0] = (view[sent:], ())
                    continue
                due = self._moved + self.send_timeout
                if time.monotonic() >= due:
                    self._cut_off(f"the peer took nothing for {self.send_timeout:g} s (it stopped reading)")
                    return
                # Waits for room outside the lock, a slice at a time, so a close is seen soon.
                self._lock.release()
                try:
                    _wait(self.sock, select.POLLOUT, min(due, time.monotonic() + WRITER_SLICE_SECONDS))
                except (socket.timeout, OSError, ValueError):
                    pass
                finally:
                    self._lock.acquire()

    def _cut_off(self, why: str) -> None:
        """(lock held) Gives up on the peer: nothing more is sent, and the connection is shut
        down, which wakes its reader (the owner closes the socket)."""
        if self.broken is None:
            self.broken = why
        self._queue.clear()
        self._queued = 0
        self._changed.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def recv(self, timeout: Optional[float] = None) -> Frame:
        """One frame whose first byte comes within ``timeout`` seconds (None: no bound) and
        the rest within ``frame_timeout`` of it; ``socket.timeout`` past either. The header
        is checked (magic, version, type, length within ``limit``) before more of the body
        than one read's worth (`READ_BYTES`) is taken in; then the body is decoded and
        validated by the core. `ProtocolError` for a bad frame, ``EOFError`` at the end."""
        if not self._read:
            _wait(self.sock, select.POLLIN, None if timeout is None else time.monotonic() + timeout)
        deadline = time.monotonic() + self.frame_timeout
        header = self._take(_core.WIRE_HEADER_BYTES, deadline, keep=True)
        return _frame_after(header, lambda length: self._take(len(header) + length, deadline), self.limit, self.frames)

    def _take(self, n: int, deadline: float, keep: bool = False) -> bytes:
        """The next ``n`` bytes read, by ``deadline`` (monotonic); ``keep``: left in the
        buffer for the next take (a header, read again with its body)."""
        self._read_until(n, deadline)
        with memoryview(self._read) as view:
            data = bytes(view[:n])
        if not keep:
            del self._read[:n]
        return data

    def _read_until(self, n: int, deadline: float) -> None:
        """Reads until ``n`` bytes are held, by ``deadline`` (monotonic). Each read waits in
        poll(2), never in recv(2), so the socket's mode is never changed (another thread may
        be sending on it)."""
        held = self._read
        while len(held) < n:
            try:
                chunk = self.sock.recv(min(max(n - len(held), READ_BYTES), 1 << 20), socket.MSG_DONTWAIT)
            except BlockingIOError:
                _wait(self.sock, select.POLLIN, deadline)
                continue
            if not chunk:
                raise EOFError("the peer closed the connection")
            held += chunk

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        """Whether a frame (or the end of the connection) is waiting."""
        if self._read:
            return True
        # poll(2), not select(2): select refuses descriptors >= 1024, which a busy process has.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))

    def goodbye(self, reason: str) -> None:
        """Tells the peer why the connection is closing, if that can be done now: best
        effort, never blocks (a peer that does not read, or is gone, misses it)."""
        try:
            data = memoryview(self.frames.encode(Goodbye(reason.encode()[:1000].decode(errors="ignore"))))
        except KvFerryError:
            return
        if not self._lock.acquire(blocking=False):
            return  # a send of another thread is under way: the peer will not get it now
        try:
            if self.broken is not None or self._closed:
                return
            if not self._queue:
                data = data[_send_some(self.sock, data, ()) :]
                self._moved = time.monotonic()
            if data and self.queue_bytes is not None and self._queued + len(data) <= self.queue_bytes:
                self._enqueue(data, ())
        except OSError:
            pass
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stops the writer (what still waits is dropped) and closes the socket."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._queued = 0
            self._changed.notify_all()
            self.sock.close()


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
    if isinstance(got, Goodbye) and kind is Proof and got.reason == REFUSED_PROOF:
        raise _Refused()
    if not isinstance(got, kind):
        raise AuthenticationError(f"a {got.kind} frame during the handshake, expected a {kind.kind}")
    return got


class _Refused(Exception):
    """The endpoint refused the sender's proof (`REFUSED_PROOF`), in place of its own."""


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
        _send_until(sock, encode(Challenge(role, mine)), deadline)
        challenge = _expect(sock, Challenge, deadline)
        got_role, theirs = challenge.role, challenge.nonce
        if got_role != peer_role:
            raise AuthenticationError(f"the peer claims role {got_role}, expected {peer_role} (a reflected challenge?)")
        if role == ROLE_SENDER:
            _send_until(sock, encode(Proof(_mac(key, role, bindings[0], theirs, mine))), deadline)
            proved = True
        proof = _expect(sock, Proof, deadline).mac
        bound = next((b for b in bindings if hmac.compare_digest(proof, _mac(key, peer_role, b, mine, theirs))), None)
        if bound is None:
            if role == ROLE_ENDPOINT:
                # Said before closing, so the sender tells a refused key from a connection cut
                # off mid-handshake (a bound, room for newer connections), which says nothing
                # about the key.
                try:
                    _send_until(sock, encode(Goodbye(REFUSED_PROOF)), deadline)
                except OSError:
                    pass
                raise AuthenticationError(
                    "the peer's proof is wrong: it does not hold this session's key, or it meant another endpoint than"
                    f" {names[0]} (a relay?), or speaks another handshake version than v{HANDSHAKE_VERSION}",
                    wrong_key=True,
                )
            raise AuthenticationError(
                f"the peer's proof is wrong: it does not hold this session's key, or it is not the endpoint {names[0]}"
                f" (a relay to another endpoint?), or speaks another handshake version than v{HANDSHAKE_VERSION}",
                wrong_key=True,
            )
        if role == ROLE_ENDPOINT:
            _send_until(sock, encode(Proof(_mac(key, role, bound, theirs, mine))), deadline)
        return bound.decode()
    except AuthenticationError:
        raise
    except socket.timeout:
        raise AuthenticationError(f"no complete handshake within {timeout} s", stalled=True) from None
    except _Refused:
        raise AuthenticationError(
            "the peer refused our proof: it does not hold our key (not this session's?), or we meant another"
            " address than it is reached by (a relay, or another name than it advertises?)",
            wrong_key=True,
        ) from None
    except EOFError:
        if proved:  # a refusal says so first (`REFUSED_PROOF`): this is a cut, not a key mismatch
            raise AuthenticationError(
                "the peer closed the connection after our proof without refusing it: it cut the handshake off"
                " (its own deadline, or room for newer connections) or went away"
            ) from None
        raise AuthenticationError("the peer closed the connection during the handshake") from None
    except OSError as err:
        raise AuthenticationError(f"handshake failed: {type(err).__name__} ({err.strerror or 'no detail'})") from None
    finally:
        sock.settimeout(None)
