"""A maskplug :class:`~maskplug.grammar.Vocab` from the tokenizer SGLang hands a grammar backend.

SGLang passes its backend factory the server's tokenizer (a Hugging Face fast
tokenizer for almost every model), the model's logits width and the model's
stop tokens. maskplug's providers need the decoded bytes of every token id;
this module gets them without any network access:

* an object with a ``maskplug_vocab`` attribute (a ready :class:`Vocab`) is
  used as is (custom tokenizers, tests);
* a Hugging Face fast tokenizer is serialised to its ``tokenizer.json`` text
  and read by :func:`maskplug.grammar.vocabs.load_tokenizer_json`, which knows
  byte-level BPE and metaspace/byte-fallback vocabularies.

The model's stop tokens (``eos_token_ids``) are authoritative, as in SGLang's
own xgrammar backend; the mask width is the model's ``vocab_size``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from maskplug.grammar.sdk import Vocab, vocab_from_hf_tokenizer

__all__ = ["vocab_from_tokenizer"]


def vocab_from_tokenizer(
    tokenizer: Any,
    vocab_size: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> Vocab:
    """The :class:`Vocab` of SGLang's ``tokenizer`` with the model's stop tokens and logits width.

    :func:`maskplug.grammar.vocabs.vocab_from_hf_tokenizer`, the loader both
    engine adapters share; see there for the arguments.

    Raises:
        GrammarError: the tokenizer is neither kind, or its ids do not fit.
    """
    return vocab_from_hf_tokenizer(tokenizer, vocab_size, eos_token_ids)
