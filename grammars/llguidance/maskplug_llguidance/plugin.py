"""The plugin object the ``maskplug`` entry point ``llguidance`` names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import maskplug

from .provider import LLGuidanceProvider


@maskplug.hookimpl
def maskplug_register_grammar_providers(register: Callable[[str, Any], None]) -> None:
    """Register the ``"llguidance"`` provider (factory: ``LLGuidanceProvider(vocab)``)."""
    register(LLGuidanceProvider.name, LLGuidanceProvider)
