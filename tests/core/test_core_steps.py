"""StepPlanner against the core functions it stands in for.

Every step a planner plans must equal, field for field, what
``ScheduledLayout`` + ``choose_budget`` (or the given budget) + ``compact`` +
``GrammarRows(...).mapping`` return for the same arguments, over many steps of
one planner (the reused parts must never leak one step into the next). A bad
call raises the error the core functions raise and changes nothing the next
step sees.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskplug as mp
from maskplug import steps as steps_mod
from maskplug.steps import Step, StepPlanner

COST = mp.CostModel.linear(1.0, 0.01, 5.0, 0.02, max_reqs=512, max_tokens=8192)
CURVES = mp.CostModel.from_curves(
    [(1, 1.0), (64, 1.4), (256, 2.5)], [(1, 5.0), (64, 5.5), (512, 9.0), (2048, 25.0)], 512, 8192, graph_limit=512
)


class SlowerCost(mp.CostModel):
    """A subclass with its own verify cost: the planner must defer to choose_budget."""

    def verify_ms(self, num_tokens: Any) -> Any:
        return np.asarray(super().verify_ms(num_tokens)) * 1.5


def expected_step(
    req_ids: list[Any],
    rows: mp.GrammarRows,
    nd: Any,
    nn: Any,
    num_bonus: int,
    cost: mp.CostModel,
    conf: Any,
    budget: Any,
    kwargs: dict[str, Any],
) -> tuple[mp.ScheduledLayout, mp.BudgetDecision | None, int, mp.Compaction, mp.RowMapping]:
    layout = mp.ScheduledLayout(req_ids, nd, nn, num_bonus)
    decision = None
    if conf is not None:
        decision = mp.choose_budget(conf, layout, cost, **kwargs)
        b = decision.budget
    else:
        b = layout.total_drafts if budget is None else budget
    return layout, decision, int(b), mp.compact(layout, b), rows.mapping(layout)


def assert_same(got: Step, want: tuple[Any, ...]) -> None:
    layout, decision, budget, comp, mapping = want
    gl = got.layout
    assert isinstance(gl, mp.ScheduledLayout)
    assert gl.n == layout.n and gl.num_bonus == layout.num_bonus and gl.total_drafts == layout.total_drafts
    for name in ("num_drafts", "num_non_draft", "cu_scheduled"):
        a, b = getattr(gl, name), getattr(layout, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert gl.num_tokens == layout.num_tokens
    assert gl.req_ids.tolist() == layout.req_ids.tolist()
    assert repr(gl) == repr(layout)
    ids = layout.req_ids.tolist()
    if ids:
        assert gl.indices_of(ids[::-1]).tolist() == layout.indices_of(ids[::-1]).tolist()
    assert got.decision == decision
    assert got.budget == budget
    assert got.compaction.regime == comp.regime and got.compaction.exact == comp.exact
    assert np.array_equal(got.compaction.num_tokens_per_req, comp.num_tokens_per_req)
    assert np.array_equal(got.compaction.cu_logits, comp.cu_logits)
    assert got.mapping.request.dtype == np.int32 and got.mapping.position.dtype == np.int32
    assert np.array_equal(got.mapping.request, mapping.request)
    assert np.array_equal(got.mapping.position, mapping.position)


@st.composite
def planners(draw: st.DrawFn) -> dict[str, Any]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(0, 40))
    kind = draw(st.sampled_from(["str", "int"]))
    raw = rng.choice(10 * n + 10, size=n, replace=False)
    req_ids: list[Any] = [f"req-{int(v)}" for v in raw] if kind == "str" else [int(v) for v in raw]
    share = draw(st.sampled_from([0.0, 0.5, 1.0]))
    grammar = [req_ids[i] for i in rng.permutation(n) if rng.random() < share or share == 1.0]
    mode = draw(st.sampled_from(["ragged", "ragged", "fixed"]))
    max_drafts = draw(st.integers(0, 8))
    return {
        "rng": rng,
        "req_ids": req_ids,
        "grammar": grammar,
        "num_bonus": draw(st.integers(0, 2)),
        "mode": mode,
        "stride": (max_drafts + 2) if mode == "fixed" else None,
        "max_drafts": max_drafts,
        "cost": draw(st.sampled_from([COST, CURVES, SlowerCost.linear()])),
        # Survivals by rows (cumprod) or column by column, whatever the batch size.
        "columnwise_from": draw(st.sampled_from([0, 10**9])),
        "steps": draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["uniform", "ragged", "zero", "repeat"]),
                    st.sampled_from(["choose", "choose-limits", "given", "full"]),
                    st.sampled_from(["numpy", "numpy32", "inplace", "list", "tensor"]),
                ),
                min_size=1,
                max_size=6,
            )
        ),
    }


@given(planners())
def test_planner_steps_equal_the_core_functions(p: dict[str, Any]) -> None:
    saved = steps_mod._COLUMNWISE_FROM
    steps_mod._COLUMNWISE_FROM = p["columnwise_from"]
    try:
        _check_steps(p)
    finally:
        steps_mod._COLUMNWISE_FROM = saved


def _check_steps(p: dict[str, Any]) -> None:
    rng: np.random.Generator = p["rng"]
    n = len(p["req_ids"])
    planner = StepPlanner(
        p["req_ids"], p["grammar"], num_bonus=p["num_bonus"], cost=p["cost"], mode=p["mode"], stride=p["stride"]
    )
    rows = mp.GrammarRows(p["grammar"], p["mode"], p["stride"])
    assert planner.n == n
    # An engine's count buffers, refilled in place every step ("inplace").
    nd_buf = np.zeros(n, dtype=np.int64)
    nn_buf = np.zeros(n, dtype=np.int64)
    prev_nd = prev_nn = None
    for drafts, how, form in p["steps"]:
        md = p["max_drafts"]
        if drafts == "repeat" and prev_nd is not None and prev_nn is not None:
            nd, nn = prev_nd.copy(), prev_nn.copy()  # the same counts as the step before
        elif drafts == "uniform":
            nd = np.full(n, md, dtype=np.int64)
        elif drafts == "zero":
            nd = np.zeros(n, dtype=np.int64)
        else:
            nd = rng.integers(0, md + 1, size=n)
        if drafts != "repeat" or prev_nn is None:
            nn = rng.integers(1, 4, size=n)
        prev_nd, prev_nn = nd.copy(), nn.copy()
        conf = rng.uniform(0.0, 1.0, size=(n, md + int(rng.integers(0, 2))))
        conf[rng.random(conf.shape) < 0.1] = 1.0
        nn_in: Any = nn
        if form == "list":
            nd_in: Any = nd.tolist()
            conf_in: Any = conf.tolist()
        elif form == "tensor":
            nd_in, conf_in = torch.from_numpy(nd.copy()), torch.from_numpy(conf.copy())
        elif form == "numpy32":
            nd_in, nn_in, conf_in = nd.astype(np.int32), nn.astype(np.int32), conf.astype(np.float32)
            conf = conf_in.astype(np.float64)
        elif form == "inplace":
            nd_buf[:] = nd
            nn_buf[:] = nn
            nd_in, nn_in, conf_in = nd_buf, nn_buf, conf
        else:
            nd_in, conf_in = nd, conf
        kwargs: dict[str, Any] = {}
        conf_arg = budget = None
        if how.startswith("choose"):
            conf_arg = conf_in
            if how == "choose-limits":
                kwargs = {
                    "num_sampling": int(rng.integers(0, n + 1)),
                    "max_logits": n * p["num_bonus"] + int(nd.sum()) // 2,
                }
        elif how == "given":
            budget = int(rng.integers(0, int(nd.sum()) + 1))
        want = expected_step(p["req_ids"], rows, nd, nn, p["num_bonus"], p["cost"], conf_arg, budget, kwargs)
        got = planner.step(nd_in, nn_in, conf_arg, budget=budget, **kwargs)
        assert_same(got, want)
        # The caller owns what it got: writing into it never reaches a later step.
        got.mapping.request[:] = -7
        got.mapping.position[:] = -7
        got.layout.num_drafts[:] = 0


def _planner() -> tuple[StepPlanner, list[str]]:
    ids = [f"r{i}" for i in range(6)]
    return StepPlanner(ids, ids[::-1], cost=COST), ids


def _error(fn: Any) -> tuple[type[BaseException], str]:
    with pytest.raises(mp.MaskplugError) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    ("nd", "nn", "conf", "extra"),
    [
        ([3] * 5, [1] * 6, None, {}),  # too few draft counts
        ([3, 3, 3, -1, 3, 3], [1] * 6, None, {}),  # a negative count
        ([3.5] * 6, [1] * 6, None, {}),  # fractional counts
        ([True] * 6, [1] * 6, None, {}),  # bools are not counts
        ([3] * 6, [[1] * 6], None, {}),  # 2-D token counts
        ([3] * 6, [1] * 6, np.full((6, 3), 1.5), {}),  # confidence out of range
        ([3] * 6, [1] * 6, np.full((6, 2), 0.5), {}),  # too few confidence columns
        ([3] * 6, [1] * 6, np.full((5, 3), 0.5), {}),  # wrong number of rows
        ([3] * 6, [1] * 6, np.full((6, 3), np.nan), {}),  # NaN
        ([3] * 6, [1] * 6, np.full((6, 3), 0.5), {"max_logits": 2}),  # no room for the bonus rows
        ([3] * 6, [1] * 6, np.full((6, 3), 0.5), {"num_sampling": -1}),
        ([3] * 6, [1] * 6, np.full((6, 3), 0.5), {"num_sampling": 2.0}),
        ([3] * 6, [1] * 6, None, {"budget": 19}),  # more than the drafts
        ([3] * 6, [1] * 6, None, {"budget": -1}),
        ([3] * 6, [1] * 6, None, {"budget": True}),
    ],
)
def test_bad_step_raises_the_core_error_and_leaves_the_planner_intact(
    nd: Any, nn: Any, conf: Any, extra: dict[str, Any]
) -> None:
    planner, ids = _planner()

    def core() -> None:
        layout = mp.ScheduledLayout(ids, nd, nn)
        if conf is not None:
            mp.choose_budget(conf, layout, COST, **extra)
        else:
            mp.compact(layout, extra.get("budget", layout.total_drafts))

    want = _error(core)
    got = _error(lambda: planner.step(nd, nn, conf, **extra))
    assert got == want
    # The next good step is exactly the core's.
    good_nd, good_nn, good_conf = [3, 1, 0, 2, 3, 3], [1] * 6, np.full((6, 3), 0.7)
    assert_same(
        planner.step(good_nd, good_nn, good_conf),
        expected_step(ids, mp.GrammarRows(ids[::-1]), good_nd, good_nn, 1, COST, good_conf, None, {}),
    )


def test_planner_refuses_what_the_core_classes_refuse() -> None:
    assert _error(lambda: StepPlanner(["a", "a"])) == _error(lambda: mp.ScheduledLayout(["a", "a"], [0, 0], [0, 0]))
    assert _error(lambda: StepPlanner(["a"], ["b"])) == _error(
        lambda: mp.GrammarRows(["b"]).mapping(mp.ScheduledLayout(["a"], [0], [0]))
    )
    assert _error(lambda: StepPlanner(["a"], mode="fixed", stride=0)) == _error(lambda: mp.GrammarRows([], "fixed", 0))
    assert _error(lambda: StepPlanner(["a"], num_bonus=-1)) == _error(lambda: mp.ScheduledLayout(["a"], [0], [0], -1))
    kind, msg = _error(lambda: StepPlanner(["a"], cost="fast"))  # type: ignore[arg-type]
    assert kind is mp.BudgetError and msg.startswith("cost:")
    assert _error(lambda: StepPlanner(5)) == _error(lambda: mp.ScheduledLayout(5, [], []))  # type: ignore[arg-type]
    zero_d = torch.tensor(3)  # a 0-d tensor is not a sequence of ids
    assert _error(lambda: StepPlanner(zero_d)) == _error(lambda: mp.ScheduledLayout(zero_d, [], []))  # type: ignore[arg-type]


def test_planner_reads_ids_from_an_iterator_once() -> None:
    ids = ["a", "b", "c"]
    planner = StepPlanner(iter(ids), iter(["c", "a"]), cost=COST)
    nd, nn, conf = [1, 2, 0], [1, 1, 1], np.full((3, 2), 0.9)
    assert_same(
        planner.step(nd, nn, conf),
        expected_step(ids, mp.GrammarRows(["c", "a"]), nd, nn, 1, COST, conf, None, {}),
    )


def test_planner_argument_combinations() -> None:
    ids = ["a", "b"]
    no_cost = StepPlanner(ids, ids)
    kind, msg = _error(lambda: no_cost.step([1, 1], [1, 1], np.full((2, 1), 0.5)))
    assert kind is mp.BudgetError and msg.startswith("cost:")
    planner = StepPlanner(ids, ids, cost=COST)
    kind, msg = _error(lambda: planner.step([1, 1], [1, 1], np.full((2, 1), 0.5), budget=1))
    assert kind is mp.BudgetError and msg.startswith("budget:")
    kind, msg = _error(lambda: planner.step([1, 1], [1, 1], max_logits=10))
    assert kind is mp.BudgetError and "max_logits" in msg


def test_planner_builds_layouts_with_the_constructor_when_the_layout_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """If ScheduledLayout's fields differ from the ones the planner fills, it uses the constructor instead."""
    monkeypatch.setattr(steps_mod, "_FILL_LAYOUT", False)
    ids = ["x", "y", "z"]
    planner = StepPlanner(ids, ["z", "x"], cost=COST)
    nd, nn, conf = [2, 0, 1], [1, 1, 1], np.full((3, 2), 0.6)
    assert_same(
        planner.step(nd, nn, conf),
        expected_step(ids, mp.GrammarRows(["z", "x"]), nd, nn, 1, COST, conf, None, {}),
    )


def test_the_planner_fills_every_layout_field() -> None:
    """The planner's list of ScheduledLayout fields is the class's own (else every step takes the slow path)."""
    assert steps_mod._FILL_LAYOUT, sorted(mp.ScheduledLayout.__slots__)
