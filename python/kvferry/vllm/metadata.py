"""What the scheduler half of the connector tells its worker half each step, and what the
worker half tells the scheduler half once (the handshake). Plain picklable data: vLLM ships
it from the scheduler process to the workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

__all__ = ["Chunk", "Handshake", "KvferryMetadata", "RecvSpec", "SendSpec"]


@dataclass
class RecvSpec:
    """Decode side: a request whose blocks ``[held_blocks, len(dst_blocks))`` are to arrive."""

    req_id: str
    kv_id: int
    transfer: str
    prompt_len: int
    dst_blocks: list[int]
    held_blocks: int
    digest: str
    timeout_s: float


@dataclass
class SendSpec:
    """Prefill side: a request that sends into ``destination`` (the decode side's
    published blocks, epoch and endpoint); ``reused_len``: its prefix-cache hit."""

    req_id: str
    transfer: str
    prompt_len: int
    reused_len: int
    peer: str
    destination: dict[str, Any]
    timeout_s: float


@dataclass
class Chunk:
    """Prefill side: the request's tokens ``[start, end)`` are computed this step, with its
    block table so far."""

    req_id: str
    start: int
    end: int
    src_blocks: list[int]


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    recvs: list[RecvSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    # Requests the scheduler refused (bad kvferry parameters, no destination): the worker
    # reports them as failed loads, which fails them in vLLM's terms.
    fails: list[tuple[str, str]] = field(default_factory=list)
    # Prefill requests vLLM preempted this step (their blocks are freed and may be
    # overwritten by this step's forward): their transfers are given up first.
    preempted: list[str] = field(default_factory=list)


@dataclass
class Handshake(KVConnectorHandshakeMetadata):
    """The decode worker's endpoints, for the scheduler half's ``hello`` answer."""

    engine: str
    peer: str
