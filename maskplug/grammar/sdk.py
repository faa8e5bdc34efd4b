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
* Compiles in a process with a limit that holds (:class:`CompileWorker`,
  :func:`check_limit`, :func:`effective_limit`, :data:`DEFAULT_COMPILE_LIMIT_S`),
  spec helpers (:func:`schema_keywords`, :func:`strict_keys_schema`,
  :data:`DEFAULT_MAX_WHITESPACE`), :func:`vocab_from_hf_tokenizer`, and the
  registry's :func:`grammar_provider`, :func:`grammar_providers` and :data:`AUTO`
  for engine integrations.
* :class:`FailedMatcher`: for engine integrations, the stand-in for a grammar
  already marked failed (every call raises its error, so the producer gives
  that request the stop-only rows and reports it in ``failed``).
"""

from __future__ import annotations

from ..errors import GrammarError
from .bases import BatchOpsBase, ChainOpsBase, CompileCache, FailedMatcher, MatcherBase, ProviderBase
from .checks import brief_error, check_bitmask, check_chain_args, check_choice, check_token, schema_dict, schema_text
from .limits import DEFAULT_COMPILE_LIMIT_S, CompileWorker, check_limit, effective_limit
from .pools import shared_pool, spread_tasks
from .protocols import BatchOps, ChainOps, CompiledGrammar, GrammarProvider, Matcher
from .registry import AUTO, grammar_provider, grammar_providers
from .rows import bits_row, stop_row, text_ids
from .spec import DEFAULT_MAX_WHITESPACE, SPEC_KINDS, GrammarSpec, Vocab, schema_keywords, strict_keys_schema
from .vocabs import vocab_from_hf_tokenizer

__all__ = [
    "AUTO",
    "DEFAULT_COMPILE_LIMIT_S",
    "DEFAULT_MAX_WHITESPACE",
    "SPEC_KINDS",
    "BatchOps",
    "BatchOpsBase",
    "ChainOps",
    "ChainOpsBase",
    "CompileCache",
    "CompileWorker",
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
    "check_limit",
    "check_token",
    "effective_limit",
    "grammar_provider",
    "grammar_providers",
    "schema_dict",
    "schema_keywords",
    "schema_text",
    "shared_pool",
    "spread_tasks",
    "stop_row",
    "strict_keys_schema",
    "text_ids",
    "vocab_from_hf_tokenizer",
]
