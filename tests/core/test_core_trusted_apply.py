"""The apply's trusted path: mappings maskplug built and checked are not checked again.

A :class:`RowMapping` from :meth:`GrammarRows.mapping` or a
:class:`StepPlanner` step holds read-only arrays whose values were checked
when they were built; :func:`maskplug.apply_grammar_bitmask` then checks only
what can still be wrong (the bitmask's rows, the offsets against the mapping
and the logits). Every result must still equal ``maskplug.reference`` bit for
bit, and every bad call must still raise the named error and write nothing.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskplug as mp
from maskplug import reference
from maskplug.steps import StepPlanner

COST = mp.CostModel.linear(1.0, 0.01, 5.0, 0.02, max_reqs=512, max_tokens=8192)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype])


@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 12),
    st.sampled_from(["full", "partial", "zero", "chosen"]),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    st.sampled_from(["mask", "keep"]),
)
def test_planner_mappings_apply_as_the_reference(
    seed: int, n: int, regime: str, dtype: torch.dtype, tail: Literal["mask", "keep"]
) -> None:
    """Steps whose counts change every step, every regime: the trusted apply equals the reference's."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(n)]
    grammar = [ids[i] for i in rng.permutation(n) if rng.random() < 0.8]
    planner = StepPlanner(ids, grammar, cost=COST)
    for _ in range(3):
        nd = rng.integers(0, 5, size=n)
        nn = np.ones(n, dtype=np.int64)
        total = int(nd.sum())
        if regime == "chosen":
            step = planner.step(nd, nn, rng.uniform(0, 1, size=(n, 5)))
        else:
            budget = {"full": total, "zero": 0, "partial": int(rng.integers(0, total + 1))}[regime]
            step = planner.step(nd, nn, budget=budget)
        if step.compaction.exact:
            cu = step.compaction.cu_logits
        else:  # the partial regime: the device's offsets, here from a host allocation
            cap = mp.allocate(torch.from_numpy(rng.uniform(0, 1, size=(n, 5))), nd, step.budget).numpy()
            cu = mp.compact(step.layout, step.budget, capacity=cap).cu_logits
        assert step.mapping._trusted_needs() is not None
        width = int(rng.integers(1, 100))
        words = (width + 31) // 32
        bm = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(len(step.mapping), words)).astype(np.int32))
        logits = torch.randn(int(cu[-1]) + 1, width).to(dtype)
        want = logits.clone()
        reference.apply_grammar_bitmask(want, bm, step.mapping, cu, tail=tail)
        got = logits.clone()
        mp.apply_grammar_bitmask(got, bm, step.mapping, cu, tail=tail)
        assert torch.equal(bits(got), bits(want))


def _one_request() -> tuple[mp.RowMapping, np.ndarray, torch.Tensor]:
    layout = mp.ScheduledLayout(["a", "b"], [2, 1], [1, 1])
    mapping = mp.GrammarRows(["b", "a"]).mapping(layout)
    return mapping, layout.cu_scheduled.copy(), torch.full((len(mapping), 2), 0x0F0F0F0F, dtype=torch.int32)


@pytest.mark.parametrize(
    ("change", "error", "arg"),
    [
        ("bitmask-rows", mp.LayoutError, "mapping:"),
        ("offsets-short", mp.LayoutError, "mapping.request:"),
        ("offsets-start", mp.LayoutError, "cu_logits:"),
        ("offsets-decrease", mp.LayoutError, "cu_logits:"),
        ("offsets-past-logits", mp.LayoutError, "cu_logits:"),
        ("offsets-float", mp.LayoutError, "cu_logits:"),
    ],
)
def test_trusted_mapping_still_refuses_what_can_be_wrong(change: str, error: type[Exception], arg: str) -> None:
    mapping, cu, bm = _one_request()
    logits = torch.randn(int(cu[-1]), 64)
    if change == "bitmask-rows":
        bm = bm[:-1]
    elif change == "offsets-short":
        cu = cu[:2]  # one request fewer than the mapping needs
    elif change == "offsets-start":
        cu = cu + 1
    elif change == "offsets-decrease":
        cu = cu.copy()
        cu[1] = cu[2] + 1
    elif change == "offsets-past-logits":
        logits = logits[:-1]
    else:
        cu = cu.astype(np.float64)
    before = logits.clone()
    with pytest.raises(error) as info:
        mp.apply_grammar_bitmask(logits, bm, mapping, cu)
    assert str(info.value).startswith(arg)
    assert torch.equal(bits(logits), bits(before))


def test_a_mapping_made_writable_again_is_checked_in_full() -> None:
    """Trust lasts only while the arrays stay read-only: a writable one may hold anything, and is checked."""
    mapping, cu, bm = _one_request()
    assert not mapping.request.flags.writeable and not mapping.position.flags.writeable
    with pytest.raises(ValueError):
        mapping.request[0] = 5
    mapping.request.flags.writeable = True  # a view of the mapping's own writable owner: allowed
    mapping.request[0] = 5
    assert mapping._trusted_needs() is None
    logits = torch.randn(int(cu[-1]), 64)
    before = logits.clone()
    with pytest.raises(mp.LayoutError) as info:
        mp.apply_grammar_bitmask(logits, bm, mapping, cu)
    assert str(info.value).startswith("mapping.request:")
    assert torch.equal(bits(logits), bits(before))


def test_hand_built_mappings_are_not_trusted() -> None:
    req, pos = np.array([0, 0], dtype=np.int32), np.array([0, 1], dtype=np.int32)
    assert mp.RowMapping(req, pos)._trusted_needs() is None
    logits = torch.randn(2, 40)
    before = logits.clone()
    with pytest.raises(mp.LayoutError) as info:
        mp.apply_grammar_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), (req + 3, pos), np.array([0, 2]))
    assert str(info.value).startswith("mapping.request:")
    assert torch.equal(bits(logits), bits(before))


def test_trusted_and_checked_paths_agree_on_one_request() -> None:
    """The same call through the trusted lists and through the full checks (a hand-made copy) gives the same bits."""
    mapping, cu, bm = _one_request()
    logits = torch.randn(int(cu[-1]), 70)
    a, b = logits.clone(), logits.clone()
    mp.apply_grammar_bitmask(a, bm, mapping, cu, vocab_size=50)
    copy: Any = mp.RowMapping(mapping.request.copy(), mapping.position.copy())
    mp.apply_grammar_bitmask(b, bm, copy, cu, vocab_size=50)
    assert torch.equal(bits(a), bits(b))
