"""outlines-core driven through its own API, for ``maskplug conformance`` (the engine path).

Building an outlines-core ``Index`` is the slow part (seconds to minutes over
a large vocabulary), so the engine path walks the ``Index`` maskplug's
provider built (the same regex over the same vocabulary) with outlines-core's
own ``Guide``: a token is taken only when the guide lists it, and the stop
token must be listed at the end. Its compile figures are maskplug's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outlines_core import Guide, Index

from maskplug.grammar.sdk import GrammarError, GrammarSpec, Vocab

__all__ = ["OutlinesDriver"]


class OutlinesDriver:
    """outlines-core's ``Guide`` over the index of maskplug's grammar (``encoding`` is not needed)."""

    #: The engine path walks the index maskplug built.
    shares_compile = True

    def __init__(self, vocab: Vocab, encoding: Any) -> None:
        self.eos = vocab.eos_ids[0]

    def compile(self, spec: GrammarSpec, grammar: Any) -> Index:
        """The ``Index`` of maskplug's grammar (:class:`GrammarError` when that compile failed)."""
        if grammar is None:
            raise GrammarError("spec: outlines-core's index is built once, by maskplug, and that compile failed")
        index: Index = grammar.index
        return index

    def feed(self, compiled: Index, ids: Sequence[int]) -> bool:
        """Whether a fresh ``Guide`` lists each token of ``ids`` in turn, then the stop token."""
        g = Guide(compiled)
        for t in ids:
            if int(t) not in set(g.get_tokens()):
                return False
            g.advance(int(t))
        return self.eos in set(g.get_tokens())
