"""The rendezvous: how a prefill request learns its destination blocks on the decode server.

```
decode worker (Rendezvous)                         prefill scheduler / worker (client.Client)
publish(T, destination)  <- the decode request's blocks are allocated and expected
            <-- kvferry's mutual handshake (transports/wire.py: HMAC-SHA256 both ways),
                once per connection: every question below rides on it, numbered (call) --
            <-- lookup (T, wait_ms, S)
            --> destination {...}   once T is published, with the URL of sender S's own
                                    endpoint; or refused (why: taken, abandoned, ended, none
                                    within the wait, no endpoint for S). None within the
                                    wait also marks T abandoned: the prefill side gives it
                                    up, so a decode request publishing it later fails at once
            <-- abandon (T, reason, epoch)   the prefill side gave up before its worker
                                      wrote anything of T (it sends no abandon after): the
                                      decode side frees T's blocks at once, no fence due.
                                      Once T is taken, only the request that took it may
                                      (it names the epoch of the destination it got);
            --> abandoned             another's abandon is refused and changes nothing
```
Under a router that speaks NixlConnector's protocol the prefill server cannot know its decode
server; the decode server learns the prefill server's address from its request instead, and
offers its rendezvous to the prefill server's own (one listens in every prefill server's
scheduler, taking offers only), which then looks its destination up as above:

```
decode scheduler                                   prefill scheduler (Rendezvous, on_offer)
            -- offer (T, every decode rank's rendezvous, their signature) -->
            <-- accepted, or refused (why)
```
It listens on a ``unix://`` socket (the default: a fresh 0700 directory) or ``tcp://host:port``
(loopback unless told otherwise; a wildcard bind needs ``advertise``), by wire's rules.
Every message is a frame of kvferry's binary codec (the same header and handshake as the
transports' control channels, ``wire.Channel``; its own set of frames, kvferry.vllm.frames
and rust/src/wire/rendezvous.rs), read only after both sides proved they hold the key, with
bodies of at most 1 MiB; every frame but the handshake's and the goodbye ends with
``call`` (u32), the question's number on its connection, which its answer repeats:

```
lookup       transfer (1-1024 bytes UTF-8) | wait_ms u32 (<= 3600000) | sender (1-128 bytes)
destination  request_id i64 | epoch i64 | prompt_len i64 (each >= 0) | block_size u32 (> 0)
             | held_blocks i64 (<= the ids) | dst_blocks (<= 2^20 ids >= 0) | digest (1-64
             lower-case hex) | engine (a name) | endpoint (URL, 1-1024 bytes, no control chars;
             several, tried in order: kvferry.vllm.paths.choice_url)
refused      why (1-4096 bytes)        abandon  transfer | reason (<= 1024 bytes) | epoch i64 (>= 0)
abandoned    (call only)               goodbye  why the connection closes
offer        transfer | peer (1-4096 bytes) | peer_mac (64 lower-case hex)
accepted     (call only)
```
The core checks every field of every frame, both ways, before Python sees it: nothing from
the socket is ever unpickled or parsed as JSON. A frame that does not decode, or one the
rendezvous does not take (anything but a lookup or an abandon), ends that connection with a
goodbye naming the reason; the rendezvous serves the others on. A transfer id is handed to
one lookup only (a second prefill request naming it is refused), so no decode block is
written by two senders; and once handed out, only the request that took it can give it up
(an abandon naming the destination's epoch): a prefill request that named the same id but
took nothing (a client's second request, aborted) cannot make the decode side free blocks
the taker is still writing. At most ``max_connections`` authenticated connections are
served at once (`MAX_CONNECTIONS`, a thread each; one more is answered with a refusal naming
the bound); one with no question pending that sends nothing for `IDLE_SECONDS` is closed.

A connection's thread reads its questions and answers each at once, except a lookup that
must wait: that one is parked (no thread holds it) until its transfer is published,
withdrawn or abandoned, or its wait ends, when the watcher thread looks at it again. A
lookup that takes a destination is answered by one of `MAKERS` endpoint threads, which make
the sender's endpoint first (a ring, a listener, with NIXL a registration): the decode step
that publishes never makes one, and one engine's slow endpoint holds up no other answer.
Answers are queued (`QUEUE_BYTES` per connection), never waited for.
Each prefill engine ``S`` (its vLLM engine id) gets an endpoint of its own: a staging ring
has one writer.

Names may be published as `Alternatives` of one another: one decode request published once
for each kind of prefill server that may send it (a decode server taking prefill servers of
several tensor parallel sizes publishes each size's names). The first lookup that takes one
of them chooses its alternative, under the rendezvous's lock: the other alternatives' names
are withdrawn then (a lookup of one is refused) and are never handed out, so two kinds of
sender never both learn one request's blocks:

```
published  T (alternative 1)   T@p0of2, T@p1of2 (alternative 2)
lookup T@p0of2 from S@p0of2 -> taken; alternative 2 chosen: T withdrawn
lookup T from S'            -> refused (ended: alternative 2 was chosen)
lookup T@p1of2 from S@p1of2 -> taken (the chosen alternative's other name)
```
A lookup takes a name of an alternative only when its sender is of that alternative
(``alternative_of(sender)``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import tempfile
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Mapping, Optional

from kvferry import affinity
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.transports import guard, wire
from kvferry.transports.frames import Frame
from kvferry.vllm import client
from kvferry.vllm.client import Client
from kvferry.vllm.frames import (
    PUBLISHED_KEYS,
    RENDEZVOUS,
    Abandon,
    Abandoned,
    Accepted,
    Destination,
    Lookup,
    Offer,
    Refused,
)

# How a lookup that no decode request published within its wait is refused: the decode
# server had not admitted its request, and computes that request itself once it does (a
# router such as kvferry proxy then keeps the decode leg).
UNCLAIMED = "no decode request expected it within"

__all__ = ["Alternatives", "InvalidDestinationError", "Rendezvous", "abandon", "lookup", "offer"]

logger = logging.getLogger("kvferry.vllm")
# Failed handshakes and accept errors: a flood of them logs a few lines, then a count.
_log = guard.RateLimitedLog(logger)

MAX_FRAME = 1 << 20
# A connecting peer's handshake: as long as a client waits for it (kvferry.vllm.client), so
# a client whose own threads were starved mid-handshake is not cut off while it waits. A
# peer without the key holds a thread this long at most, and no more than guard's bounds of
# them at once (the oldest is cut off for a newcomer).
HANDSHAKE_SECONDS = client.PATIENCE_SECONDS
# Authenticated connections served at once, each with a thread (a prefill process keeps one
# per rendezvous it asks; a waiting lookup holds none). One more is refused.
MAX_CONNECTIONS = 1024
# A connection with no question pending that sends nothing for this long is closed (a
# client closes its own idle line sooner: client.LINE_IDLE_SECONDS).
IDLE_SECONDS = 60.0
# Questions of one connection waiting at once (parked lookups, destinations being
# finished); one more is refused by name.
MAX_PENDING = 16384
# Answers waiting for a peer that does not read, per connection, before it is cut off.
QUEUE_BYTES = 16 << 20
# Threads that finish taken destinations (make the sender's endpoint, answer).
MAKERS = 4
GONE_KEPT = 4096  # transfers that ended, remembered so a late lookup fails at once
MAX_WAIT_SECONDS = 3600
# The codec's bounds (rust/src/wire/rendezvous.rs): a refusal's text, an abandon's reason.
MAX_ERROR_BYTES = 4096
MAX_REASON_BYTES = 1000
# What a destination carries besides the endpoint (the codec's `destination` frame).
DESTINATION_KEYS = PUBLISHED_KEYS


class _Peer:
    """One authenticated connection being served: its channel (answers are queued, never
    waited for) and, under the rendezvous's lock, its questions not answered yet."""

    def __init__(self, channel: wire.Channel) -> None:
        self.channel = channel
        self.pending = 0
        self.gone = False

    def answer(self, frame: Frame) -> None:
        try:
            self.channel.send_frame(wire.encode(frame, RENDEZVOUS))
        except OSError:  # gone, or cut off for not reading: its reader ends the connection
            pass


@dataclass(eq=False)
class _Parked:
    """A lookup waiting for its transfer to be published (or withdrawn, abandoned), or for
    its ``deadline`` (monotonic)."""

    peer: _Peer
    call: int
    transfer: str
    sender: str
    wait: float
    deadline: float


class InvalidDestinationError(TransferError, InvalidArgumentError):
    """A destination the wire's ``destination`` frame cannot carry: a `TransferError` (the
    decode worker fails that request by it) whose message names the field."""


def _clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, on a character boundary."""
    return text.encode()[:limit].decode(errors="ignore")


def _check_destination(transfer: str, destination: dict[str, Any]) -> None:
    """Raises `InvalidDestinationError` for a destination the wire's ``destination`` frame
    cannot carry (a missing or extra key, a field out of its bounds), naming the field."""
    keys = set(destination)
    if keys != DESTINATION_KEYS:
        raise InvalidDestinationError(
            f"invalid destination for transfer {transfer!r}: keys {sorted(keys)}, must be "
            f"{sorted(DESTINATION_KEYS)}"
            f" (missing {sorted(DESTINATION_KEYS - keys)}, unknown {sorted(keys - DESTINATION_KEYS)})"
        )
    try:  # checked now, not at the lookup: the endpoint is the only field added later
        wire.encode(Destination(**dict(destination, endpoint="unix:///checked")), RENDEZVOUS)
    except (InvalidArgumentError, TypeError) as err:
        raise InvalidDestinationError(f"invalid destination for transfer {transfer!r}: {err}") from None


class Alternatives:
    """Names published as alternatives of one another (`Rendezvous.publish` with
    ``among=``): the first lookup that takes one of them chooses its alternative. ``what``
    says what tells the prefill servers of one alternative apart, for the refusals (e.g.
    "tensor parallel size").
    Its state belongs to the rendezvous that published the names: read it with
    `Rendezvous.chosen`."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.chosen: Optional[Hashable] = None
        self.names: dict[str, Hashable] = {}  # each name published -> its alternative

    def why_not(self, alternative: Hashable) -> str:
        return f"its decode request was taken by prefill servers of {self.what} {self.chosen!r}, not {alternative!r}"


class Rendezvous:
    """Owned by the decode worker: publishes each expected transfer's destination and
    collects the transfers prefill sides abandoned."""

    def __init__(
        self,
        authkey: bytes,
        endpoint_for: Callable[[str], str],
        directory: Optional[str] = None,
        *,
        listen: str = "unix://",
        advertise: Optional[str] = None,
        admit: Optional[Callable[[str], Optional[str]]] = None,
        alternative_of: Optional[Callable[[str], Hashable]] = None,
        on_offer: Optional[Callable[[str, str, str], Optional[str]]] = None,
        max_connections: int = MAX_CONNECTIONS,
        family_of: Optional[Callable[[str], str]] = None,
        not_in_family: Optional[Callable[[str, frozenset[str]], str]] = None,
    ) -> None:
        """``endpoint_for(sender)``: the URL of that prefill engine's endpoint (made on its
        first lookup). ``listen``: ``unix://`` (a socket in a fresh 0700 directory under
        ``directory``), ``unix:///path`` or ``tcp://host:port``; ``advertise``: the host a
        wildcard bind is reached by. ``admit(sender)``: why a lookup from that prefill
        engine is refused at once (before it waits), or None. ``alternative_of(sender)``: the
        alternative (`Alternatives`) of the names that prefill engine may take.
        ``family_of(name)``: the transfer a published name is a part of (its prefill rank's
        part); once a transfer's parts are published, a lookup of a part of it that was not is
        refused at once, saying ``not_in_family(sender, names published)``, instead of
        waiting for a publish that will not come.
        ``on_offer(transfer, peer, peer_mac)``: a prefill server's rendezvous takes offers
        (returns why one is refused, or None); without it an offer is refused.
        ``max_connections``: authenticated connections served at once. ``address`` is the URL
        peers connect to."""
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections <= 0:
            raise InvalidArgumentError(f"invalid max_connections={max_connections!r}: must be an int > 0")
        self.max_connections = max_connections
        self._connections = 0  # authenticated, being served
        self._admit = admit
        self._on_offer_cb = on_offer
        self._alternative_of = alternative_of
        self._family_of = family_of
        self._not_in_family = not_in_family
        self._authkey = wire.check_authkey(authkey)
        self._endpoint_for = endpoint_for
        where = wire.parse_address(listen, "kv_connector_extra_config listen")
        self._dir: Optional[str] = None
        if where.scheme == "unix" and not where.path:
            self._dir = tempfile.mkdtemp(prefix="kvferry-vllm-", dir=directory)  # 0700
            where = wire.Address("unix", path=os.path.join(self._dir, "rendezvous.sock"))
        try:
            self._listener, bound, _ = wire.listen(where, advertise=advertise)
        except OSError as err:
            raise KvFerryError(f"cannot listen on kv_connector_extra_config listen={listen!r}: {err}") from err
        self.address = bound.url()
        self._unix_path = bound.path if bound.scheme == "unix" else None
        self._cond = threading.Condition()
        self._published: dict[str, dict[str, Any]] = {}
        self._taken: dict[str, str] = {}  # transfer -> the prefill engine that took it
        self._epochs: dict[str, int] = {}  # transfer taken -> its destination's epoch (who may abandon it)
        self._reserved: dict[str, str] = {}  # transfer offered again (`republish`) -> the only engine that may take it
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._abandoned: dict[str, str] = {}
        self._abandons: deque[str] = deque(maxlen=GONE_KEPT)  # abandoned since the last take_abandoned
        # Each name published among alternatives (until withdrawn): its group and alternative.
        self._among: dict[str, tuple[Alternatives, Hashable]] = {}
        self._choices: deque[str] = deque(maxlen=GONE_KEPT)  # names whose take chose, since the last take_chosen
        # Each transfer's names published (with family_of), the latest GONE_KEPT transfers.
        self._families: OrderedDict[str, set[str]] = OrderedDict()
        # Lookups waiting for their transfer, by name; their deadlines (a heap); the names
        # (and families) whose state changed since the watcher last looked.
        self._parked: dict[str, list[_Parked]] = {}
        self._deadlines: list[tuple[float, int, _Parked]] = []
        self._seq = itertools.count()
        self._dirty: set[str] = set()
        self._dirty_families: set[str] = set()
        self._dropped = False  # a connection with parked lookups ended
        self._closing = False
        self._stop = threading.Event()  # the accept loop's: set with _closing
        self._admission = guard.Admission()
        self._makers = ThreadPoolExecutor(
            max_workers=MAKERS,
            thread_name_prefix="kvferry-rendezvous-endpoint",
            initializer=affinity.pin_current_thread,
        )
        self._watcher = affinity.Thread(target=self._watch, name="kvferry-rendezvous-parked", daemon=True)
        self._watcher.start()
        self._thread = affinity.Thread(target=self._serve, name="kvferry-rendezvous", daemon=True)
        self._thread.start()

    def publish(
        self,
        transfer: str,
        destination: dict[str, Any],
        *,
        among: Optional[Alternatives] = None,
        alternative: Hashable = None,
    ) -> None:
        """Makes ``transfer``'s destination available to one lookup. Raises `TransferError`
        when the id is live already (two decode requests named the same transfer), and
        `InvalidDestinationError` (a `TransferError` too) for a destination the wire's ``destination`` frame cannot
        carry (a missing or extra key, a field out of its bounds), naming the field. With
        ``among``: one of ``alternative``'s names; if another alternative was chosen already,
        it is withdrawn at once (never handed out)."""
        _check_destination(transfer, destination)
        with self._cond:
            if transfer in self._published or transfer in self._taken:
                raise TransferError(f"transfer {transfer!r} is already expected by another decode request")
            self._gone.pop(transfer, None)
            if self._family_of is not None:
                family = self._family_of(transfer)
                self._families.setdefault(family, set()).add(transfer)
                self._families.move_to_end(family)
                self._dirty_families.add(family)  # a lookup of a name it lacks may be refused now
                while len(self._families) > GONE_KEPT:
                    self._families.popitem(last=False)
            if among is not None:
                among.names[transfer] = alternative
                self._among[transfer] = (among, alternative)
                if among.chosen is not None and among.chosen != alternative:
                    self._end(transfer, among.why_not(alternative))  # a lookup waiting for it is refused
                    return
            self._published[transfer] = destination
            self._changed(transfer)

    def republish(self, transfer: str, destination: dict[str, Any]) -> None:
        """Offers a taken transfer again, under ``destination``'s new epoch: its sender revoked
        it before all its blocks arrived (a prefill engine preempted the request; its fence
        came, so no write of the old epoch lands any more). Only the prefill engine that took
        it may take it again: it looks it up once it computes the request again. Raises
        `TransferError` for a transfer not taken, `InvalidDestinationError` as `publish`."""
        _check_destination(transfer, destination)
        with self._cond:
            taker = self._taken.pop(transfer, None)
            if taker is None:
                raise TransferError(f"transfer {transfer!r} is not taken: nothing to offer again")
            self._epochs.pop(transfer, None)
            self._reserved[transfer] = taker
            self._published[transfer] = destination
            self._changed(transfer)

    def withdraw(self, transfer: str, reason: str) -> None:
        """The transfer ended here (arrived, failed, aborted): a lookup still to come fails."""
        with self._cond:
            self._published.pop(transfer, None)
            self._taken.pop(transfer, None)
            self._epochs.pop(transfer, None)
            self._reserved.pop(transfer, None)
            self._abandoned.pop(transfer, None)
            among = self._among.pop(transfer, None)
            if among is not None:
                among[0].names.pop(transfer, None)
            self._end(transfer, reason)

    def _end(self, transfer: str, reason: str) -> None:
        """Under the lock: a lookup of ``transfer`` is refused from now on, saying ``reason``."""
        self._gone[transfer] = reason
        while len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)
        self._changed(transfer)

    def withdraw_untaken(self, transfer: str, reason: str) -> bool:
        """Withdraws ``transfer`` if no lookup took its destination yet; returns whether it
        did (then no sender ever learnt its blocks, so none can write them). A name among
        alternatives of which another was chosen never was, nor will be, handed out: it is
        withdrawn too."""
        with self._cond:  # an RLock: withdraw takes it again, so no lookup slips in between
            among = self._among.get(transfer)
            if among is not None and among[0].chosen not in (None, among[1]):
                self.withdraw(transfer, reason)
                return True
            if transfer in self._taken or transfer not in self._published:
                return False
            self.withdraw(transfer, reason)
            return True

    def chosen(self, among: Alternatives) -> Optional[Hashable]:
        """The alternative of ``among`` a lookup chose (it took one of its names), or None."""
        with self._cond:
            return among.chosen

    def take_chosen(self) -> list[str]:
        """The names whose take chose their alternative since the last call (one per group of
        alternatives): the decode worker looks at these each step, not at every request."""
        with self._cond:
            names = list(self._choices)
            self._choices.clear()
        return names

    def taker(self, transfer: str) -> Optional[str]:
        """The prefill engine whose lookup took ``transfer``'s destination, or ``None``."""
        with self._cond:
            return self._taken.get(transfer)

    def takers(self) -> set[str]:
        """The prefill engines holding a destination here now (taken, not yet withdrawn)."""
        with self._cond:
            return set(self._taken.values())

    def abandoned(self, transfer: str) -> Optional[str]:
        """Why the prefill side gave ``transfer`` up, or ``None``."""
        with self._cond:
            return self._abandoned.get(transfer)

    @property
    def connections(self) -> int:
        """Authenticated connections being served now (at most ``max_connections``)."""
        with self._cond:
            return self._connections

    def take_abandoned(self) -> list[str]:
        """The transfers abandoned since the last call: the decode worker looks at these each
        step, not at every transfer it holds (one it publishes later it asks `abandoned`)."""
        with self._cond:
            taken = list(self._abandons)
            self._abandons.clear()
        return taken

    def _serve(self) -> None:
        guard.accept_loop(
            self._listener, self._stop, self._start, admission=self._admission, failed=self._accept_failed
        )

    def _accept_failed(self, what: str, err: BaseException) -> None:
        _log.warning(what, "kvferry: the rendezvous at %s: %s", self.address, guard.describe(what, err))

    def _start(self, conn: socket.socket) -> None:
        """A connection's handshake counts against the admission bound (kvferry.transports.guard)."""

        def cut_off() -> None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        ticket = self._admission.admit(guard.source_of(conn), cut_off)
        try:
            name = "kvferry-rendezvous-conn"
            thread = affinity.Thread(target=self._pump, args=(conn, ticket), name=name, daemon=True)
            thread.start()
        except BaseException:
            self._admission.settle(ticket)
            raise

    def _pump(self, conn: socket.socket, ticket: int) -> None:
        """One connection: its handshake, then its questions, each handled at once (a lookup
        that must wait is parked, `_park`, and this thread reads the next question)."""
        served = False
        peer: Optional[_Peer] = None
        try:
            try:
                wire.tune(conn)
                wire.handshake(conn, self._authkey, wire.ROLE_ENDPOINT, HANDSHAKE_SECONDS, self.address)
            except wire.AuthenticationError as err:
                _log.warning(
                    "refused",
                    "kvferry: a connection to the rendezvous at %s failed authentication%s: %s",
                    self.address,
                    " (a peer with another key?)" if err.wrong_key else " (no complete handshake: a busy or gone peer)",
                    err,
                )
                return
            finally:
                self._admission.settle(ticket)
            with self._cond:
                served = self._connections < self.max_connections and not self._closing
                if served:
                    self._connections += 1
            if not served:  # its question is read (a client sends one at once) and refused by name
                channel = wire.Channel(conn, MAX_FRAME, RENDEZVOUS)
                why = f"the rendezvous serves at most {self.max_connections} connections at once (max_connections)"
                _log.warning("full", "kvferry: the rendezvous at %s: %s; one more refused", self.address, why)
                frame = channel.recv(IDLE_SECONDS)
                channel.send_frame(wire.encode(Refused(why, call=getattr(frame, "call", 0)), RENDEZVOUS))
                return
            # Answers are queued, never waited for: the thread that answers (this one, the
            # parked lookups' or an endpoint maker) never waits on a peer that stopped reading.
            peer = _Peer(wire.Channel(conn, MAX_FRAME, RENDEZVOUS, queue_bytes=QUEUE_BYTES))
            self._serve_questions(conn, peer)
        except (EOFError, OSError):  # the peer went away (or stopped reading): the connection ends
            pass
        except Exception:  # a bug here: this connection ends, the rendezvous serves on
            logger.exception("kvferry: the rendezvous at %s dropped a connection", self.address)
        finally:
            if served:
                with self._cond:
                    self._connections -= 1
                    if peer is not None:
                        peer.gone = True
                        if peer.pending:  # its parked lookups are dropped: nobody to answer, nothing taken
                            self._dropped = True
                            self._cond.notify_all()
            conn.close()

    def _serve_questions(self, conn: socket.socket, peer: _Peer) -> None:
        channel = peer.channel
        while True:
            if not channel.poll(IDLE_SECONDS):
                with self._cond:
                    if peer.pending and not self._closing:
                        continue  # a lookup of its own waits: the connection is not idle
                channel.goodbye(f"closed: no frame within {IDLE_SECONDS:g} s and no question pending")
                return
            try:
                frame = channel.recv(None)  # its first byte is here: the rest within frame_timeout
            except wire.ProtocolError as err:
                logger.warning("kvferry: the rendezvous at %s drops %s: %s", self.address, wire.peer_name(conn), err)
                channel.goodbye(f"disconnected: {err}")
                return
            except socket.timeout:
                channel.goodbye(f"disconnected: a frame begun and not finished within {channel.frame_timeout:g} s")
                return
            handler = self.HANDLERS.get(type(frame))
            if handler is None:
                why = f"a {frame.kind} frame, which the rendezvous does not take (only lookup, abandon and offer)"
                logger.warning("kvferry: the rendezvous at %s drops %s: %s", self.address, wire.peer_name(conn), why)
                channel.goodbye(f"disconnected: {why}")
                return
            handler(self, peer, frame)

    def _on_lookup(self, peer: _Peer, frame: Lookup) -> None:
        transfer, sender, call = frame.transfer, frame.sender, frame.call
        logger.debug("kvferry: the rendezvous at %s: lookup of %s from %s", self.address, transfer, sender)
        if self._admit is not None and (why := self._admit(sender)) is not None:
            peer.answer(_refused(f"transfer {transfer!r}: {why}", call))
            return
        wait = frame.wait_ms / 1000
        parked = _Parked(peer, call, transfer, sender, wait, time.monotonic() + wait)
        with self._cond:
            outcome = self._try(parked, due=wait <= 0 or self._closing)
            if outcome is None:
                if peer.pending >= MAX_PENDING:
                    outcome = (
                        f"transfer {transfer!r}: this connection has {peer.pending} questions waiting already, "
                        f"the most the rendezvous keeps for one (MAX_PENDING={MAX_PENDING})"
                    )
                else:
                    self._park(parked)
                    return
            peer.pending += 1
        self._settle(parked, outcome)

    def _park(self, parked: _Parked) -> None:
        """(lock held) ``parked`` waits, holding no thread, until its transfer changes (a
        publish, withdraw or abandon marks it) or its deadline; `_watch` looks again then."""
        parked.peer.pending += 1
        self._parked.setdefault(parked.transfer, []).append(parked)
        heapq.heappush(self._deadlines, (parked.deadline, next(self._seq), parked))
        self._cond.notify_all()

    def _changed(self, transfer: str) -> None:
        """(lock held) ``transfer``'s state changed: a lookup parked for it looks again."""
        if transfer in self._parked:
            self._dirty.add(transfer)
        self._cond.notify_all()

    def _watch(self) -> None:
        """The parked lookups' thread: looks again at those whose transfer changed or whose
        deadline passed; what it takes is finished on `_makers` (an endpoint may take long to
        make), what it refuses is answered at once (answers are queued, never waited for)."""
        while True:
            settled: list[tuple[_Parked, Any]] = []
            with self._cond:
                while not (self._dirty or self._dirty_families or self._closing or self._due() or self._dropped):
                    self._cond.wait(None if not self._deadlines else max(0.0, self._deadlines[0][0] - time.monotonic()))
                now = time.monotonic()
                names, self._dirty = self._dirty, set()
                while self._deadlines and (self._deadlines[0][0] <= now or self._closing):
                    names.add(heapq.heappop(self._deadlines)[2].transfer)
                for name in names | self._stale_names():
                    still = []
                    for parked in self._parked.get(name, ()):
                        if parked.peer.gone:
                            continue  # its connection ended: nobody to answer, nothing taken
                        outcome = self._try(parked, due=parked.deadline <= now or self._closing)
                        if outcome is None:
                            still.append(parked)
                        else:
                            settled.append((parked, outcome))
                    if still:
                        self._parked[name] = still
                    else:
                        self._parked.pop(name, None)
                if len(self._deadlines) > 2 * sum(map(len, self._parked.values())) + 64:
                    # Deadlines of lookups answered early: dropped now and then, not one by one.
                    self._deadlines = [d for d in self._deadlines if d[2].transfer in self._parked]
                    heapq.heapify(self._deadlines)
                done = self._closing and not self._parked
            for parked, outcome in settled:
                self._settle(parked, outcome)
            if done:
                return

    def _due(self) -> bool:
        return bool(self._deadlines) and self._deadlines[0][0] <= time.monotonic()

    def _stale_names(self) -> set[str]:
        """(lock held) Names with a parked lookup of a connection that ended (dropped now),
        and, when a family changed, every parked name of it."""
        names: set[str] = set()
        if self._dropped:
            self._dropped = False
            names.update(name for name, waiting in self._parked.items() if any(p.peer.gone for p in waiting))
        if self._dirty_families and self._family_of is not None:
            families, self._dirty_families = self._dirty_families, set()
            names.update(name for name in self._parked if self._family_of(name) in families)
        return names

    def _settle(self, parked: _Parked, outcome: Any) -> None:
        """Answers a lookup that `_try` settled: a refusal at once, a destination taken on
        an endpoint maker's thread (never the caller's: publish may be an engine's step)."""
        if isinstance(outcome, str):
            self._answered(parked.peer, _refused(outcome, parked.call))
        else:
            self._makers.submit(self._finish, parked, outcome)

    def _answered(self, peer: _Peer, frame: Frame) -> None:
        peer.answer(frame)
        with self._cond:
            peer.pending -= 1

    def _finish(self, parked: _Parked, published: dict[str, Any]) -> None:
        """The destination a lookup took, with its sender's endpoint (made or found here,
        outside the lock: making one, a ring or a registration, must hold up no other lookup)."""
        transfer, sender = parked.transfer, parked.sender
        frame: Frame
        try:
            endpoint = self._endpoint_for(sender)
        except Exception as err:  # no room for another endpoint: this lookup fails, not the server
            why = self._refuse_taken(transfer, sender, f"no endpoint for prefill engine {sender!r}: {err}")
            self._answered(parked.peer, _refused(why, parked.call))
            return
        try:  # publish checked every other field: only the endpoint can be refused
            frame = Destination(**dict(published, endpoint=endpoint, call=parked.call))
            wire.encode(frame, RENDEZVOUS)
        except (InvalidArgumentError, TypeError) as err:
            why = self._refuse_taken(transfer, sender, f"no usable endpoint for prefill engine {sender!r}: {err}")
            frame = _refused(why, parked.call)
        self._answered(parked.peer, frame)

    def _on_abandon(self, peer: _Peer, frame: Abandon) -> None:
        why = self._abandon(frame.transfer, frame.reason, frame.epoch)
        if why is not None:
            logger.warning("kvferry: the rendezvous at %s refused an abandon: %s", self.address, why)
            peer.answer(_refused(why, frame.call))
            return
        peer.answer(Abandoned(call=frame.call))

    def _on_offer(self, peer: _Peer, frame: Offer) -> None:
        logger.debug("kvferry: the rendezvous at %s: offer of %s", self.address, frame.transfer)
        why: Optional[str]
        if self._on_offer_cb is None:
            why = "this is a decode server's rendezvous: it takes lookups and abandons, not offers"
        else:
            why = self._on_offer_cb(frame.transfer, frame.peer, frame.peer_mac)
        if why is not None:
            peer.answer(_refused(f"transfer {frame.transfer!r}: {why}", frame.call))
            return
        peer.answer(Accepted(call=frame.call))

    # What a peer may send, by frame class: each handler answers it (or parks it).
    HANDLERS: ClassVar[Mapping[type[Frame], Callable[[Any, _Peer, Any], None]]] = {
        Lookup: _on_lookup,
        Abandon: _on_abandon,
        Offer: _on_offer,
    }

    def _abandon(self, transfer: str, reason: str, epoch: int = 0) -> Optional[str]:
        """Records that the prefill side gave ``transfer`` up, or says why it may not: a
        transfer taken already is given up only by the request that took it, which names its
        destination's ``epoch`` (the decode side then frees its blocks as never written, so a
        stranger's abandon would free blocks the taker may be writing). Wakes a lookup
        waiting for it, which is refused."""
        with self._cond:
            if transfer in self._taken and epoch != self._epochs.get(transfer):
                return (
                    f"transfer {transfer!r} was taken by a prefill request; only that request may abandon it"
                    f" (this abandon names epoch {epoch}, not its destination's)"
                )
            # Kept even before the decode request published it (the prefill request may be
            # aborted first): the decode worker asks about each transfer it holds.
            self._abandoned[transfer] = reason or "no reason given"
            self._abandons.append(transfer)
            while len(self._abandoned) > GONE_KEPT:
                del self._abandoned[next(iter(self._abandoned))]
            self._changed(transfer)
        return None

    def _try(self, parked: _Parked, due: bool) -> Any:
        """(lock held) Settles the lookup ``parked`` if it can: why it is refused (a str), or
        the published destination it took (a dict); None while it must wait. ``due``: its
        wait is over (or the rendezvous closes): it is refused rather than left waiting."""
        transfer, sender, wait = parked.transfer, parked.sender, parked.wait
        if transfer in self._abandoned:
            return f"transfer {transfer!r} was abandoned: {self._abandoned[transfer]}"
        taker = self._taken.get(transfer)
        if taker is not None and taker != sender:
            return f"transfer {transfer!r} was already taken by another prefill request"
        # Its own taker looking it up again (it preempted the request and computed it
        # again) waits for `republish`, once its revoke reached the decode server.
        if transfer in self._published:  # (never both published and taken)
            if self._reserved.get(transfer, sender) != sender:
                return f"transfer {transfer!r} was taken by another prefill engine"
            why = self._choose(transfer, sender)
            if why is not None:
                return f"transfer {transfer!r}: {why}"
            published = self._published.pop(transfer)
            self._reserved.pop(transfer, None)
            self._taken[transfer] = sender
            self._epochs[transfer] = int(published["epoch"])
            return published
        if transfer in self._gone:
            return f"transfer {transfer!r} ended on the decode server: {self._gone[transfer]}"
        stranger = self._stranger(transfer, sender)
        if stranger is not None:
            return f"transfer {transfer!r}: {stranger}"
        if not due:
            return None
        if taker is not None:
            return (
                f"transfer {transfer!r}: this prefill engine took it, and its decode server did not offer it"
                f" again within {wait:g} s"
            )
        if not self._closing:
            # The prefill side gives the transfer up with this answer: a decode request that
            # names it later fails at once, not at its own timeout.
            self._abandon(transfer, f"no destination within its {wait:g} s wait")  # (an RLock)
        return f"transfer {transfer!r}: {UNCLAIMED} {wait:g} s"

    def _stranger(self, transfer: str, sender: str) -> Optional[str]:
        """Under the lock: why a lookup of ``transfer``, not published, will never find it (its
        transfer's other parts were published, this one was not), or None."""
        if self._family_of is None:
            return None
        names = self._families.get(self._family_of(transfer))
        if not names or transfer in names:
            return None
        if self._not_in_family is None:
            return f"its decode request published only {sorted(names)}"
        return self._not_in_family(sender, frozenset(names))

    def _choose(self, transfer: str, sender: str) -> Optional[str]:
        """Under the lock, before a lookup from ``sender`` takes the published ``transfer``:
        why it may not (a name of another alternative than the sender's), or None. The first
        take of a group's name chooses its alternative and withdraws the other alternatives'
        names, in the same critical section: no lookup can take one of them after this."""
        among = self._among.get(transfer)
        if among is None:
            return None
        group, alternative = among
        mine = self._alternative_of(sender) if self._alternative_of is not None else alternative
        if mine != alternative:
            return f"a name for prefill servers of {group.what} {alternative!r}; prefill engine {sender!r} has {mine!r}"
        if group.chosen is None:
            group.chosen = alternative
            self._choices.append(transfer)
            for name, other in group.names.items():
                if other != alternative and name in self._published:
                    del self._published[name]
                    self._end(name, group.why_not(other))
        return None  # group.chosen == alternative: the others' names were withdrawn when it was chosen

    def _refuse_taken(self, transfer: str, sender: str, reason: str) -> str:
        """Gives back a destination ``sender`` took but cannot use: nothing can reach its
        blocks, so its decode request fails now (abandoned), not at its timeout. Returns
        ``reason``, the refusal's."""
        with self._cond:
            self._abandoned[transfer] = reason
            if self._taken.get(transfer) == sender:
                del self._taken[transfer]
                self._epochs.pop(transfer, None)
            self._changed(transfer)
        return reason

    def close(self) -> None:
        """Stops taking connections; every parked lookup is refused (its transfer is not
        marked abandoned: the decode side is going away, not the prefill side)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._watcher.join(timeout=5)
        self._makers.shutdown(wait=False)
        self._listener.close()
        if self._unix_path is not None:
            try:
                os.unlink(self._unix_path)
            except OSError:
                pass
        if self._dir is not None:
            try:
                os.rmdir(self._dir)
            except OSError:
                pass


def _refused(why: str, call: int) -> Refused:
    return Refused(_clip(why, MAX_ERROR_BYTES), call=call)


def lookup(address: str, authkey: bytes, transfer: str, wait_s: float, sender: str) -> dict[str, Any]:
    """Blocks until the decode server published ``transfer``'s destination (at most
    ``wait_s``, in [0, 3600]); returns it (the published keys and ``endpoint``), or raises
    `TransferError` with the decode side's reason. A transfer or sender the wire cannot
    carry (empty, too long) raises `InvalidArgumentError` before anything is sent. One
    connection of its own: a process asking often keeps a `client.Client` instead."""
    with Client(authkey) as client:
        return client.lookup(address, transfer, wait_s, sender).result()


def abandon(address: str, authkey: bytes, transfer: str, reason: str, epoch: int = 0) -> None:
    """Tells the decode server that the prefill side gave ``transfer`` up; its decode request
    then fails at once instead of at its timeout. ``epoch``: that of the destination this
    request's lookup took (0: it took none); a transfer taken by another request is not
    given up (the rendezvous refuses). Raises `TransferError` if it cannot, or is refused."""
    with Client(authkey) as client:
        client.abandon(address, transfer, reason, epoch).result()


def offer(address: str, authkey: bytes, transfer: str, peer: str, peer_mac: str) -> None:
    """Tells the prefill server whose rendezvous is at ``address`` that ``transfer``'s
    destination is published at ``peer`` (this decode server's rendezvous, one URL per rank),
    signed by ``peer_mac``. Raises `TransferError` with the prefill side's reason when it
    cannot be told or refuses."""
    with Client(authkey) as client:
        client.offer(address, transfer, peer, peer_mac).result()
