"""Cross-process transports: the receiver serves what a sender needs to address its pool (a
shared-memory descriptor, CUDA IPC handles, a NIXL agent), then takes notices over an
authenticated control channel: a Unix socket on one host, TCP across hosts
(kvferry.transports.wire: addresses, the handshake, the frames).

```
receiver process                              sender process
LocalEndpoint <--challenge / proof (key)------>  LocalTransport
              --hello (how to reach the pool)-->  opens the pool
              <--announce (request, epoch)------  KVSender.add
              <--notices + destination ids------  post(), after the writes
              <--revoke (request, epoch)--------  the fence: no more writes for it
              --cancel (request, epoch)-------->  the receiver gave up on it; read at the
                                                  sender's next poll, which revokes it
              --goodbye (why)------------------>  the endpoint drops a peer that broke the
                                                  protocol, saying why
              EOF: the sender's unfinished requests fail at once, and all it owned is fenced
```
Both sides prove they hold the session's key before the hello leaves, so a process without
it can neither reach the pool nor pose as the receiver. Every message is a frame of the Rust
codec, decoded and validated before anything is applied; nothing is ever unpickled. A frame
that does not decode, of an unknown version or type, or naming destination blocks outside
its request's lease ends that sender's connection (with a goodbye saying why); the endpoint
serves the others on. The default Unix socket lives in a fresh 0700 directory.

Which requests a connection owns: a request belongs to the first connection that announced
it (`LocalTransport.announce`) or sent a notice for it (`KVReceiver.bind` / ``deliver(...,
source)``). When a connection ends (EOF, a reset, a frame that breaks the protocol), the
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
from collections import deque
from typing import AbstractSet, Any, Callable, Hashable, Optional, Sequence

import numpy as np
import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)
import torch

from kvferry.engine import CopyEngine, Pending
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver, LeaseError
from kvferry.tiers import Signal, Source
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
        self.channel: Optional[wire.Channel] = None  # once authenticated
        self.number = next(self._numbers)
        self.pid = wire.peer_pid(sock)
        self.where = wire.peer_name(sock)
        self.thread: Optional[threading.Thread] = None
        # What the receiver records as the requests' sender: this connection, unless the
        # transport names itself otherwise (a NIXL agent, whose notifications bypass it).
        self.source: Hashable = self

    def __str__(self) -> str:
        return f"sender #{self.number} ({self.where})"

    def send(self, kind: str, value: Any) -> None:
        """One frame to the sender; any thread (the connection thread replies with staging
        frees while another passes on a cancellation)."""
        assert self.channel is not None, "sent to a peer that is not authenticated"
        self.channel.send(kind, value)

    def shutdown(self) -> None:
        """Wakes a thread blocked reading the connection (closing the descriptor would not)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


Hello = dict[str, Any]


class LocalEndpoint:
    """The receiver's side: authenticates each sender, sends it ``hello``, then delivers its
    notices to the receiver, one thread per connection. ``errors`` records what was refused
    (failed handshakes, refused notices, broken frames).

    ``hello``: the hello frame's fields (kvferry._core.wire_encode("hello", ...)), or a
    function building them per connection (CUDA IPC handles are shared per peer).
    ``address``: where to listen, ``unix://`` (a fresh socket in a private directory: the
    default), ``unix:///path`` or ``tcp://host:port`` (port 0: any free port; a wildcard
    host needs ``advertise``, the host peers reach this one by). The ``address`` attribute
    is the URL senders connect to. ``handshake_timeout``: seconds a peer has to complete
    the handshake (kvferry.transports.wire) before it is dropped."""

    def __init__(
        self,
        receiver: KVReceiver,
        hello: Hello | Callable[[], Hello],
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
        if not callable(hello):
            wire.frame("hello", hello)  # refuses a hello the codec cannot carry, here and now
        # The handshake runs on the connection's own thread, so a peer that stalls in it
        # cannot keep the accept loop from serving the others.
        self._listener, bound, self._dir = wire.listen(where, advertise=advertise)
        self._bound = bound
        self.address = bound.url()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._peers: set[_Peer] = set()
        # Every connection thread started and maybe not ended yet: a thread leaves _peers as it
        # begins to wind down, and close must still wait for it.
        self._threads: list[threading.Thread] = []
        self._local = threading.local()  # the peer whose thread is running
        self.errors: deque[BaseException] = deque(maxlen=ERRORS_KEPT)
        self.error_count = 0
        self._unsubscribe = receiver.on_cancel(self._pass_cancel)
        self._thread = threading.Thread(target=self._serve, name="kvferry-endpoint", daemon=True)
        self._thread.start()

    def connected(self) -> bool:
        """Whether an authenticated sender holds a connection to this endpoint now."""
        with self._lock:
            return any(p.channel is not None for p in self._peers)

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
            peers = [p for p in self._peers if p.source == source and p.channel is not None]
        for peer in peers:
            try:
                peer.send("cancel", [(int(request_id), int(epoch))])
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
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(peer.thread)
            peer.thread.start()

    def _authenticate(self, peer: _Peer) -> bool:
        try:
            wire.handshake(peer.sock, self._authkey, wire.ROLE_ENDPOINT, self._handshake_timeout)
        except AuthenticationError as err:  # a wrong key, a stall, garbage: refused, nothing changed
            if not self._closing.is_set():
                self._record(AuthenticationError(f"{peer}: refused: {err}"))
            return False
        peer.channel = wire.Channel(peer.sock)
        return True

    def _pump(self, peer: _Peer) -> None:
        self._local.peer = peer
        reason = "its connection closed"
        authenticated = False
        try:
            if not self._authenticate(peer):
                return
            authenticated = True
            peer.send("hello", self._hello() if callable(self._hello) else self._hello)
            assert peer.channel is not None
            while True:
                kind, value = peer.channel.recv()
                self.dispatch(peer, kind, value)
        except KvFerryError as err:  # a frame that broke the protocol: the peer cannot be trusted further
            reason = f"it broke the protocol: {err}"
            self._record(err if isinstance(err, wire.ProtocolError) else wire.ProtocolError(f"{peer}: {err}; disconnected", peer=str(peer)))
            if peer.channel is not None:
                peer.channel.goodbye(f"disconnected: {err}")
        except (EOFError, OSError) as err:
            reason = "the endpoint closed" if self._closing.is_set() else f"its connection ended ({type(err).__name__})"
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

    def dispatch(self, peer: Any, kind: str, value: Any) -> None:
        """One decoded frame from a sender. ``announce`` binds requests to the sender before
        their first notice; ``revoke`` is a request's fence; ``notices`` are delivered.
        Subclasses take their own kinds first. Any other kind breaks the protocol."""
        if kind == "announce":
            for request_id, epoch in value:
                try:
                    self.receiver.bind(request_id, peer.source, epoch)
                except KvFerryError as err:  # recorded; a conflicting bind failed the request
                    self._record(err)
        elif kind == "revoke":
            try:
                self.receiver.revoked(value[0], value[1], peer.source)
            except KvFerryError as err:  # recorded; another sender's fence failed the request
                self._record(err)
        elif kind == "notices":
            notices, dst_ids = value
            self.deliver(self.notices(notices), peer.source, dst_ids=dst_ids)
        else:
            raise wire.ProtocolError(f"{peer}: a {kind} frame, which a sender does not send", peer=str(peer))

    def current_source(self) -> Optional[Hashable]:
        """The sender whose connection thread is running (``None`` on any other thread)."""
        peer = getattr(self._local, "peer", None)
        return None if peer is None else peer.source

    def deliver(self, batch: Sequence[Notice], source: Any = None, *, dst_ids: Optional[np.ndarray] = None) -> None:
        """Hands a batch of notices to the receiver with the destination blocks their writes
        used (``dst_ids``, in notice order; ``None``: the sender named none, refused for a
        request whose lease records its blocks). ``source`` defaults to the sender whose
        connection thread is running. Stale notices are discarded by the receiver
        (`KVReceiver.discarded`), not recorded here; a notice naming blocks outside its
        lease is refused and then ends the connection (`LeaseError`)."""
        source = source if source is not None else self.current_source()
        outside: Optional[KvFerryError] = None
        at = 0
        for notice in batch:
            ids = None
            if dst_ids is not None:  # the codec checked: one id per block the notices cover
                ids, at = dst_ids[at : at + notice.end - notice.start], at + notice.end - notice.start
            try:
                self.receiver.deliver(notice, source, dst_ids=ids)
            except LeaseError as err:
                self._record(err)
                outside = outside or err
            except KvFerryError as err:  # refused and recorded; a known request failed
                self._record(err)
        if outside is not None:
            raise wire.ProtocolError(f"{_name(source)} wrote outside a request's lease: {outside}", request_ids=getattr(outside, "request_ids", ()), peer=_name(source))

    @staticmethod
    def notices(batch: Sequence[Any]) -> list[Notice]:
        """The decoded notice tuples as notices."""
        return [Notice(*values) for values in batch]

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
        with self._lock:
            threads = list(self._threads)
        for thread in threads:  # those of peers already winding down too
            thread.join(timeout=JOIN_SECONDS)
        if self._dir is not None:
            try:
                os.rmdir(self._dir)
            except OSError:
                pass


def _name(source: Any) -> Optional[str]:
    return None if source is None else str(source)


class PeerConnection:
    """The sender's connection to its receiver. Every way of losing the receiver (EOF, a
    broken pipe, a reset, a goodbye, a frame that breaks the protocol) surfaces as one
    `TransferError` naming it, kept in ``lost``, so callers (and the staging ring's own
    reads) need no per-call error handling.

    The receiver sends two kinds of frame back: cancellations (kept in ``cancels`` until
    `take_cancels`) and staging frees (kept in ``replies`` for their reader).
    `read_waiting` sorts whatever has arrived."""

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
        self._channel = wire.Channel(self._sock)
        self.peer = f"receiver at {where.url()} ({wire.peer_name(self._sock)})"
        self.lost: Optional[TransferError] = None
        self.cancels: list[tuple[int, int]] = []
        self.replies: deque[int] = deque()
        try:
            kind, self.hello = self._channel.recv()
            if kind == "goodbye":
                raise TransferError(f"the {self.peer} refused the connection: {self.hello}", peer=self.peer)
            if kind != "hello":
                raise wire.ProtocolError(f"the {self.peer} sent a {kind} frame instead of its hello", peer=self.peer)
        except (OSError, EOFError, KvFerryError) as err:
            self.close()
            raise TransferError(f"cannot reach the {self.peer}: {err}", peer=self.peer) from err

    def _lose(self, err: BaseException) -> TransferError:
        if self.lost is None:
            self.lost = TransferError(f"{self.peer} went away: {err}", peer=self.peer)
        return self.lost

    def send(self, kind: str, value: Any) -> None:
        """One frame to the receiver. A value the codec refuses raises (nothing was sent)."""
        if self.lost is not None:
            raise self.lost
        data = wire.frame(kind, value)
        try:
            self._channel.send_frame(data)
        except OSError as err:
            raise self._lose(err) from err

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        if self.lost is not None:
            raise self.lost
        try:
            return self._channel.poll(timeout)
        except OSError as err:
            raise self._lose(err) from err

    def read_waiting(self) -> None:
        """Reads every frame that has arrived, without blocking, into ``cancels`` and
        ``replies``. Raises ``lost`` once the receiver's end closed (after what it sent
        before closing was read)."""
        while self.poll():
            try:
                kind, value = self._channel.recv()
            except (OSError, EOFError) as err:
                raise self._lose(err) from err
            except KvFerryError as err:  # a frame that does not decode: nothing more is trusted
                raise self._lose(err) from None
            if kind == "cancel":
                self.cancels.extend(value)
            elif kind == "freed":
                self.replies.append(value)
            elif kind == "goodbye":
                raise self._lose(TransferError(f"it closed the connection: {value}"))
            else:
                raise self._lose(wire.ProtocolError(f"a {kind} frame from the receiver, which it does not send"))

    def check(self) -> None:
        """Raises ``lost`` once the receiver's end closed; never blocks. Reads what the
        receiver sent meanwhile (`read_waiting`): a frame waiting unread would otherwise
        hide the end of the connection behind it."""
        if self.lost is not None:
            raise self.lost
        self.read_waiting()

    def take_cancels(self) -> list[tuple[int, int]]:
        """The cancellations read so far, each once."""
        cancels, self.cancels = self.cancels, []
        return cancels

    def close(self) -> None:
        self._sock.close()


class LocalTransport(Transport):
    """The sender's side: connects with the key, opens the receiver's pool from its hello,
    posts notices with the destination blocks each write used (the receiver checks them
    against the request's lease). ``open_pool(hello)`` returns the pool and a function that
    releases it."""

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
        # Destination ids of the writes queued and not yet posted, oldest first (writes are
        # posted or abandoned in the order they were queued).
        self._written: deque[np.ndarray] = deque()
        try:
            self.dst, self._release = open_pool(self._conn.hello)
        except BaseException:
            self._conn.close()
            raise

    def check_peer(self) -> None:
        """Raises `TransferError` (naming the receiver) once the receiver went away."""
        self._conn.check()

    def cancel_requests(self) -> list[tuple[int, int]]:
        return self._conn.take_cancels()

    def announce(self, requests: Sequence[tuple[int, int]]) -> None:
        """Tells the receiver that these ``(request_id, epoch)`` come from this sender,
        before any of their notices: if this sender dies first, the receiver fails them at
        once instead of at their timeout."""
        self._send("announce", [(int(r), int(e)) for r, e in requests])

    def write(
        self,
        engine: CopyEngine,
        src: Source,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        notices: Sequence[Notice],
        *,
        after: Sequence[Signal] = (),
        layers: Optional[tuple[int, int]] = None,
    ) -> Pending:
        pending = super().write(engine, src, src_ids, dst_ids, notices, after=after, layers=layers)
        self._written.append(np.array(dst_ids, dtype=np.int64).reshape(-1))
        return pending

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        keep = kept(batch, revoked)
        # The destination ids of the write these notices describe; none for a post without
        # a write (a sender that has no write to describe names no blocks).
        dst = self._written.popleft() if self._written else None
        if dst is not None and len(keep) != len(batch):
            lengths = np.array([n.end - n.start for n in batch])
            dst = dst[np.repeat([n.request_id not in revoked for n in batch], lengths)]
        if keep:
            self._send("notices", ([n.as_tuple() for n in keep], dst))

    def abandon(self, batch: Sequence[Notice]) -> None:
        if self._written:
            self._written.popleft()

    def revoke(self, request_id: int, epoch: int) -> None:
        self._send("revoke", (int(request_id), int(epoch)))

    def _send(self, kind: str, value: Any) -> None:
        self._conn.send(kind, value)

    def close(self) -> None:
        self._conn.close()
        del self.dst
        self._release()


def pool_hello(pool: PagedKV, kind: str, **fields: Any) -> Hello:
    """The hello fields every transport's hello shares (the pool's geometry and size), and
    ``kind``'s own."""
    return {"geometry": pool.geometry(), "num_blocks": pool.num_blocks, "block_dim": pool.block_dim, "kind": kind, **fields}


def torch_dtype(name: str) -> torch.dtype:
    """The dtype a hello names (``"torch.float16"``); nothing else is looked up."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"invalid dtype={name!r}: not a torch dtype")
    return dtype


def _share_layer(layer: torch.Tensor) -> dict[str, Any]:
    """The fields torch shares a CUDA tensor's storage by (what its own pickler would send,
    as plain values): the storage's IPC handles, and the view on it."""
    storage = layer._typed_storage()  # noqa: SLF001  (torch's reductions use the same call)
    device, handle, size, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()  # noqa: SLF001
    return {
        "device": int(device),
        "handle": bytes(handle),
        "storage_size": int(size),
        "storage_offset": int(offset),
        "ref_counter_handle": bytes(counter),
        "ref_counter_offset": int(counter_offset),
        "event_handle": bytes(event),
        "event_sync_required": bool(event_sync),
        "shape": list(layer.shape),
        "stride": list(layer.stride()),
        "offset": int(layer.storage_offset()),
        "dtype": str(layer.dtype),
    }


def _open_layer(fields: dict[str, Any]) -> torch.Tensor:
    """A CUDA tensor rebuilt from `_share_layer`'s fields with torch's own rebuild function
    (no pickle involved). Untested on a GPU in CI (the CUDA tests skip on CPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor,
        torch.Size(fields["shape"]),
        tuple(fields["stride"]),
        fields["offset"],
        torch.storage.TypedStorage,
        torch_dtype(fields["dtype"]),
        fields["device"],
        fields["handle"],
        fields["storage_size"],
        fields["storage_offset"],
        False,
        fields["ref_counter_handle"],
        fields["ref_counter_offset"],
        fields["event_handle"],
        fields["event_sync_required"],
    )


class CudaIpcEndpoint(LocalEndpoint):
    """A CUDA pool shared through CUDA IPC handles: senders on the same GPU, or a peer GPU of
    the host, write straight into it with the fused copy kernel. The handles travel only in
    the hello, that is only to a peer that proved it holds the key; each connection gets its
    own (torch counts the peers that opened a storage)."""

    def __init__(self, receiver: KVReceiver, *, authkey: bytes, **options: Any) -> None:
        pool = receiver.pool
        if pool.device.type != "cuda":
            raise InvalidArgumentError(f"invalid receiver: its pool is on {pool.device}, CUDA IPC needs a CUDA pool")
        super().__init__(receiver, lambda: pool_hello(pool, "cuda_ipc", layers=[_share_layer(t) for t in pool.layers]), authkey=authkey, **options)


def _open_ipc_pool(hello: dict[str, Any]) -> tuple[PagedKV, Callable[[], None]]:
    if hello["kind"] != "cuda_ipc":
        raise TransferError(f"the receiver serves a {hello['kind']} pool, not CUDA IPC handles")
    layers = tuple(_open_layer(fields) for fields in hello["layers"])
    pool = PagedKV(layers, hello["geometry"]["tokens_per_block"], hello["block_dim"])
    pool.check_compatible(hello["geometry"])
    return pool, lambda: None


class CudaIpcTransport(LocalTransport):
    def __init__(self, address: str, *, authkey: bytes, handshake_timeout: Optional[float] = None) -> None:
        super().__init__(address, authkey=authkey, open_pool=_open_ipc_pool, handshake_timeout=handshake_timeout)
