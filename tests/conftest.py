"""Shared pytest configuration: bounded hypothesis runs so the whole suite stays fast, and
the fixtures that force timing events (a fake sender clock, a tier wait observed)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# 200 examples per property keeps the suite well under a minute; deadline=None because the
# first call of a property pays for numpy/extension warm-up. KVFERRY_HYPOTHESIS_PROFILE=thorough
# runs ten times as many for a slow local soak.
settings.register_profile(
    "default",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("KVFERRY_HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    """Tests marked ``cuda`` need a GPU: skipped where torch sees none (CPU CI), run on the
    device machine."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class FakeClock:
    """The sender's clock, moved by hand: a test that needs a copy to outlive the sender's
    timeout advances it past the timeout instead of sleeping (the copy itself is held by an
    event, so it cannot finish meanwhile)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def sender_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """A `FakeClock` as ``kvferry.sender``'s ``time``: copy ages, timeouts and deadlines."""
    import kvferry.sender

    clock = FakeClock()
    monkeypatch.setattr(kvferry.sender, "time", clock)
    return clock


@pytest.fixture
def tier_waits(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a copy engine starts waiting for a tier signal (`kvferry.engine.await_signal`):
    from then on that copy, and every later copy of the engine, waits for the signal."""
    import kvferry.engine

    entered = threading.Event()
    original = kvferry.engine.await_signal

    def watched(signal: Any, closing: threading.Event) -> None:
        entered.set()
        original(signal, closing)

    monkeypatch.setattr(kvferry.engine, "await_signal", watched)
    return entered
