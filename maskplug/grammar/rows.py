"""Mask rows of fixed token sets: any set of ids, the stop tokens, the grammar-text tokens."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
import torch

from .spec import Vocab

__all__ = ["bits_row", "stop_row", "text_ids"]


def bits_row(ids: Iterable[int], words: int) -> npt.NDArray[np.int32]:
    """An int32 mask row of ``words`` words with exactly the bits of ``ids`` set."""
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[np.asarray(list(ids), dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


def stop_row(vocab: Vocab) -> torch.Tensor:
    """The mask row allowing only ``vocab``'s stop tokens (what a terminated matcher allows)."""
    return torch.from_numpy(bits_row(vocab.eos_ids, vocab.mask_words))


def text_ids(vocab: Vocab) -> list[int]:
    """Ids whose bytes may appear in grammar text: real tokens that are neither special nor empty."""
    special = vocab.special_ids
    return [i for i, t in enumerate(vocab.tokens) if t and i not in special]
