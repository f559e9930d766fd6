"""Cross-process transports on one host: the receiver serves what a sender needs to address
its pool (a shared-memory descriptor, or CUDA IPC handles), then takes notices over an
authenticated Unix socket.

```
receiver process                              sender process
LocalEndpoint <--challenge / response (key)-->  LocalTransport
              --hello (how to reach the pool)-->  opens the pool
              <--announce (optional)-----------  announce(request_ids)
              <--notices, after the writes------  post()
              EOF: the sender's unfinished requests fail at once
```
Both sides prove they hold the session's key (the HMAC challenge of
multiprocessing.connection, run both ways) before anything is unpickled or the hello leaves,
so another local process can neither reach the pool nor pose as the receiver. The socket lives
in a fresh 0700 directory. Messages are pickled with torch's multiprocessing pickler, which
sends CUDA tensors as IPC handles.

Which requests a connection owns: a request belongs to the first connection that announced
it (`LocalTransport.announce`) or sent a notice for it (`KVReceiver.bind` / ``deliver(...,
source)``). When a connection ends (EOF, a reset, a message that breaks the protocol), the
receiver fails every incomplete request it owns, so their waits raise at once; a request no
connection announced yet is left to its own timeout.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import tempfile
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge
from typing import AbstractSet, Any, Callable, Iterable, Optional, Sequence

import torch.multiprocessing  # noqa: F401  (registers the CUDA-tensor reductions)

from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transport import Transport, kept

__all__ = ["CudaIpcEndpoint", "CudaIpcTransport", "LocalEndpoint", "LocalTransport", "PeerConnection"]

MIN_AUTHKEY_BYTES = 16
# A peer that connects but does not complete the challenge in this time is dropped: it must
# not hold a thread (or, before the handshake moved off the accept loop, every other sender).
HANDSHAKE_SECONDS = 10.0
JOIN_SECONDS = 5.0


def _socket_of(conn: Connection) -> socket.socket:
    """A second handle on the connection's socket, for what `Connection` does not offer
    (peer credentials, timeouts, shutdown, a peek). It shares the socket, not a copy."""
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))


def _peer_pid(sock: socket.socket) -> Optional[int]:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):  # not Linux
        return None
    return int(struct.unpack("3i", creds)[0])


def _set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """A blocking read on the socket gives up after ``seconds`` (0: never). Set on the socket,
    so it applies to the `Connection` sharing it too."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


class _Peer:
    """One sender connection at the endpoint; requests are bound to it (see the module doc)."""

    _numbers = itertools.count(1)

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.sock = _socket_of(conn)
        self.number = next(self._numbers)
        self.pid = _peer_pid(self.sock)
        self.thread: Optional[threading.Thread] = None

    def __str__(self) -> str:
        return f"sender #{self.number} (pid {self.pid})"

    def shutdown(self) -> None:
        """Wakes a thread blocked reading the connection (closing the descriptor would not)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.conn.close()
        self.sock.close()


class LocalEndpoint:
    """The receiver's side: authenticates each sender, sends it ``hello``, then delivers its
    notices to the receiver, one thread per connection. ``errors`` records what was refused
    (failed handshakes, refused notices, broken messages)."""

    def __init__(self, receiver: KVReceiver, hello: dict[str, Any], *, authkey: bytes) -> None:
        if len(authkey) < MIN_AUTHKEY_BYTES:
            raise InvalidArgumentError(f"invalid authkey: {len(authkey)} bytes, need at least {MIN_AUTHKEY_BYTES}")
        self.receiver = receiver
        self._hello = hello
        self._authkey = authkey
        self._dir = tempfile.mkdtemp(prefix="kvferry-")  # 0700: other users cannot connect
        self.address = os.path.join(self._dir, "notices.sock")
        # No authkey here: the challenge runs on the connection's own thread, so a peer that
        # stalls in it cannot keep the accept loop from serving the others.
        self._listener = Listener(self.address, family="AF_UNIX", backlog=16)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._peers: set[_Peer] = set()
        self._local = threading.local()  # the peer whose thread is running
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, name="kvferry-endpoint", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError as err:
                if self._closing.is_set():
                    return
                self.errors.append(err)
                continue
            if self._closing.is_set():
                conn.close()
                return
            peer = _Peer(conn)
            peer.thread = threading.Thread(target=self._pump, args=(peer,), name="kvferry-notices", daemon=True)
            with self._lock:
                self._peers.add(peer)
            peer.thread.start()

    def _authenticate(self, peer: _Peer) -> bool:
        try:
            _set_recv_timeout(peer.sock, HANDSHAKE_SECONDS)
            deliver_challenge(peer.conn, self._authkey)
            answer_challenge(peer.conn, self._authkey)
            _set_recv_timeout(peer.sock, 0)
        except Exception as err:  # a wrong key, a stall, garbage: refused before any unpickling
            if not self._closing.is_set():
                self.errors.append(AuthenticationError(f"{peer}: refused: {err!r}"))
            return False
        return True

    def _pump(self, peer: _Peer) -> None:
        self._local.peer = peer
        reason = "its connection closed"
        try:
            if not self._authenticate(peer):
                return
            peer.conn.send(self._hello)
            while True:
                message = peer.conn.recv()
                if isinstance(message, dict):
                    self.control(peer, message)
                else:
                    self.handle(peer.conn, message)
        except KvFerryError as err:
            reason = f"it broke the protocol: {err}"
            self.errors.append(err)
        except (EOFError, OSError) as err:
            reason = "the endpoint closed" if self._closing.is_set() else f"its connection ended ({type(err).__name__})"
        except Exception as err:  # a malformed message: the peer cannot be trusted further
            reason = f"it sent a malformed message ({err!r})"
            self.errors.append(TransferError(f"{peer}: {reason}; disconnected", peer=str(peer)))
        finally:
            with self._lock:
                self._peers.discard(peer)
            peer.close()
            self.lost(peer, reason)

    def lost(self, peer: Any, reason: str) -> None:
        """A sender's connection ended: its unfinished requests can get no more notices."""
        self.receiver.fail_source(peer, f"{peer} went away before all its blocks arrived: {reason}")

    def control(self, peer: Any, message: dict[str, Any]) -> None:
        """A control message: ``{"kind": "announce", "request_ids": [...]}`` binds requests
        to the sender before their first notice."""
        if message.get("kind") != "announce":
            raise InvalidArgumentError(f"invalid control message kind={message.get('kind')!r}: expected 'announce'")
        for request_id in message["request_ids"]:
            try:
                self.receiver.bind(int(request_id), peer)
            except KvFerryError as err:  # recorded; a conflicting bind failed the request
                self.errors.append(err)

    def handle(self, conn: Connection, message: Any) -> None:
        """One message from a sender: here, a batch of notice tuples."""
        self.deliver(message)

    def deliver(self, batch: Sequence[tuple[int, int, int, int, bool]], source: Any = None) -> None:
        """Hands a batch of notice tuples to the receiver. ``source`` defaults to the sender
        whose connection thread is running (subclasses' `handle` call this without it)."""
        source = source if source is not None else getattr(self._local, "peer", None)
        for values in batch:
            notice = Notice.from_tuple(values)  # a malformed tuple raises: the peer is dropped
            try:
                self.receiver.deliver(notice, source)
            except KvFerryError as err:  # refused and recorded; a known request failed
                self.errors.append(err)

    def close(self) -> None:
        """Stops serving; unfinished requests of connected senders fail ("the endpoint
        closed"); every thread of the endpoint has ended when this returns."""
        self._closing.set()
        try:  # wake the accept() call
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.connect(self.address)
        except OSError:
            pass
        self._thread.join(timeout=JOIN_SECONDS)
        self._listener.close()
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.shutdown()
        for peer in peers:
            if peer.thread is not None:
                peer.thread.join(timeout=JOIN_SECONDS)
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


class PeerConnection:
    """The sender's connection to its receiver. Every way of losing the receiver (EOF, a
    broken pipe, a reset) surfaces as one `TransferError` naming it, kept in ``lost``, so
    callers (and the staging ring's own reads) need no per-call error handling."""

    def __init__(self, address: str, authkey: bytes) -> None:
        try:
            self._conn = Client(address, family="AF_UNIX", authkey=authkey)
        except (OSError, EOFError, AuthenticationError) as err:
            raise TransferError(f"cannot reach the receiver at {address}: {err!r}", peer=address) from err
        self._sock = _socket_of(self._conn)
        self.peer = f"receiver at {address} (pid {_peer_pid(self._sock)})"
        self.lost: Optional[TransferError] = None
        try:
            self.hello = self._conn.recv()
        except (OSError, EOFError) as err:
            self.close()
            raise TransferError(f"cannot reach the {self.peer}: {err!r}", peer=self.peer) from err

    def _lose(self, err: BaseException) -> TransferError:
        if self.lost is None:
            self.lost = TransferError(f"{self.peer} went away: {err!r}", peer=self.peer)
        return self.lost

    def send(self, message: Any) -> None:
        if self.lost is not None:
            raise self.lost
        try:
            self._conn.send(message)
        except (OSError, EOFError) as err:
            raise self._lose(err) from err

    def recv(self) -> Any:
        if self.lost is not None:
            raise self.lost
        try:
            return self._conn.recv()
        except (OSError, EOFError) as err:
            raise self._lose(err) from err

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        if self.lost is not None:
            raise self.lost
        try:
            return self._conn.poll(timeout)
        except (OSError, EOFError) as err:
            raise self._lose(err) from err

    def check(self) -> None:
        """Raises ``lost`` once the receiver's end closed; never blocks, never consumes a
        message (a peek: the staging ring's frees stay queued for their reader)."""
        if self.lost is None:
            try:
                data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as err:
                raise self._lose(err) from err
            if data:
                return
            self._lose(EOFError("connection closed"))
        assert self.lost is not None
        raise self.lost

    def close(self) -> None:
        self._conn.close()
        self._sock.close()


class LocalTransport(Transport):
    """The sender's side: connects with the key, opens the receiver's pool from its hello,
    posts notices. ``open_pool(hello)`` returns the pool and a function that releases it."""

    def __init__(self, address: str, *, authkey: bytes, open_pool: Callable[[dict[str, Any]], tuple[PagedKV, Callable[[], None]]]) -> None:
        self._conn = PeerConnection(address, authkey)
        self.peer = self._conn.peer
        self.dst, self._release = open_pool(self._conn.hello)

    def check_peer(self) -> None:
        """Raises `TransferError` (naming the receiver) once the receiver went away."""
        self._conn.check()

    def announce(self, request_ids: Iterable[int]) -> None:
        """Tells the receiver that these requests come from this sender, before any of their
        notices: if this sender dies first, the receiver fails them at once instead of at
        their timeout."""
        self._conn.send({"kind": "announce", "request_ids": [int(r) for r in request_ids]})

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        self._send([n.as_tuple() for n in kept(batch, revoked)])

    def _send(self, message: Any) -> None:
        self._conn.send(message)

    def close(self) -> None:
        self._conn.close()
        del self.dst
        self._release()


def _pool_hello(pool: PagedKV) -> dict[str, Any]:
    return {"layers": pool.layers, "tokens_per_block": pool.tokens_per_block, "block_dim": pool.block_dim}


class CudaIpcEndpoint(LocalEndpoint):
    """A CUDA pool shared through CUDA IPC handles: senders on the same GPU, or a peer GPU of
    the host, write straight into it with the fused copy kernel. The handles travel only in
    the hello, that is only to a peer that proved it holds the key."""

    def __init__(self, receiver: KVReceiver, *, authkey: bytes) -> None:
        if receiver.pool.device.type != "cuda":
            raise InvalidArgumentError(f"invalid receiver: its pool is on {receiver.pool.device}, CUDA IPC needs a CUDA pool")
        super().__init__(receiver, _pool_hello(receiver.pool), authkey=authkey)


def _open_ipc_pool(hello: dict[str, Any]) -> tuple[PagedKV, Callable[[], None]]:
    return PagedKV(tuple(hello["layers"]), hello["tokens_per_block"], hello["block_dim"]), lambda: None


class CudaIpcTransport(LocalTransport):
    def __init__(self, address: str, *, authkey: bytes) -> None:
        super().__init__(address, authkey=authkey, open_pool=_open_ipc_pool)
