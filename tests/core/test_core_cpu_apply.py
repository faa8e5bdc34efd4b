"""The torch backend's CPU path, block by block, against ``maskplug.reference``.

The CPU path works in blocks of at most ``_CHUNK_ELEMS`` logits: groups of
whole rows when rows are narrow, column ranges of one row when they are wide;
one row at a time it picks a masked store (narrow rows), a gather of the
32-column groups whose mask words are not all 0 or not all -1 (rows whose
words mostly are), or the branch-free blocks. At the real sizes the property
tests elsewhere meet few of these, so here the block size and the thresholds
are drawn small, which makes every case cross column-range and row-group
boundaries and take every one-row way: ranges that start mid-word, ranges wholly past the
grammar's vocabulary, gathered (non-consecutive) logits rows, mask rows taken
out of order, and several mask rows for one logits row (applied as the AND of
their masks). Logits are compared bit for bit through an integer view.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskplug as mp
from maskplug import reference
from maskplug.kernels import cpu_numba, torch_backend

INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype])


_KNOBS = ("_CHUNK_ELEMS", "_SMALL_ROW", "_SPARSE_MIN_WORDS", "_SPARSE_SHARE")
#: The wide-row kernels this environment has: numpy always, numba where it imports.
KERNELS = ("numpy", "numba") if cpu_numba.installed() else ("numpy",)


@contextmanager
def kernel(name: str) -> Iterator[None]:
    """Run the CPU path with the ``numpy`` or ``numba`` wide-row kernel."""
    saved = os.environ.get(cpu_numba.CPU_KERNEL_ENV)
    os.environ[cpu_numba.CPU_KERNEL_ENV] = name
    try:
        assert cpu_numba.kernel_name() == name
        yield
    finally:
        if saved is None:
            del os.environ[cpu_numba.CPU_KERNEL_ENV]
        else:
            os.environ[cpu_numba.CPU_KERNEL_ENV] = saved


@contextmanager
def knobs(chunk: int, small_row: int, sparse_min: int, sparse_share: int, kernel_name: str = "numpy") -> Iterator[None]:
    """Run the CPU path with blocks of at most ``chunk`` logits, the given one-row thresholds and wide-row kernel."""
    saved = [getattr(torch_backend, k) for k in _KNOBS]
    for k, v in zip(_KNOBS, (chunk, small_row, sparse_min, sparse_share), strict=True):
        setattr(torch_backend, k, v)
    try:
        with kernel(kernel_name):
            yield
    finally:
        for k, v in zip(_KNOBS, saved, strict=True):
            setattr(torch_backend, k, v)


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
    shape = draw(st.sampled_from(["scattered", "repeats", "shuffled", "in order"]))
    if shape == "repeats" and nrows > 1:
        request[1::2], position[1::2] = request[0], position[0]
    elif shape in ("shuffled", "in order") and cu[-1] > 0:
        # Every live row once, in shuffled order (mask rows out of order onto consecutive logits rows),
        # or in logits order from some row on (an engine's own layout: consecutive runs of rows).
        live = [(r, p) for r in range(n) for p in range(int(sizes[r]))]
        if shape == "shuffled":
            pick = rng.permutation(len(live))[:nrows]
        else:
            pick = np.arange(int(rng.integers(0, len(live))), len(live))[:nrows]
        request = np.array([live[i][0] for i in pick], dtype=np.int32)
        position = np.array([live[i][1] for i in pick], dtype=np.int32)
        nrows = request.size
    width = draw(st.integers(1, 200))
    if draw(st.booleans()):
        width = 32 * ((width + 31) // 32)  # whole mask words: rows the mask decides exactly
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
        "chunk": draw(st.sampled_from([8, 16, 24, 40, 64, 96, 200, 1 << 17])),
        # One-row ways: the masked store up to small_row columns; past it, the gather of the words that are
        # not all 0 (or not all -1) when at most 1 / sparse_share of a row's sparse_min or more words are.
        "small_row": draw(st.sampled_from([0, 16, 64, 1024])),
        "sparse_min": draw(st.sampled_from([1, 2, 64])),
        "sparse_share": draw(st.sampled_from([1, 2, 4])),
        "kernel": draw(st.sampled_from(KERNELS)),
    }


def apply_case(case: dict[str, Any], logits: torch.Tensor) -> None:
    """``case``'s masks applied to ``logits`` by the torch backend."""
    mp.apply_grammar_bitmask(
        logits,
        case["bitmask"],
        case["mapping"],
        case["cu"],
        vocab_size=case["vocab_size"],
        tail=case["tail"],
        backend="torch",
    )


@given(cases())
def test_cpu_blocks_match_reference(case: dict[str, Any]) -> None:
    expected = case["logits"].clone()
    reference.apply_grammar_bitmask(
        expected, case["bitmask"], case["mapping"], case["cu"], vocab_size=case["vocab_size"], tail=case["tail"]
    )
    base = case["wide"]
    before = base.clone()
    with knobs(case["chunk"], case["small_row"], case["sparse_min"], case["sparse_share"], case["kernel"]):
        apply_case(case, case["logits"])
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
        with knobs(1 << 17, case["small_row"], 64, 4, case["kernel"]):
            apply_case(case, got)
        assert torch.equal(bits(got), bits(expected))
        got = case["logits"].clone()
        apply_case(case, got)
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


@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tail", ["mask", "keep"])
def test_wide_rows_at_the_real_thresholds_match_reference(
    dtype: torch.dtype, tail: Literal["mask", "keep"], kernel_name: str
) -> None:
    """Rows wide enough for every one-row way at the shipped sizes: mostly-0 words, mostly--1 words, random bits.

    Strided logits, a vocabulary that is not a multiple of 32, and two mask rows for one logits row.
    """
    rng = np.random.default_rng(11)
    width, vocab = 9_000, 8_999
    words = (vocab + 31) // 32
    bm = np.zeros((5, words), dtype=np.int32)
    bm[0, rng.choice(words, 20, replace=False)] = rng.integers(1, 2**31, 20)  # grammar-like: few words allow
    bm[1] = -1
    bm[1, rng.choice(words, 20, replace=False)] = rng.integers(-(2**31), -1, 20)  # permissive: few words drop
    bm[2] = rng.integers(-(2**31), 2**31, words)  # random bits
    bm[3] = bm[0] | rng.integers(-(2**31), 2**31, words) * (rng.random(words) < 0.1)
    bm[4] = bm[1]  # with row 3, aims at one logits row: the AND of both
    request = np.array([0, 0, 0, 0, 0], dtype=np.int32)
    position = np.array([0, 1, 2, 3, 3], dtype=np.int32)
    cu = np.array([0, 4])
    raw = rng.integers(np.iinfo(np.int16).min, np.iinfo(np.int16).max, size=(4, width + 40))
    if dtype == torch.float32:
        wide = torch.from_numpy((raw * 65_537).astype(np.int32)).view(dtype)  # NaNs, infinities, subnormals
    else:
        wide = torch.from_numpy(raw.astype(np.int16)).view(dtype)
    logits = wide[:, 20 : 20 + width]
    outside = torch.cat([bits(wide[:, :20]), bits(wide[:, 20 + width :])], dim=1)
    expected = logits.clone()
    bitmask = torch.from_numpy(bm)
    reference.apply_grammar_bitmask(expected, bitmask, (request, position), cu, vocab_size=vocab, tail=tail)
    with kernel(kernel_name):
        for rows in (slice(0, 5), slice(0, 1), slice(1, 2), slice(2, 3)):  # the batch path and the few-row path
            got = logits.clone()
            want = logits.clone()
            mapping = (request[rows], position[rows])
            reference.apply_grammar_bitmask(want, bitmask[rows], mapping, cu, vocab_size=vocab, tail=tail)
            mp.apply_grammar_bitmask(got, bitmask[rows], mapping, cu, vocab_size=vocab, tail=tail, backend="torch")
            assert torch.equal(bits(got), bits(want))
        mp.apply_grammar_bitmask(logits, bitmask, (request, position), cu, vocab_size=vocab, tail=tail, backend="torch")
    assert torch.equal(bits(logits), bits(expected))
    assert torch.equal(torch.cat([bits(wide[:, :20]), bits(wide[:, 20 + width :])], dim=1), outside)
