"""The grammar side: vocabularies, grammar specs, providers and matchers.

Providers live in their own distributions (``maskplug-xgrammar``,
``maskplug-outlines``, ``maskplug-llguidance``) and register through
``maskplug_register_grammar_providers``; the core only sees the protocols
below. :mod:`maskplug.grammar.vocabs` loads vocabularies from tokenizer files
(and the real ones in the ``mistral-common`` wheel).
"""

from __future__ import annotations

from .base import (
    SPEC_KINDS,
    BatchOps,
    CompileCache,
    CompiledGrammar,
    GrammarProvider,
    GrammarSpec,
    Matcher,
    MatcherBase,
    ProviderBase,
    Vocab,
    check_bitmask,
    check_token,
    grammar_provider,
    grammar_providers,
)
from .draft import commit, fill_draft_masks
from .vocabs import mistral_sentencepiece, mistral_tekken

__all__ = [
    "SPEC_KINDS",
    "BatchOps",
    "CompileCache",
    "CompiledGrammar",
    "GrammarProvider",
    "GrammarSpec",
    "Matcher",
    "MatcherBase",
    "ProviderBase",
    "Vocab",
    "check_bitmask",
    "check_token",
    "commit",
    "fill_draft_masks",
    "grammar_provider",
    "grammar_providers",
    "mistral_sentencepiece",
    "mistral_tekken",
]
