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

import os
import tempfile
from collections.abc import Iterable
from typing import Any

from maskplug import GrammarError
from maskplug.grammar import Vocab
from maskplug.grammar.vocabs import load_tokenizer_json

__all__ = ["vocab_from_tokenizer"]


def _eos_list(tokenizer: Any, eos_token_ids: Iterable[int] | None) -> list[int]:
    if eos_token_ids is not None:
        ids = sorted({int(e) for e in eos_token_ids})
        if ids:
            return ids
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, (list, tuple)) and eos:
        return sorted({int(e) for e in eos})
    raise GrammarError(
        "eos_token_ids: expected the model's stop tokens (from SGLang) or a tokenizer with eos_token_id, got neither"
    )


def _resize(base: Vocab, eos_ids: list[int], vocab_size: int | None) -> Vocab:
    """``base`` with the model's stop tokens and logits width.

    Tokens past the model's logits width can never be produced, so they are
    dropped rather than widening the mask past what SGLang allocates.
    """
    size = base.vocab_size if vocab_size is None else int(vocab_size)
    if size <= 0:
        raise GrammarError(f"vocab_size: expected a positive logits width, got {size}")
    tokens = base.tokens[:size]
    bad = [e for e in eos_ids if not 0 <= e < len(tokens)]
    if bad:
        raise GrammarError(f"eos_token_ids: expected ids in [0, {len(tokens)}) of the tokenizer, got {bad}")
    special = {s for s in base.special_ids if s < len(tokens)}
    return Vocab(tokens, eos_ids, special, size)


def vocab_from_tokenizer(
    tokenizer: Any,
    vocab_size: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> Vocab:
    """The :class:`Vocab` of ``tokenizer`` with the model's stop tokens and logits width.

    Args:
        tokenizer: an object with a ``maskplug_vocab`` attribute, or a Hugging
            Face fast tokenizer (``backend_tokenizer.to_str()``).
        vocab_size: the model's logits width (SGLang's ``vocab_size``);
            default: the tokenizer's number of ids.
        eos_token_ids: the model's stop tokens; default: the tokenizer's
            ``eos_token_id``.

    Raises:
        GrammarError: the tokenizer is neither kind, or its ids do not fit.
    """
    given = getattr(tokenizer, "maskplug_vocab", None)
    if isinstance(given, Vocab):
        eos = list(given.eos_ids) if eos_token_ids is None else _eos_list(tokenizer, eos_token_ids)
        if vocab_size is None or int(vocab_size) == given.vocab_size:
            if tuple(eos) == given.eos_ids:
                return given
        return _resize(given, eos, vocab_size)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if not callable(to_str):
        raise GrammarError(
            "tokenizer: expected a Hugging Face fast tokenizer (with backend_tokenizer) or an object with a "
            f"maskplug_vocab attribute, got {type(tokenizer).__name__}"
        )
    eos = _eos_list(tokenizer, eos_token_ids)
    # The loader reads files; a private temporary file keeps it that way.
    fd, path = tempfile.mkstemp(prefix="maskplug-sglang-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(to_str())
        # The stop tokens are set below from the model's ids, so the loader is
        # told one of them by its text only to satisfy its own check.
        texts = tokenizer.convert_ids_to_tokens(eos[:1])
        try:
            base = load_tokenizer_json(path, eos_tokens=texts)
        except GrammarError:
            base = load_tokenizer_json(path)
    finally:
        os.unlink(path)
    return _resize(base, eos, vocab_size)
