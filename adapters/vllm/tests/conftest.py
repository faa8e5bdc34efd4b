"""Shared configuration of the maskplug-vllm tests (run in the vLLM virtual environment)."""

from __future__ import annotations

import os

# vLLM's CPU worker does not reduce torch to one thread here, and idle OpenMP and
# numba threads (the n-gram drafter starts them) then spin against the model's
# operators on a 2-core machine: speculative steps were tens of times slower.
# Set before torch loads, so the engines these tests start (in this process or
# in subprocesses, which inherit it) compute on one thread with sleeping idlers.
for _name, _value in (("OMP_NUM_THREADS", "1"), ("OMP_WAIT_POLICY", "PASSIVE"), ("NUMBA_NUM_THREADS", "1")):
    os.environ.setdefault(_name, _value)

import pytest  # noqa: E402
from vllm_release import skip_other_release_tests  # noqa: E402

from maskplug.testing import load_hypothesis_profile, skip_gpu_tests  # noqa: E402

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
