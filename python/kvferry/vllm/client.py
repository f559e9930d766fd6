"""The asking side of the rendezvous (kvferry.vllm.rendezvous): lookups, abandons and offers
over one authenticated connection per rendezvous address, kept while questions come.

```
prefill scheduler  --lookup(T1)-->  Client --.                     one handshake, one
(engine thread;    --lookup(T2)-->           |== line to address ==> connection, two threads
 never waits)      --abandon(T3)->           |   (call 1, 2, 3 ...)  per address, not per
                   <-- Future ------------ answers, in any order     request
```
Each question gets a ``call`` number on its line, and its answer names it, so a lookup that
waits for its destination holds up no other question. A line is made on its first question
(connect and kvferry's mutual handshake, on the line's own thread: the asking thread never
waits on the network) and closed once it has had nothing to ask for `LINE_IDLE_SECONDS`
(shorter than the rendezvous's own idle bound, so the rendezvous never closes a line that
a question is being written to). Every ask returns a `concurrent.futures.Future`.

What a broken line does to its questions: those not written yet wait for the next
connection; those written and not answered fail with `TransferError` (the rendezvous may
have handed the lookup its destination, and a lookup is never sent twice, so no
destination is taken twice or silently lost), as a question fails whose connection cannot
be made, or whose answer does not come within its bound (a lookup's wait plus
`PATIENCE_SECONDS`; an abandon's or offer's `PATIENCE_SECONDS`). Each of those failures is a
`NoAnswerError`: the rendezvous may never have seen the question.

How long a peer may take tracks its liveness, not a short timer: a peer that goes away
(its process ends, its host resets the connection) fails what waits on it at once, since
its connection ends; one that stays connected is slow, not gone (a loaded host, several
engine processes on a few cores, leaves a process's threads unscheduled for tens of
seconds), and is given `PATIENCE_SECONDS` for its handshake and for each answer before the
error names it as connected but not serving.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvferry import affinity
from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.transports import wire
from kvferry.transports.frames import Frame, Goodbye
from kvferry.vllm.frames import RENDEZVOUS, Abandon, Abandoned, Accepted, Destination, Lookup, Offer, Refused

__all__ = ["PATIENCE_SECONDS", "Client", "NoAnswerError", "connect"]

logger = logging.getLogger("kvferry.vllm")

MAX_FRAME = 1 << 20
# How long a peer that stays connected may take to complete its handshake, to send its
# hello, or to answer a question (the module doc: a gone peer fails at once, whatever this).
PATIENCE_SECONDS = 120.0
# A handshake slower than this completes, with a warning: the 10 s it used to be given.
SLOW_SECONDS = 10.0
MAX_WAIT_SECONDS = 3600
MAX_ERROR_BYTES = 4096
MAX_REASON_BYTES = 1000
# A line with nothing to ask closes after this; the rendezvous closes a connection with
# no question pending after its IDLE_SECONDS (60), so the two never cross.
LINE_IDLE_SECONDS = 20.0
CALLS = 1 << 32  # a call number is a u32 on the wire


def _clip(text: str, limit: int) -> str:
    return text.encode()[:limit].decode(errors="ignore")


class NoAnswerError(TransferError):
    """A question the rendezvous did not answer: its connection could not be made, broke
    before the answer, or its answer did not come within its bound. The rendezvous may never
    have seen it (unlike a refusal, which it sent)."""


def connect(
    address: str, authkey: bytes, timeout: float = PATIENCE_SECONDS, what: str = "decode server's"
) -> socket.socket:
    """A connection to the rendezvous at ``address``, through kvferry's mutual handshake;
    `TransferError` says which step failed (and, for a wrong key, what to check)."""
    try:
        where = wire.parse_address(address, "kv_transfer_params.kvferry.peer")
    except KvFerryError as err:
        raise TransferError(f"cannot reach the {what} rendezvous: {err}", peer=str(address)) from err
    try:
        sock = wire.connect(where, timeout)
    except OSError as err:
        raise TransferError(f"cannot reach the {what} rendezvous at {address!r}: {err!r}", peer=address) from err
    try:
        wire.handshake(sock, authkey, wire.ROLE_SENDER, timeout, where.url())
    except wire.AuthenticationError as err:
        who = wire.peer_name(sock)
        sock.close()
        if err.stalled:  # connected all along: alive, but its threads did not run the handshake
            raise TransferError(
                f"the {what} rendezvous at {address!r} ({who}) is connected but did not complete the handshake within "
                f"{timeout:g} s: a starved, stopped or stuck process",
                peer=address,
            ) from err
        if not err.wrong_key:  # a reset or a closed connection says nothing about the keys
            raise TransferError(
                f"no complete handshake with the {what} rendezvous at {address!r} ({who}; going away, or it cut "
                f"the handshake off): {err}",
                peer=address,
            ) from err
        raise TransferError(
            f"authentication failed with the {what} rendezvous at {address!r}: the two servers hold different "
            "keys "
            f"(kv_connector_extra_config.authkey_file must name a file with the same key on both): {err}",
            peer=address,
        ) from err
    return sock


@dataclass(eq=False)
class _Ask:
    """One question on a line: the frame (its call set when written), how long its answer
    may take once written, and how its answer or failure becomes its future's outcome."""

    frame: Lookup | Abandon | Offer
    wait_s: float
    future: Future[Any]
    answered: Callable[[Frame], Any]  # the future's result, or raises TransferError
    failed: Callable[[str], TransferError]  # a line failure (why) as the question's error
    whom: str  # "decode server" or "prefill server", for a connection's errors
    address: str
    call: int = -1
    channel: Optional[wire.Channel] = None  # the connection it was written on
    deadline: float = math.inf  # monotonic, once written
    settled: bool = field(default=False)


class _Line:
    """One address's connection and its questions. The keeper thread connects, writes
    questions and fails those past their deadline; the reader thread (one per connection)
    hands each answer to its question. Both end once the line is idle or the client closes."""

    def __init__(self, client: Client, address: str) -> None:
        self.client = client
        self.address = address
        self._cond = threading.Condition()
        self._queue: list[_Ask] = []  # not written yet
        self._sent: dict[int, _Ask] = {}  # written, by call
        self._deadlines: list[tuple[float, int, _Ask]] = []
        self._calls = itertools.count(1)
        self._channel: Optional[wire.Channel] = None
        self._closing = False
        self._idle_since = time.monotonic()
        self._keeper = affinity.Thread(target=self._keep, name="kvferry-rendezvous-line", daemon=True)
        self._keeper.start()

    def ask(self, ask: _Ask) -> bool:
        """Queues ``ask``; False if this line is closing (the client makes another)."""
        with self._cond:
            if self._closing:
                return False
            self._queue.append(ask)
            self._cond.notify_all()
        return True

    def close(self) -> None:
        """Fails its questions not answered yet and shuts its connection down now (the
        rendezvous sees it end at once), then its threads end."""
        self._fail_all("the client closed")

    def _settle(self, ask: _Ask) -> None:
        """(lock held) Takes ``ask`` off the line: whoever settles it sets its future, once,
        outside the lock."""
        ask.settled = True
        self._sent.pop(ask.call, None)

    @staticmethod
    def _finish(ask: _Ask, answer: Frame) -> None:
        """Sets ``ask``'s future from its answer (a refusal or a malformed answer: its error)."""
        try:
            ask.future.set_result(ask.answered(answer))
            return
        except TransferError as err:
            error = err
        except Exception as err:  # a malformed answer: this question fails, the line goes on
            error = TransferError(
                f"a malformed answer from the rendezvous at {ask.address!r}: {err!r}", peer=ask.address
            )
        ask.future.set_exception(error)

    def _keep(self) -> None:
        try:
            self._keep_on()
        except Exception:  # a bug here: every question of the line fails, the client makes another
            logger.exception("kvferry: the rendezvous line to %s failed", self.address)
            self._fail_all("the line failed")

    def _fail_all(self, why: str) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            asks = self._queue + list(self._sent.values())
            self._queue, self._sent = [], {}
            for ask in asks:
                ask.settled = True
            channel, self._channel = self._channel, None
        self.client._retire(self)
        if channel is not None:
            _shut(channel)  # wakes its reader, which closes it
        for ask in asks:
            ask.future.set_exception(ask.failed(why))

    def _keep_on(self) -> None:
        while True:
            expired: list[_Ask] = []
            with self._cond:
                while True:
                    now = time.monotonic()
                    while self._deadlines and (self._deadlines[0][2].settled or self._deadlines[0][0] <= now):
                        due, _, ask = heapq.heappop(self._deadlines)
                        if not ask.settled and due == ask.deadline:  # (else written again since: a newer one)
                            self._settle(ask)
                            expired.append(ask)
                    if self._sent or self._queue:
                        self._idle_since = now
                    if expired or self._queue or self._closing:
                        break
                    if now - self._idle_since >= LINE_IDLE_SECONDS:
                        self._closing = True  # the client makes a new line for a later question
                        break
                    due = self._idle_since + LINE_IDLE_SECONDS
                    if self._deadlines:
                        due = min(due, self._deadlines[0][0])
                    self._cond.wait(max(0.0, due - now))
                closing = self._closing
                channel = self._channel
            for ask in expired:
                ask.future.set_exception(
                    ask.failed(
                        f"is connected but did not answer within {ask.wait_s:g} s: a starved, stopped or stuck process"
                    )
                )
            if closing:
                self._fail_all("the client closed" if self.client.closed else "the line closed")
                return
            if expired:
                continue
            if channel is None:
                channel = self._connect()
                if channel is None:
                    continue
            self._write(channel)

    def _connect(self) -> Optional[wire.Channel]:
        """Connects (outside the lock); a failure fails every question waiting for it."""
        with self._cond:
            whom = self._queue[0].whom if self._queue else "decode server"
        began = time.monotonic()
        try:
            sock = connect(self.address, self.client.authkey, PATIENCE_SECONDS, what=f"{whom}'s")
            took = time.monotonic() - began
            if took > SLOW_SECONDS:  # it waited, not failed: worth a line (a starved process on either side)
                logger.warning("kvferry: the handshake with the %s's rendezvous at %s took %.1f s (a loaded host?)",
                               whom, self.address, took)  # fmt: skip
        except TransferError as err:
            err = NoAnswerError(str(err), peer=self.address)
            with self._cond:
                asks, self._queue = self._queue, []
                for ask in asks:
                    ask.settled = True
            for ask in asks:
                ask.future.set_exception(err)
            return None
        channel = wire.Channel(sock, MAX_FRAME, RENDEZVOUS)
        with self._cond:
            self._channel = channel
            self.client._connected()
        affinity.Thread(target=self._read, args=(channel,), name="kvferry-rendezvous-answers", daemon=True).start()
        return channel

    def _write(self, channel: wire.Channel) -> None:
        """Writes every queued question on ``channel``; a failed write fails that question
        (it may have reached the rendezvous: it is not written again, unless the channel was
        closed before it) and ends the connection."""
        with self._cond:
            asks, self._queue = self._queue, []
            now = time.monotonic()
            for ask in asks:
                ask.call = next(self._calls) % CALLS
                while ask.call in self._sent or ask.call == 0:
                    ask.call = next(self._calls) % CALLS
                ask.deadline = now + ask.wait_s
                ask.channel = channel
                self._sent[ask.call] = ask
                heapq.heappush(self._deadlines, (ask.deadline, ask.call, ask))
        for i, ask in enumerate(asks):
            try:
                channel.send_frame(wire.encode(dataclasses.replace(ask.frame, call=ask.call), RENDEZVOUS))
            except OSError as err:
                _shut(channel)  # its reader fails the questions written on it, this one too
                # Closed before this one was written (the rendezvous closed a connection that
                # had been quiet too long, while this thread waited for the CPU): nothing of
                # it left, so it waits for the next connection with the rest.
                first = i if isinstance(err, wire.ChannelClosedError) else i + 1
                with self._cond:
                    unsent = [a for a in asks[first:] if not a.settled]
                    for a in unsent:  # never written: they wait for the next connection
                        self._sent.pop(a.call, None)
                        a.channel, a.deadline = None, math.inf
                    self._queue = unsent + self._queue
                    if self._channel is channel:
                        self._channel = None  # the next write makes a new one
                logger.info("kvferry: the rendezvous line to %s broke while writing: %r", self.address, err)
                return

    def _read(self, channel: wire.Channel) -> None:
        why = "the connection closed"
        try:
            while True:
                frame = channel.recv(None)
                if isinstance(frame, Goodbye):
                    why = f"closed the connection: {frame.reason}"
                    return
                call = getattr(frame, "call", None)
                with self._cond:
                    ask = self._sent.get(call) if isinstance(call, int) else None
                    if ask is not None:
                        self._settle(ask)
                        self._idle_since = time.monotonic()  # idle from its last answer on
                if ask is not None:
                    self._finish(ask, frame)
                else:  # its question expired here already (or a peer that numbers wrongly)
                    logger.debug("kvferry: the rendezvous at %s answered call %r, not asked now", self.address, call)
        except wire.ProtocolError as err:
            why = f"sent a frame that breaks the protocol: {err}"
        except (EOFError, OSError, ValueError) as err:  # ValueError: the socket closed under it
            why = f"went away: {err!r}"
        finally:
            with self._cond:
                lost = [ask for ask in self._sent.values() if ask.channel is channel]
                for ask in lost:
                    self._settle(ask)
                if self._channel is channel:
                    self._channel = None
                self._cond.notify_all()
            channel.close()
            for ask in lost:
                ask.future.set_exception(ask.failed(why))


def _shut(channel: wire.Channel) -> None:
    try:
        channel.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Client:
    """Questions to rendezvous servers, one kept line per address (see the module). Thread
    safe; owned by one scheduler (or router half), closed with it. ``handshakes`` counts the
    connections it made (a connection is one handshake)."""

    def __init__(self, authkey: bytes) -> None:
        self.authkey = wire.check_authkey(authkey)
        self._lock = threading.Lock()
        self._lines: dict[str, _Line] = {}
        self.closed = False
        self.handshakes = 0

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connected(self) -> None:
        with self._lock:
            self.handshakes += 1

    def _retire(self, line: _Line) -> None:
        with self._lock:
            if self._lines.get(line.address) is line:
                del self._lines[line.address]

    def _ask(self, ask: _Ask) -> Future[Any]:
        address = ask.address
        while True:
            with self._lock:
                if self.closed:
                    ask.future.set_exception(ask.failed("the client closed"))
                    return ask.future
                line = self._lines.get(address)
                if line is None:
                    line = self._lines[address] = _Line(self, address)
            if line.ask(ask):
                return ask.future
            self._retire(line)  # closing as idle: the next line takes it

    @property
    def lines(self) -> int:
        """Lines open now (one per rendezvous address asked lately)."""
        with self._lock:
            return len(self._lines)

    def close(self) -> None:
        """Fails every question not answered yet and closes the lines."""
        with self._lock:
            self.closed = True
            lines = list(self._lines.values())
        for line in lines:
            line.close()

    def lookup(self, address: str, transfer: str, wait_s: float, sender: str) -> Future[dict[str, Any]]:
        """``transfer``'s destination (the published keys and ``endpoint``) once the decode
        server published it, within ``wait_s`` (in [0, 3600]); else `TransferError` with the
        decode side's reason. A transfer or sender the wire cannot carry, or a bad
        ``wait_s``, raises `InvalidArgumentError` here, before anything is sent."""
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_WAIT_SECONDS:
            raise InvalidArgumentError(f"invalid wait_s={wait_s!r}: must be in [0, {MAX_WAIT_SECONDS}] seconds")
        frame = Lookup(transfer, math.ceil(wait_s * 1000), sender)
        wire.encode(frame, RENDEZVOUS)  # refuses what the wire cannot carry, by name

        def answered(answer: Frame) -> dict[str, Any]:
            if isinstance(answer, Destination):
                return answer.as_dict()
            if isinstance(answer, Refused):
                raise TransferError(answer.error, peer=address)
            raise TransferError(
                f"transfer {transfer!r}: the decode server's rendezvous at {address!r} answered a lookup with a "
                f"{answer.kind} frame",
                peer=address,
            )

        def failed(why: str) -> TransferError:
            return NoAnswerError(f"transfer {transfer!r}: the decode server at {address!r} {why}", peer=address)

        return self._ask(_Ask(frame, wait_s + PATIENCE_SECONDS, Future(), answered, failed, "decode server", address))

    def abandon(self, address: str, transfer: str, reason: str, epoch: int = 0) -> Future[None]:
        """Tells the decode server that the prefill side gave ``transfer`` up (``epoch``: that
        of the destination this request took, 0 if none); `TransferError` if it cannot, or
        is refused."""
        return self._tell(address, transfer, "decode server", "abandon", Abandoned,
                          lambda: Abandon(transfer, _clip(str(reason), MAX_REASON_BYTES), int(epoch)))  # fmt: skip

    def offer(self, address: str, transfer: str, peer: str, peer_mac: str) -> Future[None]:
        """Tells the prefill server whose rendezvous is at ``address`` that ``transfer``'s
        destination is published at ``peer``, signed by ``peer_mac``; `TransferError` with
        the prefill side's reason when it cannot be told or refuses."""
        return self._tell(
            address, transfer, "prefill server", "offer", Accepted, lambda: Offer(transfer, peer, peer_mac)
        )

    def _tell(
        self,
        address: str,
        transfer: str,
        whom: str,
        asked: str,
        done: type[Frame],
        frame: Callable[[], Abandon | Offer],
    ) -> Future[None]:
        future: Future[None] = Future()
        try:
            made = frame()
            wire.encode(made, RENDEZVOUS)
        except (InvalidArgumentError, TypeError) as err:
            future.set_exception(
                TransferError(
                    f"transfer {transfer!r}: could not tell the {whom} at {address!r}: {err}", peer=str(address)
                )
            )
            return future

        def answered(answer: Frame) -> None:
            if isinstance(answer, Refused):
                raise TransferError(f"the {whom} at {address!r} refused the {asked}: {answer.error}", peer=address)
            if not isinstance(answer, done):
                raise TransferError(
                    f"transfer {transfer!r}: the {whom}'s rendezvous at {address!r} answered a {asked} with a "
                    f"{answer.kind} frame",
                    peer=address,
                )

        def failed(why: str) -> TransferError:
            return NoAnswerError(
                f"transfer {transfer!r}: could not tell the {whom} at {address!r}: {why}", peer=address
            )

        return self._ask(_Ask(made, PATIENCE_SECONDS, future, answered, failed, whom, address))
