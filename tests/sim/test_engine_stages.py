"""The simulated engine step: its regime is the library's, and grammar-reading schedulers are found by flag."""

from __future__ import annotations

from typing import Any

import numpy as np
from sim_testkit import simulation

from maskplug import hookimpl, reset_registry
from maskplug.compaction import regime_of
from maskplug.layout import ScheduledLayout
from maskplug.plugins import get_registry
from maskplug.schedulers import GrammarAwareScheduler, get_scheduler
from maskplug.sim import SimConfig


class _Recorder:
    def __init__(self) -> None:
        self.stats: list[dict[str, Any]] = []

    @hookimpl
    def maskplug_step_end(self, stats: dict[str, Any]) -> None:
        self.stats.append(dict(stats))


def _recorded(cfg: SimConfig, scheduler: str) -> tuple[Any, list[dict[str, Any]]]:
    rec = _Recorder()
    reg = get_registry()
    reg.pm.register(rec, name="test-stage-recorder")
    try:
        res = simulation(cfg, scheduler).run()
    finally:
        reg.pm.unregister(rec)
    return res, rec.stats


def test_regimes_are_counted_with_the_library_rule() -> None:
    # A tight token limit and every fourth step with room for bonus rows only: all three regimes occur.
    cfg = SimConfig(steps=12, concurrency=6, drafts=3, tokenizer="spm", squeeze_every=4, max_batch_tokens=24)
    res, stats = _recorded(cfg, "dspark")
    for s in stats:
        # regime_of on a layout with the same draft total and budget.
        layout = ScheduledLayout(np.arange(1), [s["scheduled_drafts"]], [1])
        assert s["regime"] == regime_of(layout, s["budget"]), s
    # Step 0 prefills every request: no drafts, nothing trimmed, so "full".
    assert stats[0]["scheduled_drafts"] == 0 and stats[0]["regime"] == "full"
    assert {s["regime"] for s in stats} == {"full", "partial", "zero"}
    counted = {k: sum(1 for s in stats if s["regime"] == k) for k in ("full", "partial", "zero")}
    assert res.regimes == counted
    assert res.zero_trimmed == counted["zero"]  # zero now always means drafts were trimmed
    assert res.violations == []


def test_no_spec_steps_are_full_since_nothing_is_trimmed() -> None:
    cfg = SimConfig(steps=5, concurrency=3, tokenizer="spm")
    res, stats = _recorded(cfg, "no-spec")
    assert all(s["scheduled_drafts"] == 0 and s["budget"] == 0 for s in stats)
    assert res.regimes == {"full": 5, "partial": 0, "zero": 0}
    assert res.zero_trimmed == 0


class _RenamedGrammarAware:
    """Registers the grammar-aware wrapper under a name that does not say so."""

    @hookimpl
    def maskplug_register_schedulers(self, register: Any) -> None:
        register("renamed-ga", lambda **config: GrammarAwareScheduler("dspark", **config))


class _BlindWrapper:
    """``grammar-aware`` with its flag hidden: the engine must then allocate grammar-blind."""

    uses_grammar = False

    def __init__(self) -> None:
        self.inner = get_scheduler("grammar-aware", inner="dspark")

    def budget(self, step: Any) -> Any:
        return self.inner.budget(step)

    def observe(self, outcome: Any) -> None:
        self.inner.observe(outcome)


class _BlindPlugin:
    @hookimpl
    def maskplug_register_schedulers(self, register: Any) -> None:
        register("grammar-aware-blind", lambda **config: _BlindWrapper())


def test_grammar_reading_schedulers_are_found_by_their_flag_not_their_name() -> None:
    cfg = SimConfig(steps=14, concurrency=6, tokenizer="spm", max_batch_tokens=48)
    reset_registry()
    try:
        get_registry().add_plugin(_RenamedGrammarAware(), "renamed-ga-plugin")
        get_registry().add_plugin(_BlindPlugin(), "blind-plugin")
        named = simulation(cfg, "grammar-aware:dspark")
        renamed = simulation(cfg, "renamed-ga")
        blind = simulation(cfg, "grammar-aware-blind")
        assert named.grammar_aware and renamed.grammar_aware and not blind.grammar_aware
        a, b, c = named.run(), renamed.run(), blind.run()
    finally:
        reset_registry()
    assert a.violations == [] and b.violations == [] and c.violations == []
    # The same scheduler under another name runs the very same engine steps.
    assert b.as_json(timing=False) == a.as_json(timing=False)
    assert b.budgets == a.budgets
    # Without the flag the engine allocates grammar-blind (checked against the
    # reference allocation instead): the same first budget, then other steps.
    assert c.budgets[:2] == a.budgets[:2] and c.budgets != a.budgets
