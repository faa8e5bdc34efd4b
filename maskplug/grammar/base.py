"""Protocols and value types shared by every grammar provider."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import GrammarError
from ..plugins import get_registry

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

SPEC_KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark", "choice")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match.

    ``kind`` is one of :data:`SPEC_KINDS`. ``source`` is the schema (a JSON
    string or a dict) for ``json_schema``, ignored for ``json_object``, the
    pattern for ``regex``, the grammar text for ``ebnf``/``lark``, and a list
    of strings for ``choice``.
    """

    kind: str
    source: Any = None

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise GrammarError(f"kind: expected one of {SPEC_KINDS}, got {self.kind!r}")

    def key(self) -> str:
        """A canonical string for caching (dict schemas are serialised with sorted keys)."""
        src = self.source
        if isinstance(src, (dict, list, tuple)):
            src = json.dumps(src, sort_keys=True, separators=(",", ":"))
        return f"{self.kind}:{src}"


class Vocab:
    """A model's vocabulary, as decoded bytes per token id.

    Args:
        tokens: ``tokens[i]`` is the byte string token ``i`` decodes to
            (special tokens: their literal text, they are never allowed by a
            grammar except as stop tokens).
        eos_ids: the stop tokens.
        special_ids: token ids that are control tokens (never grammar text).
        vocab_size: the model's padded logits width (``>= len(tokens)``); it
            fixes the mask width ``ceil(vocab_size / 32)``.
    """

    def __init__(
        self,
        tokens: Sequence[bytes],
        eos_ids: Iterable[int],
        special_ids: Iterable[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        toks = list(tokens)
        for i, t in enumerate(toks):
            if not isinstance(t, (bytes, bytearray)):
                raise GrammarError(f"tokens[{i}]: expected bytes, got {type(t).__name__}")
        self.tokens: list[bytes] = [bytes(t) for t in toks]
        self.eos_ids: tuple[int, ...] = tuple(int(e) for e in eos_ids)
        if not self.eos_ids:
            raise GrammarError("eos_ids: expected at least one stop token, got none")
        self.special_ids: frozenset[int] = frozenset(int(s) for s in special_ids) | frozenset(self.eos_ids)
        size = len(self.tokens) if vocab_size is None else int(vocab_size)
        if size < len(self.tokens):
            raise GrammarError(f"vocab_size: expected >= len(tokens) = {len(self.tokens)}, got {size}")
        self.vocab_size: int = size
        for name, ids in (("eos_ids", self.eos_ids), ("special_ids", self.special_ids)):
            bad = [i for i in ids if not 0 <= i < len(self.tokens)]
            if bad:
                raise GrammarError(f"{name}: expected ids in [0, {len(self.tokens)}), got {bad[:5]}")
        self._fingerprint: str | None = None

    @property
    def mask_words(self) -> int:
        """Words per bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    @property
    def fingerprint(self) -> str:
        """A digest of the tokens, stop and special ids and size (cache key)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for t in self.tokens:
                h.update(len(t).to_bytes(4, "little"))
                h.update(t)
            h.update(repr((self.eos_ids, sorted(self.special_ids), self.vocab_size)).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """A CPU int32 bitmask of ``rows`` rows, all tokens allowed."""
        return torch.full((rows, self.mask_words), -1, dtype=torch.int32)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Vocab({len(self.tokens)} tokens, eos={list(self.eos_ids)}, vocab_size={self.vocab_size})"


@runtime_checkable
class Matcher(Protocol):
    """One request's grammar state. Identical semantics for every provider.

    * ``accept(token)``: advance by one token; False (state unchanged) when the
      grammar does not allow it. Accepting a stop token terminates.
    * ``validate(tokens)``: length of the accepted prefix, without advancing.
    * ``rollback(n)``: undo the last ``n`` accepted tokens (a stop token counts).
    * ``fill(bitmask, row)``: write the allowed set into ``bitmask[row]`` (a CPU
      int32 tensor exactly ``ceil(vocab_size/32)`` words wide); returns False
      when every token is allowed. A terminated matcher allows only the stop
      tokens.
    * ``is_terminated()``, ``reset()``, ``fork()`` (an independent copy).
    """

    def accept(self, token: int) -> bool: ...
    def validate(self, tokens: Sequence[int]) -> int: ...
    def rollback(self, n: int) -> None: ...
    def fill(self, bitmask: torch.Tensor, row: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def reset(self) -> None: ...
    def fork(self) -> Matcher: ...


@runtime_checkable
class CompiledGrammar(Protocol):
    """A grammar compiled for one vocabulary; cheap to make matchers from."""

    spec: GrammarSpec

    def matcher(self) -> Matcher: ...


@runtime_checkable
class GrammarProvider(Protocol):
    """A grammar engine bound to one :class:`Vocab`."""

    name: str
    vocab: Vocab
    kinds: frozenset[str]

    def supports(self, kind: str) -> bool: ...
    def compile(self, spec: GrammarSpec) -> CompiledGrammar: ...


@dataclass
class _ProviderCache:
    by_key: dict[tuple[str, str], GrammarProvider] = field(default_factory=dict)


_cache = _ProviderCache()


def grammar_providers() -> list[str]:
    """Names of the registered grammar providers."""
    return sorted(get_registry().grammar_providers)


def grammar_provider(name: str, vocab: Vocab) -> GrammarProvider:
    """The provider ``name`` bound to ``vocab`` (one instance per vocabulary, so its compile cache is shared)."""
    if not isinstance(vocab, Vocab):
        raise GrammarError(f"vocab: expected a maskplug Vocab, got {type(vocab).__name__}")
    factories = get_registry().grammar_providers
    if name not in factories:
        raise GrammarError(f"name: expected one of the registered providers {sorted(factories)}, got {name!r}")
    key = (name, vocab.fingerprint)
    prov = _cache.by_key.get(key)
    if prov is None:
        prov = factories[name](vocab)
        _cache.by_key[key] = prov
    return prov
