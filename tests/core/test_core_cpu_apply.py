"""The torch backend's CPU path, block by block, against ``maskplug.reference``.

The CPU path works in blocks of at most ``_CHUNK_ELEMS`` logits: groups of
whole rows when rows are narrow, column ranges of one row when they are wide.
At the real block size the property tests elsewhere only meet row groups, so
here the block size is drawn small, which makes every case cross column-range
and row-group boundaries: ranges that start mid-word, ranges wholly past the
grammar's vocabulary, gathered (non-consecutive) logits rows, mask rows taken
out of order, and several mask rows for one logits row (applied as the AND of
their masks). Logits are compared bit for bit through an integer view.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskplug as mp
from maskplug import reference
from maskplug.kernels import torch_backend

INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype])


@contextmanager
def chunk_elems(n: int) -> Iterator[None]:
    """Run the CPU path with blocks of at most ``n`` logits."""
    saved = torch_backend._CHUNK_ELEMS
    torch_backend._CHUNK_ELEMS = n
    try:
        yield
    finally:
        torch_backend._CHUNK_ELEMS = saved


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = draw(st.integers(1, 6))
    sizes = rng.integers(0, 5, size=n)  # logits rows per request after compaction
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=cu[1:])
    nrows = draw(st.integers(1, 24))
    # Mask rows aim anywhere: live rows, trimmed positions, unused rows, and repeats of one target.
    request = rng.integers(-1, n, size=nrows).astype(np.int32)
    position = rng.integers(0, 6, size=nrows).astype(np.int32)
    shape = draw(st.sampled_from(["scattered", "repeats", "shuffled"]))
    if shape == "repeats" and nrows > 1:
        request[1::2], position[1::2] = request[0], position[0]
    elif shape == "shuffled" and cu[-1] > 0:
        # Every live row once, in shuffled order: mask rows out of order onto consecutive logits rows.
        live = [(r, p) for r in range(n) for p in range(int(sizes[r]))]
        pick = rng.permutation(len(live))[:nrows]
        request = np.array([live[i][0] for i in pick], dtype=np.int32)
        position = np.array([live[i][1] for i in pick], dtype=np.int32)
        nrows = request.size
    width = draw(st.integers(1, 200))
    if draw(st.booleans()):
        grammar_vocab = draw(st.integers(1, width))
        vocab_size: int | None = grammar_vocab
        words = (grammar_vocab + 31) // 32 + draw(st.integers(0, 2))
    else:
        vocab_size = None
        words = (width + 31) // 32 + draw(st.integers(0, 1))
    bm = rng.integers(-(2**31), 2**31, size=(nrows, words), dtype=np.int64).astype(np.int32)
    bm[rng.random(nrows) < 0.2] = -1
    # Grammar-like rows: mostly whole words of nothing allowed, some of everything, a few mixed.
    grammar_like = rng.random(nrows) < 0.4
    kind = rng.random((int(grammar_like.sum()), words))
    bm[grammar_like] = np.where(kind < 0.6, 0, np.where(kind < 0.8, -1, bm[grammar_like]))
    dtype = draw(st.sampled_from(DTYPES))
    pad = draw(st.sampled_from([0, 3, 40]))
    raw = rng.integers(np.iinfo(np.int16).min, np.iinfo(np.int16).max, size=(int(cu[-1]) + 1, width + pad))
    if dtype == torch.float32:
        wide = torch.from_numpy((raw * 65_537).astype(np.int32)).view(dtype)  # NaNs, infinities, subnormals
    else:
        wide = torch.from_numpy(raw.astype(np.int16)).view(dtype)
    bitmask = torch.from_numpy(bm)
    if draw(st.booleans()):
        # Mask rows with a row stride past their words.
        bitmask = torch.from_numpy(np.concatenate([bm, bm[:, :1]], axis=1))[:, :words]
    return {
        "wide": wide,
        "logits": wide[:, pad // 2 : pad // 2 + width],
        "bitmask": bitmask,
        "mapping": (request, position),
        "cu": cu,
        "vocab_size": vocab_size,
        "tail": draw(st.sampled_from(["mask", "keep"])),
        "chunk": draw(st.sampled_from([8, 16, 24, 40, 64, 96, 200, 1 << 16])),
    }


@given(cases())
def test_cpu_blocks_match_reference(case: dict[str, Any]) -> None:
    expected = case["logits"].clone()
    reference.apply_grammar_bitmask(
        expected, case["bitmask"], case["mapping"], case["cu"], vocab_size=case["vocab_size"], tail=case["tail"]
    )
    base = case["wide"]
    before = base.clone()
    with chunk_elems(case["chunk"]):
        mp.apply_grammar_bitmask(
            case["logits"],
            case["bitmask"],
            case["mapping"],
            case["cu"],
            vocab_size=case["vocab_size"],
            tail=case["tail"],
            backend="torch",
        )
    assert torch.equal(bits(case["logits"]), bits(expected))
    # Columns of the padded storage outside the view are untouched.
    start = case["logits"].storage_offset() - base.storage_offset()
    outside = torch.ones(base.shape, dtype=torch.bool)
    outside[:, start : start + case["logits"].shape[1]] = False
    assert torch.equal(bits(base)[outside], bits(before)[outside])


@given(cases(), st.sampled_from([1, 2]))
def test_cpu_apply_same_under_any_thread_setting_and_leaves_it(case: dict[str, Any], threads: int) -> None:
    """The CPU path gives the reference's answer whatever the caller's torch threads, and does not change them."""
    expected = case["logits"].clone()
    reference.apply_grammar_bitmask(
        expected, case["bitmask"], case["mapping"], case["cu"], vocab_size=case["vocab_size"], tail=case["tail"]
    )
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = case["logits"].clone()
        mp.apply_grammar_bitmask(
            got,
            case["bitmask"],
            case["mapping"],
            case["cu"],
            vocab_size=case["vocab_size"],
            tail=case["tail"],
            backend="torch",
        )
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(bits(got), bits(expected))


def test_cpu_apply_on_a_tensor_that_requires_grad() -> None:
    """Logits that require grad (a leaf made by the engine) are written in place through their data."""
    rng = np.random.default_rng(7)
    logits = torch.randn(3, 70)
    bm = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32))
    mapping = (np.array([0, 0, 0], dtype=np.int32), np.array([0, 1, 2], dtype=np.int32))
    cu = np.array([0, 3])
    expected = logits.clone()
    reference.apply_grammar_bitmask(expected, bm, mapping, cu)
    with torch.no_grad():
        leaf = logits.clone().requires_grad_(True)
        mp.apply_grammar_bitmask(leaf, bm, mapping, cu, backend="torch")
    assert torch.equal(bits(leaf.detach()), bits(expected))
    assert int(torch.isneginf(expected).sum()) > 0  # the mask did drop something
