"""Bad input by class: a named error, nothing written, the same check for every argument form.

Each class of mistake has a table of cases. Every case runs against a fresh
:class:`World` (logits, bitmask, host and live confidences, a confidence
history with two recorded steps) and asserts the exact error class, that the
message names the argument, and that every tensor, array and history buffer
of the world is bit for bit what it was before the call. Properties follow for
the numeric classes: a NaN, negative or overflowing value anywhere it counts
is refused, never propagated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskplug as mp
from maskplug import plugins
from maskplug.errors import ConfigWarning
from maskplug.schedulers import GoodputScheduler

COST = mp.CostModel.linear()


@dataclass
class World:
    """Everything a bad call could corrupt, built fresh for each case."""

    layout: mp.ScheduledLayout
    logits: torch.Tensor
    bitmask: torch.Tensor
    mapping: mp.RowMapping
    cu: np.ndarray
    conf_np: np.ndarray
    conf_t: torch.Tensor
    hist: mp.ConfidenceHistory
    extra: dict[str, Any] = field(default_factory=dict)

    def step(self, grammar: mp.DraftMasks | None = None) -> mp.StepView:
        return mp.StepView(self.layout, COST, confidences=self.conf_np, grammar=grammar)

    def masks(self) -> mp.DraftMasks:
        """Good draft masks: requests 2 and 0, the grammar accepting 1 and 2 of their drafts."""
        return mp.DraftMasks(np.array([2, 0]), np.array([1, 2]), np.zeros((2, 4), dtype=bool))

    def apply(self, logits: torch.Tensor | None = None, **kwargs: Any) -> None:
        lg = self.logits if logits is None else logits
        mp.apply_grammar_bitmask(lg, self.bitmask, self.mapping, self.cu, backend="torch", **kwargs)


def make_world() -> World:
    """Three requests with 2, 0 and 3 drafts; every request under a grammar; full budget."""
    layout = mp.ScheduledLayout(["a", "b", "c"], [2, 0, 3], [1, 1, 1])
    mapping = mp.GrammarRows(["c", "a", "b"]).mapping(layout)
    gen = torch.Generator().manual_seed(7)
    rows = len(mapping)
    logits = torch.randn(rows, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, 4), dtype=torch.int32, generator=gen)
    conf = np.random.default_rng(7).uniform(0.05, 0.95, size=(3, 3))
    hist = mp.ConfidenceHistory(4, 3)
    for _ in range(2):
        hist.record([0, 2, 3], torch.from_numpy(conf).float())
    return World(
        layout, logits, bitmask, mapping, mp.compact(layout, 5).cu_logits, conf, torch.from_numpy(conf.copy()), hist
    )


def snapshot(w: World) -> list[Any]:
    """Copies of every buffer of the world, history included (bit patterns, not values: NaN == NaN)."""
    h = w.hist
    tensors = [w.logits.detach(), w.bitmask, w.conf_t, h._table, *h._host]
    return [
        *(t.clone().view(torch.int32 if t.element_size() == 4 else torch.int64) for t in tensors),
        w.cu.copy(),
        w.conf_np.copy(),
        w.mapping.request.copy(),
        w.mapping.position.copy(),
        h.step,
        h._reset_at.copy(),
        list(h._written_at),
    ]


def assert_unchanged(before: list[Any], after: list[Any]) -> None:
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"buffer {i} changed"
        elif isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=f"buffer {i} changed")
        else:
            assert a == b, f"state {i} changed"


Case = tuple[str, Callable[[World], Any], type[mp.MaskplugError], str]


def _overlapping(w: World) -> torch.Tensor:
    # Rows 50 elements apart but 100 wide: each row shares half its memory with the next.
    return w.logits.view(-1).as_strided(w.logits.shape, (50, 1))


def _leaf_requiring_grad(w: World) -> None:
    w.logits.requires_grad_(True)
    try:
        w.apply()
    finally:
        w.logits.requires_grad_(False)


def _non_leaf_requiring_grad(w: World) -> None:
    leaf = torch.zeros(w.logits.shape, requires_grad=True)
    w.apply(leaf + w.logits)


# ------------------------------------------------------------------------------------------- 1. aliasing
ALIASING: list[Case] = [
    ("as-strided-rows-overlap", lambda w: w.apply(_overlapping(w)), mp.LayoutError, "logits"),
    ("expanded-row-stride-0", lambda w: w.apply(w.logits[:1].expand(w.logits.shape)), mp.LayoutError, "logits"),
    ("one-column-row-stride-0", lambda w: w.apply(w.logits[:1, :1].expand(w.logits.shape[0], 1), vocab_size=1), mp.LayoutError, "logits"),
    ("leaf-requires-grad", _leaf_requiring_grad, mp.LayoutError, "logits"),
    ("non-leaf-requires-grad", _non_leaf_requiring_grad, mp.LayoutError, "logits"),
]  # fmt: skip


def _nan_at(arr: np.ndarray, i: int, j: int, value: float = float("nan")) -> np.ndarray:
    out = arr.copy()
    out[i, j] = value
    return out


def _t(arr: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(arr).to(dtype)


# ------------------------------------------------------------------------------------- 2. confidences
CONFIDENCES: list[Case] = [
    ("allocate-nan", lambda w: mp.allocate(_t(_nan_at(w.conf_np, 0, 1)), w.layout.num_drafts, 3), mp.BudgetError, "confidences"),
    ("allocate-negative", lambda w: mp.allocate(_t(_nan_at(w.conf_np, 2, 2, -0.5)), [2, 0, 3], 3), mp.BudgetError, "confidences"),
    ("allocate-above-one-bf16", lambda w: mp.allocate(_t(_nan_at(w.conf_np, 0, 0, 1.5), torch.bfloat16), [2, 0, 3], 1), mp.BudgetError, "confidences"),
    ("allocate-step-nan", lambda w: mp.allocate_step(w.step(w.masks()), _t(_nan_at(w.conf_np, 2, 0)), 2), mp.BudgetError, "confidences"),
    ("allocate-step-inf-without-grammar", lambda w: mp.allocate_step(w.step(), _t(_nan_at(w.conf_np, 0, 1, np.inf)), 2), mp.BudgetError, "confidences"),
    ("record-nan", lambda w: w.hist.record([0, 1], _t(_nan_at(w.conf_np[:2], 1, 2))), mp.BudgetError, "confidences"),
    ("record-negative", lambda w: w.hist.record([3], _t(_nan_at(w.conf_np[:1], 0, 0, -1e-3))), mp.BudgetError, "confidences"),
    ("choose-budget-nan", lambda w: mp.choose_budget(_nan_at(w.conf_np, 2, 1), w.layout, COST), mp.BudgetError, "confidences"),
    ("step-view-above-one", lambda w: mp.StepView(w.layout, COST, confidences=_nan_at(w.conf_np, 0, 0, 1.0001)), mp.BudgetError, "confidences"),
    ("step-view-best-negative", lambda w: w.step().best(_nan_at(w.conf_np, 2, 2, -1.0)), mp.BudgetError, "confidences"),
]  # fmt: skip

META = torch.device("meta")


# ---------------------------------------------------------------------------------- 3. tensor forms
TENSOR_FORMS: list[Case] = [
    ("allocate-num-drafts-tensor-minus-one", lambda w: mp.allocate(w.conf_t.float(), torch.tensor([2, -1, 3]), 1), mp.BudgetError, "num_drafts"),
    ("allocate-num-drafts-tensor-above-columns", lambda w: mp.allocate(w.conf_t.float(), torch.tensor([2, 0, 4]), 1), mp.BudgetError, "num_drafts"),
    ("allocate-num-drafts-bool-tensor", lambda w: mp.allocate(w.conf_t.float(), torch.tensor([True, False, True]), 1), mp.BudgetError, "num_drafts"),
    ("allocate-0d-budget-above-drafts", lambda w: mp.allocate(w.conf_t.float(), [2, 0, 3], torch.tensor(6)), mp.BudgetError, "budget"),
    ("allocate-0d-budget-negative", lambda w: mp.allocate(w.conf_t.float(), [2, 0, 3], torch.tensor(-1)), mp.BudgetError, "budget"),
    ("allocate-float-0d-budget", lambda w: mp.allocate(w.conf_t.float(), [2, 0, 3], torch.tensor(2.0)), mp.BudgetError, "budget"),
    ("allocate-1d-budget", lambda w: mp.allocate(w.conf_t.float(), [2, 0, 3], torch.tensor([2])), mp.BudgetError, "budget"),
    ("allocate-device-budget-on-other-device", lambda w: mp.allocate(w.conf_t.float(), [2, 0, 3], torch.empty((), dtype=torch.int64, device=META)), mp.BudgetError, "budget"),
    ("allocate-step-0d-budget-above-drafts", lambda w: mp.allocate_step(w.step(w.masks()), w.conf_t.float(), torch.tensor(9)), mp.BudgetError, "budget"),
    ("active-cu-2-pow-40", lambda w: mp.active_cu_logits(torch.tensor([2**40, 1])), mp.BudgetError, "capacity"),
    ("active-cu-sum-past-int32", lambda w: mp.active_cu_logits(torch.tensor([2**30, 2**30], dtype=torch.int64)), mp.BudgetError, "capacity"),
    ("active-cu-negative", lambda w: mp.active_cu_logits(torch.tensor([3, -1], dtype=torch.int16)), mp.BudgetError, "capacity"),
    ("active-cu-complex", lambda w: mp.active_cu_logits(torch.tensor([1 + 0j, 2 + 0j])), mp.BudgetError, "capacity"),
    ("active-cu-bool", lambda w: mp.active_cu_logits(torch.tensor([True, True])), mp.BudgetError, "capacity"),
    ("active-cu-bonus-overflow", lambda w: mp.active_cu_logits(torch.tensor([1, 1]), 2**31 - 1), mp.BudgetError, "num_bonus"),
    ("layout-sum-past-int64", lambda w: mp.ScheduledLayout([1, 2], np.array([2**62, 2**62]), [1, 1]), mp.LayoutError, "num_drafts"),
    ("layout-uint64-above-int64", lambda w: mp.ScheduledLayout([1, 2], np.array([1, 2**63], dtype=np.uint64), [1, 1]), mp.LayoutError, "num_drafts"),
    ("layout-tensor-negative", lambda w: mp.ScheduledLayout([1, 2], [1, 1], torch.tensor([1, -1])), mp.LayoutError, "num_non_draft"),
    ("layout-python-int-past-int64", lambda w: mp.ScheduledLayout([1, 2], [1, 2**70], [1, 1]), mp.LayoutError, "num_drafts"),
    ("layout-bonus-0d-tensor-negative", lambda w: mp.ScheduledLayout([1], [1], [1], num_bonus=torch.tensor(-1)), mp.LayoutError, "num_bonus"),
    ("compact-0d-budget-above-drafts", lambda w: mp.compact(w.layout, torch.tensor(6)), mp.BudgetError, "budget"),
    ("apply-vocab-size-0d-tensor-above-width", lambda w: w.apply(vocab_size=torch.tensor(101)), mp.LayoutError, "vocab_size"),
    ("apply-vocab-size-float", lambda w: w.apply(vocab_size=100.0), mp.LayoutError, "vocab_size"),
    ("score-0d-budget-above-cap", lambda w: w.step().score(torch.tensor(6)), mp.BudgetError, "budget"),  # type: ignore[arg-type]
    ("compact-capacity-tensor-negative", lambda w: mp.compact(w.layout, 1, capacity=torch.tensor([2, 0, -1])), mp.BudgetError, "capacity"),
]  # fmt: skip


def _masks(request: Any, acceptable: Any, forced: Any) -> mp.DraftMasks:
    return mp.DraftMasks(request, acceptable, forced)


F2 = np.zeros((2, 4), dtype=bool)
# (case id, bad draft masks for make_world()'s layout, field named)
BAD_MASKS: list[tuple[str, mp.DraftMasks | Any, str]] = [
    ("negative-acceptable", _masks(np.array([2, 0]), np.array([1, -1]), F2), "grammar.acceptable"),
    ("acceptable-above-drafts", _masks(np.array([2, 0]), np.array([4, 1]), F2), "grammar.acceptable"),
    ("duplicate-request", _masks(np.array([2, 2]), np.array([1, 1]), F2), "grammar.request"),
    ("request-out-of-batch", _masks(np.array([2, 3]), np.array([1, 1]), F2), "grammar.request"),
    ("request-negative", _masks(np.array([-1, 0]), np.array([1, 1]), F2), "grammar.request"),
    ("request-2d", _masks(np.array([[2, 0]]), np.array([1, 1]), F2), "grammar.request"),
    ("request-float", _masks(np.array([2.0, 0.0]), np.array([1, 1]), F2), "grammar.request"),
    ("acceptable-wrong-length", _masks(np.array([2, 0]), np.array([1]), F2), "grammar.acceptable"),
    ("acceptable-float", _masks(np.array([2, 0]), np.array([1.0, 1.0]), F2), "grammar.acceptable"),
    ("forced-1d", _masks(np.array([2, 0]), np.array([1, 1]), np.zeros(2, dtype=bool)), "grammar.forced"),
    ("forced-wrong-rows", _masks(np.array([2, 0]), np.array([1, 1]), np.zeros((3, 4), dtype=bool)), "grammar.forced"),
    ("forced-int", _masks(np.array([2, 0]), np.array([1, 1]), np.ones((2, 4), dtype=np.int64)), "grammar.forced"),
    ("forced-none", _masks(np.array([2, 0]), np.array([1, 1]), None), "grammar.forced"),
    ("not-draft-masks", {"request": [2], "acceptable": [1]}, "grammar"),
]

# Every place a DraftMasks enters.
MASK_ENTRIES: dict[str, Callable[[World, Any], Any]] = {
    "choose_budget": lambda w, g: mp.choose_budget(w.conf_np, w.layout, COST, grammar=g),
    "StepView": lambda w, g: w.step(g),
    "grammar_confidences": lambda w, g: mp.budget.grammar_confidences(w.conf_np, w.layout, g),
}


class _NanCost(mp.CostModel):
    """A cost model whose verification cost is unknown (NaN) past four tokens."""

    def verify_ms(self, num_tokens: Any) -> Any:
        t = np.asarray(num_tokens, dtype=np.float64)
        return np.where(t > 4, np.nan, 1.0 + t)


# ----------------------------------------------------------------- unnamed errors from deep inside
DEEP: list[Case] = [
    ("mapping-of-a-string", lambda w: mp.GrammarRows(["a"]).mapping("a"), mp.LayoutError, "layout"),  # type: ignore[arg-type]
    ("num-rows-of-none", lambda w: mp.GrammarRows(["a"]).num_rows(None), mp.LayoutError, "layout"),  # type: ignore[arg-type]
    ("fixed-stride-float", lambda w: mp.GrammarRows(["a"], mode="fixed", stride=4.0), mp.LayoutError, "stride"),  # type: ignore[arg-type]
    ("choose-budget-grammar-string", lambda w: mp.choose_budget(w.conf_np, w.layout, COST, grammar="json"), mp.BudgetError, "grammar"),  # type: ignore[arg-type]
    ("choose-budget-confidences-strings", lambda w: mp.choose_budget([["x"] * 3] * 3, w.layout, COST), mp.BudgetError, "confidences"),
    ("choose-budget-confidences-complex", lambda w: mp.choose_budget(torch.ones(3, 3, dtype=torch.complex64), w.layout, COST), mp.BudgetError, "confidences"),
    ("from-curves-string", lambda w: mp.CostModel.from_curves("1,2", [(1, 1.0)], 8, 8), mp.BudgetError, "draft_curve"),  # type: ignore[arg-type]
    ("from-curves-ragged", lambda w: mp.CostModel.from_curves([(1, 1.0)], [(1, 1.0), (2,)], 8, 8), mp.BudgetError, "verify_curve"),  # type: ignore[list-item]
    ("from-curves-none", lambda w: mp.CostModel.from_curves(None, [(1, 1.0)], 8, 8), mp.BudgetError, "draft_curve"),  # type: ignore[arg-type]
    ("from-curves-max-tokens-1e13", lambda w: mp.CostModel.from_curves([(1, 1.0)], [(1, 1.0)], 8, 10**13), mp.BudgetError, "max_tokens"),
    ("from-curves-max-reqs-float", lambda w: mp.CostModel.from_curves([(1, 1.0)], [(1, 1.0)], 8.0, 8), mp.BudgetError, "max_reqs"),  # type: ignore[arg-type]
    ("linear-string", lambda w: mp.CostModel.linear(draft_base_ms="1"), mp.BudgetError, "draft_base_ms"),  # type: ignore[arg-type]
    ("linear-none", lambda w: mp.CostModel.linear(verify_per_token_ms=None), mp.BudgetError, "verify_per_token_ms"),  # type: ignore[arg-type]
    ("choose-budget-cost-subclass-nan", lambda w: mp.choose_budget(w.conf_np, w.layout, _NanCost.linear()), mp.BudgetError, "cost"),
    ("allocate-string-budget", lambda w: mp.allocate(w.conf_t.float(), [2, 0, 3], "2"), mp.BudgetError, "budget"),  # type: ignore[arg-type]
    ("allocate-num-drafts-strings", lambda w: mp.allocate(w.conf_t.float(), ["2", "0", "3"], 1), mp.BudgetError, "num_drafts"),
    ("goodput-outcome-1e13", lambda w: GoodputScheduler().observe(mp.StepOutcome(np.array(["a"]), np.array([10**13]), np.array([0]))), mp.BudgetError, "verified"),
    ("goodput-outcome-too-many-positions", lambda w: GoodputScheduler().observe(mp.StepOutcome(np.array(["a"]), np.array([2**31 - 1]), np.array([0]))), mp.BudgetError, "verified"),
    ("history-absurd-size", lambda w: mp.ConfidenceHistory(10**6, 10**6), mp.BudgetError, "max_drafts"),
    ("history-stale-columns-float", lambda w: w.hist.stale([0], num_columns=2.0), mp.BudgetError, "num_columns"),  # type: ignore[arg-type]
    ("history-slots-float", lambda w: w.hist.record([0.5], w.conf_t[:1].float()), mp.LayoutError, "slots"),  # type: ignore[list-item]
]  # fmt: skip

CLASSES: dict[str, list[Case]] = {
    "aliasing": ALIASING,
    "confidences": CONFIDENCES,
    "tensor-forms": TENSOR_FORMS,
    "deep": DEEP,
}
ALL_CASES = [(cls, *case) for cls, cases in CLASSES.items() for case in cases]


def _assert_names(err: BaseException, arg: str) -> None:
    msg = str(err)
    assert msg.startswith(arg + ":") or f" {arg}:" in msg, msg
    assert "expected" in msg, msg


def test_every_class_has_three_cases() -> None:
    for cls, cases in CLASSES.items():
        assert len(cases) >= 3, cls
    assert len(BAD_MASKS) >= 3


@pytest.mark.parametrize(("call", "exc", "arg"), [c[2:] for c in ALL_CASES], ids=[f"{c[0]}:{c[1]}" for c in ALL_CASES])
def test_bad_input_is_refused_and_writes_nothing(
    call: Callable[[World], Any], exc: type[mp.MaskplugError], arg: str
) -> None:
    w = make_world()
    before = snapshot(w)
    with pytest.raises(mp.MaskplugError) as info:
        call(w)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    _assert_names(info.value, arg)
    assert_unchanged(before, snapshot(w))


@pytest.mark.parametrize("entry", sorted(MASK_ENTRIES))
@pytest.mark.parametrize(("bad", "arg"), [c[1:] for c in BAD_MASKS], ids=[c[0] for c in BAD_MASKS])
def test_draft_masks_are_checked_the_same_wherever_they_enter(entry: str, bad: Any, arg: str) -> None:
    w = make_world()
    before = snapshot(w)
    with pytest.raises(mp.BudgetError) as info:
        MASK_ENTRIES[entry](w, bad)
    assert type(info.value) is mp.BudgetError
    _assert_names(info.value, arg)
    assert_unchanged(before, snapshot(w))
    # The very same message from every entry point: one check.
    messages = set()
    for other in MASK_ENTRIES.values():
        with pytest.raises(mp.BudgetError) as again:
            other(make_world(), bad)
        messages.add(str(again.value))
    assert len(messages) == 1, messages


def test_good_draft_masks_enter_everywhere() -> None:
    w = make_world()
    g = w.masks()
    view = w.step(g)
    assert view.grammar is not None and view.grammar.request.tolist() == [2, 0]
    d = mp.choose_budget(w.conf_np, w.layout, COST, grammar=g)
    assert 0 <= d.budget <= 3  # acceptable 1 + 2 drafts
    cap = mp.allocate_step(view, w.conf_t.float(), d.budget)
    assert int(cap.sum()) == d.budget and cap.tolist()[1] == 0


# ------------------------------------------------------------------- one path for every argument form


def _forms(values: list[int]) -> dict[str, Any]:
    return {
        "list": list(values),
        "int64-array": np.array(values, dtype=np.int64),
        "object-array": np.array(values, dtype=object),
        "tensor": torch.tensor(values, dtype=torch.int64),
    }


@pytest.mark.parametrize("bad", [[2, -1, 3], [2, 0, 4], [2, 0, 2**31]], ids=["negative", "above-columns", "past-int32"])
def test_allocate_num_drafts_refused_alike_in_every_form(bad: list[int]) -> None:
    w = make_world()
    messages = set()
    for form, value in _forms(bad).items():
        if form == "object-array":
            continue  # object arrays of ints are not a count type
        with pytest.raises(mp.BudgetError) as info:
            mp.allocate(w.conf_t.float(), value, 1)
        _assert_names(info.value, "num_drafts")
        messages.add(str(info.value))
    assert len(messages) == 1, messages


@pytest.mark.parametrize("bad", [-1, 6, 2**40])
def test_budget_refused_alike_as_int_numpy_scalar_and_0d_tensor(bad: int) -> None:
    w = make_world()
    forms: list[Any] = [bad, np.int64(bad), np.array(bad), torch.tensor(bad)]
    for fn in (
        lambda b: mp.allocate(w.conf_t.float(), [2, 0, 3], b),
        lambda b: mp.allocate_step(w.step(w.masks()), w.conf_t.float(), b),
        lambda b: mp.compact(w.layout, b),
    ):
        messages = set()
        for b in forms:
            with pytest.raises(mp.BudgetError) as info:
                fn(b)
            _assert_names(info.value, "budget")
            messages.add(str(info.value))
        assert len(messages) == 1, messages


def test_good_budget_forms_agree() -> None:
    w = make_world()
    caps = [mp.allocate(w.conf_t.float(), [2, 0, 3], b).tolist() for b in (3, np.int32(3), torch.tensor(3))]
    assert caps[0] == caps[1] == caps[2] and sum(caps[0]) == 3
    assert mp.compact(w.layout, torch.tensor(3)).num_tokens == mp.compact(w.layout, 3).num_tokens
    assert w.step().score(torch.tensor(3)) == w.step().score(3)  # type: ignore[arg-type]
    expected = w.logits.clone()
    w.apply(vocab_size=100)
    again = make_world()
    again.apply(vocab_size=torch.tensor(100))
    assert torch.equal(w.logits.view(torch.int32), again.logits.view(torch.int32))
    assert not torch.equal(w.logits.view(torch.int32), expected.view(torch.int32))  # the call did mask


@pytest.mark.parametrize("bad", [[1, -2], [2**31, 0], [2**62, 2**62]], ids=["negative", "past-int32", "sum-past-int64"])
def test_layout_counts_refused_alike_in_every_form(bad: list[int]) -> None:
    messages = set()
    for value in _forms(bad).values():
        with pytest.raises(mp.LayoutError) as info:
            mp.ScheduledLayout(["x", "y"], value, [1, 1])
        _assert_names(info.value, "num_drafts")
        messages.add(str(info.value))
    # the object array is refused as a dtype, the others name the same offending value
    assert len({m for m in messages if "dtype object" not in m}) == 1, messages


# --------------------------------------------------------------------------- device tensors, sync-free


def test_device_tensors_keep_their_shape_and_dtype_checks_without_a_host_read() -> None:
    """On 'meta' any host read raises: these refusals come from dtype, shape and device alone."""
    conf = torch.empty(3, 4, device=META)
    with pytest.raises(mp.BudgetError, match="num_drafts: expected an integer tensor of shape"):
        mp.allocate(conf, torch.empty(3, device=META), 1)
    with pytest.raises(mp.BudgetError, match="budget: expected a 0-d integer tensor"):
        mp.allocate(
            conf, torch.empty(3, dtype=torch.int64, device=META), torch.empty(1, dtype=torch.int64, device=META)
        )
    with pytest.raises(mp.BudgetError, match="budget: expected a 0-d integer tensor"):
        mp.allocate(conf, torch.empty(3, dtype=torch.int64, device=META), torch.empty((), device=META))
    with pytest.raises(mp.BudgetError, match="capacity: expected a 1-D integer tensor"):
        mp.active_cu_logits(torch.empty(3, dtype=torch.bool, device=META))


# ------------------------------------------------------------------------------- configuration typos


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for var in (plugins.LOAD_PLUGINS_ENV, plugins.DISABLE_PLUGINS_ENV, plugins.KERNEL_BACKEND_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(plugins.md, "entry_points", lambda *, group: [])
    mp.reset_registry()
    yield monkeypatch
    mp.reset_registry()


CONFIG_TYPOS = [
    (plugins.LOAD_PLUGINS_ENV, "maskplug-tritn"),
    (plugins.DISABLE_PLUGINS_ENV, "cupy-backend"),
    (plugins.KERNEL_BACKEND_ENV, "nope"),
]


@pytest.mark.parametrize(("var", "value"), CONFIG_TYPOS)
def test_unknown_names_in_the_environment_warn_at_load_naming_variable_and_value(
    clean_registry: pytest.MonkeyPatch, var: str, value: str
) -> None:
    clean_registry.setenv(var, value)
    with pytest.warns(ConfigWarning) as record:
        reg = mp.get_registry()
    msgs = [str(r.message) for r in record if issubclass(r.category, ConfigWarning)]
    assert len(msgs) == 1 and msgs[0].startswith(f"{var}: expected") and repr(value) in msgs[0], msgs
    assert reg.config_problems == msgs
    assert "torch" in reg.kernels  # loading went on


def test_known_names_do_not_warn(clean_registry: pytest.MonkeyPatch) -> None:
    clean_registry.setenv(plugins.KERNEL_BACKEND_ENV, "torch")
    clean_registry.setenv(plugins.LOAD_PLUGINS_ENV, "")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert mp.get_registry().config_problems == []


def test_unknown_kernel_backend_variable_is_named_on_use_and_writes_nothing(clean_registry: pytest.MonkeyPatch) -> None:
    clean_registry.setenv(plugins.KERNEL_BACKEND_ENV, "nope")
    w = make_world()
    before = snapshot(w)
    with pytest.warns(ConfigWarning):
        mp.get_registry()
    with pytest.raises(mp.BackendUnavailable) as info:
        mp.apply_grammar_bitmask(w.logits, w.bitmask, w.mapping, w.cu)
    msg = str(info.value)
    assert msg.startswith("MASKPLUG_KERNEL_BACKEND: expected") and "'nope'" in msg, msg
    assert_unchanged(before, snapshot(w))


class _ProbeRaises:
    name = "probe-raises"
    priority = 99

    def __init__(self) -> None:
        self.calls = 0

    def unavailable_reason(self, device: torch.device) -> str | None:
        raise OSError("driver library not loadable")

    def apply(self, *args: Any) -> None:
        self.calls += 1


def test_a_raising_availability_probe_is_reported_and_skipped(clean_registry: pytest.MonkeyPatch) -> None:
    broken = _ProbeRaises()

    class Plugin:
        @staticmethod
        def maskplug_register_kernels(register: Callable[[Any], None]) -> None:
            register(broken)

    class EP:
        name = "probe-raises"
        dist = None

        @staticmethod
        def load() -> Any:
            return Plugin

    clean_registry.setattr(plugins.md, "entry_points", lambda *, group: [EP()])
    mp.reset_registry()
    cpu = torch.device("cpu")
    assert mp.resolve_backend("auto", cpu).name == "torch"  # the highest priority is skipped, not a crash
    assert "OSError: driver library not loadable" in (mp.backend_status("cpu")["probe-raises"] or "")
    w = make_world()
    before = snapshot(w)
    with pytest.raises(mp.BackendUnavailable) as info:
        mp.apply_grammar_bitmask(w.logits, w.bitmask, w.mapping, w.cu, backend="probe-raises")
    msg = str(info.value)
    assert msg.startswith("backend: 'probe-raises' cannot run on cpu") and "driver library not loadable" in msg, msg
    assert_unchanged(before, snapshot(w))
    mp.apply_grammar_bitmask(w.logits, w.bitmask, w.mapping, w.cu)  # auto still masks, with torch
    assert broken.calls == 0


# ----------------------------------------------------------------------------------------- properties

BAD_FLOATS = st.sampled_from([float("nan"), float("inf"), -float("inf"), -1e-30, -0.5, 1.0000001, 2.0, 1e300])


@st.composite
def bad_confidences(draw: st.DrawFn) -> tuple[mp.ScheduledLayout, np.ndarray, tuple[int, int]]:
    """A layout, confidences in [0, 1], and one scheduled position spoiled with a bad value."""
    n = draw(st.integers(1, 6))
    nd = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n).filter(lambda v: sum(v) > 0))
    k = max(nd) + draw(st.integers(0, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    conf = rng.uniform(0.0, 1.0, size=(n, k))
    live = [(r, p) for r in range(n) for p in range(nd[r])]
    r, p = draw(st.sampled_from(live))
    conf[r, p] = draw(BAD_FLOATS)
    return mp.ScheduledLayout(list(range(n)), nd, [1] * n), conf, (r, p)


@given(bad_confidences(), st.sampled_from([torch.float32, torch.float64]))
def test_any_bad_scheduled_confidence_is_refused_everywhere(
    case: tuple[mp.ScheduledLayout, np.ndarray, tuple[int, int]], dtype: torch.dtype
) -> None:
    layout, conf, _ = case
    live = torch.from_numpy(conf).to(dtype)
    live_before = live.clone()
    calls: list[Callable[[], Any]] = [
        lambda: mp.allocate(live, layout.num_drafts, 1),
        lambda: mp.allocate_step(mp.StepView(layout, COST), live, 1),
        lambda: mp.choose_budget(conf, layout, COST),
        lambda: mp.StepView(layout, COST, confidences=conf),
        lambda: mp.StepView(layout, COST).best(conf),
    ]
    for call in calls:
        with pytest.raises(mp.BudgetError) as info:
            call()
        _assert_names(info.value, "confidences")
    hist = mp.ConfidenceHistory(layout.n, conf.shape[1])
    with pytest.raises(mp.BudgetError):
        hist.record(list(range(layout.n)), live)
    assert hist.step == 0 and torch.equal(hist._table, torch.ones_like(hist._table))
    as_int = torch.int64 if dtype == torch.float64 else torch.int32
    assert torch.equal(live.view(as_int), live_before.view(as_int))


@given(bad_confidences())
def test_bad_values_past_a_requests_drafts_are_ignored_not_propagated(
    case: tuple[mp.ScheduledLayout, np.ndarray, tuple[int, int]],
) -> None:
    """Stale columns may hold anything; the result is that of the same call with them zeroed."""
    layout, conf, (r, p) = case
    conf[r, p] = 0.5  # the scheduled position is good again
    junk = conf.copy()
    pad = np.arange(conf.shape[1])[None, :] >= layout.num_drafts[:, None]
    junk[pad] = np.nan
    clean = np.where(pad, 0.0, conf)
    assert mp.choose_budget(junk, layout, COST) == mp.choose_budget(clean, layout, COST)
    b = layout.total_drafts // 2
    got = mp.allocate(torch.from_numpy(junk), layout.num_drafts, b)
    assert torch.equal(got, mp.allocate(torch.from_numpy(clean), layout.num_drafts, b))
    assert int(got.sum()) == b and bool((got.numpy() <= layout.num_drafts).all())


BAD_COUNTS = st.sampled_from([-1, -(2**31), 2**31, 2**40, 2**62, 2**63 - 1])


@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=8),
    st.data(),
    st.sampled_from(["list", "int64-array", "tensor"]),
)
def test_any_negative_or_overflowing_count_is_refused_in_every_form(
    counts: list[int], data: st.DataObject, form: str
) -> None:
    i = data.draw(st.integers(0, len(counts) - 1))
    counts = list(counts)
    counts[i] = data.draw(BAD_COUNTS)
    value = _forms(counts)[form]
    n = len(counts)
    with pytest.raises(mp.LayoutError) as info:
        mp.ScheduledLayout(list(range(n)), value, [1] * n)
    _assert_names(info.value, "num_drafts")
    assert f"got {counts[i]} at index {i}" in str(info.value)  # the only bad count, named with its place
    with pytest.raises(mp.BudgetError) as binfo:
        mp.allocate(torch.full((n, 60), 0.5), value, 0)
    _assert_names(binfo.value, "num_drafts")
    with pytest.raises(mp.BudgetError) as cinfo:
        mp.active_cu_logits(torch.tensor(counts, dtype=torch.int64))
    _assert_names(cinfo.value, "capacity")
    good = mp.ScheduledLayout(list(range(n)), [1] * n, [1] * n)
    with pytest.raises(mp.BudgetError) as dinfo:
        mp.compact(good, 0, capacity=value)
    _assert_names(dinfo.value, "capacity")


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6))
def test_counts_in_range_never_wrap(counts: list[int]) -> None:
    """Counts up to 2**31 - 1 are exact: their sums never wrap, offsets past int32 are refused on the host."""
    n = len(counts)
    layout = mp.ScheduledLayout(list(range(n)), counts, [1] * n)
    assert layout.total_drafts == sum(counts)
    assert int(layout.cu_scheduled[-1]) == sum(counts) + n
    cap = torch.tensor(counts, dtype=torch.int64)
    if sum(counts) + n <= 2**31 - 1:
        assert mp.active_cu_logits(cap).tolist()[-1] == sum(counts) + n
    else:
        with pytest.raises(mp.BudgetError, match="capacity: expected offsets that fit in int32"):
            mp.active_cu_logits(cap)


@given(
    st.integers(1, 6),
    st.integers(1, 5),
    st.data(),
)
def test_device_allocation_keeps_its_invariants_whatever_the_unread_values(n: int, k: int, data: st.DataObject) -> None:
    """What allocate does with device tensors it cannot read (run here on the CPU with the checks skipped).

    NaN, infinite or negative confidences, counts below 0 or above the columns
    and budgets outside ``[0, Σ num_drafts]`` never give a request more than
    ``min(num_drafts, max_drafts)`` drafts, and never a non-prefix.
    """
    values = st.one_of(st.floats(0.0, 1.0), BAD_FLOATS)
    conf = torch.tensor(data.draw(st.lists(st.lists(values, min_size=k, max_size=k), min_size=n, max_size=n)))
    nd = torch.tensor(data.draw(st.lists(st.integers(-3, k + 3), min_size=n, max_size=n)))
    budget = data.draw(st.integers(-5, n * k + 5))
    cap = mp.budget._top_budget(conf, nd, torch.tensor(budget), unchecked=True)
    room = nd.clamp(0, k)
    assert cap.dtype == torch.int32 and cap.shape == (n,)
    assert bool((cap >= 0).all()) and bool((cap <= room).all())
    assert int(cap.sum()) == min(max(budget, 0), int(room.sum()))
    # Same as a checked call on the clamped values and counts.
    clean = torch.nan_to_num(conf.double().clamp(0.0, 1.0), nan=0.0)
    b = min(max(budget, 0), int(room.sum()))
    assert torch.equal(cap, mp.allocate(clean, room, b))


@pytest.mark.gpu
def test_cuda_history_checks_recorded_values_when_the_host_reads_them() -> None:
    """record() on CUDA does not read the device; the bad value is refused by the stale() that reads it back."""
    hist = mp.ConfidenceHistory(2, 2, "cuda")
    hist.record([0, 1], torch.tensor([[0.5, float("nan")], [0.2, 0.3]], device="cuda"))
    hist.record([0, 1], torch.full((2, 2), 0.5, device="cuda"))
    with pytest.raises(mp.BudgetError, match=r"^confidences: expected probabilities in \[0, 1\]"):
        hist.stale([0, 1])


@pytest.mark.gpu
def test_cuda_allocation_of_unread_values_equals_the_checked_one_on_clamped_values() -> None:
    conf = torch.tensor([[0.9, float("nan"), 0.5], [-2.0, 0.7, 3.0]], device="cuda")
    nd = torch.tensor([3, 2], device="cuda")
    cap = mp.allocate(conf, nd, torch.tensor(3, device="cuda"))
    clean = torch.nan_to_num(conf.cpu().double().clamp(0.0, 1.0), nan=0.0)
    assert cap.cpu().tolist() == mp.allocate(clean, [3, 2], 3).tolist()
