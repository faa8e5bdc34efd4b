"""What the one-request apply remembers between calls never changes a result.

The CPU path keeps numpy views of small tensors by address, shape, strides and
dtype, and reads ``MASKPLUG_KERNEL_BACKEND`` without going through
``os.environ.get``. A different tensor of the same shape, a tensor whose
memory was swapped in place, a row of a larger buffer and a change of the
environment variable at run time must all behave as if nothing were
remembered: bit for bit as ``maskplug.reference``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import maskplug as mp
from maskplug import reference
from maskplug.errors import BackendUnavailable, LayoutError
from maskplug.steps import StepPlanner


def one_request() -> tuple[mp.RowMapping, np.ndarray]:
    planner = StepPlanner(["req-0"], ["req-0"])
    step = planner.step(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64))
    return step.mapping, step.compaction.cu_logits


def masks(seed: int, words: int = 1) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 2**32, size=(1, words), dtype=np.uint64).astype(np.uint32).view(np.int32))


def expect(logits: torch.Tensor, bitmask: torch.Tensor, mapping: mp.RowMapping, cu: np.ndarray) -> torch.Tensor:
    want = logits.clone()
    reference.apply_grammar_bitmask(want, bitmask, mapping, cu)
    return want


def applies_as_reference(logits: torch.Tensor, bitmask: torch.Tensor, mapping: mp.RowMapping, cu: np.ndarray) -> None:
    want = expect(logits, bitmask, mapping, cu)
    mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)
    assert torch.equal(logits.view(torch.int32), want.view(torch.int32))


def test_same_shape_different_tensors_each_get_their_own_mask() -> None:
    mapping, cu = one_request()
    for seed in range(6):
        applies_as_reference(
            torch.randn(1, 32, generator=torch.Generator().manual_seed(seed)), masks(seed), mapping, cu
        )


def test_a_tensor_refilled_in_place_is_masked_with_its_new_values() -> None:
    mapping, cu = one_request()
    logits = torch.randn(1, 32)
    bitmask = masks(1)
    for seed in range(4):
        logits.copy_(torch.randn(1, 32, generator=torch.Generator().manual_seed(seed)))
        bitmask.copy_(masks(seed + 10))
        applies_as_reference(logits, bitmask, mapping, cu)


def test_memory_swapped_under_the_same_tensor_object_is_the_memory_written() -> None:
    mapping, cu = one_request()
    logits = torch.randn(1, 32)
    bitmask = masks(2)
    mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)
    old = logits.clone()
    fresh = torch.randn(1, 32, generator=torch.Generator().manual_seed(7))
    want = expect(fresh, bitmask, mapping, cu)
    held = logits.clone()
    other = fresh.clone()
    logits.set_(other.untyped_storage(), 0, other.shape, other.stride())  # same Python object, other storage
    mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)
    assert torch.equal(logits.view(torch.int32), want.view(torch.int32))
    assert torch.equal(held, old)  # the previous memory is not what was written


def test_rows_of_one_buffer_are_told_apart_by_their_address() -> None:
    mapping, cu = one_request()
    buf = torch.randn(4, 40)
    bitmask = masks(3, words=2)
    orig = buf.clone()
    for r in (2, 0, 3, 2):
        row = buf[r : r + 1, 4:36]  # same shape and strides, other addresses
        want = expect(row, bitmask, mapping, cu)
        mp.apply_grammar_bitmask(row, bitmask, mapping, cu, vocab_size=32)
        assert torch.equal(row.view(torch.int32), want.view(torch.int32))
    untouched = torch.ones(4, 40, dtype=torch.bool)
    untouched[[0, 2, 3], 4:36] = False
    assert torch.equal(buf.view(torch.int32)[untouched], orig.view(torch.int32)[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_float32_call_then_another_dtype_of_the_same_shape(dtype: torch.dtype) -> None:
    mapping, cu = one_request()
    raw = torch.randn(1, 32)
    logits = raw.to(dtype)
    bitmask = masks(4)
    want = expect(logits, bitmask, mapping, cu)
    mp.apply_grammar_bitmask(raw, bitmask, mapping, cu)
    mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)
    int_view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    assert torch.equal(logits.view(int_view), want.view(int_view))


def test_a_narrower_vocabulary_keeps_the_tail_when_asked() -> None:
    mapping, cu = one_request()
    logits = torch.randn(1, 32)
    bitmask = torch.full((1, 1), -1, dtype=torch.int32)  # every bit set, past the vocabulary too
    bitmask[0, 0] = 0x0F0F0F0F
    want = logits.clone()
    reference.apply_grammar_bitmask(want, bitmask, mapping, cu, vocab_size=30, tail="keep")
    mp.apply_grammar_bitmask(logits, bitmask, mapping, cu, vocab_size=30, tail="keep")
    assert torch.equal(logits.view(torch.int32), want.view(torch.int32))
    assert not torch.isinf(logits[0, 30:]).any()


def test_a_negative_last_offset_is_refused_and_nothing_written() -> None:
    mapping, _ = one_request()
    logits = torch.randn(1, 32)
    before = logits.clone()
    with pytest.raises(LayoutError, match="cu_logits"):
        mp.apply_grammar_bitmask(logits, masks(5), mapping, np.array([0, -1], dtype=np.int64))
    assert torch.equal(logits, before)


def test_the_backend_switch_is_read_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    mapping, cu = one_request()
    logits = torch.randn(1, 32)
    bitmask = masks(6)
    monkeypatch.delenv("MASKPLUG_KERNEL_BACKEND", raising=False)
    mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)
    monkeypatch.setenv("MASKPLUG_KERNEL_BACKEND", "no-such-backend")
    before = logits.clone()
    with pytest.raises(BackendUnavailable, match="MASKPLUG_KERNEL_BACKEND"):
        mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)
    assert torch.equal(logits, before)
    os.environ["MASKPLUG_KERNEL_BACKEND"] = "torch"  # a plain assignment is seen too
    mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)
    del os.environ["MASKPLUG_KERNEL_BACKEND"]
    monkeypatch.setenv("MASKPLUG_KERNEL_BACKEND", "still-missing")
    with pytest.raises(BackendUnavailable, match="still-missing"):
        mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)
    monkeypatch.delenv("MASKPLUG_KERNEL_BACKEND")
    mp.apply_grammar_bitmask(logits, bitmask, mapping, cu)


def test_a_replaced_environ_mapping_is_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    mapping, cu = one_request()
    logits = torch.randn(1, 32)
    monkeypatch.setattr(os, "environ", {"MASKPLUG_KERNEL_BACKEND": "not-installed"})
    with pytest.raises(BackendUnavailable, match="not-installed"):
        mp.apply_grammar_bitmask(logits, masks(7), mapping, cu)
