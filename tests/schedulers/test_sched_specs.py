"""Scheduler specs (``NAME``, ``OUTER:INNER``) and request ids of every kind a layout takes.

One parser (:func:`maskplug.schedulers.parse_scheduler_spec`) reads the
spelling the CLI, the engine adapters and ``MASKPLUG_SCHEDULER`` use; every
bad spelling is refused with a :class:`~maskplug.PluginError` naming where it
came from. Schedulers take the request ids layouts take (tuples included) in
:class:`~maskplug.StepOutcome` and follow them from step to step.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import maskplug as mp
from maskplug.hookspecs import hookimpl
from maskplug.schedulers import (
    DSparkScheduler,
    GoodputScheduler,
    GrammarAwareScheduler,
    NoSpecScheduler,
    SchedulerSpec,
    VerifyAllScheduler,
    parse_scheduler_spec,
    scheduler_names,
)
from maskplug.sim.engine import make_scheduler

COST = mp.CostModel.linear()
NAMES = ["dspark", "goodput", "grammar-aware", "no-spec", "verify-all"]
LISTED = re.escape(str(NAMES))  # as a pattern


@pytest.fixture(autouse=True)
def builtins_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("MASKPLUG_LOAD_PLUGINS", "MASKPLUG_DISABLE_PLUGINS", "MASKPLUG_SCHEDULER"):
        monkeypatch.delenv(var, raising=False)
    mp.reset_registry()
    yield
    mp.reset_registry()


def _outcome(*args: Any, **kw: Any) -> mp.StepOutcome:
    """A StepOutcome from any forms of ids and counts (lists, tuples, arrays) the checks take."""
    return mp.StepOutcome(*args, **kw)


def _chain(s: Any) -> list[type]:
    """The scheduler's class, then the class of each scheduler it wraps."""
    out = [type(s)]
    while isinstance(s, GrammarAwareScheduler):
        s = s.inner
        out.append(type(s))
    return out


GOOD = [
    ("dspark", [DSparkScheduler]),
    ("goodput", [GoodputScheduler]),
    ("grammar-aware", [GrammarAwareScheduler, DSparkScheduler]),
    ("grammar-aware:dspark", [GrammarAwareScheduler, DSparkScheduler]),
    ("grammar-aware:goodput", [GrammarAwareScheduler, GoodputScheduler]),
    ("grammar-aware:verify-all", [GrammarAwareScheduler, VerifyAllScheduler]),
    ("  grammar-aware : no-spec ", [GrammarAwareScheduler, NoSpecScheduler]),
    ("grammar-aware:grammar-aware:goodput", [GrammarAwareScheduler, GrammarAwareScheduler, GoodputScheduler]),
]


@pytest.mark.parametrize(("spec", "classes"), GOOD)
def test_every_spelling_builds_the_same_scheduler_everywhere(
    spec: str, classes: list[type], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _chain(mp.get_scheduler(spec)) == classes
    assert _chain(make_scheduler(spec)) == classes  # the simulator's
    monkeypatch.setenv("MASKPLUG_SCHEDULER", spec)
    assert _chain(mp.get_scheduler()) == classes


def test_the_parsed_spec() -> None:
    assert parse_scheduler_spec("goodput") == SchedulerSpec("goodput", {})
    assert parse_scheduler_spec(" grammar-aware:goodput") == SchedulerSpec("grammar-aware", {"inner": "goodput"})
    assert parse_scheduler_spec("grammar-aware:grammar-aware:dspark") == SchedulerSpec(
        "grammar-aware", {"inner": "grammar-aware:dspark"}
    )
    with pytest.raises(TypeError):
        parse_scheduler_spec("goodput").config["inner"] = "x"  # type: ignore[index]


def test_configuration_reaches_the_wrapped_scheduler() -> None:
    s = mp.get_scheduler("grammar-aware:goodput", alpha=0.25)
    assert isinstance(s, GrammarAwareScheduler) and isinstance(s.inner, GoodputScheduler)
    assert s.inner.alpha == 0.25
    with pytest.raises(mp.BudgetError, match=r"^config: \['inner'\] given both in the scheduler spec 'grammar-aware:"):
        mp.get_scheduler("grammar-aware:goodput", inner="dspark")
    with pytest.raises(mp.BudgetError, match=r"dspark: unexpected configuration \['alpha'\]"):
        mp.get_scheduler("grammar-aware:dspark", alpha=0.25)


BAD = [
    ("dsprak", rf"expected one of the registered schedulers {LISTED}, got 'dsprak'$"),
    ("", rf"expected one of the registered schedulers {LISTED}, got ''$"),
    ("grammar-aware:", r"expected a scheduler name after 'grammar-aware:', got 'grammar-aware:'$"),
    ("grammar-aware: ", r"expected a scheduler name after 'grammar-aware:', got 'grammar-aware: '$"),
    (
        "grammar-aware:nope",
        rf"expected one of the registered schedulers {LISTED} after 'grammar-aware:', got 'nope' in "
        r"'grammar-aware:nope'$",
    ),
    (
        "grammar-aware:grammar-aware:dsprak",
        rf"expected one of the registered schedulers {LISTED} after 'grammar-aware:grammar-aware:', got 'dsprak' in ",
    ),
    (
        "goodput:dspark",
        r"expected a registered scheduler that wraps another before ':' \(one of \['grammar-aware'\]\), got 'goodput' "
        r"in 'goodput:dspark'$",
    ),
    (
        "gramar-aware:dspark",
        r"expected a registered scheduler that wraps another before ':' \(one of \['grammar-aware'\]\), got 'gramar-aware' in ",
    ),
    (
        ":dspark",
        r"expected a registered scheduler that wraps another before ':' \(one of \['grammar-aware'\]\), got '' in ':dspark'$",
    ),
    (
        "grammar-aware:goodput:dspark",
        r"expected a registered scheduler that wraps another before ':' \(one of \['grammar-aware'\]\), got 'goodput' in ",
    ),
]


@pytest.mark.parametrize(("spec", "msg"), BAD, ids=[b[0] or "empty" for b in BAD])
def test_bad_spellings_are_refused_naming_where_they_came_from(
    spec: str, msg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(mp.PluginError, match=rf"^name: {msg}"):
        mp.get_scheduler(spec)
    with pytest.raises(mp.PluginError, match=rf"^name: {msg}"):
        parse_scheduler_spec(spec)
    if spec:  # an empty MASKPLUG_SCHEDULER means unset
        monkeypatch.setenv("MASKPLUG_SCHEDULER", spec)
        with pytest.raises(mp.PluginError, match=rf"^MASKPLUG_SCHEDULER: {msg}"):
            mp.get_scheduler()


def test_specs_that_are_not_strings() -> None:
    for bad in (3, b"dspark", None, ["dspark"]):
        with pytest.raises(mp.PluginError, match=rf"^name: expected one of the registered schedulers {LISTED}, got "):
            parse_scheduler_spec(bad)


def test_scheduler_names_lists_the_registered_schedulers() -> None:
    assert mp.scheduler_names is scheduler_names
    assert "scheduler_names" in mp.__all__
    assert scheduler_names() == mp.schedulers.schedulers() == NAMES
    for name in scheduler_names():
        assert parse_scheduler_spec(name) == SchedulerSpec(name, {})


class _Wrap:
    """An outside plugin's wrapper (it takes ``inner``), and a scheduler whose name holds a ':'."""

    def __init__(self, inner: str = "dspark") -> None:
        self.inner = mp.get_scheduler(inner)

    def budget(self, step: mp.StepView) -> mp.BudgetDecision:
        return self.inner.budget(step)

    def observe(self, outcome: mp.StepOutcome) -> None:
        self.inner.observe(outcome)


class _Plugin:
    @hookimpl
    def maskplug_register_schedulers(self, register: Any) -> None:
        register("wrap", _Wrap)
        register("team:fixed", VerifyAllScheduler)


def test_outside_schedulers_use_the_same_spelling() -> None:
    mp.get_registry().add_plugin(_Plugin(), "test-wrap")
    assert "wrap" in scheduler_names() and "team:fixed" in scheduler_names()
    s = mp.get_scheduler("wrap:goodput")
    assert isinstance(s, _Wrap) and isinstance(s.inner, GoodputScheduler)
    assert isinstance(mp.get_scheduler("team:fixed"), VerifyAllScheduler)  # a registered name is a name
    assert _chain(mp.get_scheduler("grammar-aware:team:fixed")) == [GrammarAwareScheduler, VerifyAllScheduler]
    with pytest.raises(mp.PluginError, match=r"one of \['grammar-aware', 'wrap'\]\), got 'team' in 'team:dspark'"):
        mp.get_scheduler("team:dspark")


# ---- request ids ------------------------------------------------------------------------------------------

ID_KINDS: dict[str, list[Any]] = {
    "ints": [7, 3, 11],
    "strings": ["b", "a", "c"],
    "tuples": [("eng", 0), ("eng", 1), ("other", 0)],
    "frozensets": [frozenset({1}), frozenset({2}), frozenset()],
}


@pytest.mark.parametrize("kind", list(ID_KINDS))
@pytest.mark.parametrize("name", ["dspark", "goodput", "grammar-aware:goodput", "verify-all", "no-spec"])
def test_schedulers_take_every_request_id_a_layout_takes(kind: str, name: str) -> None:
    """Budgets and history with these ids are those of the same steps with plain int ids."""
    ids = ID_KINDS[kind]
    twin_ids = list(range(len(ids)))
    sched, twin = mp.get_scheduler(name), mp.get_scheduler(name)
    rng = np.random.default_rng(5)
    for step in range(6):
        order = rng.permutation(len(ids))
        nd = rng.integers(0, 5, len(ids))
        conf = rng.random((len(ids), 4))
        lay = mp.ScheduledLayout([ids[i] for i in order], nd, [1] * len(ids))
        twin_lay = mp.ScheduledLayout([twin_ids[i] for i in order], nd, [1] * len(ids))
        got = sched.budget(mp.StepView(lay, COST, confidences=conf))
        want = twin.budget(mp.StepView(twin_lay, COST, confidences=conf))
        assert got == want, step
        acc = np.minimum(rng.integers(0, 5, len(ids)), nd)
        done = [ids[order[0]]] if step == 3 else []
        # Ids as the layout holds them, and as a plain list.
        req = lay.req_ids if step % 2 else [ids[i] for i in order]
        sched.observe(_outcome(req, nd, acc, finished=done))
        twin.observe(_outcome(twin_lay.req_ids, nd, acc, finished=[twin_ids[order[0]]] if done else []))
    if isinstance(sched, GoodputScheduler):
        np.testing.assert_array_equal(sched.estimates(ids, 4), twin.estimates(twin_ids, 4))  # type: ignore[attr-defined]


def test_outcome_ids_are_checked_like_a_layouts() -> None:
    v, a = np.array([2, 1]), np.array([1, 0])
    out = _outcome([("x", 1), ("x", 2)], v, a)
    assert out.req_ids.shape == (2,) and out.req_ids.tolist() == [("x", 1), ("x", 2)]
    assert _outcome([1, "1"], v, a).req_ids.tolist() == [1, "1"]  # two ids, as in a layout
    bad = [
        ([("x", 1), ("x", 1)], r"^req_ids: expected unique request ids in one outcome$"),
        ([[1], [2]], r"^req_ids: expected a 1-D sequence of hashable request ids, got list \[1\]$"),
        (np.zeros((2, 2), dtype=np.int64), r"^req_ids: expected a 1-D sequence of request ids, got shape \(2, 2\)$"),
        ("ab", r"^req_ids: expected a 1-D sequence of request ids, got str 'ab'$"),
        (5, r"^req_ids: expected a 1-D sequence of request ids, got int$"),
    ]
    for ids, msg in bad:
        with pytest.raises(mp.BudgetError, match=msg):
            _outcome(ids, v, a)
    with pytest.raises(mp.BudgetError, match=r"^finished: expected a 1-D sequence of hashable request ids"):
        _outcome([1, 2], v, a, finished=[{"a": 1}])


def test_goodput_keeps_one_kind_of_id() -> None:
    """A history of int ids refuses tuple ids (and the other way round), leaving the history as it was."""
    g = GoodputScheduler()
    g.observe(_outcome([1, 2], [2, 2], [2, 0]))
    before = g.estimates([1, 2], 2)
    with pytest.raises(mp.BudgetError, match=r"^req_ids: expected int ids like the earlier ones, got object ids"):
        g.observe(_outcome([("a", 1)], [1], [1]))
    np.testing.assert_array_equal(g.estimates([1, 2], 2), before)
    t = GoodputScheduler()
    t.observe(_outcome([("a", 1)], [2], [1]))
    with pytest.raises(mp.BudgetError, match=r"^req_ids: expected object ids like the earlier ones, got int ids"):
        t.observe(_outcome([1], [1], [1]))
    # Unknown ids of another kind are just unknown: the population prior.
    np.testing.assert_array_equal(t.estimates([7], 2), t.population(2)[None, :])
