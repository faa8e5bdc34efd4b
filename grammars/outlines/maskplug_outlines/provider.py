"""The outlines-core provider: regex and JSON-schema grammars as token automata.

outlines-core compiles a regular expression into an ``Index``, a deterministic
automaton over token ids, built eagerly for the whole vocabulary (from
milliseconds for a small regex to seconds for a JSON schema on a 131k-token
vocabulary, so compiled grammars are cached per provider and spec). A
``Guide`` walks one request through it.

What this module normalises, so callers see maskplug's matcher semantics:

* **Stop tokens.** outlines-core knows a single EOS id and ``Guide.advance``
  on it raises ``ValueError`` in a final state. The stop token never reaches
  the engine here: :class:`maskplug.grammar.base.MatcherBase` accepts it when
  the automaton is in a final state and terminates, and every stop id of the
  vocabulary is allowed in a final state (not only the first).
* **Rollback.** ``Guide.rollback_state`` is bounded by ``max_rollback``; past
  that bound the guide is rebuilt from the accepted tokens, so ``rollback`` is
  unlimited, and a stop token counts as one step like any other.
* **Buffer sizing.** ``write_mask_into`` checks the buffer against the number
  of vocabulary entries, not the largest token id, and silently drops allowed
  ids that fall beyond it. The buffer handed over is always the full
  ``ceil(vocab_size / 32)``-word row, so every id below ``vocab_size`` fits.
* **Special tokens** (and empty or padding tokens) are left out of the
  engine's vocabulary, so they are never allowed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from maskplug import GrammarError
from maskplug.grammar.base import GrammarSpec, MatcherBase, ProviderBase, Vocab

__all__ = ["OutlinesGrammar", "OutlinesMatcher", "OutlinesProvider", "choice_regex", "grammar_text_ids"]

# Draft windows are a handful of tokens; deeper rollbacks rebuild the guide.
_MAX_ROLLBACK = 64

# Characters with a meaning in outlines-core's (Rust regex-syntax) patterns.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~ ")


def grammar_text_ids(vocab: Vocab) -> list[int]:
    """Ids whose bytes may appear in grammar text: real tokens that are neither special nor empty."""
    special = vocab.special_ids
    return [i for i, t in enumerate(vocab.tokens) if t and i not in special]


def choice_regex(choices: Any) -> str:
    """A regex matching exactly one of ``choices`` (a non-empty list of non-empty strings)."""
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
        raise GrammarError(f"spec.source: expected a non-empty list of strings for kind 'choice', got {choices!r}")
    parts = []
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise GrammarError(f"spec.source[{i}]: expected a non-empty str, got {c!r}")
        # Escaping every meta character (and only those) keeps the pattern
        # valid for regex-syntax, which rejects escapes of ordinary letters.
        parts.append("".join("\\" + ch if ch in _REGEX_META else ch for ch in c))
    return "(" + "|".join(parts) + ")"


def _schema_text(source: Any) -> str:
    if isinstance(source, dict):
        return json.dumps(source)
    if isinstance(source, str):
        try:
            json.loads(source)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"spec.source: expected a JSON schema, got text that is not JSON ({exc})") from exc
        return source
    raise GrammarError(f"spec.source: expected a JSON schema as a dict or str, got {type(source).__name__}")


class OutlinesGrammar:
    """A grammar compiled by outlines-core: the regex it became and its token ``Index``."""

    def __init__(self, provider: OutlinesProvider, spec: GrammarSpec, regex: str, index: Index) -> None:
        self.provider = provider
        self.spec = spec
        self.regex = regex
        self.index = index

    def matcher(self) -> OutlinesMatcher:
        """A fresh matcher at the start of the grammar."""
        return OutlinesMatcher(self)


class OutlinesMatcher(MatcherBase):
    """One request's position in an :class:`OutlinesGrammar` (see the module notes)."""

    # write_mask_into holds the GIL and takes microseconds: threads gain nothing.
    releases_gil = False

    def __init__(self, grammar: OutlinesGrammar) -> None:
        super().__init__(grammar.provider.vocab)
        self.grammar = grammar
        self._index = grammar.index
        self._guide = Guide(grammar.index, max_rollback=_MAX_ROLLBACK)
        self._tokens: list[int] = []
        self._extra_stops = grammar.provider._extra_stop_row

    # -- engine primitives --------------------------------------------------------
    def _accept(self, token: int) -> bool:
        # Looking the transition up first avoids the engine's exception path,
        # and a refused token leaves the guide untouched.
        if self._index.get_next_state(self._guide.get_state(), token) is None:
            return False
        self._guide.advance(token, return_tokens=False)
        self._tokens.append(token)
        return True

    def _rollback(self, n: int) -> None:
        if n <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(n)
            del self._tokens[len(self._tokens) - n :]
        else:
            keep = self._tokens[: len(self._tokens) - n]
            self._replay(keep)

    def _replay(self, tokens: Sequence[int]) -> None:
        guide = Guide(self._index, max_rollback=_MAX_ROLLBACK)
        for t in tokens:
            guide.advance(t, return_tokens=False)
        self._guide = guide
        self._tokens = list(tokens)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        words = self.vocab.mask_words
        # The full row width, never the engine's entry count: ids up to
        # vocab_size - 1 must all fit (check_bitmask guaranteed the width).
        self._guide.write_mask_into(bitmask.data_ptr() + row * words * 4, words, 4)
        if self._extra_stops is not None and self._guide.is_finished():
            bitmask[row] |= self._extra_stops

    def _is_complete(self) -> bool:
        return bool(self._guide.is_finished())

    # -- the rest of the protocol ---------------------------------------------------
    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (an accepted stop token counts as one)."""
        done = len(self._tokens) + int(self._terminated)
        if not isinstance(n, bool) and hasattr(n, "__index__") and int(n) > done:
            raise GrammarError(f"n: expected at most the {done} accepted tokens, got {int(n)}")
        super().rollback(n)

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._guide.reset()
        self._tokens.clear()
        self._terminated = False

    def fork(self) -> OutlinesMatcher:
        """An independent matcher in the same state (replayed; copying a Guide would copy its Index)."""
        twin = OutlinesMatcher(self.grammar)
        twin._replay(self._tokens)
        twin._terminated = self._terminated
        return twin

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far, a stop token included."""
        return len(self._tokens) + int(self._terminated)


class OutlinesProvider(ProviderBase):
    """outlines-core bound to one :class:`~maskplug.grammar.Vocab`.

    Supports ``regex``, ``json_schema`` and ``choice``. ``ebnf`` and ``lark``
    are not regular, and ``json_object`` is not either: outlines-core can only
    approximate it by a regex of bounded nesting whose automaton takes many
    seconds to build (9 s on a 32k vocabulary here), so all three are refused
    with :class:`GrammarError`. JSON schemas become outlines-core's regex,
    which allows an optional single space between items.
    """

    name = "outlines-core"
    kinds = frozenset({"regex", "json_schema", "choice"})

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self._engine_vocab: Vocabulary | None = None
        self._vocab_lock = threading.Lock()
        # outlines-core sets the bit of its single EOS id in final states;
        # the other stop ids are or-ed in from this row.
        self._extra_stop_row: torch.Tensor | None = None
        if len(vocab.eos_ids) > 1:
            row = torch.zeros(vocab.mask_words, dtype=torch.int64)
            for e in vocab.eos_ids:
                row[e >> 5] |= 1 << (e & 31)
            self._extra_stop_row = torch.where(row >= 2**31, row - 2**32, row).to(torch.int32)

    def engine_vocabulary(self) -> Vocabulary:
        """The outlines-core ``Vocabulary`` (built once): grammar-text tokens only, first stop id as EOS."""
        with self._vocab_lock:
            if self._engine_vocab is None:
                by_bytes: dict[bytes, list[int]] = {}
                for i in grammar_text_ids(self.vocab):
                    by_bytes.setdefault(self.vocab.tokens[i], []).append(i)
                self._engine_vocab = Vocabulary(self.vocab.eos_ids[0], by_bytes)
            return self._engine_vocab

    def regex_for(self, spec: GrammarSpec) -> str:
        """The regular expression outlines-core compiles for ``spec``."""
        src = spec.source
        if spec.kind == "regex":
            if not isinstance(src, str):
                raise GrammarError(f"spec.source: expected a regex str, got {type(src).__name__}")
            return src
        if spec.kind == "json_schema":
            text = _schema_text(src)
            try:
                return str(build_regex_from_schema(text))
            except (ValueError, TypeError) as exc:
                raise GrammarError(
                    f"spec.source: outlines-core cannot turn this JSON schema into a regex: {exc}"
                ) from exc
        return choice_regex(src)

    def _compile(self, spec: GrammarSpec) -> OutlinesGrammar:
        regex = self.regex_for(spec)
        try:
            index = Index(regex, self.engine_vocabulary())
        except (ValueError, TypeError) as exc:
            raise GrammarError(
                f"spec.source: outlines-core failed to compile {spec.kind} {regex[:200]!r}: {exc}"
            ) from exc
        return OutlinesGrammar(self, spec, regex, index)
