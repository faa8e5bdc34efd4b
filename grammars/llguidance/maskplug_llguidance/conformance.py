"""llguidance driven through its own API, for ``maskplug conformance`` (the engine path).

An ``LLMatcher`` over ``LLTokenizer.from_tiktoken`` (the tiktoken encoding's
ranks shifted past the control ids, which are llguidance's special tokens),
the grammar text the provider builds from the spec, and a token taken only
when the engine's own mask allows it, as masked sampling does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from maskplug.grammar.sdk import GrammarError, GrammarSpec, Vocab

from .provider import grammar_text

__all__ = ["LLGuidanceDriver"]


class LLGuidanceDriver:
    """llguidance over ``vocab``'s tokenizer (``encoding``: its tiktoken encoding, ranks from ``maskplug_offset``)."""

    #: llguidance compiles the grammar itself.
    shares_compile = False

    def __init__(self, vocab: Vocab, encoding: Any) -> None:
        off = int(encoding.maskplug_offset)
        ranks = {b: r + off for b, r in encoding._mergeable_ranks.items()}
        specials = {vocab.tokens[i].decode("utf-8"): i for i in range(off)}
        self.eos = vocab.eos_ids[0]
        self.tok = LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
            encoder=ranks,
            special_tokens=specials,
            pattern=encoding._pat_str,
            eos_token=self.eos,
            n_vocab=vocab.vocab_size,
        )
        self.words = (vocab.vocab_size + 31) // 32

    def compile(self, spec: GrammarSpec, grammar: Any) -> str:
        """The llguidance grammar text of ``spec``, once a matcher of it reports no error."""
        text = grammar_text(spec)
        m = LLMatcher(self.tok, text, log_level=0)
        if m.is_error():
            raise GrammarError(f"spec.source: {m.get_error()}")
        return text

    def feed(self, compiled: str, ids: Sequence[int]) -> bool:
        """Whether a fresh ``LLMatcher`` allows and consumes ``ids``, then allows the stop token."""
        m = LLMatcher(self.tok, compiled, log_level=0)
        mask = np.zeros(self.words, dtype=np.int32)
        for t in [*map(int, ids), self.eos]:
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if not (int(mask[t >> 5]) >> (t & 31)) & 1:  # masked sampling never picks a token the mask refuses
                return False
            if t == self.eos:
                return True
            if not m.consume_token(t):
                return False
        return True
