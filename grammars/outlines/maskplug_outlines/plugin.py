"""The plugin object the ``maskplug`` entry point ``outlines-core`` names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import maskplug

from .conformance import OutlinesDriver
from .provider import OutlinesProvider


@maskplug.hookimpl
def maskplug_register_grammar_providers(register: Callable[[str, Any], None]) -> None:
    """Register the ``"outlines-core"`` provider (factory: ``OutlinesProvider(vocab)``)."""
    register(OutlinesProvider.name, OutlinesProvider)


@maskplug.hookimpl
def maskplug_register_engine_drivers(register: Callable[[str, Any], None]) -> None:
    """Register outlines-core driven directly, for ``maskplug conformance`` (``OutlinesDriver(vocab, encoding)``)."""
    register(OutlinesProvider.name, OutlinesDriver)
