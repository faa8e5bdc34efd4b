"""maskplug-xgrammar: the xgrammar grammar provider for maskplug.

Installing this distribution registers the provider ``"xgrammar"`` through
the ``maskplug`` entry-point group; use it with
``maskplug.grammar.grammar_provider("xgrammar", vocab)``.
"""

from __future__ import annotations

from .plugin import maskplug_register_grammar_providers
from .provider import (
    XGRAMMAR_COMPILE_LIMIT_S,
    XGrammarBatchOps,
    XGrammarCompiled,
    XGrammarGrammar,
    XGrammarMatcher,
    XGrammarProvider,
)

__all__ = [
    "XGRAMMAR_COMPILE_LIMIT_S",
    "XGrammarBatchOps",
    "XGrammarCompiled",
    "XGrammarGrammar",
    "XGrammarMatcher",
    "XGrammarProvider",
    "maskplug_register_grammar_providers",
]
