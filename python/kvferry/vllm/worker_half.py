"""The worker half of `KvferryConnector` with no vLLM in it: what each of vLLM's worker-side
connector hooks does, in the order vLLM calls them. kvferry.vllm.connector is the thin vLLM
adapter that forwards its hooks here; a test on a machine without vLLM (the GPU machine)
drives this class with CUDA caches and the metadata a real scheduler half built
(tests/test_worker_replay.py), so what runs there is the connector's own worker path.

```
register_kv_caches   -> WorkerHalf.register   (a decode worker then starts its rendezvous)
bind_connector_meta  -> WorkerHalf.bind       (preempted sends given up, decode requests
                                               expected, refusals noted, new sends and the
                                               early send, in that order)
save_kv_layer        -> WorkerHalf.save_layer (layer groups of the last chunk)
wait_for_save        -> WorkerHalf.wait_for_save
get_finished / ...   -> WorkerHalf.results    (finished sending, finished receiving, failed)
```
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kvferry.vllm.decode_worker import DecodeWorker
from kvferry.vllm.metadata import Handshake, KvferryMetadata, KvferryWorkerMeta
from kvferry.vllm.prefill_worker import PrefillWorker
from kvferry.vllm.worker import WorkerCommon

__all__ = ["WorkerHalf"]


class WorkerHalf:
    """One engine worker's kvferry roles over one `WorkerCommon`: a `PrefillWorker` on a
    ``kv_producer``, a `DecodeWorker` on a ``kv_consumer``, both on ``kv_both``."""

    def __init__(self, common: WorkerCommon, kv_role: str) -> None:
        self.common = common
        self.prefill = PrefillWorker(common) if kv_role in ("kv_producer", "kv_both") else None
        self.decode = DecodeWorker(common) if kv_role in ("kv_consumer", "kv_both") else None

    def register(self, kv_caches: dict[str, torch.Tensor], layer_index: Callable[[str], int]) -> None:
        self.common.register_kv_caches(kv_caches, layer_index)
        if self.prefill is not None:
            self.prefill.start()  # the host pool late prompts park in, when there is one
        if self.decode is not None:
            self.decode.start()

    def handshake(self) -> Optional[Handshake]:
        return None if self.decode is None else self.decode.handshake()

    def bind(self, meta: KvferryMetadata) -> None:
        if self.prefill is not None:
            self.prefill.preempt(meta)  # before this step's forward reuses their blocks
        if self.decode is not None:
            self.decode.bind(meta)
        for rid, reason in meta.fails:
            self.common.fail_next(rid, None, reason)  # refused by the scheduler half, which keeps the reason
        if self.prefill is not None:
            self.prefill.bind(meta)  # the early sends leave here, before the forward

    def save_layer(self, layer_name: str) -> None:
        if self.prefill is not None:
            self.prefill.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.prefill is not None:
            self.prefill.after_forward()

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) for vLLM's
        ``KVConnectorTransferResults``; ``finished_req_ids``: the requests vLLM finished since
        the last call."""
        sending = self.prefill.results(finished_req_ids) if self.prefill is not None else set()
        failed = self.common.take_failed()
        recving = set(failed)
        if self.decode is not None:
            arrived, lost = self.decode.results(finished_req_ids)
            recving |= arrived
            failed |= lost
        return sending, recving, failed

    def outcomes(self) -> Optional[KvferryWorkerMeta]:
        return self.common.outcomes()  # how this step's transfers ended, for `status`

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
        if self.decode is not None:
            self.decode.close()
        self.common.trace.close()
