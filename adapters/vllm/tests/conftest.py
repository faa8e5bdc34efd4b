"""Shared configuration of the maskplug-vllm tests (run in the vLLM virtual environment)."""

from __future__ import annotations

import pytest
from vllm_release import skip_other_release_tests

from maskplug.testing import load_hypothesis_profile, skip_gpu_tests

# The same profiles as the core suite: CI runs every property with 1,000 examples.
load_hypothesis_profile()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu_tests(items, reason="needs a CUDA device (and vLLM's CUDA build); none on this machine")
    skip_other_release_tests(items)


@pytest.fixture
def patched() -> object:
    """The adapter's patches installed for one test, removed afterwards."""
    import maskplug_vllm

    maskplug_vllm.install()
    try:
        yield maskplug_vllm
    finally:
        maskplug_vllm.uninstall()
