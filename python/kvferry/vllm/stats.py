"""kvferry's figures on each server's Prometheus ``/metrics``: the worker half tallies them
(`Tally`), vLLM ships them to its logger as `KvferryStats`, and `KvferryPromMetrics` turns
them into counters and histograms named ``vllm:kvferry_*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvferry.vllm.tally import COUNTERS, FAILURE_REASONS, HISTOGRAMS, UNHONOURED_REASONS, Tally, failure_reason

__all__ = [
    "COUNTERS",
    "FAILURE_REASONS",
    "HISTOGRAMS",
    "UNHONOURED_REASONS",
    "KvferryPromMetrics",
    "KvferryStats",
    "Tally",
    "failure_reason",
]


@dataclass
class KvferryStats(KVConnectorStats):
    """``data``: ``{"counts": {name: int}, "observed": {name: [float]}}``."""

    def __post_init__(self) -> None:
        self.data.setdefault("counts", {})
        self.data.setdefault("observed", {})

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counts": {}, "observed": {}}

    def aggregate(self, other: KVConnectorStats) -> KvferryStats:
        counts, observed = self.data["counts"], self.data["observed"]
        for name, value in other.data.get("counts", {}).items():
            counts[name] = counts.get(name, 0) + value
        for name, values in other.data.get("observed", {}).items():
            observed.setdefault(name, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counts"])
        for name, values in self.data["observed"].items():
            if values:
                out[f"{name}_mean"] = round(sum(values) / len(values), 6)
        return out

    def is_empty(self) -> bool:
        return not self.data["counts"] and not any(self.data["observed"].values())


class KvferryPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvferry_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        self.histograms = {
            name: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:kvferry_{name}", documentation=doc, buckets=list(buckets), labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, (doc, buckets) in HISTOGRAMS.items()
        }
        failures = self._counter_cls(
            name="vllm:kvferry_failures",
            documentation="Transfers that failed (either side), by the kind of their error.",
            labelnames=[*labelnames, "reason"],
        )
        self.failures = {
            (idx, reason): failures.labels(*values, reason)
            for idx, values in per_engine_labelvalues.items()
            for reason in FAILURE_REASONS
        }

        unhonoured = self._counter_cls(
            name="vllm:kvferry_unhonoured",
            documentation="Requests whose kv_transfer_params were not served as they asked, by reason: "
            + "; ".join(f"{k}: {v}" for k, v in UNHONOURED_REASONS.items()),
            labelnames=[*labelnames, "reason"],
        )
        self.unhonoured = {
            (idx, reason): unhonoured.labels(*values, reason)
            for idx, values in per_engine_labelvalues.items()
            for reason in UNHONOURED_REASONS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counts", {}).items():
            if name in self.counters:
                self.counters[name][engine_idx].inc(value)
            elif name.startswith("failures/") and (engine_idx, name[9:]) in self.failures:
                self.failures[(engine_idx, name[9:])].inc(value)
            elif name.startswith("unhonoured/") and (engine_idx, name[11:]) in self.unhonoured:
                self.unhonoured[(engine_idx, name[11:])].inc(value)
        for name, values in transfer_stats_data.get("observed", {}).items():
            if name in self.histograms:
                for value in values:
                    self.histograms[name][engine_idx].observe(value)
