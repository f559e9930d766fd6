"""Cross-process transports on one host: the receiver serves what a sender needs to address
its pool (a shared-memory descriptor, or CUDA IPC handles), then takes notices over an
authenticated Unix socket.

```
receiver process                              sender process
LocalEndpoint --hello (how to reach the pool)-->  LocalTransport: opens the pool
              <--notices, after the writes------  post()
```
The socket demands the session's key (the HMAC challenge of multiprocessing.connection), so
another local process cannot connect without it. Messages are pickled with torch's
multiprocessing pickler, which sends CUDA tensors as IPC handles.
"""

from __future__ import annotations

import os
import tempfile
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import AbstractSet, Any, Callable, Optional, Sequence

import torch.multiprocessing  # noqa: F401  (registers the CUDA-tensor reductions)

from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transport import Transport, kept

__all__ = ["CudaIpcEndpoint", "CudaIpcTransport", "LocalEndpoint", "LocalTransport"]

MIN_AUTHKEY_BYTES = 16


class LocalEndpoint:
    """The receiver's side: sends ``hello`` to each sender that presents the key, then
    delivers its notices to the receiver on a listener thread."""

    def __init__(self, receiver: KVReceiver, hello: dict[str, Any], *, authkey: bytes) -> None:
        if len(authkey) < MIN_AUTHKEY_BYTES:
            raise InvalidArgumentError(f"invalid authkey: {len(authkey)} bytes, need at least {MIN_AUTHKEY_BYTES}")
        self.receiver = receiver
        self._hello = hello
        self._authkey = authkey
        self._dir = tempfile.mkdtemp(prefix="kvferry-")
        self.address = os.path.join(self._dir, "notices.sock")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=authkey)
        self._closing = threading.Event()
        self._connections: list[Connection] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, name="kvferry-endpoint", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError) as err:  # a bad key, or closing
                if not self._closing.is_set():
                    self.errors.append(err)
                continue
            if self._closing.is_set():
                conn.close()
                return
            self._connections.append(conn)
            threading.Thread(target=self._pump, args=(conn,), name="kvferry-notices", daemon=True).start()

    def _pump(self, conn: Connection) -> None:
        conn.send(self._hello)
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the sender closed or died; its requests time out at the receiver
            self.handle(conn, message)

    def handle(self, conn: Connection, message: Any) -> None:
        """One message from a sender: here, a batch of notice tuples."""
        self.deliver(message)

    def deliver(self, batch: Sequence[tuple[int, int, int, int, bool]]) -> None:
        for values in batch:
            try:
                self.receiver.deliver(Notice.from_tuple(values))
            except KvFerryError as err:  # recorded on the request; its wait raises
                self.errors.append(err)

    def close(self) -> None:
        self._closing.set()
        try:  # wake the accept() call
            Client(self.address, family="AF_UNIX", authkey=self._authkey).close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._listener.close()
        for conn in self._connections:
            conn.close()
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


class LocalTransport(Transport):
    """The sender's side: connects with the key, opens the receiver's pool from its hello,
    posts notices. ``open_pool(hello)`` returns the pool and a function that releases it."""

    def __init__(self, address: str, *, authkey: bytes, open_pool: Callable[[dict[str, Any]], tuple[PagedKV, Callable[[], None]]]) -> None:
        try:
            self._conn = Client(address, family="AF_UNIX", authkey=authkey)
            hello = self._conn.recv()
        except (OSError, EOFError, AuthenticationError) as err:
            raise TransferError(f"cannot reach the receiver at {address}: {err!r}") from err
        self.dst, self._release = open_pool(hello)

    def post(self, batch: Sequence[Notice], revoked: AbstractSet[int] = frozenset()) -> None:
        self._send([n.as_tuple() for n in kept(batch, revoked)])

    def _send(self, message: Any) -> None:
        try:
            self._conn.send(message)
        except OSError as err:
            raise TransferError(f"receiver went away: {err}") from err

    def close(self) -> None:
        self._conn.close()
        del self.dst
        self._release()


def _pool_hello(pool: PagedKV) -> dict[str, Any]:
    return {"layers": pool.layers, "tokens_per_block": pool.tokens_per_block, "block_dim": pool.block_dim}


class CudaIpcEndpoint(LocalEndpoint):
    """A CUDA pool shared through CUDA IPC handles: senders on the same GPU, or a peer GPU of
    the host, write straight into it with the fused copy kernel."""

    def __init__(self, receiver: KVReceiver, *, authkey: bytes) -> None:
        if receiver.pool.device.type != "cuda":
            raise InvalidArgumentError(f"invalid receiver: its pool is on {receiver.pool.device}, CUDA IPC needs a CUDA pool")
        super().__init__(receiver, _pool_hello(receiver.pool), authkey=authkey)


def _open_ipc_pool(hello: dict[str, Any]) -> tuple[PagedKV, Callable[[], None]]:
    return PagedKV(tuple(hello["layers"]), hello["tokens_per_block"], hello["block_dim"]), lambda: None


class CudaIpcTransport(LocalTransport):
    def __init__(self, address: str, *, authkey: bytes) -> None:
        super().__init__(address, authkey=authkey, open_pool=_open_ipc_pool)
