"""Applying the vocab mask and editing mask rows, against SGLang's own functions and maskplug's oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from maskplug_sglang.backend import MaskplugGrammar, MaskplugGrammarBackend, allocate_mask, apply_mask

import maskplug
from maskplug import LayoutError

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _oracle(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """maskplug's reference apply with SGLang's conventions: row i ↔ row i, tail kept."""
    out = logits.clone()
    rows = mask.shape[0]
    maskplug.reference.apply_grammar_bitmask(
        out,
        mask,
        (np.arange(rows), np.zeros(rows, dtype=np.int64)),
        np.arange(rows + 1),
        vocab_size=min(logits.shape[1], 32 * mask.shape[1]),
        tail="keep",
    )
    return out


@st.composite
def cases(draw: st.DrawFn, min_width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    rows = draw(st.integers(0, 6))
    width = draw(st.integers(min_width, 200))
    # The usual full-width mask, or one narrower than the logits (padding columns kept).
    words = draw(st.sampled_from([(width + 31) // 32, max(1, width // 32)]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=g).to(dtype)
    style = draw(st.sampled_from(["random", "sparse", "dense"]))
    bits = torch.randint(0, 2**32, (rows, words), generator=g, dtype=torch.int64)
    if style == "sparse":
        bits &= torch.randint(0, 2**32, (rows, words), generator=g, dtype=torch.int64)
    elif style == "dense":
        bits |= torch.randint(0, 2**32, (rows, words), generator=g, dtype=torch.int64)
    mask = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return logits, mask


@given(case=cases())
def test_apply_matches_the_reference(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits, mask = case
    want = _oracle(logits, mask)
    MaskplugGrammar.apply_vocab_mask(logits, mask)
    assert torch.equal(logits, want)


@pytest.mark.filterwarnings("ignore:The bitmask covers only:UserWarning")
@given(case=cases(min_width=32))
def test_apply_matches_sglangs_cpu_apply(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    """SGLang's xgrammar grammar object applies CPU masks with xgrammar's CPU kernel (fp32).

    Logits under 32 columns wide are left out: there xgrammar 0.2.7's CPU
    kernel reads the bits of later rows from the wrong place and corrupts the
    heap (seen here as ``free(): invalid next size`` aborts in a plain loop
    over random cases), a shape no model has. The reference test above covers
    every width.
    """
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    logits, mask = case
    logits = logits.float()
    theirs = logits.clone()
    XGrammarGrammar.apply_vocab_mask(None, theirs, mask)  # type: ignore[arg-type]
    MaskplugGrammarBackend.apply_vocab_mask(logits, mask)
    assert torch.equal(logits, theirs)


def test_apply_on_a_strided_view() -> None:
    base = torch.randn(4, 300)
    view = base[:, :100]
    mask = torch.tensor([[5, 0, -1, 7]] * 4, dtype=torch.int32)
    want = _oracle(view.contiguous(), mask)
    apply_mask(view, mask)
    assert torch.equal(view, want)


def test_apply_refuses_mismatched_rows_without_writing() -> None:
    logits = torch.randn(3, 64)
    before = logits.clone()
    with pytest.raises(LayoutError, match="vocab_mask: expected one row per logits row"):
        apply_mask(logits, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(LayoutError, match="bitmask: expected int32"):
        apply_mask(logits, torch.zeros(3, 2, dtype=torch.int64))
    assert torch.equal(logits, before)


def test_allocate_and_move() -> None:
    m = allocate_mask(100, 3)
    assert m.shape == (3, 4) and m.dtype == torch.int32 and torch.all(m == -1)
    assert MaskplugGrammar.move_vocab_mask(m, "cpu").device.type == "cpu"
    with pytest.raises(LayoutError, match="vocab_size"):
        allocate_mask(0, 3)


@given(
    words=st.integers(1, 8),
    row=st.integers(0, 2),
    ids=st.lists(st.integers(0, 255), max_size=12),
    allowed=st.booleans(),
    reset=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_token_filter_matches_sglangs(
    words: int, row: int, ids: list[int], allowed: bool, reset: bool, seed: int
) -> None:
    from sglang.srt.constrained.torch_ops.token_filter_torch_ops import set_token_filter_torch

    ids = [i for i in ids if i < 32 * words]
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    theirs, ours = start.clone(), start.clone()
    set_token_filter_torch(theirs, ids, row, is_allowed=allowed, reset_vocab_mask=reset)
    MaskplugGrammarBackend.set_token_filter(ours, ids, row, is_allowed=allowed, reset_vocab_mask=reset)
    assert torch.equal(theirs, ours)


def test_token_filter_refuses_ids_past_the_mask() -> None:
    m = allocate_mask(64, 1)
    with pytest.raises(LayoutError, match="token_ids"):
        MaskplugGrammarBackend.set_token_filter(m, [64], 0, reset_vocab_mask=False)
    assert torch.all(m == -1)
