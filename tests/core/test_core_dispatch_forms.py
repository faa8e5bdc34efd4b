"""``apply_grammar_bitmask`` takes its mapping and offsets in several forms; every form gives the same logits.

int32 numpy arrays (what a :class:`maskplug.RowMapping` always holds) go to
the kernel without a copy or a range pass; other integer arrays and tensors
are widened, range-checked and narrowed. Whatever the form, the logits must
be bit-identical to :mod:`maskplug.reference`, the caller's arrays must be
left as they were, and bad values must be refused before anything is written.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import maskplug as mp
from maskplug import LayoutError, RowMapping, reference


def _as(form: str, arr: np.ndarray) -> Any:
    if form == "int32":
        return arr.astype(np.int32)
    if form == "int64":
        return arr.astype(np.int64)
    if form == "int32-strided":
        # Every other element of a twice-as-long array: int32 but not contiguous.
        wide = np.repeat(arr.astype(np.int32), 2)
        return wide[::2]
    if form == "int32-readonly":
        ro = arr.astype(np.int32)
        ro.flags.writeable = False
        return ro
    if form == "int32-bigendian":
        return arr.astype(">i4")
    if form == "tensor-int32":
        return torch.from_numpy(arr.astype(np.int32))
    if form == "tensor-int64":
        return torch.from_numpy(arr.astype(np.int64))
    if form == "list":
        return arr.tolist()
    raise AssertionError(form)


def _host(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


FORMS = ["int32", "int64", "int32-strided", "int32-readonly", "int32-bigendian", "tensor-int32", "tensor-int64"]


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 5))
    sizes = rng.integers(0, 5, size=n)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=cu[1:])
    nrows = draw(st.integers(1, 16))
    request = rng.integers(-1, n, size=nrows)
    position = rng.integers(0, 6, size=nrows)
    # Unused rows (request -1) may carry any position, negative ones included.
    position[(request < 0) & (rng.random(nrows) < 0.5)] = -7
    width = draw(st.integers(1, 100))
    words = (width + 31) // 32
    bm = rng.integers(-(2**31), 2**31, size=(nrows, words), dtype=np.int64).astype(np.int32)
    logits = torch.from_numpy(rng.standard_normal((int(cu[-1]) + 1, width)).astype(np.float32))
    return {"request": request, "position": position, "cu": cu, "bitmask": torch.from_numpy(bm), "logits": logits}


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from(FORMS), st.sampled_from([*FORMS, "list"]), st.booleans())
def test_every_form_matches_reference(case: dict[str, Any], map_form: str, cu_form: str, row_mapping: bool) -> None:
    expected = case["logits"].clone()
    pair = (case["request"].astype(np.int32), case["position"].astype(np.int32))
    reference.apply_grammar_bitmask(expected, case["bitmask"], pair, case["cu"], tail="mask")
    if row_mapping:
        mapping: Any = RowMapping(*pair)
    else:
        mapping = (_as(map_form, case["request"]), _as(map_form, case["position"]))
    before = [_host(m).copy() for m in mapping] if not row_mapping else [p.copy() for p in pair]
    cu = _as(cu_form, case["cu"])
    got = case["logits"].clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's warning about a tensor over read-only memory
        mp.apply_grammar_bitmask(got, case["bitmask"], mapping, cu, tail="mask", backend="torch")
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    after = [mapping.request, mapping.position] if row_mapping else list(mapping)
    for b, a in zip(before, after, strict=True):
        assert np.array_equal(_host(a), b)  # the caller's arrays are only read


@pytest.mark.parametrize("form", ["int32", "int32-strided", "tensor-int32", "int64"])
@pytest.mark.parametrize(
    ("request_", "position", "message"),
    [
        ([0, 2], [0, 0], "mapping.request: expected -1 or a request index in [0, 2), got 2"),
        ([0, -2], [0, 0], "mapping.request: expected -1 or a request index in [0, 2), got -2"),
        ([0, 1], [0, -1], "mapping.position: expected positions >= 0 for used rows, got -1"),
    ],
)
def test_bad_mapping_values_refused_in_every_form(
    form: str, request_: list[int], position: list[int], message: str
) -> None:
    logits = torch.randn(4, 64)
    before = logits.clone()
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    mapping = (_as(form, np.array(request_)), _as(form, np.array(position)))
    with pytest.raises(LayoutError) as info:
        mp.apply_grammar_bitmask(logits, bitmask, mapping, np.array([0, 2, 4]), backend="torch")
    assert message in str(info.value)
    assert torch.equal(logits, before)


def test_unused_rows_may_hold_negative_positions() -> None:
    logits = torch.randn(2, 32)
    expected = logits.clone()
    bitmask = torch.zeros(2, 1, dtype=torch.int32)  # would drop every token of a row it reached
    mapping = RowMapping(np.array([-1, -1], dtype=np.int32), np.array([-1, -5], dtype=np.int32))
    mp.apply_grammar_bitmask(logits, bitmask, mapping, np.array([0, 2]), backend="torch")
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("form", ["int32", "tensor-int32", "int64"])
def test_offsets_checked_without_int32_wraparound(form: str) -> None:
    """Offsets are compared as int64 even when given as int32: a step past int32's range is no rise."""
    logits = torch.randn(4, 32)
    before = logits.clone()
    cu = _as(form, np.array([0, 2**31 - 1, -(2**31)]))
    with pytest.raises(LayoutError) as info:
        mp.apply_grammar_bitmask(
            logits,
            torch.zeros(1, 1, dtype=torch.int32),
            (np.array([0], dtype=np.int32), np.array([0], dtype=np.int32)),
            cu,
            backend="torch",
        )
    assert "cu_logits: expected non-decreasing offsets" in str(info.value)
    assert torch.equal(logits, before)


# -- a numpy bitmask with CPU logits ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(cases(), st.booleans(), st.booleans(), st.sampled_from(["torch", "auto"]))
def test_numpy_bitmask_matches_reference(case: dict[str, Any], row_mapping: bool, strided: bool, backend: str) -> None:
    """With CPU logits the bitmask may be the scheduler's numpy array: the same logits as the tensor, bit for bit."""
    pair = (case["request"].astype(np.int32), case["position"].astype(np.int32))
    expected = case["logits"].clone()
    reference.apply_grammar_bitmask(expected, case["bitmask"], pair, case["cu"], tail="mask")
    words = case["bitmask"].numpy()
    if strided:
        # Every other row of a twice-as-tall array: int32 but not contiguous.
        tall = np.repeat(words, 2, axis=0)
        words = tall[::2]
    before = words.copy()
    mapping: Any = RowMapping(*pair) if row_mapping else pair
    got = case["logits"].clone()
    mp.apply_grammar_bitmask(got, words, mapping, case["cu"], tail="mask", backend=backend)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert np.array_equal(words, before)  # only read


@pytest.mark.parametrize(
    ("bitmask", "logits_device", "message"),
    [
        (np.zeros((2, 2), dtype=np.int64), "cpu", "bitmask: expected int32 (native byte order), got numpy <i8"),
        (np.zeros((2, 2), dtype=">i4"), "cpu", "bitmask: expected int32 (native byte order), got numpy >i4"),
        (np.zeros(4, dtype=np.int32), "cpu", "bitmask: expected 2-D (rows, words), got shape (4,)"),
        (
            np.zeros((2, 2), dtype=np.int32),
            "meta",
            "bitmask: a numpy bitmask needs logits on the CPU, got logits on meta",
        ),
        ([[0, 0], [0, 0]], "cpu", "bitmask: expected a torch.Tensor or (with CPU logits) a numpy array, got list"),
    ],
)
def test_bad_numpy_bitmask_refused(bitmask: Any, logits_device: str, message: str) -> None:
    logits = torch.randn(4, 64, device=logits_device)
    before = logits.clone() if logits_device == "cpu" else None
    mapping = RowMapping(np.array([0, 1], dtype=np.int32), np.array([0, 0], dtype=np.int32))
    with pytest.raises(LayoutError) as info:
        mp.apply_grammar_bitmask(logits, bitmask, mapping, np.array([0, 2, 4]))
    assert message in str(info.value)
    if before is not None:
        assert torch.equal(logits, before)
