"""The plugin object the ``maskplug`` entry point ``xgrammar`` names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import maskplug

from .conformance import XGrammarDriver
from .provider import XGrammarProvider


@maskplug.hookimpl
def maskplug_register_grammar_providers(register: Callable[[str, Any], None]) -> None:
    """Register the ``"xgrammar"`` provider (factory: ``XGrammarProvider(vocab)``)."""
    register(XGrammarProvider.name, XGrammarProvider)


@maskplug.hookimpl
def maskplug_register_engine_drivers(register: Callable[[str, Any], None]) -> None:
    """Register xgrammar driven directly, for ``maskplug conformance`` (factory: ``XGrammarDriver(vocab, encoding)``)."""
    register(XGrammarProvider.name, XGrammarDriver)
