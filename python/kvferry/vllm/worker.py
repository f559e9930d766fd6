"""The worker half of `KvferryConnector`: what both roles share (vLLM's KV tensors as a
`PagedKV`, the tally, how transfers ended), and the requests the scheduler half refused.
The roles themselves are `PrefillWorker` (kvferry.vllm.prefill_worker: kvferry's sender)
and `DecodeWorker` (kvferry.vllm.decode_worker: kvferry's receiver); a ``kv_both`` engine
runs both over one `WorkerCommon`.

```
prefill step:  bind_connector_metadata: add new sends (TransferHook.add_request), then
                 TransferHook.before_forward for each first chunk  (the early send)
               forward: save_kv_layer -> TransferHook.after_layer on the last chunk (layer groups)
               wait_for_save: TransferHook.after_forward for each chunk, poll
               get_transfer_results: a finished request whose writes all landed -> finished_sending
decode step:   bind_connector_metadata: KVReceiver.expect each new request, publish its destination
               get_transfer_results: every block arrived -> finished_recving; failed, aborted,
                 timed out or abandoned -> cancelled, released once fenced -> finished_recving
                 (+ failed_recving unless it was aborted)
```
Every kvferry call is made per request: one request's failure (its peer gone, a refused
write) fails that request and leaves the others' sends running.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Callable, Optional, Sequence

import torch

from kvferry import ranks
from kvferry.errors import InvalidArgumentError, KvFerryError
from kvferry.groups import GroupSet, pool_layers
from kvferry.layout import PagedKV, paged_kv_from_views
from kvferry.trace import Tracer
from kvferry.vllm.config import ConnectorConfig
from kvferry.vllm.metadata import KvferryWorkerMeta, Outcome
from kvferry.vllm.tally import Tally

logger = logging.getLogger("kvferry.vllm")


class WorkerCommon:
    """What the prefill and decode workers of one engine share."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        block_size: int,
        num_blocks: int,
        authkey: bytes,
        tp_rank: int = 0,
        tp_size: int = 1,
        num_kv_heads: int = 1,
        mla: bool = False,
        groups: Optional[GroupSet] = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        prefill_stages: Optional[Sequence[tuple[int, int]]] = None,
        park_blocks: int = 0,
    ) -> None:
        self.config = config
        # Prefill side: the host pool's size for late prompts, in blocks (kvferry.vllm.park;
        # the scheduler half sizes it the same way and decides what parks where). 0: none.
        self.park_blocks = park_blocks
        # This worker's tensor-parallel rank and size, the model's KV heads (all ranks) and
        # whether it is MLA (one latent head on every rank): which heads it holds, and with
        # the other side's size, which links it sends or receives on (kvferry.ranks).
        self.tp_rank, self.tp_size, self.num_kv_heads, self.mla = tp_rank, tp_size, num_kv_heads, mla
        # Pipeline parallelism on a prefill server: this worker's stage holds only its layers
        # and sends them. ``rank``: vLLM's global rank, which names its part of a transfer.
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.rank = pp_rank * tp_size + tp_rank
        # Decode side: the model's layers ``[lo, hi)`` each stage of the prefill servers holds
        # (``prefill_pp_size`` > 1; vLLM's partition), which `stage_slices` maps onto the pool.
        self.prefill_stages = tuple(prefill_stages) if prefill_stages is not None else None
        self.layer_ids: list[int] = []  # the model's layer index of each pool layer
        # The KV cache groups moved (one full-attention group when not given), each request as
        # one kvferry request per group.
        self.groups = groups if groups is not None else GroupSet.single(block_size)
        # The control channel's key, read at startup (config.load_authkey): the same file on
        # both servers; it never travels in a request, an answer, a log line or a metric.
        self.authkey = authkey
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.engine = secrets.token_hex(8)  # this engine process's id (a restart gets a new one)
        self.trace = Tracer(config.trace, engine=self.engine)  # one JSON line per stage, when on
        self.pool: Optional[PagedKV] = None
        self.views: tuple[torch.Tensor, ...] = ()  # vLLM's per-layer views the pool reads
        self.layer_of: dict[str, int] = {}
        self.tally = Tally()
        # How transfers ended since the last step's report (both roles), for the scheduler
        # half's ``status`` answers.
        self._outcomes: list[Outcome] = []
        self.unparked: list[str] = []  # parked requests this worker is done with (kvferry.vllm.park)
        self.given_up: list[str] = []  # transfers abandoned before a decode request here published them
        # Requests the scheduler half refused: reported as failed loads at the next results.
        self._fail_next: dict[str, tuple[Optional[str], str]] = {}  # req_id -> (transfer, reason)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layer_index: Callable[[str], int]) -> None:
        """vLLM 0.32 hands one ``[B, H, N, C]`` view per layer (blocks, KV heads or MLA's one
        latent head, tokens, K|V content) of one allocation, in the physical order of its
        resolved KVCacheLayout (docs/vllm.md, "KV cache layouts"): the pool reads them where
        they lie (`paged_kv_from_views`: no copy; vLLM's inference tensors are taken as plain
        aliases of the same memory, which kvferry's copy threads may write)."""
        # With several KV cache groups their layers overlay one another: one per region.
        names, self.layer_of = pool_layers(kv_caches, self.groups.groups, layer_index)
        self.layer_ids = [layer_index(n) for n in names]
        tensors = self.views = tuple(kv_caches[n] for n in names)
        try:
            self.pool = paged_kv_from_views(tensors, num_blocks=self.num_blocks, tokens_per_block=self.block_size)
        except InvalidArgumentError as err:
            raise KvFerryError(f"kvferry: cannot register vLLM's KV cache: {err}") from None
        if self.tp_size > 1:
            lo, hi = (0, 1) if self.mla else ranks.rank_heads(self.tp_rank, self.tp_size, self.num_kv_heads)
            if self.pool.num_heads != hi - lo:
                raise KvFerryError(
                    f"kvferry: vLLM's KV cache of tensor-parallel rank {self.tp_rank} of {self.tp_size} holds "
                    f"{self.pool.num_heads} KV heads, kvferry expects {hi - lo} of the model's {self.num_kv_heads}"
                )
        from kvferry.vllm import paths

        # An explicit transport that cannot serve these caches (cuda-ipc over CPU caches) is
        # refused here, at startup, by name: not at the first request.
        paths.offered(self.config.transport, self.pool.device.type)
        if self.config.layer_groups > self.pool.num_layers:
            raise KvFerryError(
                f"invalid kv_connector_extra_config layer_groups={self.config.layer_groups}: "
                + (
                    f"the model has {self.pool.num_layers} layers"
                    if self.pp_size == 1
                    else f"pipeline stage {self.pp_rank} of {self.pp_size} holds {self.pool.num_layers} layers"
                )
            )

    def stage_slices(self) -> list[Optional[tuple[int, int]]]:
        """The pool layers ``[lo, hi)`` each prefill stage writes (decode side), in stage
        order (`kvferry.ranks.stage_slices`); ``[None]`` (the whole pool) when the prefill
        servers have one stage."""
        if self.prefill_stages is None or len(self.prefill_stages) == 1:
            return [None]
        try:
            return list(ranks.stage_slices(self.layer_ids, self.prefill_stages))
        except InvalidArgumentError as err:
            raise KvFerryError(f"kvferry: cannot map the prefill pipeline stages onto vLLM's KV cache: {err}") from None

    def link_pool(self, heads: tuple[int, int], whole: bool) -> PagedKV:
        """The part of this rank's pool a tensor-parallel link moves: the whole pool, or the
        head slice ``heads`` (`PagedKV.heads`)."""
        assert self.pool is not None
        return self.pool if whole else self.pool.heads(*heads)

    def ended(self, side: str, transfer: str, rid: str, state: str, error: Optional[str] = None, **landed: Any) -> None:
        """How ``transfer`` (request ``rid``) ended on ``side``: for the scheduler half's
        ``status`` answers, in the trace (``landed``: its bytes and time, when done) and, when it
        did not end done, in the failures metric by reason."""
        self._outcomes.append(Outcome(transfer, state, error))
        if state == "done":
            self.trace.ended(side, transfer, rid, **landed)
        else:
            self.trace.ended(side, transfer, rid, error or state)
            self.tally.fail(error or state)

    def fail_next(self, rid: str, transfer: Optional[str], reason: str) -> None:
        """Reports ``rid`` as a failed load at the next `take_failed` (vLLM then fails it)."""
        self._fail_next[rid] = (transfer, reason)

    def take_failed(self) -> set[str]:
        failed = set(self._fail_next)
        for rid, (transfer, reason) in self._fail_next.items():
            logger.error("kvferry: request %s failed: %s", rid, reason)
            if transfer is not None:
                self.ended("decode", transfer, rid, "failed", reason)
            else:
                self.tally.fail(reason)
        self._fail_next.clear()
        return failed

    def outcomes(self) -> Optional[KvferryWorkerMeta]:
        """The transfers settled since the last call (vLLM hands them to the scheduler half
        with this step's output), or ``None``."""
        if not self._outcomes and not self.unparked and not self.given_up:
            return None
        meta = KvferryWorkerMeta(self._outcomes, self.unparked, self.given_up)
        self._outcomes, self.unparked, self.given_up = [], [], []
        return meta
