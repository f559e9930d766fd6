"""What keeps a listening endpoint alive under a flood: the accept loop, the bound on
connections still in their handshake, back-off, and a log that cannot be flooded.

```
accept() ---> Admission.admit(source) ---> a thread runs the handshake ---> settle()
   |              full (in total, or for that source): the oldest handshake of that
   |              source (else the oldest of all) is cut off, so a newcomer always gets in
   |
   +-- EMFILE / ENFILE / ENOBUFS / ENOMEM, or no thread could be started: the oldest
       handshake is cut off (freeing a descriptor) and the loop waits, 10 ms doubling up
       to 1 s, instead of spinning; it never ends but by the endpoint's close
```
A peer without the key therefore holds at most ``max_pending`` threads and descriptors of an
endpoint (``max_per_source`` from one address), each for at most the handshake's timeout,
and a legitimate peer that completes its handshake before ``max_pending`` newer connections
arrive is served however many are held open (docs/security.md has the figures).
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable, Optional

__all__ = ["Admission", "Backoff", "RateLimitedLog", "accept_loop", "describe", "source_of"]

# Connections still in their handshake, in total and from one source (an IP address; on a Unix
# socket the peer's uid).
MAX_PENDING = 64
MAX_PENDING_PER_SOURCE = 32
# Errors that mean the process is out of something; the loop waits before the next accept.
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Errors about one connection that went away before accept returned: the next accept is fine.
TRANSIENT = frozenset({errno.ECONNABORTED, errno.EINTR, errno.EPROTO, errno.EPERM, errno.EAGAIN})


_TROUBLE = {
    "exhausted": "out of descriptors or memory",
    "thread": "no thread for a connection",
    "accept": "accept failed",
}


def describe(what: str, err: BaseException) -> str:
    """One line for an accept loop's trouble, without the peer's bytes: ``what`` and the error."""
    return f"{_TROUBLE.get(what, what)}: {type(err).__name__} ({getattr(err, 'strerror', None) or err}); backing off"


def source_of(sock: socket.socket) -> Hashable:
    """Where a connection comes from, for the per-source bound: its IP address over TCP, its
    uid on a Unix socket."""
    if sock.family == socket.AF_UNIX:
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return ("uid", struct.unpack("3i", creds)[1])
        except (AttributeError, OSError):
            return ("unix", None)
    try:
        return ("ip", sock.getpeername()[0])
    except OSError:
        return ("ip", None)


class Admission:
    """Connections in their handshake, oldest first. `admit` always takes the newcomer,
    cutting off the oldest of its source, else the oldest of all, when a bound is reached."""

    def __init__(self, max_pending: int = MAX_PENDING, max_per_source: int = MAX_PENDING_PER_SOURCE) -> None:
        if not 0 < max_per_source <= max_pending:
            raise ValueError(f"invalid bounds: max_pending={max_pending}, max_per_source={max_per_source}")
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, tuple[Hashable, Callable[[], None]]] = OrderedDict()
        self._tickets = itertools.count(1)
        self.evicted = 0  # handshakes cut off to make room, over the endpoint's life

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def admit(self, source: Hashable, cut_off: Callable[[], None]) -> int:
        """Registers a connection starting its handshake; ``cut_off`` ends it (wakes its
        thread). Returns its ticket for `settle`."""
        victims = []
        with self._lock:
            same = [t for t, (s, _) in self._pending.items() if s == source]
            if len(same) >= self.max_per_source:
                victims.append(self._pending.pop(same[0])[1])
            elif len(self._pending) >= self.max_pending:
                victims.append(self._pending.popitem(last=False)[1][1])
            ticket = next(self._tickets)
            self._pending[ticket] = (source, cut_off)
            self.evicted += len(victims)
        for victim in victims:
            victim()
        return ticket

    def settle(self, ticket: int) -> None:
        """The handshake ended (either way): the connection no longer counts here."""
        with self._lock:
            self._pending.pop(ticket, None)

    def cut_oldest(self) -> bool:
        """Cuts off the oldest handshake (to free a descriptor); whether there was one."""
        with self._lock:
            if not self._pending:
                return False
            _, (_, victim) = self._pending.popitem(last=False)
            self.evicted += 1
        victim()
        return True


class Backoff:
    """Delays after consecutive failures: ``first`` doubling up to ``most`` seconds."""

    def __init__(self, first: float = 0.01, most: float = 1.0) -> None:
        self.first, self.most = first, most
        self.failures = 0

    def failed(self) -> float:
        self.failures += 1
        return min(self.most, self.first * 2 ** (self.failures - 1))

    def reset(self) -> None:
        self.failures = 0


class RateLimitedLog:
    """At most ``burst`` lines per ``every_s`` seconds for each key; what was held back is
    counted and said with the next line that passes ("... and 12345 more like it")."""

    def __init__(
        self, logger: logging.Logger, every_s: float = 10.0, burst: int = 5, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger = logger
        self.every_s, self.burst = every_s, burst
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[float, int, int]] = {}  # key -> (window start, lines, held back)

    def allow(self, key: str) -> tuple[bool, int]:
        """Whether a line of ``key`` may go out now, and how many were held back before it."""
        now = self._clock()
        with self._lock:
            start, lines, held = self._windows.get(key, (now, 0, 0))
            if now - start >= self.every_s:
                start, lines = now, 0
            if lines < self.burst:
                self._windows[key] = (start, lines + 1, 0)
                return True, held
            self._windows[key] = (start, lines, held + 1)
            return False, 0

    def warning(self, key: str, message: str, *args: object) -> None:
        ok, held = self.allow(key)
        if ok:
            if held:
                self.logger.warning(message + " (and %d more like it, not logged)", *args, held)
            else:
                self.logger.warning(message, *args)


def accept_loop(
    listener: socket.socket,
    closing: threading.Event,
    handle: Callable[[socket.socket], None],
    *,
    admission: Optional[Admission],
    failed: Callable[[str, BaseException], None],
) -> None:
    """Accepts until ``closing`` is set, handing each connection to ``handle`` (which starts
    its thread). ``failed(what, err)`` hears of each trouble: ``"exhausted"`` (out of
    descriptors or memory), ``"thread"`` (``handle`` raised: the connection was closed),
    ``"accept"`` (any other error). Never raises: only ``closing`` ends it."""
    backoff = Backoff()
    while not closing.is_set():
        try:
            sock, _ = listener.accept()
        except OSError as err:
            if closing.is_set():
                return
            if err.errno in TRANSIENT:
                continue
            exhausted = err.errno in EXHAUSTED
            failed("exhausted" if exhausted else "accept", err)
            if exhausted and admission is not None:
                admission.cut_oldest()  # a descriptor back for the next accept
            closing.wait(backoff.failed())
            continue
        except Exception as err:  # not expected; the loop must outlive it
            failed("accept", err)
            closing.wait(backoff.failed())
            continue
        if closing.is_set():
            sock.close()
            return
        try:
            handle(sock)
        except Exception as err:  # no thread could be started (pids, memory): this one is dropped
            sock.close()
            failed("thread", err)
            if admission is not None:
                admission.cut_oldest()
            closing.wait(backoff.failed())
            continue
        backoff.reset()
