"""The socket machinery every cross-process transport shares: the receiver's endpoint serves
what a sender needs to address its pool (a shared-memory descriptor, CUDA IPC handles, a
staging ring, a NIXL agent), then takes notices over an authenticated control channel: a
Unix socket on one host, TCP across hosts (kvferry.transports.wire: addresses, the
handshake, the framing; kvferry.transports.frames: the frames). Each transport's module
(shm, cuda_ipc, staging, nixl) subclasses `LocalEndpoint` and `LocalTransport` with how its
pool is reached, and extends the endpoint's dispatch table (`LocalEndpoint.HANDLERS`) with
frames of its own.

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

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections import deque
from typing import AbstractSet, Any, Callable, ClassVar, Hashable, Mapping, Optional, Sequence

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import numpy as np

from kvferry import affinity
from kvferry.engine import CopyEngine, Pending
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver, LeaseError
from kvferry.transports import guard, wire
from kvferry.transports.base import Transport, WouldWait, Write, kept
from kvferry.transports.frames import Announce, Cancel, Frame, Freed, Goodbye, Notices, Revoke
from kvferry.transports.frames import Hello as HelloFrame
from kvferry.transports.wire import DEFAULT_HANDSHAKE_SECONDS, AuthenticationError

__all__ = ["LocalEndpoint", "LocalTransport", "PeerConnection", "pool_hello"]

# A peer that connects but does not complete the handshake in this time is dropped (the
# endpoints' and transports' ``handshake_timeout`` default): it must not hold a thread.
HANDSHAKE_SECONDS = DEFAULT_HANDSHAKE_SECONDS
JOIN_SECONDS = 5.0
# Authenticated connections an endpoint serves at once (each may hold a frame of up to
# MAX_FRAME_BYTES being read and decoded: docs/security.md has the memory bound).
DEFAULT_MAX_PEERS = 64
# A connection silent this long that owns no unfinished request may be closed to make room
# for a new sender when the endpoint is full (its place, a staging ring, comes back).
DEFAULT_IDLE_RECLAIM_SECONDS = 60.0
# Failed handshakes and accept errors, logged at a bounded rate (a flood cannot flood the log).
_log = guard.RateLimitedLog(logging.getLogger("kvferry.transports"))
logger = logging.getLogger("kvferry.transports")
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
        self.ticket = 0  # its place among the connections still in their handshake (guard.Admission)
        self.last_active = time.monotonic()  # when its last frame arrived (or it authenticated)
        self.reclaimed = False  # closed by the endpoint to make room (`LocalEndpoint.make_room`)
        self.authenticated = False  # holds one of the endpoint's max_peers places
        # What the receiver records as the requests' sender: this connection, unless the
        # transport names itself otherwise (a NIXL agent, whose notifications bypass it).
        self.source: Hashable = self

    def __str__(self) -> str:
        return f"sender #{self.number} ({self.where})"

    def send(self, frame: Frame) -> None:
        """One frame to the sender, from any thread (the connection thread replies with
        staging frees while the engine's passes on a cancellation); never blocks: a sender
        that stopped reading is cut off instead (`wire.Channel` with ``queue_bytes``), and
        `wire.StalledError` raised."""
        assert self.channel is not None, "sent to a peer that is not authenticated"
        self.channel.send(frame)

    def shutdown(self) -> None:
        """Wakes a thread blocked reading the connection (closing the descriptor would not)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()  # its writer thread too
        else:
            self.sock.close()


Hello = dict[str, Any]
# How an endpoint handles a frame of one kind: ``handler(endpoint, peer, frame)``.
Handler = Callable[[Any, Any, Any], None]


class LocalEndpoint:
    """The receiver's side: authenticates each sender, sends it ``hello``, then delivers its
    notices to the receiver, one thread per connection. ``errors`` records what was refused
    (failed handshakes, refused notices, broken frames).

    ``hello``: the hello frame's fields (`kvferry.transports.frames.Hello`), or a function
    building them per connection (CUDA IPC handles are shared per peer).
    ``address``: where to listen, ``unix://`` (a fresh socket in a private directory: the
    default), ``unix:///path`` or ``tcp://host:port`` (port 0: any free port; a wildcard
    host needs ``advertise``, the host peers reach this one by). The ``address`` attribute
    is the URL senders connect to. ``handshake_timeout``: seconds a peer has to complete
    the handshake (kvferry.transports.wire) before it is dropped. ``max_peers``: the
    authenticated connections served at once; when full, a new one takes the place of a
    connection silent for ``idle_reclaim_s`` seconds that owns no unfinished request
    (`make_room`), else it is refused with a goodbye naming the bound."""

    def __init__(
        self,
        receiver: KVReceiver,
        hello: Hello | Callable[[], Hello],
        *,
        authkey: bytes,
        address: str = "unix://",
        advertise: Optional[str] = None,
        handshake_timeout: Optional[float] = None,
        max_peers: int = DEFAULT_MAX_PEERS,
        idle_reclaim_s: float = DEFAULT_IDLE_RECLAIM_SECONDS,
    ) -> None:
        self._authkey = wire.check_authkey(authkey)
        if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers <= 0:
            raise InvalidArgumentError(f"invalid max_peers={max_peers!r}: must be an int > 0")
        if (
            isinstance(idle_reclaim_s, bool)
            or not isinstance(idle_reclaim_s, (int, float))
            or not 0 <= idle_reclaim_s < float("inf")
        ):
            raise InvalidArgumentError(
                f"invalid idle_reclaim_s={idle_reclaim_s!r}: must be a finite number of seconds >= 0"
            )
        self.max_peers = max_peers
        self.idle_reclaim_s = float(idle_reclaim_s)
        self.reclaimed_count = 0  # idle connections closed to make room
        where = wire.parse_address(address)
        self._handshake_timeout = wire.check_timeout(
            HANDSHAKE_SECONDS if handshake_timeout is None else handshake_timeout
        )
        self.receiver = receiver
        self._hello = hello
        if not callable(hello):
            wire.encode(HelloFrame(hello))  # refuses a hello the codec cannot carry, here and now
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
        # Connections still in their handshake: bounded, the oldest cut off first (guard).
        self._admission = guard.Admission()
        self._thread = affinity.Thread(target=self._serve, name="kvferry-endpoint", daemon=True)
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
                peer.send(Cancel([(int(request_id), int(epoch))]))
            except OSError as err:  # the connection is ending: its end fences the request
                self._record(
                    TransferError(
                        f"{peer}: could not pass on the cancellation of request {request_id}: {err!r}", peer=str(peer)
                    )
                )

    def _serve(self) -> None:
        guard.accept_loop(
            self._listener, self._closing, self._start, admission=self._admission, failed=self._accept_failed
        )

    def hello_fds(self) -> list[int]:
        """Descriptors to pass with the hello on a Unix socket (a segment without a name);
        none here."""
        return []

    def _accept_failed(self, what: str, err: BaseException) -> None:
        """The accept loop's trouble (it backs off and serves on: kvferry.transports.guard):
        recorded, and logged at a bounded rate."""
        self._record(err)
        _log.warning(what, "kvferry: the endpoint at %s: %s", self.address, guard.describe(what, err))

    def _start(self, sock: socket.socket) -> None:
        """A new connection: its handshake counts against the admission bound, on a thread of
        its own (raises, having undone everything, when no thread can be started)."""
        try:
            wire.tune(sock)
        except OSError:  # already reset by the peer: its handshake fails at once
            pass
        peer = _Peer(sock)
        peer.ticket = self._admission.admit(guard.source_of(sock), peer.shutdown)
        peer.thread = affinity.Thread(target=self._pump, args=(peer,), name="kvferry-notices", daemon=True)
        with self._lock:
            self._peers.add(peer)
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(peer.thread)
        try:
            peer.thread.start()
        except BaseException:
            with self._lock:
                self._peers.discard(peer)
                self._threads.remove(peer.thread)
            self._admission.settle(peer.ticket)
            raise

    def _authenticate(self, peer: _Peer) -> bool:
        try:
            wire.handshake(peer.sock, self._authkey, wire.ROLE_ENDPOINT, self._handshake_timeout, self.address)
        except AuthenticationError as err:  # a wrong key, a stall, garbage: refused, nothing changed
            if not self._closing.is_set():
                self._record(AuthenticationError(f"{peer}: refused: {err}"))
                _log.warning("refused", "kvferry: the endpoint at %s refused %s: %s", self.address, peer, err)
            return False
        finally:
            self._admission.settle(peer.ticket)
        # Queued sends: no thread of the receiver's (a decode step passing on a cancellation,
        # a newcomer making room) ever waits on this peer reading.
        peer.channel = wire.Channel(peer.sock, queue_bytes=wire.QUEUE_BYTES)
        return True

    def _pump(self, peer: _Peer) -> None:
        self._local.peer = peer
        reason = "its connection closed"
        authenticated = False
        try:
            if not self._authenticate(peer):
                return
            if not self._take_place(peer):
                return
            authenticated = True
            peer.last_active = time.monotonic()
            hello = wire.encode(HelloFrame(self._hello() if callable(self._hello) else self._hello))
            fds = self.hello_fds() if peer.sock.family == socket.AF_UNIX else []
            assert peer.channel is not None
            peer.channel.send_frame(hello, fds)
            logger.debug("kvferry: the endpoint at %s: %s authenticated, hello sent", self.address, peer)
            while True:
                frame = peer.channel.recv()
                peer.last_active = time.monotonic()
                self.dispatch(peer, frame)
        except KvFerryError as err:  # a frame that broke the protocol: the peer cannot be trusted further
            reason = f"it broke the protocol: {err}"
            self._record(
                err
                if isinstance(err, wire.ProtocolError)
                else wire.ProtocolError(f"{peer}: {err}; disconnected", peer=str(peer))
            )
            if peer.channel is not None:
                peer.channel.goodbye(f"disconnected: {err}")
        except (EOFError, OSError) as err:
            broken = peer.channel.broken if peer.channel is not None else None
            if self._closing.is_set():
                reason = "the endpoint closed"
            elif peer.reclaimed:
                reason = f"the endpoint closed it to make room for another sender after {self.idle_reclaim_s:g} s idle"
            elif broken is not None:
                reason = f"the endpoint cut it off: {broken}"
            elif isinstance(err, socket.timeout):
                reason = (
                    f"the endpoint cut it off: a frame it began did not arrive whole within {wire.FRAME_SECONDS:g} s"
                )
            else:
                reason = f"its connection ended ({type(err).__name__})"
            if broken is not None or isinstance(err, socket.timeout):
                self._record(TransferError(f"{peer}: {reason}", peer=str(peer)))
                _log.warning("cut off", "kvferry: the endpoint at %s: %s: %s", self.address, peer, reason)
        finally:
            with self._lock:
                self._peers.discard(peer)
            peer.close()
            if authenticated:  # a refused peer owned nothing and changed nothing
                self.lost(peer, reason)

    def _take_place(self, peer: _Peer) -> bool:
        """An authenticated connection takes one of ``max_peers`` places (making room if it
        must); a refused one is told why and ends, having changed nothing."""
        for _ in range(2):
            with self._lock:
                served = sum(1 for p in self._peers if p is not peer and p.authenticated)
                if served < self.max_peers:
                    peer.authenticated = True
                    return True
            if not self.make_room(peer):
                break
        why = (
            f"refused: this endpoint serves at most {self.max_peers} senders at once (max_peers),"
            f" none idle for {self.idle_reclaim_s:g} s"
        )
        self._record(TransferError(f"{peer}: {why}", peer=str(peer)))
        if peer.channel is not None:
            peer.channel.goodbye(why)
        return False

    def make_room(self, newcomer: Any) -> bool:
        """Closes the connection silent longest, if it has been silent ``idle_reclaim_s`` and
        owns no unfinished request, and waits for its thread to end (its places, a staging
        ring, are free then). Returns whether one was closed."""
        now = time.monotonic()
        with self._lock:
            idle = sorted(
                (
                    p
                    for p in self._peers
                    if p is not newcomer
                    and p.authenticated
                    and not p.reclaimed
                    and now - p.last_active >= self.idle_reclaim_s
                ),
                key=lambda p: p.last_active,
            )
        for victim in idle:
            if self.receiver.owns_unfinished(victim.source):
                continue
            victim.reclaimed = True
            if victim.channel is not None:
                idle_s = now - victim.last_active
                victim.channel.goodbye(f"closed: idle for {idle_s:.0f} s while another sender needed its place")
            victim.shutdown()
            if victim.thread is not None and victim.thread is not threading.current_thread():
                victim.thread.join(JOIN_SECONDS)
            with self._lock:
                self.reclaimed_count += 1
            return True
        return False

    def lost(self, peer: Any, reason: str) -> None:
        """A sender's connection ended: its unfinished requests can get no more notices.
        Unless the endpoint itself is closing (the sender may then still be writing), the
        sender can write nothing more either: what it owned is fenced."""
        self.receiver.fail_source(
            peer.source, f"{peer} went away before all its blocks arrived: {reason}", fenced=not self._closing.is_set()
        )

    def _on_announce(self, peer: Any, frame: Announce) -> None:
        """Binds requests to the sender before their first notice."""
        for request_id, epoch in frame.leases:
            try:
                self.receiver.bind(request_id, peer.source, epoch)
            except KvFerryError as err:  # recorded; a conflicting bind changes nothing
                self._record(err)

    def _on_revoke(self, peer: Any, frame: Revoke) -> None:
        """A request's fence."""
        try:
            self.receiver.revoked(frame.request_id, frame.epoch, peer.source)
        except KvFerryError as err:  # recorded; another sender's fence changes nothing
            self._record(err)

    def _on_notices(self, peer: Any, frame: Notices) -> None:
        self.deliver(frame.notices, peer.source, dst_ids=frame.dst_ids)

    # What a sender may send, by frame class; a subclass extends or overrides it with its
    # own (``HANDLERS = {**LocalEndpoint.HANDLERS, Staged: _on_staged}``).
    HANDLERS: ClassVar[Mapping[type[Frame], Handler]] = {
        Announce: _on_announce,
        Revoke: _on_revoke,
        Notices: _on_notices,
    }

    def dispatch(self, peer: Any, frame: Frame) -> None:
        """One decoded frame from a sender, to its handler in ``HANDLERS``. Any other kind
        breaks the protocol."""
        handler = self.HANDLERS.get(type(frame))
        if handler is None:
            raise wire.ProtocolError(f"{peer}: a {frame.kind} frame, which a sender does not send", peer=str(peer))
        handler(self, peer, frame)

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
            raise wire.ProtocolError(
                f"{_name(source)} wrote outside a request's lease: {outside}",
                request_ids=getattr(outside, "request_ids", ()),
                peer=_name(source),
            )

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
            wire.handshake(self._sock, key, wire.ROLE_SENDER, timeout, where.url())
        except AuthenticationError as err:
            who = wire.peer_name(self._sock)
            self._sock.close()
            if err.stalled:  # connected all along: alive, but its threads did not run the handshake
                raise TransferError(
                    f"cannot reach the receiver at {address} ({who}): it is connected but did not complete the "
                    f"handshake within {timeout:g} s: a starved, stopped or stuck process",
                    peer=address,
                ) from err
            raise TransferError(f"cannot reach the receiver at {address} ({who}): {err}", peer=address) from err
        self._channel = wire.Channel(self._sock)  # sends block, cut off after wire.SEND_SECONDS without progress
        self.peer = f"receiver at {where.url()} ({wire.peer_name(self._sock)})"
        self.lost: Optional[TransferError] = None
        self.cancels: list[tuple[int, int]] = []
        self.replies: deque[int] = deque()
        # Descriptors the receiver passed with its hello (a Unix socket only): the transport
        # that opens the pool takes them (`take_fds`); whatever is left is closed with us.
        self.fds: list[int] = []
        try:
            # The hello comes within the handshake's timeout, like the handshake itself: an
            # endpoint that stalls here must not hold the caller (a connect) forever.
            if self._sock.family == socket.AF_UNIX:
                first, self.fds = wire.recv_frame_fds(self._sock, deadline=time.monotonic() + timeout)
            else:
                first = self._channel.recv(timeout)
            if isinstance(first, Goodbye):
                raise TransferError(f"the {self.peer} refused the connection: {first.reason}", peer=self.peer)
            if not isinstance(first, HelloFrame):
                why = f"the {self.peer} sent a {first.kind} frame instead of its hello"
                raise wire.ProtocolError(why, peer=self.peer)
            self.hello = dict(first.pool)
        except socket.timeout as err:
            self.close()
            raise TransferError(
                f"cannot reach the {self.peer}: it is connected but sent no hello within {timeout:g} s: a starved, "
                "stopped or stuck process",
                peer=self.peer,
            ) from err
        except (OSError, EOFError, KvFerryError) as err:
            self.close()
            raise TransferError(f"cannot reach the {self.peer}: {err}", peer=self.peer) from err

    def _lose(self, err: BaseException) -> TransferError:
        if self.lost is None:
            self.lost = TransferError(f"{self.peer} went away: {err}", peer=self.peer)
        return self.lost

    def send(self, frame: Frame) -> None:
        """One frame to the receiver. A frame the codec refuses raises (nothing was sent)."""
        self._send_by(self._channel.send_frame, frame)

    def try_send(self, frame: Frame) -> bool:
        """`send`, where that waits on nothing (`wire.Channel.try_send_frame`): whether the
        frame went; False, nothing sent, where the socket takes none of it now."""
        return bool(self._send_by(self._channel.try_send_frame, frame))

    def _send_by(self, send: Callable[[bytes], Optional[bool]], frame: Frame) -> Optional[bool]:
        """``frame``, encoded, through one of the channel's sends; a failure loses the receiver."""
        if self.lost is not None:
            raise self.lost
        data = wire.encode(frame)
        try:
            return send(data)
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
                frame = self._channel.recv()
            except (OSError, EOFError) as err:
                raise self._lose(err) from err
            except KvFerryError as err:  # a frame that does not decode: nothing more is trusted
                raise self._lose(err) from None
            handler = self.HANDLERS.get(type(frame))
            if handler is None:
                raise self._lose(wire.ProtocolError(f"a {frame.kind} frame from the receiver, which it does not send"))
            handler(self, frame)

    def _on_cancel(self, frame: Cancel) -> None:
        self.cancels.extend(frame.leases)

    def _on_freed(self, frame: Freed) -> None:
        self.replies.append(frame.freed)

    def _on_goodbye(self, frame: Goodbye) -> None:
        raise self._lose(TransferError(f"it closed the connection: {frame.reason}"))

    # What a receiver may send after its hello, by frame class.
    HANDLERS: ClassVar[Mapping[type[Frame], Callable[[Any, Any], None]]] = {
        Cancel: _on_cancel,
        Freed: _on_freed,
        Goodbye: _on_goodbye,
    }

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

    def take_fds(self) -> list[int]:
        """The descriptors that came with the hello, each once; the caller closes them."""
        fds, self.fds = self.fds, []
        return fds

    def close(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
        if self.lost is None:
            # The rest of a frame `try_send` began, before the end of the connection.
            with contextlib.suppress(OSError):
                self._channel.drain()
        self._channel.close()


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
        self._nowait = False  # inside `try_post`
        # Destination ids of the writes queued and not yet posted, oldest first (writes are
        # posted or abandoned in the order they were queued).
        self._written: deque[np.ndarray] = deque()
        try:
            self.dst, self._release = open_pool(self._conn.hello)
        except BaseException:
            self._conn.close()
            raise
        for fd in self._conn.take_fds():  # passed with the hello and not taken: not ours to keep
            os.close(fd)

    def check_peer(self) -> None:
        """Raises `TransferError` (naming the receiver) once the receiver went away."""
        self._conn.check()

    def cancel_requests(self) -> list[tuple[int, int]]:
        return self._conn.take_cancels()

    def announce(self, requests: Sequence[tuple[int, int]]) -> None:
        """Tells the receiver that these ``(request_id, epoch)`` come from this sender,
        before any of their notices: if this sender dies first, the receiver fails them at
        once instead of at their timeout."""
        self._send(Announce([(int(r), int(e)) for r, e in requests]))

    def write(self, engine: CopyEngine, job: Write) -> Pending:
        pending = super().write(engine, job)
        self._written.append(np.array(job.dst_ids, dtype=np.int64).reshape(-1))
        return pending

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        keep = kept(batch, revoked)
        # The destination ids of the write these notices describe; none for a post without
        # a write (a sender that has no write to describe names no blocks). Taken once sent:
        # a post `try_post` could not make now changes nothing.
        dst = self._written[0] if self._written else None
        if dst is not None and len(keep) != len(batch):
            lengths = np.array([n.end - n.start for n in batch])
            dst = dst[np.repeat([n.request_id not in revoked for n in batch], lengths)]
        if keep:
            self._send(Notices(keep, dst))
        if self._written:
            self._written.popleft()

    def try_post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> bool:
        """`post`, where its frame fits in the connection now (`PeerConnection.try_send`)."""
        self._nowait = True
        try:
            self.post(batch, revoked)
        except WouldWait:
            return False
        finally:
            self._nowait = False
        return True

    def abandon(self, batch: Sequence[Notice]) -> None:
        if self._written:
            self._written.popleft()

    def revoke(self, request_id: int, epoch: int) -> None:
        self._send(Revoke(int(request_id), int(epoch)))

    def _send(self, frame: Frame) -> None:
        """One frame to the receiver; inside `try_post`, only where it needs no wait (else
        `WouldWait`, nothing sent: a post changes nothing before its frame is sent)."""
        if not self._nowait:
            self._conn.send(frame)
        elif not self._conn.try_send(frame):
            raise WouldWait()

    def close(self) -> None:
        """Closes the connection and releases the receiver's pool; a second close (its
        `KVSender` closed it first) does nothing."""
        if "dst" not in self.__dict__:
            return  # closed already
        self._conn.close()
        del self.dst
        self._release()


def pool_hello(pool: PagedKV, kind: str, **fields: Any) -> Hello:
    """The hello fields every transport's hello shares (the pool's geometry and size), and
    ``kind``'s own."""
    return {
        "geometry": pool.geometry(),
        "num_blocks": pool.num_blocks,
        "block_dim": pool.block_dim,
        "kind": kind,
        **fields,
    }
