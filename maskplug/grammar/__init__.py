"""The grammar side: vocabularies, grammar specs, providers and matchers.

Providers live in their own distributions (``maskplug-xgrammar``,
``maskplug-outlines``, ``maskplug-llguidance``) and register through
``maskplug_register_grammar_providers``; the core only sees the protocols
below. The modules:

* :mod:`~maskplug.grammar.spec`: :class:`GrammarSpec` and :class:`Vocab`;
* :mod:`~maskplug.grammar.protocols`: :class:`Matcher`, :class:`CompiledGrammar`,
  :class:`GrammarProvider`, :class:`BatchOps` and :class:`ChainOps`;
* :mod:`~maskplug.grammar.registry`: :func:`grammar_provider` and
  :func:`grammar_providers`;
* :mod:`~maskplug.grammar.sdk`: what a provider distribution builds on, from
  :mod:`~maskplug.grammar.bases` (provider, matcher and batch bases),
  :mod:`~maskplug.grammar.checks` (argument checks, spec-source readers),
  :mod:`~maskplug.grammar.rows` (fixed mask rows) and
  :mod:`~maskplug.grammar.pools` (thread pools);
* :mod:`~maskplug.grammar.draft`: draft-row filling and commit;
* :mod:`~maskplug.grammar.jobs`: who holds a matcher, and draft-mask jobs
  (``fill_draft_masks(..., wait=False)``);
* :mod:`~maskplug.grammar.vocabs`: vocabularies from tokenizer files (and the
  real ones in the ``mistral-common`` wheel).
"""

from __future__ import annotations

from .bases import CompileCache, MatcherBase, ProviderBase
from .checks import check_bitmask, check_token
from .draft import CommitResult, DraftMasksJob, commit, commit_many, fill_draft_masks
from .protocols import BatchOps, ChainOps, CompiledGrammar, GrammarProvider, Matcher, TreeOps
from .registry import grammar_provider, grammar_providers
from .spec import SPEC_KINDS, GrammarSpec, Vocab
from .vocabs import mistral_sentencepiece, mistral_tekken

__all__ = [
    "SPEC_KINDS",
    "BatchOps",
    "ChainOps",
    "CommitResult",
    "CompileCache",
    "CompiledGrammar",
    "DraftMasksJob",
    "GrammarProvider",
    "GrammarSpec",
    "Matcher",
    "MatcherBase",
    "ProviderBase",
    "TreeOps",
    "Vocab",
    "check_bitmask",
    "check_token",
    "commit",
    "commit_many",
    "fill_draft_masks",
    "grammar_provider",
    "grammar_providers",
    "mistral_sentencepiece",
    "mistral_tekken",
]
