"""CPU pools across processes on one host: the receiver's pool lives in POSIX shared memory,
the sender maps it and writes blocks straight into it; notices travel over the local socket
of kvferry.transports.control. The segment name is 128 random bits.

A segment one sender alone maps (a staging ring: kvferry.transports.staging) loses its name
as soon as that sender mapped it (`SharedPool.attach` with ``unlink=True``): from then on only
the two mappings keep it, so the kernel frees it when both processes are gone, however they
end (a SIGKILL of both process groups takes the receiver's resource tracker with it, which
would otherwise have been the one to remove it). A pool many senders map over time (an
`ShmEndpoint`'s) loses its name when the endpoint starts: on a Unix socket the endpoint passes
each sender the segment's descriptor itself (``SCM_RIGHTS``, with the hello); over ``tcp://``
(one host still) a descriptor cannot travel, so the hello names where the receiver holds it
(its pid, the descriptor's number, the segment's inode: a `Holder`) and the sender opens
``/proc/<pid>/fd/<fd>``, checked to be that kvferry segment in /dev/shm. So nothing of an
shm endpoint's is left in /dev/shm however both sides end.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import secrets
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable, Optional, Sequence

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import torch

from kvferry.errors import InvalidArgumentError, SharedMemoryError, TransferError
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.transports.control import LocalEndpoint, LocalTransport, pool_hello

__all__ = ["SharedPool", "ShmEndpoint", "ShmTransport"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"invalid dtype={name!r}: not a torch dtype")
    return dtype


_TRACKER_PATCH = threading.Lock()
# The names this module gives segments: the only ones a hello may make a sender open or unlink.
SEGMENT_NAME = re.compile(r"kvferry-[0-9a-f]{32}")


def _reserve(segment: SharedMemory, nbytes: int) -> None:
    """Reserves the new ``segment``'s pages in /dev/shm now: on a tmpfs too small for it (a
    container's default /dev/shm is 64 MiB) the first touch of a page past its end kills the
    process with SIGBUS, where this raises `SharedMemoryError` and removes the segment."""
    try:
        fd: int = segment._fd  # type: ignore[attr-defined]  # noqa: SLF001  (SharedMemory keeps it open)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        try:
            free = os.statvfs("/dev/shm")
            have = f"{free.f_bavail * free.f_frsize} of its {free.f_blocks * free.f_frsize} bytes free"
        except OSError:
            have = "its free space unknown"
        segment.close()
        segment.unlink()  # this process made it: its resource tracker forgets it too
        raise SharedMemoryError(
            f"cannot reserve {nbytes} bytes of shared memory in /dev/shm ({have}): {err.strerror or err}; "
            "give /dev/shm more room (a container's --shm-size, or --ipc=host) or ask for less (the vLLM "
            "connector's staging_bytes, an endpoint's capacity_blocks, a smaller pool)"
        ) from None


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


def _unlink_untracked(segment: SharedMemory) -> None:
    """Removes a segment's name without touching this process's resource tracker (it never
    registered the segment: `_attach_untracked`). A name already gone is fine."""
    from multiprocessing import shared_memory

    try:
        shared_memory._posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]  # noqa: SLF001
    except FileNotFoundError:
        pass


class _MappedFd:
    """A segment mapped from a descriptor another process passed (it has no name here)."""

    def __init__(self, fd: int, size: int) -> None:
        st = os.fstat(fd)
        if st.st_size < size:
            raise TransferError(f"the receiver passed a segment of {st.st_size} bytes, its pool needs {size}")
        self._mmap = mmap.mmap(fd, size)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


class SharedPool:
    """A paged pool whose layers are consecutive slices of one shared-memory segment."""

    def __init__(self, segment: Any, descriptor: dict[str, Any], *, owner: bool) -> None:
        self._segment = segment
        self._owner = owner
        self._named = True  # whether close must remove the name (the owner's)
        self.descriptor = descriptor
        shape = tuple(descriptor["shape"])
        dtype = _dtype(descriptor["dtype"])
        layer_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=layer_bytes * descriptor["num_layers"])
        layers = tuple(
            flat[i * layer_bytes : (i + 1) * layer_bytes].view(dtype).view(shape)
            for i in range(descriptor["num_layers"])
        )
        self.pool: Optional[PagedKV] = PagedKV(layers, descriptor["tokens_per_block"], descriptor["block_dim"])

    @classmethod
    def create(
        cls, *, num_layers: int, shape: Sequence[int], dtype: torch.dtype, tokens_per_block: int, block_dim: int = 0
    ) -> SharedPool:
        """A zero-filled pool in a new segment with an unguessable name. Its pages are
        written once here, so transfers never pay for first-touch faults."""
        if num_layers <= 0:
            raise InvalidArgumentError(f"invalid num_layers={num_layers}: must be > 0")
        nbytes = num_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        segment = SharedMemory(name=f"kvferry-{secrets.token_hex(16)}", create=True, size=max(nbytes, 1))
        _reserve(segment, max(nbytes, 1))
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
    def attach(cls, descriptor: dict[str, Any], *, unlink: bool = False) -> SharedPool:
        """Maps a pool another process created. ``unlink``: removes its name once mapped
        (a segment only this process maps besides its creator: see the module doc)."""
        name = descriptor["name"]
        if not isinstance(name, str) or not SEGMENT_NAME.fullmatch(name):
            raise TransferError(
                f"invalid segment name {str(name)[:80]!r}: not one kvferry makes (kvferry- and 32 hex digits)"
            )
        segment = _attach_untracked(name)
        if unlink:
            try:
                _unlink_untracked(segment)
            except BaseException:
                segment.close()
                raise
        return cls(segment, descriptor, owner=False)

    @staticmethod
    def nbytes(descriptor: dict[str, Any]) -> int:
        element = torch.empty((), dtype=_dtype(descriptor["dtype"])).element_size()
        return int(descriptor["num_layers"]) * math.prod(descriptor["shape"]) * element

    @classmethod
    def attach_fd(cls, fd: int, descriptor: dict[str, Any]) -> SharedPool:
        """Maps a pool from the descriptor its creator passed over the Unix socket (the
        caller keeps and closes ``fd``)."""
        return cls(_MappedFd(fd, max(cls.nbytes(descriptor), 1)), descriptor, owner=False)

    def fileno(self) -> int:
        """The segment's descriptor in the creating process (what an endpoint passes on)."""
        if not self._owner:
            raise TransferError("only the process that created a shared pool passes its descriptor on")
        return int(self._segment._fd)  # noqa: SLF001  (SharedMemory keeps it open until close)

    def remove_name(self) -> None:
        """Removes the segment's name now (the creator's mapping and descriptor keep it): no
        one opens it by name from here on, and nothing is left in /dev/shm however this
        process ends."""
        if self._owner and self._named:
            self._named = False
            try:
                self._segment.unlink()
            except FileNotFoundError:
                self._forget()

    def _forget(self) -> None:
        if sys.version_info < (3, 13) or getattr(self._segment, "_track", True):
            name = self._segment._name  # noqa: SLF001
            resource_tracker.unregister(name, "shared_memory")  # type: ignore[attr-defined]

    def close(self) -> None:
        """Unmaps the segment (and removes it, in the creating process, unless the one
        process that mapped it removed its name already). Tensors taken from ``pool`` must
        be dropped first."""
        self.pool = None
        self._segment.close()
        if self._owner and self._named:
            try:
                self._segment.unlink()
            except FileNotFoundError:  # its sender unlinked the name: forget it in the tracker too
                self._forget()


class ShmEndpoint(LocalEndpoint):
    """Serves a shared pool; see `LocalEndpoint`. The pool's name is removed at once; each
    sender gets the segment's descriptor with its hello on a Unix socket (and uses it), and
    where this process holds it, for a sender over ``tcp://`` (see the module doc)."""

    def __init__(self, receiver: KVReceiver, shared: SharedPool, *, authkey: bytes, **options: Any) -> None:
        fd = shared.fileno()  # where this process holds the pool, for senders over tcp://
        holder = {"pid": os.getpid(), "fd": fd, "inode": os.fstat(fd).st_ino}
        super().__init__(
            receiver,
            pool_hello(receiver.pool, "shm", segment=shared.descriptor, holder=holder),
            authkey=authkey,
            **options,
        )
        self._shared = shared
        shared.remove_name()

    def hello_fds(self) -> list[int]:
        return [self._shared.fileno()] if self._bound.scheme == "unix" else []


def _open_held(holder: dict[str, Any], segment: dict[str, Any]) -> int:
    """A descriptor of the nameless segment the receiver holds (`Holder`), opened through
    /proc and checked to be that kvferry segment in /dev/shm (nothing else of the
    receiver's, or of this process's, is ever mapped and written)."""
    name = str(segment["name"])
    path = f"/proc/{int(holder['pid'])}/fd/{int(holder['fd'])}"
    if not SEGMENT_NAME.fullmatch(name):
        raise TransferError(f"invalid segment name {name[:80]!r}: not one kvferry makes (kvferry- and 32 hex digits)")
    try:
        target = os.readlink(path)
        if target != f"/dev/shm/{name} (deleted)":
            raise TransferError(f"{path} is {target[:120]!r}, not the receiver's nameless segment {name}")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as err:
        raise TransferError(
            f"cannot open the receiver's shared pool at {path}: {err.strerror or err}: an shm endpoint over "
            "tcp:// needs its senders on its host, in its PID namespace, run by its user (else use unix:// "
            "or the staging transport)"
        ) from err
    st = os.fstat(fd)
    if st.st_ino != int(holder["inode"]) or st.st_dev != os.stat("/dev/shm").st_dev:
        os.close(fd)
        raise TransferError(
            f"{path} is not the receiver's segment (inode {st.st_ino}, the hello says {holder['inode']})"
        )
    return fd


def _open_shared(hello: dict[str, Any], fds: Sequence[int] = ()) -> tuple[PagedKV, Callable[[], None]]:
    if hello["kind"] != "shm":
        raise TransferError(f"the receiver serves a {hello['kind']} pool, not a shared-memory one")
    if len(fds) > 1:
        raise TransferError(f"the receiver passed {len(fds)} descriptors with its hello, a shared pool takes one")
    if fds:
        shared = SharedPool.attach_fd(fds[0], hello["segment"])
    elif hello["holder"]["pid"]:
        fd = _open_held(hello["holder"], hello["segment"])
        try:
            shared = SharedPool.attach_fd(fd, hello["segment"])
        finally:
            os.close(fd)
    else:
        raise TransferError("the receiver's shm hello passed neither the segment's descriptor nor where it holds it")
    assert shared.pool is not None
    try:
        shared.pool.check_compatible(hello["geometry"])
    except BaseException:
        shared.close()
        raise
    return shared.pool, shared.close


class ShmTransport(LocalTransport):
    """Maps the receiver's shared pool; see `LocalTransport`."""

    def __init__(self, address: str, *, authkey: bytes, handshake_timeout: Optional[float] = None) -> None:
        super().__init__(address, authkey=authkey, open_pool=self._open, handshake_timeout=handshake_timeout)

    def _open(self, hello: dict[str, Any]) -> tuple[PagedKV, Callable[[], None]]:
        fds = self._conn.take_fds()
        try:
            return _open_shared(hello, fds)
        finally:
            for fd in fds:  # mapped (or refused): the mapping needs no descriptor
                os.close(fd)
