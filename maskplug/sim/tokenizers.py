"""The simulator's tokenizers: :mod:`maskplug.data.tokenizers` (re-exported under their earlier names)."""

from __future__ import annotations

from ..data.tokenizers import TOKENIZERS, Tokenizer, load_tokenizer

#: The earlier name of :class:`maskplug.data.Tokenizer`.
SimTokenizer = Tokenizer

__all__ = ["TOKENIZERS", "SimTokenizer", "Tokenizer", "load_tokenizer"]
