"""Cross-process transports on one host: the receiver serves what a sender needs to address
its pool (a shared-memory descriptor, or CUDA IPC handles), then takes notices over an
authenticated Unix socket.

```
receiver process                              sender process
LocalEndpoint <--challenge / response (key)-->  LocalTransport
              --hello (how to reach the pool)-->  opens the pool
              <--announce (request, epoch)------  KVSender.add
              <--notices, after the writes------  post()
              <--revoke (request, epoch)--------  the fence: no more writes for it
              --cancel (request, epoch)-------->  the receiver gave up on it; read at the
                                                  sender's next poll, which revokes it
              EOF: the sender's unfinished requests fail at once, and all it owned is fenced
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
connection announced yet is left to its own timeout. A connection that ended (not the
endpoint closing it) fences every request it owned: its process is gone, or closed the
transport after its copies ended (`KVSender.close`), so nothing more lands in their blocks.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from multiprocessing.connection import Connection
from collections import deque
from typing import AbstractSet, Any, Callable, Hashable, Optional, Sequence

import torch.multiprocessing  # noqa: F401  (registers the CUDA-tensor reductions)

from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transports.base import Transport, kept
from kvferry.transports import wire
from kvferry.transports.wire import DEFAULT_HANDSHAKE_SECONDS, MIN_AUTHKEY_BYTES, AuthenticationError

__all__ = ["CudaIpcEndpoint", "CudaIpcTransport", "LocalEndpoint", "LocalTransport", "PeerConnection"]

# A peer that connects but does not complete the handshake in this time is dropped (the
# endpoints' and transports' ``handshake_timeout`` default): it must not hold a thread.
HANDSHAKE_SECONDS = DEFAULT_HANDSHAKE_SECONDS
JOIN_SECONDS = 5.0
# What the endpoint refused or failed at, kept for inspection (``error_count`` counts all): a
# misbehaving sender cannot grow the endpoint without bound.
ERRORS_KEPT = 1024


class _Peer:
    """One sender connection at the endpoint; requests are bound to it (see the module doc)."""

    _numbers = itertools.count(1)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn: Optional[Connection] = None  # once authenticated
        self.number = next(self._numbers)
        self.pid = wire.peer_pid(sock)
        self.where = wire.peer_name(sock)
        self.thread: Optional[threading.Thread] = None
        # What the receiver records as the requests' sender: this connection, unless the
        # transport names itself otherwise (a NIXL agent, whose notifications bypass it).
        self.source: Hashable = self
        # The connection thread replies (staging frees) while another thread may pass on a
        # cancellation: one message at a time.
        self._send_lock = threading.Lock()

    def __str__(self) -> str:
        return f"sender #{self.number} ({self.where})"

    def send(self, message: Any) -> None:
        with self._send_lock:
            assert self.conn is not None, "sent to a peer that is not authenticated"
            self.conn.send(message)

    def shutdown(self) -> None:
        """Wakes a thread blocked reading the connection (closing the descriptor would not)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.sock.close()


class LocalEndpoint:
    """The receiver's side: authenticates each sender, sends it ``hello``, then delivers its
    notices to the receiver, one thread per connection. ``errors`` records what was refused
    (failed handshakes, refused notices, broken messages).

    ``address``: where to listen, ``unix://`` (a fresh socket in a private directory: the
    default), ``unix:///path`` or ``tcp://host:port`` (port 0: any free port; a wildcard
    host needs ``advertise``, the host peers reach this one by). The ``address`` attribute
    is the URL senders connect to. ``handshake_timeout``: seconds a peer has to complete
    the handshake (kvferry.transports.wire) before it is dropped."""

    def __init__(
        self,
        receiver: KVReceiver,
        hello: dict[str, Any],
        *,
        authkey: bytes,
        address: str = "unix://",
        advertise: Optional[str] = None,
        handshake_timeout: Optional[float] = None,
    ) -> None:
        self._authkey = wire.check_authkey(authkey)
        where = wire.parse_address(address)
        self._handshake_timeout = wire.check_timeout(HANDSHAKE_SECONDS if handshake_timeout is None else handshake_timeout)
        self.receiver = receiver
        self._hello = hello
        # The handshake runs on the connection's own thread, so a peer that stalls in it
        # cannot keep the accept loop from serving the others.
        self._listener, bound, self._dir = wire.listen(where, advertise=advertise)
        self._bound = bound
        self.address = bound.url()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._peers: set[_Peer] = set()
        self._local = threading.local()  # the peer whose thread is running
        self.errors: deque[BaseException] = deque(maxlen=ERRORS_KEPT)
        self.error_count = 0
        self._unsubscribe = receiver.on_cancel(self._pass_cancel)
        self._thread = threading.Thread(target=self._serve, name="kvferry-endpoint", daemon=True)
        self._thread.start()

    def _record(self, err: BaseException) -> None:
        with self._lock:  # connection threads record concurrently
            self.errors.append(err)
            self.error_count += 1

    def _pass_cancel(self, source: Optional[Hashable], request_id: int, epoch: int) -> None:
        """The receiver gave up on a request: tells the sender that owns it, if it is
        connected here, which revokes it and posts its fence."""
        if source is None:
            return
        with self._lock:
            peers = [p for p in self._peers if p.source == source]
        for peer in peers:
            try:
                peer.send({"kind": "cancel", "requests": [(int(request_id), int(epoch))]})
            except OSError as err:  # the connection is ending: its end fences the request
                self._record(TransferError(f"{peer}: could not pass on the cancellation of request {request_id}: {err!r}", peer=str(peer)))

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as err:
                if self._closing.is_set():
                    return
                self._record(err)
                continue
            if self._closing.is_set():
                sock.close()
                return
            wire.tune(sock)
            peer = _Peer(sock)
            peer.thread = threading.Thread(target=self._pump, args=(peer,), name="kvferry-notices", daemon=True)
            with self._lock:
                self._peers.add(peer)
            peer.thread.start()

    def _authenticate(self, peer: _Peer) -> bool:
        try:
            wire.handshake(peer.sock, self._authkey, wire.ROLE_ENDPOINT, self._handshake_timeout)
        except AuthenticationError as err:  # a wrong key, a stall, garbage: refused, nothing changed
            if not self._closing.is_set():
                self._record(AuthenticationError(f"{peer}: refused: {err}"))
            return False
        peer.conn = Connection(os.dup(peer.sock.fileno()))
        return True

    def _pump(self, peer: _Peer) -> None:
        self._local.peer = peer
        reason = "its connection closed"
        authenticated = False
        try:
            if not self._authenticate(peer):
                return
            authenticated = True
            peer.send(self._hello)
            while True:
                assert peer.conn is not None
                message = peer.conn.recv()
                if isinstance(message, dict):
                    self.control(peer, message)
                else:
                    self.handle(peer.conn, message)
        except KvFerryError as err:
            reason = f"it broke the protocol: {err}"
            self._record(err)
        except (EOFError, OSError) as err:
            reason = "the endpoint closed" if self._closing.is_set() else f"its connection ended ({type(err).__name__})"
        except Exception as err:  # a malformed message: the peer cannot be trusted further
            reason = f"it sent a malformed message ({err!r})"
            self._record(TransferError(f"{peer}: {reason}; disconnected", peer=str(peer)))
        finally:
            with self._lock:
                self._peers.discard(peer)
            peer.close()
            if authenticated:  # a refused peer owned nothing and changed nothing
                self.lost(peer, reason)

    def lost(self, peer: Any, reason: str) -> None:
        """A sender's connection ended: its unfinished requests can get no more notices.
        Unless the endpoint itself is closing (the sender may then still be writing), the
        sender can write nothing more either: what it owned is fenced."""
        self.receiver.fail_source(peer.source, f"{peer} went away before all its blocks arrived: {reason}", fenced=not self._closing.is_set())

    def control(self, peer: Any, message: dict[str, Any]) -> None:
        """A control message: ``{"kind": "announce", "requests": [(id, epoch), ...]}`` binds
        requests to the sender before their first notice; ``{"kind": "revoke",
        "request_id": id, "epoch": epoch}`` is a request's fence."""
        kind = message.get("kind")
        if kind == "announce":
            for request_id, epoch in message["requests"]:
                try:
                    self.receiver.bind(int(request_id), peer.source, int(epoch))
                except KvFerryError as err:  # recorded; a conflicting bind failed the request
                    self._record(err)
        elif kind == "revoke":
            try:
                self.receiver.revoked(int(message["request_id"]), int(message["epoch"]), peer.source)
            except KvFerryError as err:  # recorded; another sender's fence failed the request
                self._record(err)
        else:
            raise InvalidArgumentError(f"invalid control message kind={kind!r}: expected 'announce' or 'revoke'")

    def handle(self, conn: Any, message: Any) -> None:
        """One message from a sender: here, a batch of notice tuples."""
        self.deliver(self.notices(message))

    def current_source(self) -> Optional[Hashable]:
        """The sender whose connection thread is running (``None`` on any other thread)."""
        peer = getattr(self._local, "peer", None)
        return None if peer is None else peer.source

    def deliver(self, batch: Sequence[Notice], source: Any = None) -> None:
        """Hands a batch of notices to the receiver. ``source`` defaults to the sender whose
        connection thread is running (subclasses' `handle` call this without it). Stale
        notices are discarded by the receiver (`KVReceiver.discarded`), not recorded here."""
        source = source if source is not None else self.current_source()
        for notice in batch:
            try:
                self.receiver.deliver(notice, source)
            except KvFerryError as err:  # refused and recorded; a known request failed
                self._record(err)

    @staticmethod
    def notices(batch: Any) -> list[Notice]:
        """A batch of notice tuples off the wire; anything malformed raises (the peer is then
        dropped)."""
        return [Notice.from_tuple(values) for values in batch]

    def close(self) -> None:
        """Stops serving; unfinished requests of connected senders fail ("the endpoint
        closed"); every thread of the endpoint has ended when this returns."""
        self._closing.set()
        self._unsubscribe()
        try:  # wakes the accept() call (Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=JOIN_SECONDS)
        self._listener.close()
        if self._bound.scheme == "unix":
            try:
                os.unlink(self._bound.path)
            except OSError:
                pass
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.shutdown()
        for peer in peers:
            if peer.thread is not None:
                peer.thread.join(timeout=JOIN_SECONDS)
        if self._dir is not None:
            try:
                os.rmdir(self._dir)
            except OSError:
                pass


class PeerConnection:
    """The sender's connection to its receiver. Every way of losing the receiver (EOF, a
    broken pipe, a reset) surfaces as one `TransferError` naming it, kept in ``lost``, so
    callers (and the staging ring's own reads) need no per-call error handling.

    The receiver sends two kinds of message back: cancellations (a dict, kept in
    ``cancels`` until `take_cancels`) and transport replies (the staging ring's frees, kept
    in ``replies`` for their reader). `read_waiting` sorts whatever has arrived."""

    def __init__(self, address: str, authkey: bytes, handshake_timeout: Optional[float] = None) -> None:
        key = wire.check_authkey(authkey)
        where = wire.parse_address(address)
        timeout = wire.check_timeout(HANDSHAKE_SECONDS if handshake_timeout is None else handshake_timeout)
        try:
            self._sock = wire.connect(where, timeout)
        except OSError as err:
            raise TransferError(f"cannot reach the receiver at {address}: {err!r}", peer=address) from err
        try:
            wire.handshake(self._sock, key, wire.ROLE_SENDER, timeout)
        except AuthenticationError as err:
            self._sock.close()
            raise TransferError(f"cannot reach the receiver at {address}: {err}", peer=address) from err
        self._conn = Connection(os.dup(self._sock.fileno()))
        self.peer = f"receiver at {where.url()} ({wire.peer_name(self._sock)})"
        self.lost: Optional[TransferError] = None
        self.cancels: list[tuple[int, int]] = []
        self.replies: deque[Any] = deque()
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

    def read_waiting(self) -> None:
        """Reads every message that has arrived, without blocking, into ``cancels`` and
        ``replies``. Raises ``lost`` once the receiver's end closed (after what it sent
        before closing was read)."""
        while self.poll():
            message = self.recv()
            if not isinstance(message, dict):
                self.replies.append(message)
            elif message.get("kind") == "cancel":
                try:
                    self.cancels.extend((int(r), int(e)) for r, e in message["requests"])
                except (KeyError, TypeError, ValueError) as err:
                    raise self._lose(TransferError(f"malformed cancellation {message!r}: {err!r}")) from None
            else:
                raise self._lose(TransferError(f"unknown message kind={message.get('kind')!r} from the receiver"))

    def check(self) -> None:
        """Raises ``lost`` once the receiver's end closed; never blocks. Reads what the
        receiver sent meanwhile (`read_waiting`): a message waiting unread would otherwise
        hide the end of the connection behind it."""
        if self.lost is not None:
            raise self.lost
        self.read_waiting()

    def take_cancels(self) -> list[tuple[int, int]]:
        """The cancellations read so far, each once."""
        cancels, self.cancels = self.cancels, []
        return cancels

    def close(self) -> None:
        self._conn.close()
        self._sock.close()


class LocalTransport(Transport):
    """The sender's side: connects with the key, opens the receiver's pool from its hello,
    posts notices. ``open_pool(hello)`` returns the pool and a function that releases it."""

    def __init__(
        self,
        address: str,
        *,
        authkey: bytes,
        open_pool: Callable[[dict[str, Any]], tuple[PagedKV, Callable[[], None]]],
        handshake_timeout: Optional[float] = None,
    ) -> None:
        self._conn = PeerConnection(address, authkey, handshake_timeout)
        self.peer = self._conn.peer
        self.dst, self._release = open_pool(self._conn.hello)

    def check_peer(self) -> None:
        """Raises `TransferError` (naming the receiver) once the receiver went away."""
        self._conn.check()

    def cancel_requests(self) -> list[tuple[int, int]]:
        return self._conn.take_cancels()

    def announce(self, requests: Sequence[tuple[int, int]]) -> None:
        """Tells the receiver that these ``(request_id, epoch)`` come from this sender,
        before any of their notices: if this sender dies first, the receiver fails them at
        once instead of at their timeout."""
        self._send({"kind": "announce", "requests": [(int(r), int(e)) for r, e in requests]})

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        self._send([n.as_tuple() for n in kept(batch, revoked)])

    def revoke(self, request_id: int, epoch: int) -> None:
        self._send({"kind": "revoke", "request_id": int(request_id), "epoch": int(epoch)})

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

    def __init__(self, receiver: KVReceiver, *, authkey: bytes, **options: Any) -> None:
        if receiver.pool.device.type != "cuda":
            raise InvalidArgumentError(f"invalid receiver: its pool is on {receiver.pool.device}, CUDA IPC needs a CUDA pool")
        super().__init__(receiver, _pool_hello(receiver.pool), authkey=authkey, **options)


def _open_ipc_pool(hello: dict[str, Any]) -> tuple[PagedKV, Callable[[], None]]:
    return PagedKV(tuple(hello["layers"]), hello["tokens_per_block"], hello["block_dim"]), lambda: None


class CudaIpcTransport(LocalTransport):
    def __init__(self, address: str, *, authkey: bytes, handshake_timeout: Optional[float] = None) -> None:
        super().__init__(address, authkey=authkey, open_pool=_open_ipc_pool, handshake_timeout=handshake_timeout)
