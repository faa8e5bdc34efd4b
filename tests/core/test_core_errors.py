"""Bad input: the right error class, a message naming the argument, nothing written.

Each case is one distinct mistake. Cases against ``apply_grammar_bitmask`` also
check that the logits are bit-for-bit what they were before the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import maskplug as mp

META = torch.device("meta")


@dataclass
class Call:
    """A good apply call that each case spoils in one way."""

    logits: torch.Tensor
    bitmask: torch.Tensor
    mapping: Any
    cu_logits: Any
    kwargs: dict[str, Any]

    def run(self) -> None:
        mp.apply_grammar_bitmask(self.logits, self.bitmask, self.mapping, self.cu_logits, **self.kwargs)


def good_call() -> Call:
    """Two requests with two drafts each, full budget: 6 mask rows onto 6 logits rows of width 100."""
    layout = mp.ScheduledLayout(["a", "b"], [2, 2], [1, 1])
    mapping = mp.GrammarRows(["b", "a"]).mapping(layout)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, 4), dtype=torch.int32, generator=gen)
    return Call(logits, bitmask, mapping, mp.compact(layout, 4).cu_logits, {"backend": "torch"})


def _with(**changes: Any) -> Callable[[Call], None]:
    def spoil(c: Call) -> None:
        for k, v in changes.items():
            if k in ("logits", "bitmask", "mapping", "cu_logits"):
                setattr(c, k, v(c) if callable(v) else v)
            else:
                c.kwargs[k] = v

    return spoil


def _req_pos(c: Call) -> tuple[np.ndarray, np.ndarray]:
    return c.mapping.request.copy(), c.mapping.position.copy()


def _set(arr_index: int, i: int, value: int) -> Callable[[Call], tuple[np.ndarray, np.ndarray]]:
    def make(c: Call) -> tuple[np.ndarray, np.ndarray]:
        pair = [a.astype(np.int64) for a in _req_pos(c)]
        pair[arr_index][i] = value
        return pair[0], pair[1]

    return make


# (case id, how the good call is spoiled, error class, argument named in the message)
APPLY_CASES: list[tuple[str, Callable[[Call], None], type[mp.MaskplugError], str]] = [
    ("logits-1d", _with(logits=lambda c: c.logits[0]), mp.LayoutError, "logits"),
    ("logits-int-dtype", _with(logits=lambda c: c.logits.view(torch.int32)), mp.LayoutError, "logits"),
    ("logits-float64", _with(logits=lambda c: c.logits.double()), mp.LayoutError, "logits"),
    ("logits-column-stride", _with(logits=lambda c: torch.randn(100, 6).t()), mp.LayoutError, "logits"),
    ("bitmask-int64", _with(bitmask=lambda c: c.bitmask.long()), mp.LayoutError, "bitmask"),
    ("bitmask-1d", _with(bitmask=lambda c: c.bitmask.flatten()), mp.LayoutError, "bitmask"),
    ("bitmask-foreign-device", _with(bitmask=lambda c: c.bitmask.to(META)), mp.LayoutError, "bitmask"),
    ("bitmask-narrower-than-logits", _with(bitmask=lambda c: c.bitmask[:, :3].contiguous()), mp.LayoutError, "bitmask"),
    ("vocab-size-beyond-bitmask", _with(bitmask=lambda c: c.bitmask[:, :2].contiguous(), vocab_size=65), mp.LayoutError, "vocab_size"),
    ("vocab-size-beyond-logits", _with(vocab_size=101), mp.LayoutError, "vocab_size"),
    ("vocab-size-zero", _with(vocab_size=0), mp.LayoutError, "vocab_size"),
    ("vocab-size-float", _with(vocab_size=50.0), mp.LayoutError, "vocab_size"),
    ("bad-tail", _with(tail="drop"), mp.LayoutError, "tail"),
    ("unknown-backend", _with(backend="no-such-kernel"), mp.BackendUnavailable, "backend"),
    ("backend-not-a-name", _with(backend=3), mp.BackendUnavailable, "backend"),
    ("mapping-longer-than-bitmask", _with(bitmask=lambda c: c.bitmask[:5]), mp.LayoutError, "mapping"),
    ("mapping-shorter-than-bitmask", _with(mapping=lambda c: tuple(a[:2] for a in _req_pos(c))), mp.LayoutError, "mapping"),
    ("mapping-unequal-halves", _with(mapping=lambda c: (_req_pos(c)[0], _req_pos(c)[1][:5])), mp.LayoutError, "mapping"),
    ("mapping-wrong-type", _with(mapping=lambda c: [0, 0, 0, 1, 1, 1]), mp.LayoutError, "mapping"),
    ("mapping-float-request", _with(mapping=lambda c: (_req_pos(c)[0].astype(np.float32), _req_pos(c)[1])), mp.LayoutError, "mapping.request"),
    ("mapping-unknown-request", _with(mapping=_set(0, 2, 2)), mp.LayoutError, "mapping.request"),
    ("mapping-request-below-minus-one", _with(mapping=_set(0, 1, -2)), mp.LayoutError, "mapping.request"),
    ("mapping-request-overflows-int32", _with(mapping=_set(0, 1, 2**40)), mp.LayoutError, "mapping.request"),
    ("mapping-negative-position", _with(mapping=_set(1, 4, -1)), mp.LayoutError, "mapping.position"),
    ("mapping-foreign-device", _with(mapping=lambda c: tuple(torch.from_numpy(a).to(META) for a in _req_pos(c))), mp.LayoutError, "mapping.request"),
    ("cu-logits-not-monotonic", _with(cu_logits=np.array([0, 4, 3])), mp.LayoutError, "cu_logits"),
    ("cu-logits-not-from-zero", _with(cu_logits=np.array([1, 3, 6])), mp.LayoutError, "cu_logits"),
    ("cu-logits-past-the-logits", _with(cu_logits=np.array([0, 3, 7])), mp.LayoutError, "cu_logits"),
    ("cu-logits-empty", _with(cu_logits=np.zeros(0, dtype=np.int64)), mp.LayoutError, "cu_logits"),
    ("cu-logits-2d", _with(cu_logits=np.array([[0, 3, 6]])), mp.LayoutError, "cu_logits"),
    ("cu-logits-float", _with(cu_logits=np.array([0.0, 3.0, 6.0])), mp.LayoutError, "cu_logits"),
    ("cu-logits-foreign-device", _with(cu_logits=torch.tensor([0, 3, 6], device=META)), mp.LayoutError, "cu_logits"),
    ("cu-logits-too-few-requests", _with(cu_logits=np.array([0, 3])), mp.LayoutError, "mapping.request"),
]  # fmt: skip


@pytest.mark.parametrize(("spoil", "exc", "arg"), [c[1:] for c in APPLY_CASES], ids=[c[0] for c in APPLY_CASES])
def test_bad_apply_arguments(spoil: Callable[[Call], None], exc: type[mp.MaskplugError], arg: str) -> None:
    call = good_call()
    spoil(call)
    before = call.logits.clone()
    with pytest.raises(exc) as info:
        call.run()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    assert msg.startswith(arg + ":") or f" {arg}:" in msg or f"{arg} " in msg, msg
    assert "expected" in msg, msg
    assert torch.equal(call.logits.contiguous().view(torch.uint8), before.contiguous().view(torch.uint8))


def test_good_apply_call_works() -> None:
    """The baseline every case above spoils is itself valid and writes."""
    call = good_call()
    before = call.logits.clone()
    call.run()
    assert not torch.equal(call.logits, before)


def _layout() -> mp.ScheduledLayout:
    return mp.ScheduledLayout([10, 11, 12], [2, 0, 3], [1, 5, 1])


def _cost() -> mp.CostModel:
    return mp.CostModel.linear()


CONF = np.full((3, 3), 0.5)

OTHER_CASES: list[tuple[str, Callable[[], Any], type[mp.MaskplugError], str]] = [
    # ScheduledLayout
    ("layout-lengths-disagree", lambda: mp.ScheduledLayout([1, 2], [1, 1, 1], [1, 1]), mp.LayoutError, "num_drafts"),
    ("layout-negative-drafts", lambda: mp.ScheduledLayout([1, 2], [1, -1], [1, 1]), mp.LayoutError, "num_drafts"),
    ("layout-negative-non-draft", lambda: mp.ScheduledLayout([1, 2], [1, 1], [-3, 1]), mp.LayoutError, "num_non_draft"),
    ("layout-fractional-drafts", lambda: mp.ScheduledLayout([1, 2], [1.5, 1], [1, 1]), mp.LayoutError, "num_drafts"),  # type: ignore[list-item]
    ("layout-duplicate-ids", lambda: mp.ScheduledLayout(["x", "y", "x"], [1, 1, 1], [1, 1, 1]), mp.LayoutError, "req_ids"),
    ("layout-2d-ids", lambda: mp.ScheduledLayout([[1, 2]], [1, 1], [1, 1]), mp.LayoutError, "req_ids"),
    ("layout-negative-bonus", lambda: mp.ScheduledLayout([1], [1], [1], num_bonus=-1), mp.LayoutError, "num_bonus"),
    ("layout-counts-on-foreign-device", lambda: mp.ScheduledLayout([1], torch.ones(1, dtype=torch.int64, device=META), [1]), mp.LayoutError, "num_drafts"),  # type: ignore[arg-type]
    ("layout-unknown-id", lambda: _layout().index_of(99), mp.LayoutError, "req_ids"),
    # GrammarRows and RowMapping
    ("grammar-unknown-request", lambda: mp.GrammarRows([10, 13]).mapping(_layout()), mp.LayoutError, "grammar_req_ids"),
    ("grammar-duplicate-request", lambda: mp.GrammarRows([10, 12, 10]), mp.LayoutError, "grammar_req_ids"),
    ("grammar-bad-mode", lambda: mp.GrammarRows([10], mode="dense"), mp.LayoutError, "mode"),  # type: ignore[arg-type]
    ("grammar-fixed-without-stride", lambda: mp.GrammarRows([10], mode="fixed"), mp.LayoutError, "stride"),
    ("grammar-stride-too-small", lambda: mp.GrammarRows([10, 12], mode="fixed", stride=3).mapping(_layout()), mp.LayoutError, "stride"),
    ("grammar-stride-in-ragged-mode", lambda: mp.GrammarRows([10], stride=4), mp.LayoutError, "stride"),
    ("rowmapping-int64", lambda: mp.RowMapping(np.zeros(2, np.int64), np.zeros(2, np.int32)), mp.LayoutError, "mapping.request"),
    ("rowmapping-unequal", lambda: mp.RowMapping(np.zeros(2, np.int32), np.zeros(3, np.int32)), mp.LayoutError, "mapping"),
    # compact and active_cu_logits
    ("compact-budget-above-drafts", lambda: mp.compact(_layout(), 6), mp.BudgetError, "budget"),
    ("compact-negative-budget", lambda: mp.compact(_layout(), -1), mp.BudgetError, "budget"),
    ("compact-float-budget", lambda: mp.compact(_layout(), 2.0), mp.BudgetError, "budget"),  # type: ignore[arg-type]
    ("compact-capacity-wrong-sum", lambda: mp.compact(_layout(), 3, capacity=[1, 0, 1]), mp.BudgetError, "capacity"),
    ("compact-capacity-above-drafts", lambda: mp.compact(_layout(), 3, capacity=[3, 0, 0]), mp.BudgetError, "capacity"),
    ("compact-capacity-wrong-length", lambda: mp.compact(_layout(), 3, capacity=[1, 2]), mp.BudgetError, "capacity"),
    ("compact-capacity-foreign-device", lambda: mp.compact(_layout(), 3, capacity=torch.tensor([1, 0, 2], device=META)), mp.BudgetError, "capacity"),
    ("compact-not-a-layout", lambda: mp.compact([2, 0, 3], 1), mp.BudgetError, "layout"),  # type: ignore[arg-type]
    ("active-cu-float-capacity", lambda: mp.active_cu_logits(torch.tensor([1.0, 2.0])), mp.BudgetError, "capacity"),
    ("active-cu-negative-bonus", lambda: mp.active_cu_logits(torch.tensor([1, 2]), -1), mp.BudgetError, "num_bonus"),
    # choose_budget
    ("choose-wrong-rows", lambda: mp.choose_budget(CONF[:2], _layout(), _cost()), mp.BudgetError, "confidences"),
    ("choose-too-few-columns", lambda: mp.choose_budget(CONF[:, :2], _layout(), _cost()), mp.BudgetError, "confidences"),
    ("choose-string-confidences", lambda: mp.choose_budget(np.full((3, 3), "x"), _layout(), _cost()), mp.BudgetError, "confidences"),
    ("choose-confidences-on-foreign-device", lambda: mp.choose_budget(torch.from_numpy(CONF).to(META), _layout(), _cost()), mp.BudgetError, "confidences"),
    ("choose-negative-num-sampling", lambda: mp.choose_budget(CONF, _layout(), _cost(), num_sampling=-1), mp.BudgetError, "num_sampling"),
    ("choose-max-logits-below-bonus-rows", lambda: mp.choose_budget(CONF, _layout(), _cost(), max_logits=2), mp.BudgetError, "max_logits"),
    ("choose-not-a-cost-model", lambda: mp.choose_budget(CONF, _layout(), {"verify": 1.0}), mp.BudgetError, "cost"),  # type: ignore[arg-type]
    # allocate
    ("allocate-1d-confidences", lambda: mp.allocate(torch.ones(3), [1, 1, 1], 1), mp.BudgetError, "confidences"),
    ("allocate-int-confidences", lambda: mp.allocate(torch.ones(3, 2, dtype=torch.int64), [1, 1, 1], 1), mp.BudgetError, "confidences"),
    ("allocate-num-drafts-wrong-length", lambda: mp.allocate(torch.ones(3, 2), [1, 1], 1), mp.BudgetError, "num_drafts"),
    ("allocate-num-drafts-above-columns", lambda: mp.allocate(torch.ones(3, 2), [1, 3, 1], 1), mp.BudgetError, "num_drafts"),
    ("allocate-budget-above-drafts", lambda: mp.allocate(torch.ones(3, 2), [1, 2, 1], 5), mp.BudgetError, "budget"),
    ("allocate-negative-budget", lambda: mp.allocate(torch.ones(3, 2), [1, 2, 1], -1), mp.BudgetError, "budget"),
    ("allocate-float-budget", lambda: mp.allocate(torch.ones(3, 2), [1, 2, 1], 1.0), mp.BudgetError, "budget"),  # type: ignore[arg-type]
    ("allocate-num-drafts-on-foreign-device", lambda: mp.allocate(torch.ones(3, 2), torch.ones(3, dtype=torch.int64, device=META), 1), mp.BudgetError, "num_drafts"),
    ("allocate-float-num-drafts-tensor", lambda: mp.allocate(torch.ones(3, 2), torch.ones(3), 1), mp.BudgetError, "num_drafts"),
    # CostModel
    ("cost-curve-not-pairs", lambda: mp.CostModel.from_curves([(1, 1.0)], [1.0, 2.0], 8, 8), mp.BudgetError, "verify_curve"),  # type: ignore[list-item]
    ("cost-curve-empty", lambda: mp.CostModel.from_curves([], [(1, 1.0)], 8, 8), mp.BudgetError, "draft_curve"),
    ("cost-curve-duplicate-sizes", lambda: mp.CostModel.from_curves([(1, 1.0), (1, 2.0)], [(1, 1.0)], 8, 8), mp.BudgetError, "draft_curve"),
    ("cost-curve-negative-time", lambda: mp.CostModel.from_curves([(1, 1.0)], [(1, -1.0)], 8, 8), mp.BudgetError, "verify_curve"),
    ("cost-curve-nan", lambda: mp.CostModel.from_curves([(1, 1.0)], [(1, float("nan"))], 8, 8), mp.BudgetError, "verify_curve"),
    ("cost-negative-max-tokens", lambda: mp.CostModel.from_curves([(1, 1.0)], [(1, 1.0)], 8, -8), mp.BudgetError, "max_tokens"),
    ("cost-fractional-graph-limit", lambda: mp.CostModel.from_curves([(1, 1.0)], [(1, 1.0)], 8, 8, graph_limit=1.5), mp.BudgetError, "graph_limit"),  # type: ignore[arg-type]
    ("cost-linear-negative-slope", lambda: mp.CostModel.linear(verify_per_token_ms=-0.1), mp.BudgetError, "verify_per_token_ms"),
    ("cost-linear-all-zero", lambda: mp.CostModel.linear(0, 0, 0, 0), mp.BudgetError, "CostModel.linear"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "exc", "arg"), [c[1:] for c in OTHER_CASES], ids=[c[0] for c in OTHER_CASES])
def test_bad_arguments(call: Callable[[], Any], exc: type[mp.MaskplugError], arg: str) -> None:
    conf_before = CONF.copy()
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    assert msg.startswith(arg + ":") or f" {arg}:" in msg, msg
    assert "expected" in msg, msg
    np.testing.assert_array_equal(CONF, conf_before)


# One real failing call per error class: (id, call, class, the builtin it also is, argument named).
ONE_PER_CLASS: list[tuple[str, Callable[[], Any], type[mp.MaskplugError], type[Exception], str]] = [
    ("layout", lambda: mp.ScheduledLayout(["x", "x"], [1, 1], [1, 1]), mp.LayoutError, ValueError, "req_ids"),
    ("budget", lambda: mp.compact(_layout(), 6), mp.BudgetError, ValueError, "budget"),
    ("backend", lambda: _with_backend("no-such-kernel").run(), mp.BackendUnavailable, RuntimeError, "backend"),
    ("grammar-kind", lambda: mp.GrammarSpec("yaml", "a: 1"), mp.GrammarError, ValueError, "kind"),
    ("grammar-vocab", lambda: mp.Vocab([b"a", b"b"], eos_ids=[]), mp.GrammarError, ValueError, "eos_ids"),
    ("plugin", lambda: mp.get_scheduler("no-such-scheduler"), mp.PluginError, RuntimeError, "name"),
]  # fmt: skip

ERROR_CLASSES = (mp.LayoutError, mp.BudgetError, mp.BackendUnavailable, mp.GrammarError, mp.PluginError)


def _with_backend(backend: str) -> Call:
    call = good_call()
    call.kwargs["backend"] = backend
    return call


@pytest.mark.parametrize(
    ("call", "exc", "builtin", "arg"), [c[1:] for c in ONE_PER_CLASS], ids=[c[0] for c in ONE_PER_CLASS]
)
def test_each_error_class_comes_from_a_real_call(
    call: Callable[[], Any], exc: type[mp.MaskplugError], builtin: type[Exception], arg: str
) -> None:
    """Exactly the documented class, catchable as ``MaskplugError`` and as its builtin, naming the argument."""
    with pytest.raises(mp.MaskplugError) as info:
        call()
    err = info.value
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert isinstance(err, builtin)
    assert [cls for cls in ERROR_CLASSES if isinstance(err, cls)] == [exc]  # no class is a case of another
    msg = str(err)
    assert msg.startswith(arg + ":") and "expected" in msg, msg
