"""Everything a grammar provider distribution needs, in one public module.

A provider plugin imports from here only::

    from maskplug.grammar.sdk import ChainOpsBase, GrammarSpec, MatcherBase, ProviderBase, Vocab

and registers its factory through ``maskplug_register_grammar_providers``.
How the pieces fit:

* :class:`ProviderBase`: subclass it, set ``name`` and ``kinds`` and
  implement ``_compile(spec)``, which returns an object with ``spec`` and
  ``matcher()`` (:class:`CompiledGrammar`) or raises :class:`GrammarError`
  with the engine's reason; results are kept in a :class:`CompileCache`.
* :class:`MatcherBase`: subclass it and implement the engine primitives
  ``_accept``, ``_rollback``, ``_fill``, ``_is_complete``, ``_reset`` and
  ``_fork``; it gives the normalised :class:`Matcher` semantics (argument
  checks, stop tokens, what ``rollback`` counts, terminated matchers).
  Termination is recorded with ``_set_terminated`` and undone in batch
  rollbacks with ``_unwind_stop``.
* :class:`BatchOpsBase` / :class:`ChainOpsBase`: optional batch operations
  (a matcher's ``batch_ops``); override what the engine does in bulk, and
  implement ``_fill_chains`` for whole draft chains (:class:`ChainOps`).
* Argument checks (:func:`check_token`, :func:`check_bitmask`,
  :func:`check_chain_args`, :func:`brief_error` for an engine's message
  quoted in an error), spec-source readers (:func:`schema_text`,
  :func:`schema_dict`, :func:`check_choice`), fixed rows (:func:`bits_row`,
  :func:`stop_row`, :func:`text_ids`) and the thread pools
  (:func:`shared_pool`, :func:`spread_tasks`).
* :class:`FailedMatcher`: for engine integrations, the stand-in for a grammar
  already marked failed (every call raises its error, so the producer gives
  that request the stop-only rows and reports it in ``failed``).
"""

from __future__ import annotations

from ..errors import GrammarError
from .bases import BatchOpsBase, ChainOpsBase, CompileCache, FailedMatcher, MatcherBase, ProviderBase
from .checks import brief_error, check_bitmask, check_chain_args, check_choice, check_token, schema_dict, schema_text
from .pools import shared_pool, spread_tasks
from .protocols import BatchOps, ChainOps, CompiledGrammar, GrammarProvider, Matcher
from .rows import bits_row, stop_row, text_ids
from .spec import SPEC_KINDS, GrammarSpec, Vocab

__all__ = [
    "SPEC_KINDS",
    "BatchOps",
    "BatchOpsBase",
    "ChainOps",
    "ChainOpsBase",
    "CompileCache",
    "CompiledGrammar",
    "FailedMatcher",
    "GrammarError",
    "GrammarProvider",
    "GrammarSpec",
    "Matcher",
    "MatcherBase",
    "ProviderBase",
    "Vocab",
    "bits_row",
    "brief_error",
    "check_bitmask",
    "check_chain_args",
    "check_choice",
    "check_token",
    "schema_dict",
    "schema_text",
    "shared_pool",
    "spread_tasks",
    "stop_row",
    "text_ids",
]
