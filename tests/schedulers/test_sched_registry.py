"""Choosing schedulers by name, the plugin hook, the step view and range checks for every scheduler."""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sched_testkit import Case, oracle_cap, steps

import maskplug
import maskplug as mp
from maskplug import budget, plugins, reference
from maskplug.hookspecs import hookimpl
from maskplug.plugins import BUILTIN_PLUGINS, Registry
from maskplug.schedulers import (
    DSparkScheduler,
    GoodputScheduler,
    GrammarAwareScheduler,
    NoSpecScheduler,
    VerifyAllScheduler,
    allocation,
    protocol,
)

BUILTINS = ["dspark", "goodput", "grammar-aware", "no-spec", "verify-all"]
COST = mp.CostModel.linear()


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    mp.reset_registry()
    yield
    mp.reset_registry()


class _EntryPoint:
    """An entry point of the ``maskplug`` group, as importlib.metadata would list it."""

    def __init__(self, name: str, obj: object) -> None:
        self.name, self.obj = name, obj
        self.dist = SimpleNamespace(name=f"{name}-dist", version="1.0")

    def load(self) -> object:
        return self.obj


@pytest.fixture
def only_builtins(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_EntryPoint]]:
    """A registry that sees only the entry points in the returned list (none unless a test adds some)."""
    eps: list[_EntryPoint] = []
    for var in ("MASKPLUG_LOAD_PLUGINS", "MASKPLUG_DISABLE_PLUGINS", "MASKPLUG_SCHEDULER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(plugins.md, "entry_points", lambda *, group: list(eps) if group == "maskplug" else [])
    mp.reset_registry()
    yield eps
    mp.reset_registry()


def test_builtins_register_through_the_hook() -> None:
    assert "maskplug.schedulers.registry" in BUILTIN_PLUGINS
    reg = Registry()
    mod = importlib.import_module("maskplug.schedulers.registry")
    reg.add_plugin(mod, "builtin-schedulers")
    assert [p.hooks for p in reg.plugins if p.name == "builtin-schedulers"] == [["maskplug_register_schedulers"]]
    assert reg.schedulers == {
        "dspark": DSparkScheduler,
        "goodput": GoodputScheduler,
        "grammar-aware": GrammarAwareScheduler,
        "no-spec": NoSpecScheduler,
        "verify-all": VerifyAllScheduler,
    }
    assert all(cls.name == name for name, cls in reg.schedulers.items())  # type: ignore[attr-defined]


def test_the_listing_is_the_sorted_registered_names(only_builtins: list[_EntryPoint]) -> None:
    # Nothing but the built-ins: the listing is exactly their names, sorted, whichever way it is reached.
    assert mp.scheduler_names() == BUILTINS
    assert maskplug.schedulers.schedulers() == maskplug.schedulers.scheduler_names() == BUILTINS
    # The package is an ordinary module: the listing is a function of it, not the module called.
    assert isinstance(maskplug.schedulers, types.ModuleType) and not callable(maskplug.schedulers)
    assert [p.name for p in mp.get_registry().plugins] == list(BUILTIN_PLUGINS)
    # An outside plugin found through its entry point appears in the listing, in sorted place.
    only_builtins.append(_EntryPoint("halving-plugin", _Plugin()))
    mp.reset_registry()
    assert mp.scheduler_names() == ["dspark", "goodput", "grammar-aware", "halving", "no-spec", "verify-all"]
    assert type(mp.get_scheduler("halving")) is _Halving
    info = next(p for p in mp.get_registry().plugins if p.name == "halving-plugin")
    assert (info.distribution, info.error, info.hooks) == (
        "halving-plugin-dist",
        None,
        ["maskplug_register_schedulers"],
    )
    # A disabled one is gone again.
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MASKPLUG_DISABLE_PLUGINS", "halving-plugin")
        mp.reset_registry()
        assert mp.scheduler_names() == BUILTINS
        with pytest.raises(mp.PluginError, match=r"name: expected one of the registered schedulers .* got 'halving'"):
            mp.get_scheduler("halving")


def test_public_names_of_the_package() -> None:
    import maskplug.schedulers as sched_pkg
    from maskplug.schedulers import StepView, allocate_step, get_scheduler, grammar_limits

    assert StepView is mp.StepView and get_scheduler is mp.get_scheduler
    # allocate_step reads a StepView, so it lives with the schedulers (budget does not import them).
    assert allocate_step is mp.allocate_step is allocation.allocate_step
    assert not hasattr(budget, "allocate_step")
    assert grammar_limits is protocol.grammar_limits
    for name in sched_pkg.__all__:
        assert getattr(sched_pkg, name) is not None, name
    assert sched_pkg.DEFAULT_SCHEDULER == "dspark"


def test_unknown_name_lists_the_registered_ones(only_builtins: list[_EntryPoint]) -> None:
    listed = r"\['dspark', 'goodput', 'grammar-aware', 'no-spec', 'verify-all'\]"
    with pytest.raises(
        mp.PluginError, match=rf"^name: expected one of the registered schedulers {listed}, got 'dsprak'$"
    ):
        mp.get_scheduler("dsprak")
    for bad in (3, b"dspark", ""):
        with pytest.raises(mp.PluginError, match=rf"^name: expected one of the registered schedulers {listed}, got "):
            mp.get_scheduler(bad)  # type: ignore[arg-type]
    with pytest.raises(mp.PluginError, match=rf"^name: .*{listed}, got 'nope'$"):
        mp.get_scheduler("grammar-aware", inner="nope")


def test_environment_chooses_the_default(only_builtins: list[_EntryPoint], monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(mp.get_scheduler()) is DSparkScheduler  # DEFAULT_SCHEDULER
    monkeypatch.setenv("MASKPLUG_SCHEDULER", "")
    assert type(mp.get_scheduler()) is DSparkScheduler  # empty means unset
    for name, cls in (("goodput", GoodputScheduler), ("verify-all", VerifyAllScheduler), ("no-spec", NoSpecScheduler)):
        monkeypatch.setenv("MASKPLUG_SCHEDULER", name)
        assert type(mp.get_scheduler()) is cls
        assert type(mp.get_scheduler("dspark")) is DSparkScheduler  # an explicit name wins
    monkeypatch.setenv("MASKPLUG_SCHEDULER", "goodput")
    # configuration reaches the scheduler the environment names
    assert mp.get_scheduler(alpha=0.25).alpha == 0.25  # type: ignore[attr-defined]
    # grammar-aware wraps DEFAULT_SCHEDULER, not whatever the environment names
    assert type(mp.get_scheduler("grammar-aware").inner) is DSparkScheduler  # type: ignore[attr-defined]
    monkeypatch.setenv("MASKPLUG_SCHEDULER", "nope")
    with pytest.raises(
        mp.PluginError, match=r"^MASKPLUG_SCHEDULER: expected one of the registered schedulers .*got 'nope'$"
    ):
        mp.get_scheduler()
    # an outside plugin's scheduler can be the default too
    only_builtins.append(_EntryPoint("halving-plugin", _Plugin()))
    mp.reset_registry()
    monkeypatch.setenv("MASKPLUG_SCHEDULER", "halving")
    assert type(mp.get_scheduler()) is _Halving


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
    assert "halving" in mp.scheduler_names()
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


@given(steps())
def test_step_view_best_is_the_oracle_choice_for_the_step(case: Case) -> None:
    view = case.view
    for conf in (case.live, view.confidences):
        if conf is None:
            continue
        kwargs: dict[str, Any] = {"num_sampling": view.num_sampling, "max_logits": view.max_logits}
        assert view.best(conf) == reference.choose_budget(conf, view.layout, view.cost, **kwargs)
        assert view.best(conf, with_grammar=True) == reference.choose_budget(
            conf, view.layout, view.cost, grammar=view.grammar, **kwargs
        )


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


# ------------------------------------------------------------------ uses_grammar


def test_uses_grammar_flags_of_the_builtins() -> None:
    flags = {name: mp.get_scheduler(name).uses_grammar for name in BUILTINS}  # type: ignore[attr-defined]
    assert flags == {"dspark": False, "goodput": False, "grammar-aware": True, "no-spec": False, "verify-all": False}
    assert all(type(v) is bool for v in flags.values())
    for inner in ("dspark", "goodput", "verify-all", "no-spec"):
        assert mp.get_scheduler("grammar-aware", inner=inner).uses_grammar is True  # type: ignore[attr-defined]


def test_uses_grammar_is_optional_for_outside_schedulers(fresh_registry: None) -> None:
    mp.get_registry().add_plugin(_Plugin(), "test-halving")
    sched = mp.get_scheduler("halving")
    assert not hasattr(sched, "uses_grammar")
    assert isinstance(sched, mp.Scheduler)  # still a Scheduler without it
    assert getattr(sched, "uses_grammar", False) is False  # how engines read it


class _Flagged(_Halving):
    uses_grammar: Any = "yes"


class _FlaggedTrue(_Halving):
    uses_grammar = True


class _FlaggedPlugin:
    @hookimpl
    def maskplug_register_schedulers(self, register: Any) -> None:
        register("flagged", _Flagged)
        register("flagged-true", _FlaggedTrue)


def test_a_uses_grammar_that_is_not_a_bool_is_refused(fresh_registry: None) -> None:
    mp.get_registry().add_plugin(_FlaggedPlugin(), "test-flagged")
    with pytest.raises(mp.PluginError, match=r"scheduler 'flagged': expected uses_grammar to be a bool, got 'yes'"):
        mp.get_scheduler("flagged")
    assert mp.get_scheduler("flagged-true").uses_grammar is True  # type: ignore[attr-defined]


@given(steps(with_grammar=True), st.sampled_from(["dspark", "goodput", "no-spec", "verify-all"]))
def test_uses_grammar_false_means_the_draft_masks_never_change_the_budget(case: Case, name: str) -> None:
    """The flag's contract: a scheduler that says it does not read the masks decides the same without them."""
    view = case.view
    blind = mp.StepView(
        view.layout, view.cost, confidences=view.confidences, max_logits=view.max_logits, num_sampling=view.num_sampling
    )
    with_masks, without = mp.get_scheduler(name), mp.get_scheduler(name)
    assert with_masks.uses_grammar is False  # type: ignore[attr-defined]
    d, d0 = with_masks.budget(view), without.budget(blind)
    assert d.budget == d0.budget and d.cost_ms == d0.cost_ms
    assert d.expected_tokens == d0.expected_tokens or (np.isnan(d.expected_tokens) and np.isnan(d0.expected_tokens))


def test_uses_grammar_true_schedulers_do_read_the_masks() -> None:
    lay = mp.ScheduledLayout([10, 11], [6, 3], [1, 1])
    conf = np.full((2, 6), 0.99)
    masks = mp.DraftMasks(np.array([0]), np.array([2]), np.zeros((1, 7), dtype=bool))
    for name in BUILTINS:
        sched = mp.get_scheduler(name)
        with_masks = sched.budget(mp.StepView(lay, COST, confidences=conf, grammar=masks)).budget
        without = sched.budget(mp.StepView(lay, COST, confidences=conf)).budget
        assert (with_masks != without) == (name == "grammar-aware"), name
