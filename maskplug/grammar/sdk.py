"""Everything a grammar provider distribution needs, in one public module.

A provider plugin imports from here only::

    from maskplug.grammar.sdk import ChainOpsBase, GrammarSpec, MatcherBase, ProviderBase, Vocab

and registers its factory through ``maskplug_register_grammar_providers``.
How the pieces fit:

* :class:`ProviderBase`: subclass it, set ``name`` and ``kinds`` and
  implement ``_compile(spec)``, which returns an object with ``spec`` and
  ``matcher()`` (:class:`CompiledGrammar`) or raises :class:`GrammarError`
  with the engine's reason; results are kept in a :class:`CompileCache`
  (the :data:`DEFAULT_CACHE_ENTRIES` most recently used ones).
  A provider whose compiles stop at a limit calls ``_use_worker`` in its
  ``__init__`` and, in ``_compile``, compiles in the calling process when
  ``_limit_for(spec)`` is None, else with ``_run_in_worker(spec, limit)``.
* :class:`MatcherBase`: subclass it and implement the engine primitives
  ``_accept``, ``_rollback``, ``_fill``, ``_is_complete``, ``_reset`` and
  ``_fork``; it gives the normalised :class:`Matcher` semantics (argument
  checks, stop tokens, what ``rollback`` counts, terminated matchers).
  Termination is recorded with ``_set_terminated`` and undone in batch
  rollbacks with ``_unwind_stop``.
* :class:`BatchOpsBase` / :class:`ChainOpsBase`: optional batch operations
  (a matcher's ``batch_ops``); override what the engine does in bulk, and
  implement ``_fill_chains(matchers, chains)`` for whole draft chains
  (:class:`ChainOps`; the checked arguments come as :class:`Chains`).
* Argument checks (:func:`check_token`, :func:`check_bitmask`,
  :func:`check_chain_args`, :func:`brief_error` for an engine's message
  quoted in an error), spec-source readers (:func:`schema_text`,
  :func:`schema_dict`, :func:`check_choice`), fixed rows (:func:`bits_row`,
  :func:`stop_row`, :func:`text_ids`) and the thread pools
  (:func:`shared_pool`, :func:`spread_tasks`).
* Compiles in a process with a limit that holds (:class:`CompileWorker`,
  :func:`check_limit`, :func:`effective_limit`, :data:`DEFAULT_COMPILE_LIMIT_S`),
  spec helpers (:data:`SPEC_KINDS`, :func:`schema_keywords`,
  :func:`strict_keys_schema`, :func:`resolve_ref`, :data:`DEFAULT_MAX_WHITESPACE`,
  :func:`json_whitespace_regex`), :func:`vocab_from_hf_tokenizer`, and the
  registry's :func:`grammar_provider`, :func:`grammar_providers` and :data:`AUTO`
  for engine integrations.
* :class:`FailedMatcher`: for engine integrations, the stand-in for a grammar
  already marked failed (every call raises its error, so the producer gives
  that request the stop-only rows and reports it in ``failed``).
"""

from __future__ import annotations

from typing import Any

from ..errors import GrammarError
from . import limits as _limits
from . import registry as _registry
from . import spec as _spec
from .bases import (
    DEFAULT_CACHE_ENTRIES,
    BatchOpsBase,
    ChainOpsBase,
    Chains,
    CompileCache,
    FailedMatcher,
    MatcherBase,
    ProviderBase,
)
from .checks import brief_error, check_bitmask, check_chain_args, check_choice, check_token, schema_dict, schema_text
from .limits import CompileWorker, check_limit, effective_limit
from .pools import shared_pool, spread_tasks
from .protocols import BatchOps, ChainOps, CompiledGrammar, GrammarProvider, Matcher, TreeOps
from .registry import grammar_provider, grammar_providers
from .rows import bits_row, stop_row, text_ids
from .spec import GrammarSpec, Vocab, schema_keywords, strict_keys_schema
from .vocabs import vocab_from_hf_tokenizer

# The constants are bound here again (the same objects) so that each is documented where providers read it.
AUTO: str = _registry.AUTO
"""The registry name of the ``auto`` provider (``"auto"``), which tries the registered providers in order of
preference for each spec and keeps the first whose grammar enforces all of it (see :mod:`maskplug.grammar.auto`)."""

DEFAULT_COMPILE_LIMIT_S: float = _limits.DEFAULT_COMPILE_LIMIT_S
"""CPU seconds a compile may take unless the provider's ``compile_limit_s`` or the spec's says otherwise
(see :mod:`maskplug.grammar.limits`); the usual default of a provider's ``compile_limit_s`` argument."""

DEFAULT_MAX_WHITESPACE: int = _spec.DEFAULT_MAX_WHITESPACE
"""The default of :attr:`GrammarSpec.max_whitespace`: the most whitespace characters (space, tab, ``\\n``,
``\\r``) in a row between JSON items; ``json.dumps(..., indent=2)`` of deeply nested instances fits."""

SPEC_KINDS: tuple[str, ...] = _spec.SPEC_KINDS
"""Every :attr:`GrammarSpec.kind`: ``json_schema``, ``json_object``, ``regex``, ``ebnf``, ``lark`` and
``choice``; a provider's ``kinds`` is a subset."""


# The characters JSON allows between its tokens (space, newline, carriage return, tab), as a regex class.
_JSON_WS_CLASS = r"[\x20\x0A\x0D\x09]"


def json_whitespace_regex(max_whitespace: int | None) -> str:
    r"""The regex of one whitespace position of a JSON grammar under :attr:`GrammarSpec.max_whitespace`.

    ``[\x20\x0A\x0D\x09]{0,N}`` for a bound ``N >= 1`` (at most ``N`` of space, ``\n``, ``\r`` and tab in a
    row), ``[\x20\x0A\x0D\x09]*`` for None (no bound) and the empty pattern for ``0`` (no whitespace): what
    providers whose engine takes a whitespace pattern (llguidance's ``whitespace_pattern``, outlines-core's
    ``build_regex_from_schema``) pass for ``whitespace="flexible"``. Anything else is a :class:`GrammarError`
    naming ``max_whitespace``.
    """
    if max_whitespace is None:
        return _JSON_WS_CLASS + "*"
    if isinstance(max_whitespace, bool) or not isinstance(max_whitespace, int) or max_whitespace < 0:
        raise GrammarError(f"max_whitespace: expected an int >= 0 or None, got {max_whitespace!r}")
    return "" if max_whitespace == 0 else _JSON_WS_CLASS + "{0," + str(max_whitespace) + "}"


def resolve_ref(root: Any, ref: str) -> Any:
    """The subschema that the local ``$ref`` ``ref`` (``"#"`` or a JSON pointer such as ``"#/$defs/a"``) names in
    the schema ``root``.

    Pointer parts are percent-decoded and ``~1``/``~0`` unescaped as JSON Pointer says; a list is indexed by a
    decimal part. Raises :class:`KeyError` when ``ref`` is not local or names nothing in ``root``.
    """
    return _spec._pointer(root, ref)


__all__ = [
    "AUTO",
    "DEFAULT_CACHE_ENTRIES",
    "DEFAULT_COMPILE_LIMIT_S",
    "DEFAULT_MAX_WHITESPACE",
    "SPEC_KINDS",
    "BatchOps",
    "BatchOpsBase",
    "ChainOps",
    "ChainOpsBase",
    "Chains",
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
    "TreeOps",
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
    "json_whitespace_regex",
    "resolve_ref",
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
