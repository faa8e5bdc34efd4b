"""The compiled CPU path (``cpu_numba.mask_mapped``) against ``maskplug.reference`` and the numpy path.

With numba installed, a :class:`~maskplug.RowMapping` and numpy offsets on
CPU logits go through one compiled call that checks the mapping against the
offsets, finds the live rows and masks them. Every case here is applied three
ways and compared bit for bit: the reference, the compiled call, and the
numpy path (``MASKPLUG_CPU_KERNEL=numpy``); a counter on the compiled call
shows the first one really ran it. Bad offsets and mappings are refused with
the same error as the numpy path words, and nothing is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_core_cpu_apply import bits, cases, kernel

import maskplug as mp
from maskplug import LayoutError, RowMapping, reference
from maskplug.kernels import cpu_numba

pytestmark = pytest.mark.skipif(not cpu_numba.installed(), reason="numba is not installed in this environment")


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count calls of the compiled path (the count is a one-element list)."""
    calls = [0]
    real = cpu_numba.mask_mapped

    def spy(*args: Any) -> int:
        calls[0] += 1
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(cpu_numba, "mask_mapped", spy)
        yield calls


def as_mapping(case: dict[str, Any], form: str) -> RowMapping:
    request, position = case["mapping"]
    if form == "strided":
        # Every other element of arrays twice as long: a RowMapping over non-contiguous int32 arrays.
        req2 = np.repeat(request, 2)
        pos2 = np.repeat(position, 2)
        return RowMapping(req2[::2], pos2[::2])
    if form == "read-only":
        request, position = request.copy(), position.copy()
        request.flags.writeable = False
        position.flags.writeable = False
    return RowMapping(request, position)


@given(
    cases(),
    st.sampled_from(["plain", "read-only", "strided"]),
    st.sampled_from([np.int64, np.int32]),
    st.sampled_from(["tensor", "numpy"]),
)
def test_compiled_path_matches_reference_and_numpy(
    case: dict[str, Any], form: str, cu_dtype: type, words_form: str
) -> None:
    mapping = as_mapping(case, form)
    cu = case["cu"].astype(cu_dtype)
    bitmask = case["bitmask"] if words_form == "tensor" else case["bitmask"].numpy()
    expected = case["logits"].clone()
    reference.apply_grammar_bitmask(
        expected, case["bitmask"], case["mapping"], case["cu"], vocab_size=case["vocab_size"], tail=case["tail"]
    )
    got = {}
    for name in ("numba", "numpy"):
        start = case["logits"].storage_offset()
        wide = case["wide"].clone()
        logits = wide[:, start : start + case["logits"].shape[1]]
        before = wide.clone()
        with pytest.MonkeyPatch.context() as mpatch, counted(mpatch) as calls, kernel(name):
            mp.apply_grammar_bitmask(
                logits, bitmask, mapping, cu, vocab_size=case["vocab_size"], tail=case["tail"], backend="torch"
            )
        assert calls[0] == (1 if name == "numba" else 0)
        assert torch.equal(bits(logits), bits(expected)), name
        outside = torch.ones(wide.shape, dtype=torch.bool)
        outside[:, start : start + logits.shape[1]] = False
        assert torch.equal(bits(wide)[outside], bits(before)[outside])
        got[name] = logits
    assert torch.equal(bits(got["numba"]), bits(got["numpy"]))


def _one_request(rows: int = 3, width: int = 64) -> tuple[torch.Tensor, np.ndarray]:
    logits = torch.randn(rows, width)
    bm = np.random.default_rng(1).integers(-(2**31), 2**31, size=(rows, 2), dtype=np.int64).astype(np.int32)
    return logits, bm


#: (what is wrong, request, position, cu_logits, the argument the error names)
BAD = [
    ("offsets not from 0", [0, 0, 0], [0, 1, 2], [1, 3], "cu_logits"),
    ("offsets decreasing", [0, 0, 1], [0, 1, 0], [0, 2, 1], "cu_logits"),
    ("last offset past the logits", [0, 0, 0], [0, 1, 2], [0, 4], "cu_logits"),
    ("no offsets", [0, 0, 0], [0, 1, 2], [], "cu_logits"),
    ("request past the offsets", [0, 1, 0], [0, 0, 1], [0, 3], "mapping.request"),
    ("request below -1", [0, -2, 0], [0, 0, 1], [0, 3], "mapping.request"),
    ("negative position of a used row", [0, 0, 0], [0, -1, 2], [0, 3], "mapping.position"),
    ("one mapping entry too few", [0, 0], [0, 1], [0, 3], "mapping"),
]


@pytest.mark.parametrize(("what", "request_", "position", "cu", "names"), BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("cu_dtype", [np.int64, np.int32])
def test_compiled_path_refuses_bad_offsets_and_mappings_writing_nothing(
    what: str, request_: list[int], position: list[int], cu: list[int], names: str, cu_dtype: type
) -> None:
    logits, bm = _one_request()
    mapping = RowMapping(np.array(request_, dtype=np.int32), np.array(position, dtype=np.int32))
    offsets: np.ndarray = np.array(cu, dtype=cu_dtype)
    messages = {}
    for name in ("numba", "numpy"):
        before = logits.clone()
        with pytest.MonkeyPatch.context() as mpatch, counted(mpatch) as calls, kernel(name):
            with pytest.raises(LayoutError) as err:
                mp.apply_grammar_bitmask(logits, bm, mapping, offsets, backend="torch")
        assert calls[0] == (1 if name == "numba" else 0)
        assert str(err.value).startswith(names + ":"), str(err.value)
        assert torch.equal(bits(logits), bits(before))
        messages[name] = str(err.value)
    # The same words whichever path refused it.
    assert messages["numba"] == messages["numpy"]


def test_compiled_path_ands_mask_rows_aimed_at_one_logits_row() -> None:
    """Two mask rows for one logits row keep only the tokens both allow (as the reference does)."""
    logits = torch.zeros(2, 64)
    bm = np.array([[0x0F, 0], [0x3C, 0], [-1, -1]], dtype=np.int32)
    mapping = RowMapping(np.array([0, 0, 0], dtype=np.int32), np.array([0, 0, 1], dtype=np.int32))
    with kernel("numba"):
        mp.apply_grammar_bitmask(logits, bm, mapping, np.array([0, 2]), backend="torch")
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed == [2, 3]
    assert torch.isfinite(logits[1]).all()
