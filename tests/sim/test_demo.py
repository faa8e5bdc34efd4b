"""The simulator end to end: the demo at a small size, a 10,000-step soak, a sabotaged kernel."""

from __future__ import annotations

from typing import Any

import pytest
from sim_testkit import BrokenPlugin, simulation

from maskplug import hookimpl, reset_registry
from maskplug.plugins import get_registry
from maskplug.sim import DEFAULT_SCHEDULERS, SimConfig, run_demo


def test_demo_small_is_valid_and_hits_every_regime() -> None:
    # The default run, smaller: same vocabulary (tekken, 131,072), every scheduler.
    cfg = SimConfig(steps=40, concurrency=8, max_batch_tokens=64)
    rep = run_demo(cfg, DEFAULT_SCHEDULERS, progress=False)
    assert list(rep.results) == list(DEFAULT_SCHEDULERS)
    for name, r in rep.results.items():
        assert r.violations == [], (name, r.violations)
        assert r.invalid == 0, (name, r.invalid_samples)
        assert r.steps == 40
        assert r.valid > 0, name
        assert sum(r.regimes.values()) == r.steps
        # Nothing lost: every admitted request is finished or still in flight.
        assert r.admitted == r.valid + r.invalid + r.cut_off + r.in_flight
    adaptive = [rep.results[s] for s in ("dspark", "grammar-aware:dspark", "goodput")]
    assert sum(r.zero_trimmed for r in adaptive) > 0  # budget 0 with drafts scheduled
    assert sum(r.regimes["partial"] for r in adaptive) > 0
    # No drafts, nothing trimmed: maskplug.compaction counts such steps as full.
    assert rep.results["no-spec"].regimes == {"full": 40, "partial": 0, "zero": 0}
    assert rep.results["no-spec"].accepted == 0
    # The grammar rows were load-bearing: the target was tempted by forbidden tokens.
    assert sum(r.tempted_rows for r in rep.results.values()) > 0
    # Speculation emits more than one token per decoding request per step.
    assert rep.results["verify-all"].accepted_length > 1.2


class _Recorder:
    def __init__(self) -> None:
        self.stats: list[dict[str, Any]] = []

    @hookimpl
    def maskplug_step_end(self, stats: dict[str, Any]) -> None:
        self.stats.append(dict(stats))


def test_step_end_hook_sees_every_step() -> None:
    rec = _Recorder()
    reg = get_registry()
    reg.pm.register(rec, name="test-recorder")
    try:
        cfg = SimConfig(steps=6, concurrency=3, tokenizer="spm")
        res = simulation(cfg, "dspark").run()
    finally:
        reg.pm.unregister(rec)
    assert [s["step"] for s in rec.stats] == list(range(6))
    assert sum(s["emitted"] for s in rec.stats) == res.tokens
    assert all(s["scheduler"] == "dspark" for s in rec.stats)


def test_a_broken_kernel_is_caught() -> None:
    reset_registry()
    try:
        get_registry().add_plugin(BrokenPlugin(), "broken-for-test")
        cfg = SimConfig(steps=25, concurrency=6, tokenizer="spm", backend="broken-for-test", tempt_rate=0.5)
        res = simulation(cfg, "verify-all").run()
    finally:
        reset_registry()
    # The tempting forbidden tokens get through on unmasked rows: the checks see it.
    assert res.violations, "a kernel that skips mask rows went unnoticed"
    assert any("forbids" in v or "not masked exactly" in v for v in res.violations)


@pytest.mark.slow
def test_soak_10000_steps_a_third_at_budget_zero() -> None:
    # Small and cheap: the 32,000-token vocabulary, four requests, three drafts.
    cfg = SimConfig(
        steps=10_000, concurrency=4, drafts=3, tokenizer="spm", squeeze_every=3, max_batch_tokens=None, check_rows=1
    )
    sim = simulation(cfg, "grammar-aware:dspark")
    res = sim.run()
    assert res.violations == []
    assert res.invalid == 0, res.invalid_samples
    assert res.steps == 10_000
    assert res.regimes["zero"] >= 10_000 // 3
    assert res.zero_trimmed > 0 and res.regimes["partial"] + res.regimes["full"] > 0
    # Nothing lost: requests and tokens all accounted for.
    assert res.admitted == res.valid + res.invalid + res.cut_off + res.in_flight
    assert res.tokens == res.finished_tokens + sum(len(a.output) for a in sim.active)
    assert res.valid > 100


@pytest.mark.parametrize("provider", ["xgrammar", "outlines-core", "llguidance"])
def test_every_provider_serves_the_demo(provider: str) -> None:
    from maskplug.grammar import grammar_providers

    if provider not in grammar_providers():
        pytest.skip(f"grammar provider {provider!r} is not installed")
    cfg = SimConfig(steps=10, concurrency=4, tokenizer="spm", provider=provider)
    rep = run_demo(cfg, ["grammar-aware:dspark"], progress=False)
    r = rep.results["grammar-aware:dspark"]
    assert r.violations == [] and r.invalid == 0, (r.violations, r.invalid_samples)
    assert r.tokens > 10 * 4
