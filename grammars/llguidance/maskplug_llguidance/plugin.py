"""The plugin object the ``maskplug`` entry point ``llguidance`` names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import maskplug

from .conformance import LLGuidanceDriver
from .provider import LLGuidanceProvider


@maskplug.hookimpl
def maskplug_register_grammar_providers(register: Callable[[str, Any], None]) -> None:
    """Register the ``"llguidance"`` provider (factory: ``LLGuidanceProvider(vocab)``)."""
    register(LLGuidanceProvider.name, LLGuidanceProvider)


@maskplug.hookimpl
def maskplug_register_engine_drivers(register: Callable[[str, Any], None]) -> None:
    """Register llguidance driven directly, for ``maskplug conformance`` (factory: ``LLGuidanceDriver(vocab, encoding)``)."""
    register(LLGuidanceProvider.name, LLGuidanceDriver)
