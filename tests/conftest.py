"""Shared test configuration: hypothesis profiles and device markers."""

from __future__ import annotations

import pytest

from maskplug.testing import load_hypothesis_profile, skip_gpu_tests

# CI runs every property with at least 1,000 examples; local runs stay quick
# unless HYPOTHESIS_PROFILE=ci is set by hand.
load_hypothesis_profile()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu_tests(items)
