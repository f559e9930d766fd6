"""Pieces every `kvferry bench` command shares: the machine's name, percentiles, progress."""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

__all__ = ["emulated_link", "machine", "percentile", "stderr_progress"]


def machine(device: str) -> str:
    """The GPU's name, or the CPU's model and core count."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def emulated_link(device: str, transport: str) -> bool:
    """Whether a bench emulates the link (`ThreadCopyEngine(link_gbps)`): on CPU pools, for a
    transport whose copies the sender's engine makes (the registry's ``direct_copy``); the
    others move their bytes through their own agent or ring, at their own speed."""
    from kvferry.transports import registry

    return device == "cpu" and registry.spec(transport).direct_copy


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``0 <= q <= 1``) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stderr_progress(command: str) -> Callable[[str], None]:
    """A progress callback printing ``[command] message`` lines to stderr."""

    def report(message: str) -> None:
        print(f"[{command}] {message}", file=sys.stderr, flush=True)

    return report
