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
from maskplug import budget as budget_mod
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
                    st.sampled_from(["uniform", "ragged", "third", "zero", "repeat"]),
                    st.sampled_from(["choose", "choose-limits", "given", "given-zero", "given-all", "full"]),
                    st.sampled_from(["numpy", "numpy32", "inplace", "list", "tensor"]),
                ),
                min_size=1,
                max_size=6,
            )
        ),
    }


@given(planners())
def test_planner_steps_equal_the_core_functions(p: dict[str, Any]) -> None:
    saved = budget_mod._COLUMNWISE_FROM
    budget_mod._COLUMNWISE_FROM = p["columnwise_from"]
    try:
        _check_steps(p)
    finally:
        budget_mod._COLUMNWISE_FROM = saved


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
    kept: list[tuple[Step, Any]] = []
    for drafts, how, form in p["steps"]:
        md = p["max_drafts"]
        if drafts == "repeat" and prev_nd is not None and prev_nn is not None:
            nd, nn = prev_nd.copy(), prev_nn.copy()  # the same counts as the step before
        elif drafts == "uniform":
            nd = np.full(n, md, dtype=np.int64)
        elif drafts == "zero":
            nd = np.zeros(n, dtype=np.int64)
        elif drafts == "third":
            # An n-gram drafter's pattern: a random third of the requests draft fewer than the most.
            nd = np.full(n, md, dtype=np.int64)
            fewer = rng.permutation(n)[: (n + 2) // 3]
            nd[fewer] = rng.integers(0, max(md, 1), size=fewer.shape[0])
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
        elif how == "given-zero":
            budget = 0
        elif how == "given-all":
            budget = int(nd.sum())
        want = expected_step(p["req_ids"], rows, nd, nn, p["num_bonus"], p["cost"], conf_arg, budget, kwargs)
        got = planner.step(nd_in, nn_in, conf_arg, budget=budget, **kwargs)
        assert_same(got, want)
        # The mapping was checked when it was built and may be shared by later steps: read-only.
        for arr in (got.mapping.request, got.mapping.position):
            assert not arr.flags.writeable
            if arr.size:
                with pytest.raises(ValueError):
                    arr[:1] = -7
        if len(kept) % 2:
            # The caller owns the layout and compaction it got: writing into them never reaches a later step.
            got.layout.num_drafts[:] = 0
            got.layout.num_non_draft[:] = 0
            got.layout.cu_scheduled[:] = -7
            got.compaction.num_tokens_per_req[:] = -7
            got.compaction.cu_logits[:] = -7
        kept.append((got, want))
    # Steps left alone still hold their own values after every later step (refilled buffers included).
    for i, (got, want) in enumerate(kept):
        if i % 2 == 0:
            assert_same(got, want)


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


def test_planner_layouts_hold_every_field_the_constructor_sets() -> None:
    """The planner's layouts come from ScheduledLayout._with_counts: every slot equals the constructor's."""
    ids = ["x", "y", "z"]
    planner = StepPlanner(ids, ["z", "x"], cost=COST)
    nd, nn = np.array([2, 0, 1]), np.array([1, 3, 1])
    got, want = planner.layout(nd, nn), mp.ScheduledLayout(ids, nd, nn)
    for name in mp.ScheduledLayout.__slots__:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        elif name == "_req_ids":
            assert a is None and b is None  # ids were given as a list: built on first use
        else:
            assert a == b, name


def _count_buffer(form: str, values: list[int]) -> Any:
    if form.startswith("numpy"):
        return np.array(values, dtype=np.int64 if form == "numpy64" else np.int32)
    return torch.tensor(values, dtype=torch.int64 if form == "tensor64" else torch.int32)


def _refill(buf: Any, values: list[int]) -> None:
    buf[:] = torch.tensor(values, dtype=buf.dtype) if isinstance(buf, torch.Tensor) else values


@pytest.mark.parametrize("form", ["numpy64", "numpy32", "tensor64", "tensor32"])
@pytest.mark.parametrize("make", ["constructor", "planner.layout", "planner.step"])
def test_layouts_keep_their_counts_when_the_caller_refills_its_buffers(form: str, make: str) -> None:
    """A layout copies the counts it keeps: refilling the engine's buffers in place never rewrites it."""
    ids = ["a", "b", "c"]
    nd, nn = _count_buffer(form, [3, 0, 2]), _count_buffer(form, [1, 4, 1])
    planner = StepPlanner(ids, ids, cost=COST)
    if make == "constructor":
        layout = mp.ScheduledLayout(ids, nd, nn)
    elif make == "planner.layout":
        layout = planner.layout(nd, nn)
    else:
        step = planner.step(nd, nn)
        layout = step.layout
    _refill(nd, [1, 1, 1])
    _refill(nn, [9, 9, 9])
    assert layout.num_drafts.tolist() == [3, 0, 2]
    assert layout.num_non_draft.tolist() == [1, 4, 1]
    assert layout.total_drafts == 5 and layout.cu_scheduled.tolist() == [0, 4, 5, 8]
    if make == "planner.step":
        assert step.compaction.num_tokens_per_req.tolist() == [4, 4, 3]
        assert step.mapping.position.tolist() == [0, 1, 2, 3, 0, 0, 1, 2]
    # The planner sees the refilled values at its next step (compared by value, not by identity).
    assert_same(
        planner.step(nd, nn),
        expected_step(ids, mp.GrammarRows(ids), [1, 1, 1], [9, 9, 9], 1, COST, None, None, {}),
    )


@pytest.mark.parametrize("n", [1, 8, 70, 600])  # Python and numpy count paths, tables and repeats
def test_changing_counts_in_every_regime(n: int) -> None:
    """A third of the requests change their draft count every step; every regime meets the core's answer."""
    rng = np.random.default_rng(n)
    ids = [f"r{i}" for i in rng.permutation(n)]
    grammar = [ids[i] for i in rng.permutation(n)]
    planner = StepPlanner(ids, grammar, cost=CURVES)
    rows = mp.GrammarRows(grammar)
    nd_buf = np.empty(n, dtype=np.int32)  # refilled in place, as an engine does
    nn = np.ones(n, dtype=np.int32)
    seen: set[str] = set()
    for step in range(24):
        nd_buf[:] = 5
        fewer = rng.permutation(n)[: max(1, n // 3)]
        nd_buf[fewer] = rng.integers(0, 5, size=fewer.shape[0])
        total = int(nd_buf.sum())
        conf = rng.uniform(0.0, 1.0, size=(n, 6)).astype(np.float32)
        kind = step % 4
        partial = int(rng.integers(1, total)) if total > 1 else total
        budget = None if kind in (0, 3) else (0 if kind == 1 else partial)
        conf_arg = conf if kind == 0 else None
        want = expected_step(ids, rows, nd_buf.copy(), nn, 1, CURVES, conf_arg, budget, {})
        got = planner.step(nd_buf, nn, conf_arg, budget=budget)
        assert_same(got, want)
        seen.add(got.compaction.regime)
    assert seen == {"full", "partial", "zero"}
