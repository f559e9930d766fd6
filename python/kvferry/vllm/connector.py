"""`KvferryConnector`: kvferry as a vLLM V1 KV connector. vLLM builds it twice, once per
role: the scheduler half (kvferry.vllm.scheduler) decides per request, the worker half
(kvferry.vllm.worker_half) moves the blocks: a `PrefillWorker` (kvferry.vllm.prefill_worker)
on a kv_producer, a `DecodeWorker` (kvferry.vllm.decode_worker) on a kv_consumer, both on a
kv_both engine, over one `WorkerCommon` (kvferry.vllm.worker). This module is the thin vLLM
adapter: it reads vLLM's config and forwards vLLM's hooks; none of those halves imports vLLM.
docs/vllm.md has the protocol and the flow."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.model_executor.models.utils import extract_layer_index

from kvferry import affinity
from kvferry.errors import InvalidArgumentError
from kvferry.groups import GroupSet, groups_of
from kvferry.vllm.config import ConnectorConfig
from kvferry.vllm.metadata import Handshake, KvferryMetadata, KvferryWorkerMeta
from kvferry.vllm.park import park_blocks
from kvferry.vllm.scheduler import SchedulerSide
from kvferry.vllm.stats import KvferryPromMetrics, KvferryStats
from kvferry.vllm.worker import WorkerCommon
from kvferry.vllm.worker_half import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KvferryConnector"]


# The KV cache layout this connector asks vLLM for (`KvferryConnector.get_required_kvcache_layout`).
REQUIRED_LAYOUT = "LBHNC"


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid KV cache manager on; each KV cache group of a
    request moves with its own block table (kvferry.groups)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Optional[KVCacheConfig] = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        # Read here, at startup, by both halves: a missing, too-open or too-short key file
        # stops the server naming the path (docs/vllm.md, "The key").
        authkey = self.config.authkey()
        if self.config.transfer_cores:
            affinity.set_transfer_cores(self.config.transfer_cores)
        parallel = vllm_config.parallel_config
        pp_size = parallel.pipeline_parallel_size
        kv_role = str(transfer.kv_role)
        if pp_size != 1 and kv_role != "kv_producer":
            # A decode stage would hold part of the layers, which no prefill link plans for.
            raise InvalidArgumentError(
                f"invalid pipeline_parallel_size={pp_size} with kv_role={kv_role!r}: KvferryConnector runs "
                'pipeline parallelism on prefill servers (kv_producer) only (docs/vllm.md, "Pipeline parallelism")'
            )
        tp_size = parallel.tensor_parallel_size
        model = vllm_config.model_config
        mla = bool(getattr(model, "use_mla", False))
        num_kv_heads = 1 if mla else int(model.get_total_num_kv_heads())
        block_size = vllm_config.cache_config.block_size
        assert kv_cache_config is not None  # vLLM 0.32 hands it to both roles
        # Refuses, at startup, a group kvferry cannot move (Mamba/SSM state, ...).
        self.groups = GroupSet(groups_of(kv_cache_config), block_size)
        prefill_pp = self.config.prefill_pp_size
        # A stage's regions overlay its own layers of every group: no contiguous run of the
        # decode server's regions matches them. So neither this server's stages nor, on a
        # decode server, its prefill servers' (no prefill server sends those).
        for name, stages in (
            ("pipeline_parallel_size", pp_size),
            ("kv_connector_extra_config prefill_pp_size", prefill_pp),
        ):
            if stages != 1 and len(self.groups) != 1:
                raise InvalidArgumentError(
                    f"invalid {name}={stages} with {len(self.groups)} KV cache groups (a hybrid model, HMA): "
                    "KvferryConnector runs pipeline parallelism with one KV cache group only"
                )
        prefill_stages = None
        if prefill_pp > 1:  # the layers each stage of the prefill servers holds: vLLM's partition
            from vllm.distributed.utils import get_pp_indices

            layers = model.get_total_num_hidden_layers()
            prefill_stages = [get_pp_indices(layers, s, prefill_pp) for s in range(prefill_pp)]
        # Host blocks for late prompts (kvferry.vllm.park): both halves size the pool alike.
        park = (
            0
            if kv_role == "kv_consumer"
            else park_blocks(self.config.late_host_bytes, kv_cache_config, len(self.groups))
        )
        self._sched: Optional[SchedulerSide] = None
        self._half: Optional[WorkerHalf] = None
        self._worker: Optional[WorkerCommon] = None
        if role == KVConnectorRole.SCHEDULER:
            engine_id = str(transfer.engine_id)
            self._sched = SchedulerSide(
                self.config,
                block_size=block_size,
                role=kv_role,
                engine_id=engine_id,
                kv_cache_manager_getter=lambda: self._kv_cache_manager,
                authkey=authkey,
                tp_size=tp_size,
                num_kv_heads=num_kv_heads,
                mla=mla,
                groups=self.groups,
                pp_size=pp_size,
                park_blocks=park,
                num_blocks=kv_cache_config.num_blocks if park else 0,
            )
        else:
            tp_rank = pp_rank = 0
            if tp_size > 1:
                from vllm.distributed.parallel_state import get_tp_group

                tp_rank = get_tp_group().rank_in_group
            if pp_size > 1:
                from vllm.distributed.parallel_state import get_pp_group

                pp_rank = get_pp_group().rank_in_group
            self._worker = WorkerCommon(
                self.config,
                block_size=block_size,
                num_blocks=kv_cache_config.num_blocks,
                authkey=authkey,
                tp_rank=tp_rank,
                tp_size=tp_size,
                num_kv_heads=num_kv_heads,
                mla=mla,
                groups=self.groups,
                pp_rank=pp_rank,
                pp_size=pp_size,
                prefill_stages=prefill_stages,
                park_blocks=park,
            )
            self._half = WorkerHalf(self._worker, kv_role)
        # The roles' workers (tests and tools read them): None on the scheduler side.
        self._prefill = None if self._half is None else self._half.prefill
        self._decode = None if self._half is None else self._half.decode

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._half is not None
        self._half.register(kv_caches, extract_layer_index)

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        return None if self._half is None else self._half.handshake()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._half is not None and isinstance(connector_metadata, KvferryMetadata)
        self._half.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # nothing to start: the prefill side pushes, the decode side only checks arrivals

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a decode request is scheduled only once all its blocks arrived

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._half is not None:
            self._half.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._half is not None:
            self._half.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._half is not None
        sending, recving, failed = self._half.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        assert self._half is not None
        return self._half.outcomes()  # how this step's transfers ended, for `status`

    def get_kv_connector_stats(self) -> Optional[KvferryStats]:
        # Each half its own: the worker's transfers, the scheduler's unhonoured requests.
        tally = self._worker.tally if self._worker is not None else self._sched.tally if self._sched else None
        if tally is None:
            return None
        stats = KvferryStats(tally.take())
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self._half is not None:
            self._half.close()
        if self._sched is not None:
            self._sched.close()

    # -- scheduler side ------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._sched is not None
        # One per tensor-parallel rank (vLLM keys them by rank): the hello names them all.
        self._sched.set_handshakes({int(r): v for r, v in metadata.items() if isinstance(v, Handshake)})

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvferryWorkerMeta):
            self._sched.record(meta.outcomes)
            self._sched.unparked(meta.unparked)
            self._sched.given_up(meta.given_up)

    def has_pending_push_work(self) -> bool:
        # Keeps vLLM stepping while a prompt waits for its destination after vLLM freed its
        # request (parked in host memory: kvferry.vllm.park): its late send, or its release
        # at destination_timeout_s, leaves from a step.
        return self._sched is not None and self._sched.has_pending()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)  # one group (vLLM's HMA off)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        assert self._sched is not None
        return self._sched.request_finished_all_groups(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # A load writes every group this connector moves (each its own table's blocks).
        return tuple(g.index for g in self.groups.groups)

    # -- the KV cache layout -------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        """The layout every KvferryConnector engine asks vLLM for: ``LBHNC`` (a block's heads
        outermost, so a tensor-parallel head slice is one run per block and layer). vLLM
        takes it wherever the engine's attention backends support it (the CPU backend
        supports only it), so a prefill and a decode server on different backends agree;
        left to their own preferences they could pick different layouts, and kvferry refuses
        a pair whose layouts differ ("layout mismatch"). None with MLA: one latent head,
        where the layouts coincide."""
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        return REQUIRED_LAYOUT

    # -- stats ---------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> KvferryStats:
        return KvferryStats(data=dict(data) if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
