"""The grammar side: vocabularies, grammar specs, providers and matchers.

Providers live in their own distributions (``maskplug-xgrammar``,
``maskplug-outlines``, ``maskplug-llguidance``) and register through
``maskplug_register_grammar_providers``; the core only sees the protocols
below.
"""

from __future__ import annotations

from .base import (
    SPEC_KINDS,
    CompiledGrammar,
    GrammarProvider,
    GrammarSpec,
    Matcher,
    Vocab,
    grammar_provider,
    grammar_providers,
)

__all__ = [
    "SPEC_KINDS",
    "CompiledGrammar",
    "GrammarProvider",
    "GrammarSpec",
    "Matcher",
    "Vocab",
    "grammar_provider",
    "grammar_providers",
]
