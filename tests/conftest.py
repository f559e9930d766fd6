"""Shared pytest configuration: bounded hypothesis runs so the whole suite stays fast."""

from __future__ import annotations

import os

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
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
