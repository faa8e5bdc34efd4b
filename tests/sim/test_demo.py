"""The simulator end to end: the demo at a small size, a 10,000-step soak, a sabotaged kernel."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from maskplug import hookimpl, reset_registry
from maskplug.plugins import get_registry
from maskplug.sim import DEFAULT_SCHEDULERS, SimConfig, Simulation, Workload, default_cost_model, run_demo
from maskplug.sim.models import TargetModel
from maskplug.sim.tokenizers import load_tokenizer


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
    assert rep.results["no-spec"].regimes["zero"] == 40
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


def _simulation(cfg: SimConfig, scheduler: str) -> Simulation:
    tok = load_tokenizer(cfg.tokenizer)
    from maskplug.grammar import grammar_provider

    work = Workload(cfg, tok, grammar_provider(cfg.provider, tok.vocab))
    target = TargetModel(cfg.seed, tok.vocab.vocab_size, noise=cfg.noise, margin=cfg.margin)
    return Simulation(cfg, scheduler, work, target, default_cost_model())


def test_step_end_hook_sees_every_step() -> None:
    rec = _Recorder()
    reg = get_registry()
    reg.pm.register(rec, name="test-recorder")
    try:
        cfg = SimConfig(steps=6, concurrency=3, tokenizer="spm")
        res = _simulation(cfg, "dspark").run()
    finally:
        reg.pm.unregister(rec)
    assert [s["step"] for s in rec.stats] == list(range(6))
    assert sum(s["emitted"] for s in rec.stats) == res.tokens
    assert all(s["scheduler"] == "dspark" for s in rec.stats)


class _SkipsEveryOtherRow:
    """A broken kernel: applies only even mask rows (as a mapping bug would)."""

    name = "broken-for-test"
    priority = -100

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def apply(self, logits, bitmask, request, position, cu_logits, vocab_size, mask_tail) -> None:  # type: ignore[no-untyped-def]
        from maskplug.kernels.torch_backend import TorchBackend

        keep = torch.arange(bitmask.shape[0]) % 2 == 0
        req = torch.where(keep, request, torch.full_like(request, -1))
        TorchBackend().apply(logits, bitmask, req, position, cu_logits, vocab_size, mask_tail)


class _BrokenPlugin:
    @hookimpl
    def maskplug_register_kernels(self, register: Any) -> None:
        register(_SkipsEveryOtherRow())


def test_a_broken_kernel_is_caught() -> None:
    reset_registry()
    try:
        get_registry().add_plugin(_BrokenPlugin(), "broken-for-test")
        cfg = SimConfig(steps=25, concurrency=6, tokenizer="spm", backend="broken-for-test", tempt_rate=0.5)
        res = _simulation(cfg, "verify-all").run()
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
    sim = _simulation(cfg, "grammar-aware:dspark")
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
