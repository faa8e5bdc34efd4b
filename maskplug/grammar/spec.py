"""What a grammar request is made of: the spec kinds, :class:`GrammarSpec` and :class:`Vocab`.

Plain value types with no engine behind them; every provider and the core
share them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GrammarError

__all__ = ["SPEC_KINDS", "GrammarSpec", "Vocab"]

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

    @classmethod
    def from_tokenizer_json(
        cls,
        path: Any,
        *,
        eos_tokens: Sequence[str] | None = None,
        vocab_size: int | None = None,
    ) -> Vocab:
        """Load a Hugging Face ``tokenizer.json`` (see :func:`maskplug.grammar.vocabs.load_tokenizer_json`)."""
        from .vocabs import load_tokenizer_json

        return load_tokenizer_json(path, eos_tokens=eos_tokens, vocab_size=vocab_size)

    @classmethod
    def from_tiktoken(
        cls,
        ranks: Any,
        special_tokens: Any = (),
        *,
        num_special_tokens: int | None = None,
        vocab_size: int | None = None,
        eos_ids: Sequence[int] | None = None,
    ) -> Vocab:
        """Build from tiktoken-format ranks (see :func:`maskplug.grammar.vocabs.load_tiktoken`)."""
        from .vocabs import load_tiktoken

        return load_tiktoken(
            ranks, special_tokens, num_special_tokens=num_special_tokens, vocab_size=vocab_size, eos_ids=eos_ids
        )

    @classmethod
    def from_sentencepiece(cls, path: Any, *, vocab_size: int | None = None) -> Vocab:
        """Load a SentencePiece ``.model`` file (see :func:`maskplug.grammar.vocabs.load_sentencepiece`)."""
        from .vocabs import load_sentencepiece

        return load_sentencepiece(path, vocab_size=vocab_size)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Vocab({len(self.tokens)} tokens, eos={list(self.eos_ids)}, vocab_size={self.vocab_size})"
