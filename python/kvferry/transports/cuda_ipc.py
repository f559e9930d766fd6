"""CUDA IPC: a CUDA pool shared through the IPC handle fields torch shares a tensor's storage
by, sent in the hello of the control channel (kvferry.transports.control) to a peer that
proved the key; the sender opens each layer with torch's own rebuild function (no pickle)
and writes into it with the fused copy kernel, on the same GPU or a peer GPU of the host.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import kvferry._need_torch  # noqa: F401  (before torch: without it, one line naming the extra)

import torch

from kvferry.errors import InvalidArgumentError, TransferError
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.transports.control import LocalEndpoint, LocalTransport, pool_hello

__all__ = ["CudaIpcEndpoint", "CudaIpcTransport", "torch_dtype"]


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


def _open_layer(fields: dict[str, Any], device: Optional[int] = None) -> torch.Tensor:
    """A CUDA tensor rebuilt from `_share_layer`'s fields with torch's own rebuild function
    (no pickle involved), mapped into the context of GPU ``device`` of this process (else
    the index the receiver named). Untested on a GPU in CI (the CUDA tests skip on CPU).

    The sender maps the handles on its own pool's GPU, not on the receiver's index: servers
    of one host are often started with disjoint ``CUDA_VISIBLE_DEVICES``, where the
    receiver's index names another GPU here, or none. CUDA opens a handle of a GPU this
    process cannot see (the driver enables peer access to it lazily), and the copy kernel,
    which runs on the sender's GPU, then writes over NVLink or PCIe peer-to-peer."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor,
        torch.Size(fields["shape"]),
        tuple(fields["stride"]),
        fields["offset"],
        torch.storage.TypedStorage,
        torch_dtype(fields["dtype"]),
        fields["device"] if device is None else device,
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
        super().__init__(
            receiver,
            lambda: pool_hello(pool, "cuda_ipc", layers=[_share_layer(t) for t in pool.layers]),
            authkey=authkey,
            **options,
        )


def _open_ipc_pool(hello: dict[str, Any], device: Optional[int] = None) -> tuple[PagedKV, Callable[[], None]]:
    if hello["kind"] != "cuda_ipc":
        raise TransferError(f"the receiver serves a {hello['kind']} pool, not CUDA IPC handles")
    layers = tuple(_open_layer(fields, device) for fields in hello["layers"])
    geometry = hello["geometry"]
    pool = PagedKV(layers, geometry["tokens_per_block"], hello["block_dim"], geometry["block_layout"])
    pool.check_compatible(hello["geometry"])
    return pool, lambda: None


class CudaIpcTransport(LocalTransport):
    """The sender's side: opens the receiver's layers from the hello's handles on GPU
    ``device`` (an index of this process: the GPU its copies run on; None: the index the
    receiver named, right only where both processes see the same GPUs)."""

    def __init__(
        self,
        address: str,
        *,
        authkey: bytes,
        device: Optional[int] = None,
        handshake_timeout: Optional[float] = None,
    ) -> None:
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise InvalidArgumentError(f"invalid device={device!r}: must be a CUDA device index >= 0 or None")
        super().__init__(
            address,
            authkey=authkey,
            open_pool=lambda hello: _open_ipc_pool(hello, device),
            handshake_timeout=handshake_timeout,
        )
