"""Cross-process transport on one host for CPU pools: the receiver's pool lives in POSIX
shared memory, the sender maps it and writes blocks straight into it, and notices travel
over an authenticated local socket.

```
receiver process                         sender process
SharedPool.create  --descriptor-->       SharedPool.attach (same pages)
ShmEndpoint: socket <--notices-------    ShmTransport.post, after copy_blocks finished
```
The segment name is 128 random bits and the socket demands the session's key (HMAC
challenge of multiprocessing.connection), so another local process cannot guess its way in.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import tempfile
import threading
from multiprocessing import AuthenticationError, resource_tracker
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Optional, Sequence

import torch

from kvferry.errors import InvalidArgumentError, KvFerryError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transport import Transport

__all__ = ["SharedPool", "ShmEndpoint", "ShmTransport"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"invalid dtype={name!r}: not a torch dtype")
    return dtype


_TRACKER_PATCH = threading.Lock()


def _attach_untracked(name: str) -> SharedMemory:
    """Maps an existing segment without registering it with this process's resource tracker,
    which would otherwise unlink the creator's segment when this process exits (or, when the
    tracker is shared with the creator, forget the creator's own registration)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    with _TRACKER_PATCH:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register  # type: ignore[assignment]


class SharedPool:
    """A paged pool whose layers are consecutive slices of one shared-memory segment."""

    def __init__(self, segment: SharedMemory, descriptor: dict[str, Any], *, owner: bool) -> None:
        self._segment = segment
        self._owner = owner
        self.descriptor = descriptor
        shape = tuple(descriptor["shape"])
        dtype = _dtype(descriptor["dtype"])
        layer_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=layer_bytes * descriptor["num_layers"])
        layers = tuple(flat[i * layer_bytes : (i + 1) * layer_bytes].view(dtype).view(shape) for i in range(descriptor["num_layers"]))
        self.pool: Optional[PagedKV] = PagedKV(layers, descriptor["tokens_per_block"], descriptor["block_dim"])

    @classmethod
    def create(cls, *, num_layers: int, shape: Sequence[int], dtype: torch.dtype, tokens_per_block: int, block_dim: int = 0) -> SharedPool:
        """A zero-filled pool in a new segment with an unguessable name. Its pages are
        written once here, so transfers never pay for first-touch faults."""
        if num_layers <= 0:
            raise InvalidArgumentError(f"invalid num_layers={num_layers}: must be > 0")
        nbytes = num_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        segment = SharedMemory(name=f"kvferry-{secrets.token_hex(16)}", create=True, size=max(nbytes, 1))
        descriptor = {
            "name": segment.name,
            "num_layers": num_layers,
            "shape": list(shape),
            "dtype": str(dtype),
            "tokens_per_block": tokens_per_block,
            "block_dim": block_dim,
        }
        shared = cls(segment, descriptor, owner=True)
        assert shared.pool is not None
        for layer in shared.pool.layers:
            layer.view(-1).view(torch.uint8).zero_()
        return shared

    @classmethod
    def attach(cls, descriptor: dict[str, Any]) -> SharedPool:
        """Maps a pool another process created."""
        return cls(_attach_untracked(descriptor["name"]), descriptor, owner=False)

    def close(self) -> None:
        """Unmaps the segment (and removes it, in the creating process). Tensors taken from
        ``pool`` must be dropped first."""
        self.pool = None
        self._segment.close()
        if self._owner:
            self._segment.unlink()


class ShmEndpoint:
    """The receiver's side: serves the pool descriptor to each sender that presents the key,
    then delivers its notices to the receiver on a listener thread."""

    def __init__(self, receiver: KVReceiver, shared: SharedPool, *, authkey: bytes) -> None:
        if len(authkey) < 16:
            raise InvalidArgumentError(f"invalid authkey: {len(authkey)} bytes, need at least 16")
        self.receiver = receiver
        self.shared = shared
        self._authkey = authkey
        self._dir = tempfile.mkdtemp(prefix="kvferry-")
        self.address = os.path.join(self._dir, "notices.sock")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=authkey)
        self._closing = threading.Event()
        self._connections: list[Connection] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, name="kvferry-shm-endpoint", daemon=True)
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
            threading.Thread(target=self._pump, args=(conn,), name="kvferry-shm-notices", daemon=True).start()

    def _pump(self, conn: Connection) -> None:
        conn.send({"pool": self.shared.descriptor})
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                return  # the sender closed or died; its requests time out at the receiver
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


class ShmTransport(Transport):
    """The sender's side: connects with the key, maps the receiver's pool, posts notices."""

    def __init__(self, address: str, *, authkey: bytes) -> None:
        try:
            self._conn = Client(address, family="AF_UNIX", authkey=authkey)
            hello = self._conn.recv()
        except (OSError, EOFError, AuthenticationError) as err:
            raise TransferError(f"cannot reach the receiver at {address}: {err!r}") from err
        self._shared = SharedPool.attach(hello["pool"])
        assert self._shared.pool is not None
        self.dst = self._shared.pool

    def post(self, notices: Sequence[Notice]) -> None:
        try:
            self._conn.send([n.as_tuple() for n in notices])
        except OSError as err:
            raise TransferError(f"receiver went away while posting {len(notices)} notices: {err}") from err

    def close(self) -> None:
        self._conn.close()
        del self.dst
        self._shared.close()
