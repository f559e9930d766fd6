"""The rendezvous: how a prefill request learns its destination blocks on the decode server.

```
decode worker (Rendezvous)                         prefill scheduler / worker (lookup, abandon)
publish(T, destination)  <- the decode request's blocks are allocated and expected
            <-- kvferry's mutual handshake (transports/wire.py: HMAC-SHA256 both ways) --
            <-- {"op": "lookup", "transfer": T, "wait_s": w, "sender": S}
            --> {"ok": destination}   once T is published (or {"error": ...}), with the
                                      URL of sender S's own endpoint
            <-- {"op": "abandon", "transfer": T, "reason": r}  the prefill side gave up
            --> {"ok": true}
```
It listens on a ``unix://`` socket (the default: a fresh 0700 directory) or ``tcp://host:port``
(loopback unless told otherwise; a wildcard bind needs ``advertise``), by wire's rules.
Frames are JSON objects behind a 4-byte length, at most 1 MiB, read only after both sides
proved they hold the key: nothing from the socket is ever unpickled, and every field is
checked. A transfer id is handed to one lookup only (a second prefill request naming it is
refused), so no decode block is written by two senders. Each prefill engine ``S`` (its vLLM
engine id) gets an endpoint of its own: a staging ring has one writer.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from kvferry.errors import KvFerryError, TransferError
from kvferry.transports import wire

__all__ = ["Rendezvous", "abandon", "lookup"]

logger = logging.getLogger("kvferry.vllm")

MAX_FRAME = 1 << 20
HANDSHAKE_SECONDS = 10.0
GONE_KEPT = 4096  # transfers that ended, remembered so a late lookup fails at once
_LEN = struct.Struct(">I")


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    if len(body) > MAX_FRAME:
        raise TransferError(f"a rendezvous frame of {len(body)} bytes, more than {MAX_FRAME}")
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > MAX_FRAME:
        raise ValueError(f"a frame of {length} bytes, more than {MAX_FRAME}")
    message = json.loads(_recv_exact(sock, length))
    if not isinstance(message, dict):
        raise ValueError(f"frame is a {type(message).__name__}, not an object")
    return message


class Rendezvous:
    """Owned by the decode worker: publishes each expected transfer's destination and
    collects the transfers prefill sides abandoned."""

    def __init__(
        self, authkey: bytes, endpoint_for: Callable[[str], str], directory: Optional[str] = None, *, listen: str = "unix://", advertise: Optional[str] = None
    ) -> None:
        """``endpoint_for(sender)``: the URL of that prefill engine's endpoint (made on its
        first lookup). ``listen``: ``unix://`` (a socket in a fresh 0700 directory under
        ``directory``), ``unix:///path`` or ``tcp://host:port``; ``advertise``: the host a
        wildcard bind is reached by. ``address`` is the URL prefill servers connect to."""
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
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._abandoned: dict[str, str] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="kvferry-rendezvous", daemon=True)
        self._thread.start()

    def publish(self, transfer: str, destination: dict[str, Any]) -> None:
        """Makes ``transfer``'s destination available to one lookup. Raises `TransferError`
        when the id is live already (two decode requests named the same transfer)."""
        with self._cond:
            if transfer in self._published or transfer in self._taken:
                raise TransferError(f"transfer {transfer!r} is already expected by another decode request")
            self._gone.pop(transfer, None)
            self._published[transfer] = destination
            self._cond.notify_all()

    def withdraw(self, transfer: str, reason: str) -> None:
        """The transfer ended here (arrived, failed, aborted): a lookup still to come fails."""
        with self._cond:
            self._published.pop(transfer, None)
            self._taken.pop(transfer, None)
            self._abandoned.pop(transfer, None)
            self._gone[transfer] = reason
            while len(self._gone) > GONE_KEPT:
                self._gone.popitem(last=False)
            self._cond.notify_all()

    def withdraw_untaken(self, transfer: str, reason: str) -> bool:
        """Withdraws ``transfer`` if no lookup took its destination yet; returns whether it
        did (then no sender ever learnt its blocks, so none can write them)."""
        with self._cond:  # an RLock: withdraw takes it again, so no lookup slips in between
            if transfer in self._taken or transfer not in self._published:
                return False
            self.withdraw(transfer, reason)
            return True

    def taker(self, transfer: str) -> Optional[str]:
        """The prefill engine whose lookup took ``transfer``'s destination, or ``None``."""
        with self._cond:
            return self._taken.get(transfer)

    def abandoned(self, transfer: str) -> Optional[str]:
        """Why the prefill side gave ``transfer`` up, or ``None``."""
        with self._cond:
            return self._abandoned.get(transfer)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                continue
            if self._closing:
                conn.close()
                return
            threading.Thread(target=self._pump, args=(conn,), name="kvferry-rendezvous-conn", daemon=True).start()

    def _pump(self, conn: socket.socket) -> None:
        try:
            wire.tune(conn)
            try:
                wire.handshake(conn, self._authkey, wire.ROLE_ENDPOINT, HANDSHAKE_SECONDS)
            except wire.AuthenticationError as err:
                logger.warning("kvferry: a connection to the rendezvous at %s failed authentication (a prefill server with another key?): %s", self.address, err)
                return
            while True:
                message = _recv(conn)
                _send(conn, self._answer(message))
        except Exception:  # EOF, a malformed frame: the connection ends
            pass
        finally:
            conn.close()

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        op, transfer = message.get("op"), message.get("transfer")
        if not isinstance(transfer, str):
            return {"error": f"invalid transfer={transfer!r}: must be a string"}
        if op == "abandon":
            with self._cond:
                # Kept even before the decode request published it (the prefill request may
                # be aborted first): the decode worker asks about each transfer it holds.
                self._abandoned[transfer] = str(message.get("reason", "no reason given"))[:1000]
                while len(self._abandoned) > GONE_KEPT:
                    del self._abandoned[next(iter(self._abandoned))]
            return {"ok": True}
        if op != "lookup":
            return {"error": f"invalid op={op!r}: expected 'lookup' or 'abandon'"}
        wait = message.get("wait_s")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
            return {"error": f"invalid wait_s={wait!r}: must be in [0, 3600]"}
        sender = message.get("sender")
        if not isinstance(sender, str) or not 0 < len(sender) <= 128:
            return {"error": f"invalid sender={sender!r}: must be the prefill engine's id"}
        try:
            endpoint = self._endpoint_for(sender)
        except Exception as err:  # no room for another endpoint: this lookup fails, not the server
            reason = f"no endpoint for prefill engine {sender!r}: {err}"
            with self._cond:  # nothing can reach its blocks: its decode request fails now, not at its timeout
                self._abandoned[transfer] = reason
            return {"error": reason}
        deadline = time.monotonic() + float(wait)
        with self._cond:
            while True:
                if transfer in self._abandoned:
                    return {"error": f"transfer {transfer!r} was abandoned: {self._abandoned[transfer]}"}
                if transfer in self._taken:
                    return {"error": f"transfer {transfer!r} was already taken by another prefill request"}
                if transfer in self._published:
                    self._taken[transfer] = sender
                    return {"ok": dict(self._published.pop(transfer), endpoint=endpoint)}
                if transfer in self._gone:
                    return {"error": f"transfer {transfer!r} ended on the decode server: {self._gone[transfer]}"}
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    return {"error": f"transfer {transfer!r}: no decode request expected it within {wait} s"}
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        except OSError:
            pass
        self._thread.join(timeout=5)
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


def _connect(address: str, authkey: bytes, timeout: float = HANDSHAKE_SECONDS) -> socket.socket:
    try:
        where = wire.parse_address(address, "kv_transfer_params.kvferry.peer")
    except KvFerryError as err:
        raise TransferError(f"cannot reach the decode server's rendezvous: {err}", peer=str(address)) from err
    try:
        sock = wire.connect(where, timeout)
    except OSError as err:
        raise TransferError(f"cannot reach the decode server's rendezvous at {address!r}: {err!r}", peer=address) from err
    try:
        wire.handshake(sock, authkey, wire.ROLE_SENDER, timeout)
    except wire.AuthenticationError as err:
        sock.close()
        raise TransferError(
            f"authentication failed with the decode server's rendezvous at {address!r}: the two servers hold different keys "
            f"(kv_connector_extra_config.authkey_file must name a file with the same key on both): {err}",
            peer=address,
        ) from err
    return sock


def _ask(sock: socket.socket, message: dict[str, Any], wait_s: float) -> dict[str, Any]:
    _send(sock, message)
    ready, _, _ = select.select([sock], [], [], wait_s)
    if not ready:
        raise TimeoutError(f"no answer within {wait_s} s")
    sock.settimeout(HANDSHAKE_SECONDS)  # the frame itself is on its way
    return _recv(sock)


def lookup(address: str, authkey: bytes, transfer: str, wait_s: float, sender: str) -> dict[str, Any]:
    """Blocks until the decode server published ``transfer``'s destination (at most
    ``wait_s``); returns it, or raises `TransferError` with the decode side's reason."""
    sock = _connect(address, authkey)
    try:
        answer = _ask(sock, {"op": "lookup", "transfer": transfer, "wait_s": wait_s, "sender": sender}, wait_s + HANDSHAKE_SECONDS)
    except TimeoutError as err:
        raise TransferError(f"transfer {transfer!r}: the decode server at {address!r} did not answer within {wait_s} s", peer=address) from err
    except Exception as err:
        raise TransferError(f"transfer {transfer!r}: the decode server at {address!r} went away: {err!r}", peer=address) from err
    finally:
        sock.close()
    if "ok" in answer and isinstance(answer["ok"], dict):
        return answer["ok"]
    raise TransferError(f"{answer.get('error', answer)}", peer=address)


def abandon(address: str, authkey: bytes, transfer: str, reason: str) -> None:
    """Tells the decode server that the prefill side gave ``transfer`` up; its decode request
    then fails at once instead of at its timeout. Raises `TransferError` if it cannot."""
    sock = _connect(address, authkey)
    try:
        _ask(sock, {"op": "abandon", "transfer": transfer, "reason": reason[:1000]}, HANDSHAKE_SECONDS)
    except Exception as err:
        raise TransferError(f"transfer {transfer!r}: could not tell the decode server at {address!r}: {err!r}", peer=address) from err
    finally:
        sock.close()
