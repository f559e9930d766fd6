"""The rendezvous: how a prefill request learns its destination blocks on the decode server.

```
decode worker (Rendezvous)                         prefill scheduler / worker (lookup, abandon)
publish(T, destination)  <- the decode request's blocks are allocated and expected
            <-- challenge / response (authkey), both ways --
            <-- {"op": "lookup", "transfer": T, "wait_s": w, "sender": S}
            --> {"ok": destination}   once T is published (or {"error": ...}), with the
                                      address of sender S's own staging endpoint
            <-- {"op": "abandon", "transfer": T, "reason": r}  the prefill side gave up
            --> {"ok": true}
```
Frames are JSON in `multiprocessing.connection`'s length-prefixed byte messages, sent only
after both sides proved they hold the key: nothing from the socket is ever unpickled. A
transfer id is handed to one lookup only (a second prefill request naming it is refused), so
no decode block is written by two senders. Each prefill engine ``S`` (its vLLM engine id) gets
a staging endpoint of its own: a staging ring has one writer.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge
from typing import Any, Callable, Optional

from kvferry.errors import TransferError

__all__ = ["Rendezvous", "abandon", "lookup"]

MAX_FRAME = 1 << 20
HANDSHAKE_SECONDS = 10.0
GONE_KEPT = 4096  # transfers that ended, remembered so a late lookup fails at once


def _set_timeout(conn: Connection, seconds: float) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))
    try:
        whole = int(seconds)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))
    finally:
        sock.close()


def _send(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: Connection) -> dict[str, Any]:
    message = json.loads(conn.recv_bytes(MAX_FRAME))
    if not isinstance(message, dict):
        raise ValueError(f"frame is a {type(message).__name__}, not an object")
    return message


class Rendezvous:
    """Owned by the decode worker: publishes each expected transfer's destination and
    collects the transfers prefill sides abandoned."""

    def __init__(self, authkey: bytes, endpoint_for: Callable[[str], str], directory: Optional[str] = None) -> None:
        """``endpoint_for(sender)``: the address of that prefill engine's staging endpoint
        (made on its first lookup)."""
        self._authkey = authkey
        self._endpoint_for = endpoint_for
        self._dir = tempfile.mkdtemp(prefix="kvferry-vllm-", dir=directory)  # 0700
        self.address = os.path.join(self._dir, "rendezvous.sock")
        self._listener = Listener(self.address, family="AF_UNIX", backlog=64)
        self._cond = threading.Condition()
        self._published: dict[str, dict[str, Any]] = {}
        self._taken: set[str] = set()
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
            self._taken.discard(transfer)
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

    def abandoned(self, transfer: str) -> Optional[str]:
        """Why the prefill side gave ``transfer`` up, or ``None``."""
        with self._cond:
            return self._abandoned.get(transfer)

    def _serve(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                continue
            if self._closing:
                conn.close()
                return
            threading.Thread(target=self._pump, args=(conn,), name="kvferry-rendezvous-conn", daemon=True).start()

    def _pump(self, conn: Connection) -> None:
        try:
            _set_timeout(conn, HANDSHAKE_SECONDS)
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            _set_timeout(conn, 0)
            while True:
                message = _recv(conn)
                _send(conn, self._answer(message))
        except Exception:  # EOF, a wrong key, a malformed frame: the connection ends
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
            staging = self._endpoint_for(sender)
        except Exception as err:  # no room for another endpoint: this lookup fails, not the server
            return {"error": f"no staging endpoint for prefill engine {sender!r}: {err}"}
        deadline = time.monotonic() + float(wait)
        with self._cond:
            while True:
                if transfer in self._abandoned:
                    return {"error": f"transfer {transfer!r} was abandoned: {self._abandoned[transfer]}"}
                if transfer in self._taken:
                    return {"error": f"transfer {transfer!r} was already taken by another prefill request"}
                if transfer in self._published:
                    self._taken.add(transfer)
                    return {"ok": dict(self._published.pop(transfer), staging=staging)}
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
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.connect(self.address)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._listener.close()
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


def _connect(address: str, authkey: bytes) -> Connection:
    try:
        return Client(address, family="AF_UNIX", authkey=authkey)
    except Exception as err:
        raise TransferError(f"cannot reach the decode server's rendezvous at {address!r}: {err!r}", peer=address) from err


def lookup(address: str, authkey: bytes, transfer: str, wait_s: float, sender: str) -> dict[str, Any]:
    """Blocks until the decode server published ``transfer``'s destination (at most
    ``wait_s``); returns it, or raises `TransferError` with the decode side's reason."""
    conn = _connect(address, authkey)
    try:
        _send(conn, {"op": "lookup", "transfer": transfer, "wait_s": wait_s, "sender": sender})
        if not conn.poll(wait_s + HANDSHAKE_SECONDS):
            raise TransferError(f"transfer {transfer!r}: the decode server at {address!r} did not answer within {wait_s} s", peer=address)
        answer = _recv(conn)
    except TransferError:
        raise
    except Exception as err:
        raise TransferError(f"transfer {transfer!r}: the decode server at {address!r} went away: {err!r}", peer=address) from err
    finally:
        conn.close()
    if "ok" in answer and isinstance(answer["ok"], dict):
        return answer["ok"]
    raise TransferError(f"{answer.get('error', answer)}", peer=address)


def abandon(address: str, authkey: bytes, transfer: str, reason: str) -> None:
    """Tells the decode server that the prefill side gave ``transfer`` up; its decode request
    then fails at once instead of at its timeout. Raises `TransferError` if it cannot."""
    conn = _connect(address, authkey)
    try:
        _send(conn, {"op": "abandon", "transfer": transfer, "reason": reason})
        if conn.poll(HANDSHAKE_SECONDS):
            _recv(conn)
    except Exception as err:
        raise TransferError(f"transfer {transfer!r}: could not tell the decode server at {address!r}: {err!r}", peer=address) from err
    finally:
        conn.close()
