"""Draft masks produced during the simulated forward pass: same run, both step times reported."""

from __future__ import annotations

import dataclasses

import pytest

from maskplug.cli import main
from maskplug.sim import SimConfig
from maskplug.sim.run import run_demo

SCHEDULERS = ["no-spec", "dspark", "grammar-aware:dspark", "goodput"]


def test_overlap_changes_nothing_but_the_step_times() -> None:
    cfg = SimConfig(steps=8, concurrency=4, tokenizer="spm", seed=5)
    serial = run_demo(cfg, SCHEDULERS, progress=False)
    overlapped = run_demo(dataclasses.replace(cfg, overlap=True), SCHEDULERS, progress=False)
    for name in SCHEDULERS:
        a, b = serial.results[name], overlapped.results[name]
        assert a.as_json(timing=False) == b.as_json(timing=False), name
        assert a.budgets == b.budgets and a.sim_ms == b.sim_ms and a.forward_ms == b.forward_ms
        assert not a.violations and not b.violations
        # Without overlap, the step takes mask production then the forward pass.
        assert a.overlap_ms == a.serial_ms == pytest.approx(a.mask_ms + a.forward_ms)
        assert b.forward_ms == pytest.approx(b.sim_ms) and b.forward_ms > 0 and b.mask_ms > 0
        if name.startswith("grammar-aware"):
            # A scheduler that reads the masks chooses the budget from them: nothing to overlap.
            assert b.overlap_ms == b.serial_ms
        else:
            # Overlapped, a step lasts at least its forward pass and its mask production, never their sum plus.
            assert b.overlap_ms >= b.forward_ms
            assert b.bound_ms >= max(b.forward_ms, b.mask_ms)
            assert b.serial_ms == pytest.approx(b.mask_ms + b.forward_ms)


def test_the_demo_table_shows_both_step_times(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["demo", "--steps", "4", "--concurrency", "3", "--tokenizer", "spm", "--no-progress"]
    assert main([*small, "--scheduler", "dspark"]) == 0
    out = capsys.readouterr().out
    assert "step ms" in out and "overlapped" in out and "wait=False), measured)" in out
    assert main([*small, "--scheduler", "dspark", "--no-overlap"]) == 0
    assert "measured: off, --no-overlap" in capsys.readouterr().out
