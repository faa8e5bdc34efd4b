"""Shared configuration of the maskplug-vllm tests (run in the vLLM virtual environment)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# The same profiles as the core suite: CI runs every property with 1,000 examples.
settings.register_profile(
    "ci",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "dev",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (and vLLM's CUDA build); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def patched() -> object:
    """The adapter's patches installed for one test, removed afterwards."""
    import maskplug_vllm

    maskplug_vllm.install()
    try:
        yield maskplug_vllm
    finally:
        maskplug_vllm.uninstall()
