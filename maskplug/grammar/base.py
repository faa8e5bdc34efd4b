"""The grammar interfaces and provider helpers under their earlier module name.

They live in :mod:`maskplug.grammar.spec`, :mod:`~maskplug.grammar.protocols`,
:mod:`~maskplug.grammar.registry`, :mod:`~maskplug.grammar.pools` and, for
provider distributions, :mod:`maskplug.grammar.sdk`; this module re-exports
them so existing imports keep working.
"""

from __future__ import annotations

from .bases import CompileCache, MatcherBase, ProviderBase
from .checks import check_bitmask, check_chain_args, check_token
from .pools import shared_pool, spread_tasks
from .protocols import BatchOps, CompiledGrammar, GrammarProvider, Matcher
from .registry import grammar_provider, grammar_providers
from .spec import SPEC_KINDS, GrammarSpec, Vocab

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
    "check_chain_args",
    "check_token",
    "grammar_provider",
    "grammar_providers",
    "shared_pool",
    "spread_tasks",
]
