"""Choosing schedulers by name, the plugin hook, the step view and range checks for every scheduler."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sched_testkit import Case, oracle_cap, steps

import maskplug as mp
from maskplug import reference
from maskplug.hookspecs import hookimpl
from maskplug.plugins import BUILTIN_PLUGINS, Registry

BUILTINS = ["dspark", "goodput", "grammar-aware", "no-spec", "verify-all"]
COST = mp.CostModel.linear()


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    mp.reset_registry()
    yield
    mp.reset_registry()


def test_builtins_register_through_the_hook() -> None:
    assert "maskplug.schedulers.registry" in BUILTIN_PLUGINS
    reg = Registry()
    mod = importlib.import_module("maskplug.schedulers.registry")
    reg.add_plugin(mod, "builtin-schedulers")
    assert sorted(reg.schedulers) == BUILTINS
    assert [p.hooks for p in reg.plugins if p.name == "builtin-schedulers"] == [["maskplug_register_schedulers"]]
    assert set(BUILTINS) <= set(mp.schedulers())
    assert mp.schedulers() == mod.schedulers()  # the module is callable and is the listing


def test_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(
        mp.PluginError, match=r"name: expected one of the registered schedulers \[.*'dspark'.*\], got 'dsprak'"
    ):
        mp.get_scheduler("dsprak")


def test_environment_chooses_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASKPLUG_SCHEDULER", raising=False)
    assert type(mp.get_scheduler()).__name__ == "DSparkScheduler"
    monkeypatch.setenv("MASKPLUG_SCHEDULER", "goodput")
    assert type(mp.get_scheduler()).__name__ == "GoodputScheduler"
    assert type(mp.get_scheduler("no-spec")).__name__ == "NoSpecScheduler"  # an explicit name wins
    monkeypatch.setenv("MASKPLUG_SCHEDULER", "nope")
    with pytest.raises(mp.PluginError, match=r"MASKPLUG_SCHEDULER.*got 'nope'"):
        mp.get_scheduler()


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(mp.BudgetError, match=r"dspark.*unexpected configuration"):
        mp.get_scheduler("dspark", alpha=0.3)
    with pytest.raises(mp.BudgetError, match="config"):
        mp.get_scheduler("goodput", beta=0.3)
    with pytest.raises(mp.PluginError, match="registered schedulers"):
        mp.get_scheduler("grammar-aware", inner="nope")
    ga = mp.get_scheduler("grammar-aware", inner="goodput", alpha=0.3)
    assert ga.inner.alpha == 0.3  # type: ignore[attr-defined]


class _Halving:
    """An outside scheduler: half of every scheduled draft."""

    def __init__(self, rounding: str = "down") -> None:
        self.rounding = rounding
        self.seen: list[mp.StepOutcome] = []

    def budget(self, step: mp.StepView) -> mp.BudgetDecision:
        return step.score(step.cap // 2)

    def observe(self, outcome: mp.StepOutcome) -> None:
        self.seen.append(outcome)


class _Plugin:
    @hookimpl
    def maskplug_register_schedulers(self, register: Any) -> None:
        register("halving", _Halving)


def test_outside_plugin_scheduler_is_found_by_name_and_wrapped(fresh_registry: None) -> None:
    mp.get_registry().add_plugin(_Plugin(), "test-halving")
    assert "halving" in mp.schedulers()
    sched = mp.get_scheduler("halving", rounding="up")
    assert isinstance(sched, mp.Scheduler) and sched.rounding == "up"  # type: ignore[attr-defined]
    lay = mp.ScheduledLayout([1, 2], [4, 3], [1, 1])
    g = mp.DraftMasks(np.array([0]), np.array([1]), np.zeros((1, 5), dtype=bool))
    view = mp.StepView(lay, COST, grammar=g)
    assert sched.budget(view).budget == 3
    ga = mp.get_scheduler("grammar-aware", inner="halving")
    assert ga.budget(view).budget == 3  # no beliefs: only trimmed to the 1 + 3 accepted drafts
    out = mp.StepOutcome(np.array([2, 1]), np.array([2, 1]), np.array([1, 0]))
    ga.observe(out)
    assert ga.inner.seen == [out]  # type: ignore[attr-defined]
    # registering the same name twice is refused (and reported, not raised, by the loader)
    with pytest.warns(RuntimeWarning, match="already registered"):
        mp.get_registry().add_plugin(_Plugin(), "test-halving-again")


def test_step_view_validation_and_read_only() -> None:
    lay = mp.ScheduledLayout([1, 2], [3, 1], [1, 1])
    conf = np.full((2, 3), 0.5)
    view = mp.StepView(lay, COST, confidences=conf)
    assert view.confidences is not None and not view.confidences.flags.writeable
    conf[0, 0] = 0.0  # the view has its own copy
    assert view.confidences[0, 0] == 0.5
    with pytest.raises(ValueError):
        view.confidences[0, 0] = 1.0
    with pytest.raises(AttributeError):
        view.max_logits = 3  # type: ignore[misc]
    bad_conf = conf.copy()
    bad_conf[1, 0] = np.nan
    cases: list[tuple[dict[str, Any], str]] = [
        ({"layout": "x"}, "layout: expected a ScheduledLayout"),
        ({"cost": 1.0}, "cost: expected a CostModel"),
        ({"confidences": bad_conf}, "confidences: expected probabilities"),
        ({"confidences": np.full((3, 3), 0.5)}, r"confidences: expected shape \(2, max_drafts\)"),
        ({"confidences": np.full((2, 2), 0.5)}, "at least 3 columns"),
        ({"max_logits": 1}, "max_logits: expected at least"),
        ({"max_logits": -1}, "max_logits: expected an int >= 0"),
        ({"num_sampling": 1.5}, "num_sampling"),
        ({"grammar": "x"}, "grammar: expected DraftMasks"),
        ({"grammar": mp.DraftMasks(np.array([2]), np.array([0]), np.zeros((1, 4), bool))}, "grammar.request"),
        ({"grammar": mp.DraftMasks(np.array([1]), np.array([2]), np.zeros((1, 4), bool))}, "grammar.acceptable"),
        ({"grammar": mp.DraftMasks(np.array([0, 0]), np.array([1, 1]), np.zeros((2, 4), bool))}, "unique"),
        ({"grammar": mp.DraftMasks(np.array([0]), np.array([1]), np.zeros((2, 4), bool))}, "grammar.forced"),
    ]
    for kwargs, msg in cases:
        args: dict[str, Any] = {"layout": lay, "cost": COST, "confidences": conf, **kwargs}
        with pytest.raises(mp.BudgetError, match=msg):
            mp.StepView(**args)
    with pytest.raises(mp.BudgetError, match=r"budget: expected an int in \[0, 4\]"):
        view.score(5)


def _check_decision(d: mp.BudgetDecision, view: mp.StepView) -> None:
    assert isinstance(d, mp.BudgetDecision)
    assert isinstance(d.budget, int) and 0 <= d.budget <= oracle_cap(view)
    lay = view.layout
    assert d.cost_ms == pytest.approx(
        float(view.cost.draft_ms(lay.n)) + float(view.cost.verify_ms(int(lay.num_non_draft.sum()) + d.budget))
    )
    assert np.isnan(d.expected_tokens) or d.expected_tokens >= view.sampling


@given(steps(), st.sampled_from(["dspark", "verify-all", "no-spec", "goodput", "grammar-aware"]))
def test_every_scheduler_returns_a_budget_in_range(case: Case, name: str) -> None:
    """Random steps, including empty batches, batches without drafts, and row limits."""
    view = case.view
    sched = mp.get_scheduler(name)
    d = sched.budget(view)
    _check_decision(d, view)
    if view.layout.total_drafts == 0:
        assert d.budget == 0
    if name == "no-spec":
        assert d.budget == 0 and d.expected_tokens == view.sampling
    if name == "verify-all":
        assert d.budget == oracle_cap(view)
    if name == "dspark":
        assert d == reference.choose_budget(
            view.confidences, view.layout, view.cost, num_sampling=view.num_sampling, max_logits=view.max_logits
        )
    # the decision can be allocated on the live confidences: a prefix per request summing to the budget
    cap = mp.allocate_step(view, torch.tensor(case.live), d.budget).numpy()
    assert int(cap.sum()) == d.budget and np.all(cap <= view.layout.num_drafts) and np.all(cap >= 0)
    if view.grammar is not None:
        lim = view.layout.num_drafts.copy()
        lim[view.grammar.request] = np.minimum(lim[view.grammar.request], view.grammar.acceptable)
        if d.budget <= lim.sum():
            assert np.all(cap <= lim)  # no draft the grammar rejects
        else:
            assert np.all(cap >= lim)  # a grammar-blind budget: every accepted draft is in first
    # observing the outcome keeps every scheduler working
    accepted = np.minimum(cap, 1)
    sched.observe(mp.StepOutcome(view.layout.req_ids, cap.astype(np.int64), accepted.astype(np.int64)))
    _check_decision(sched.budget(view), view)


@given(steps(with_confidences=False), st.sampled_from(["verify-all", "no-spec", "goodput"]))
def test_schedulers_without_a_confidence_head(case: Case, name: str) -> None:
    view = case.view
    _check_decision(mp.get_scheduler(name).budget(view), view)
    _check_decision(mp.get_scheduler("grammar-aware", inner=name).budget(view), view)
