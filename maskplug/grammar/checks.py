"""Argument checks and spec-source readers shared by the core and every provider.

They hold the normalised semantics in one place, so every provider checks
arguments the same way and raises the same :class:`GrammarError` before
anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import GrammarError
from .spec import Vocab

__all__ = [
    "brief_error",
    "check_bitmask",
    "check_chain_args",
    "check_choice",
    "check_token",
    "schema_dict",
    "schema_text",
]


def check_token(token: Any, vocab: Vocab, arg: str = "token") -> int:
    """``token`` as an int in ``[0, vocab.vocab_size)``, else :class:`GrammarError`.

    Ids in the padding (``len(vocab.tokens) <= id < vocab_size``) are valid
    input: no grammar ever allows them, so ``accept`` refuses them.
    """
    if isinstance(token, bool) or not hasattr(token, "__index__"):
        raise GrammarError(f"{arg}: expected an int token id, got {type(token).__name__}")
    t = int(token)
    if not 0 <= t < vocab.vocab_size:
        raise GrammarError(f"{arg}: expected a token id in [0, {vocab.vocab_size}), got {t}")
    return t


def check_bitmask(bitmask: Any, row: Any, vocab: Vocab, arg: str = "bitmask") -> int:
    """Validate a fill target: a contiguous CPU int32 2-D tensor exactly ``vocab.mask_words`` wide.

    Returns ``row`` as an int. Engines' fill routines ignore strides and trust
    the width, so a wrong buffer would be written out of place; it is refused
    instead, before any write.
    """
    if not isinstance(bitmask, torch.Tensor):
        raise GrammarError(f"{arg}: expected a torch.Tensor, got {type(bitmask).__name__}")
    if bitmask.dtype != torch.int32:
        raise GrammarError(f"{arg}: expected dtype torch.int32, got {bitmask.dtype}")
    if bitmask.device.type != "cpu":
        raise GrammarError(f"{arg}: expected a CPU tensor, got one on {bitmask.device}")
    if bitmask.dim() != 2:
        raise GrammarError(f"{arg}: expected a 2-D tensor (rows x words), got shape {tuple(bitmask.shape)}")
    if bitmask.shape[1] != vocab.mask_words:
        raise GrammarError(
            f"{arg}: expected exactly ceil(vocab_size/32) = {vocab.mask_words} words per row "
            f"(vocab_size {vocab.vocab_size}), got {bitmask.shape[1]}"
        )
    if not bitmask.is_contiguous():
        raise GrammarError(f"{arg}: expected a contiguous tensor, got strides {tuple(bitmask.stride())}")
    if isinstance(row, bool) or not hasattr(row, "__index__"):
        raise GrammarError(f"row: expected an int, got {type(row).__name__}")
    r = int(row)
    if not 0 <= r < bitmask.shape[0]:
        raise GrammarError(f"row: expected a row in [0, {bitmask.shape[0]}), got {r}")
    return r


def check_chain_args(
    bitmask: torch.Tensor, rows: Sequence[int], drafts: Sequence[Sequence[int]], n: int, vocab: Vocab
) -> None:
    """Validate ``fill_chains`` arguments before anything is written (the fills trust the buffer)."""
    if len(rows) != n or len(drafts) != n:
        raise GrammarError(f"rows, drafts: expected {n} each (one per matcher), got {len(rows)} and {len(drafts)}")
    if n:
        first = min(int(r) for r in rows)
        last = max(int(r) + len(d) for r, d in zip(rows, drafts, strict=True))
        check_bitmask(bitmask, last, vocab)
        if first < 0:
            raise GrammarError(f"rows: expected first rows >= 0, got {first}")


def check_choice(source: Any, *, allow_empty: bool = False) -> list[str]:
    """The strings of a ``choice`` spec: a non-empty list (or tuple) of str, non-empty unless ``allow_empty``."""
    if isinstance(source, (str, bytes)) or not isinstance(source, Sequence) or not source:
        raise GrammarError(f"spec.source: expected a non-empty list of strings for kind 'choice', got {source!r}")
    items = list(source)
    for i, c in enumerate(items):
        if not isinstance(c, str) or not (c or allow_empty):
            raise GrammarError(f"spec.source[{i}]: expected a{'' if allow_empty else ' non-empty'} str, got {c!r}")
    return items


def _parse_schema(source: str | bytes) -> Any:
    try:
        return json.loads(source)
    except ValueError as exc:
        raise GrammarError(f"spec.source: expected a JSON schema, got text that is not JSON ({exc})") from exc


def schema_text(source: Any) -> str:
    """A ``json_schema`` spec's source as JSON text (a dict is serialised; text must parse as JSON)."""
    if isinstance(source, dict):
        return json.dumps(source)
    if isinstance(source, (str, bytes)):
        _parse_schema(source)
        return source if isinstance(source, str) else source.decode("utf-8")
    raise GrammarError(f"spec.source: expected a JSON schema as a dict or str, got {type(source).__name__}")


def schema_dict(source: Any) -> dict[str, Any]:
    """A ``json_schema`` spec's source as a JSON object (text is parsed)."""
    value = _parse_schema(source) if isinstance(source, (str, bytes)) else source
    if not isinstance(value, dict):
        raise GrammarError(f"spec.source: expected a JSON schema object, got {type(value).__name__}")
    return value


def brief_error(exc: BaseException) -> str:
    """An exception's message on one line, cut to 300 characters: what an error naming a request quotes."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
