"""What the scheduler half of the connector tells its worker half each step, what the worker
half tells the scheduler half once (the handshake) and each step (how transfers ended). Plain
picklable data: vLLM ships it between the scheduler process and the workers.

With vLLM installed the classes subclass vLLM's metadata bases; without it (the worker's data
path driven on a machine that has no vLLM, as the GPU machine's tests do) they subclass plain
stand-ins of the same names. vLLM checks no type of them; they carry only these fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from kvferry.vllm import redact

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorHandshakeMetadata,
            KVConnectorMetadata,
            KVConnectorWorkerMetadata,
        )
    except ModuleNotFoundError as err:
        if err.name is None or not (err.name == "vllm" or err.name.startswith("vllm.")):
            raise

        class KVConnectorHandshakeMetadata:
            """Stand-in of vLLM's base (no vLLM here)."""

        class KVConnectorMetadata:
            """Stand-in of vLLM's base (no vLLM here)."""

        class KVConnectorWorkerMetadata:
            """Stand-in of vLLM's base (no vLLM here)."""


__all__ = [
    "Chunk",
    "Handshake",
    "KvferryMetadata",
    "KvferryWorkerMeta",
    "Outcome",
    "RecvSpec",
    "SendLeg",
    "SendSpec",
    "leg_name",
    "leg_rank",
]


@dataclass
class RecvSpec:
    """Decode side: a request whose blocks ``[held_blocks, prompt blocks)`` are to arrive, in
    each KV cache group (a sliding-window group: only those of its live window); ``kv_id``:
    the first group's kvferry id (group g's is ``kv_id + g``)."""

    req_id: str
    kv_id: int
    transfer: str
    prompt_len: int
    dst_blocks: list[list[int]]  # the prompt's blocks, one table per KV cache group moved
    held_blocks: int
    digest: str
    timeout_s: float
    # The tensor parallel size of the prefill server that sends it, when its request named it
    # (a router's, NixlConnector's protocol): the decode worker takes any size that pairs
    # with its own. None: the sizes of ``prefill_tp_size``.
    prefill_tp: Optional[int] = None


LEG_MARK = "@p"


def leg_name(name: str, prefill_rank: int, prefill_tp: int, prefill_pp: int = 1) -> str:
    """The name of prefill rank ``prefill_rank``'s part of a transfer or of a prefill
    engine (a sender), ``<name>@p<rank>of<size>``: each rank of a tensor-parallel prefill
    server looks up its own destination and writes through its own endpoint (a staging ring
    has one writer), and the size in the name lets a decode server expecting another refuse
    the lookup at once. The name itself with one prefill rank, as without tensor parallelism.

    Under pipeline parallelism (``prefill_pp`` stages) the rank is vLLM's global one, ``stage
    * prefill_tp + tensor-parallel rank``, and the name ``<name>@p<rank>of<tp>x<pp>``: each
    stage's ranks write their own layers."""
    if prefill_pp > 1:
        return f"{name}{LEG_MARK}{prefill_rank}of{prefill_tp}x{prefill_pp}"
    return name if prefill_tp == 1 else f"{name}{LEG_MARK}{prefill_rank}of{prefill_tp}"


def leg_rank(sender: str) -> Optional[tuple[int, int, int]]:
    """``(prefill rank, prefill tensor parallel size, pipeline parallel size)`` of a sender
    name made by `leg_name`, or None for a name without a mark (one prefill rank)."""
    head, mark, tail = sender.rpartition(LEG_MARK)
    rank, of, sizes = tail.partition("of")
    size, x, stages = sizes.partition("x")
    if not (mark and head and of and rank.isdigit() and size.isdigit() and len(rank) <= 3 and len(size) <= 3):
        return None
    if x and not (stages.isdigit() and len(stages) <= 3):
        return None
    return int(rank), int(size), int(stages) if x else 1


@dataclass
class SendLeg:
    """Under tensor or pipeline parallelism, one (prefill rank, decode rank) link of a send
    (kvferry.ranks; ``prefill_rank`` is vLLM's global rank, ``stage * tp + tp rank``, and a
    stage's rank sends its own layers): the prefill rank's local heads ``src_heads`` go into the decode rank's
    ``dst_heads`` (``whole``: whole blocks), at ``destination`` (that decode rank's published
    blocks, epoch and endpoint). ``rendezvous`` and ``transfer``: where and under which name
    that decode rank published it (for an abandon)."""

    prefill_rank: int
    decode_rank: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]
    whole: bool
    rendezvous: str
    transfer: str
    destination: dict[str, Any]


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
    # A late send: the request finished (its whole prompt computed) before its destination
    # came; vLLM keeps its blocks until the worker reports finished_sending.
    finished: bool = False
    # Tensor parallelism on either side: every link of the send (kvferry.ranks), each
    # prefill rank taking its own. None: one rank each side, ``destination`` is the one.
    legs: Optional[list[SendLeg]] = None
    # False when this step's forward writes some of the hit's blocks (another request
    # scheduled before it in the same step computes them): the prefix then leaves with the
    # first chunk, after the forward, instead of before it.
    early: bool = True


@dataclass
class Chunk:
    """Prefill side: the request's tokens ``[start, end)`` are computed this step, with its
    block table so far."""

    req_id: str
    start: int
    end: int
    src_blocks: list[list[int]]  # one table per KV cache group moved


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
    # Finished prefill requests whose blocks waited for a destination that did not come:
    # (req_id, transfer, why). The worker reports them finished_sending (vLLM frees the
    # blocks) and how they ended.
    releases: list[tuple[str, str, str]] = field(default_factory=list)
    # Finished prefill requests whose blocks park in host memory until their destination
    # comes (kvferry.vllm.park): (req_id, its block table, the host blocks it takes). Each
    # worker copies them and reports the request finished_sending once copied.
    parks: list[tuple[str, list[int], list[int]]] = field(default_factory=list)


@dataclass
class Handshake(KVConnectorHandshakeMetadata):
    """The decode worker's endpoints, for the scheduler half's ``hello`` answer."""

    engine: str
    peer: str


@dataclass(frozen=True)
class Outcome:
    """How one side of a transfer ended on this server: ``state`` is ``"done"`` (every block
    arrived / every write landed), ``"failed"`` or ``"aborted"``; ``error`` says why for the
    last two. The scheduler half keeps the recent ones for the ``status`` op, which any HTTP
    client may ask: ``error`` is the reason without the deployment's addresses
    (`kvferry.vllm.redact`; the full reason is in the server's log)."""

    transfer: str
    state: str
    error: Optional[str] = None

    def __post_init__(self) -> None:
        if self.error is not None:
            object.__setattr__(self, "error", redact.scrub(self.error))


@dataclass
class KvferryWorkerMeta(KVConnectorWorkerMetadata):
    """The transfers the worker half settled this step (vLLM reports a failed load by request
    id only, and drops the connector's answer of a request it finishes with an error, so the
    reasons come back this way)."""

    outcomes: list[Outcome] = field(default_factory=list)
    # Parked requests whose late send ended (or was released) on this worker: their host
    # blocks are free once every worker reported them (kvferry.vllm.park).
    unparked: list[str] = field(default_factory=list)
    # Transfers the prefill side gave up (an abandon, or a lookup that waited out its bound)
    # before any decode request here published them: that request is computed here.
    given_up: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvferryWorkerMeta)
        return KvferryWorkerMeta(
            self.outcomes + other.outcomes, self.unparked + other.unparked, self.given_up + other.given_up
        )
