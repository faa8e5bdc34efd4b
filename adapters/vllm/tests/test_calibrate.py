"""``python -m maskplug_vllm.calibrate``: the engine's own cost, measured and written for the schedulers.

One real calibration of vLLM's CPU engine on the tiny model (a fresh process,
about 20 s), then: the file is there and parses, every cost is positive, the
sizes are the ones asked for, and the cost model built from it is one that
maskplug's schedulers take and decide with. A damaged or foreign cost file is
refused with a :class:`maskplug.BudgetError` that says what is wrong.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_model
from maskplug_vllm.calibrate import COST_FILE_FORMAT, CostProfile, lower_envelope, read_cost_file

from maskplug import BudgetError, CostModel, ScheduledLayout, StepView, get_scheduler

TOKEN_COUNTS = [1, 4, 16, 48]
REQUEST_COUNTS = [1, 4, 16]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("calibrate")
    model = tiny_model.build(folder / "model")
    out = folder / "sub" / "cost.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASKPLUG_VLLM")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        sys.executable,
        "-m",
        "maskplug_vllm.calibrate",
        "--model",
        str(model),
        "--out",
        str(out),
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "512",
        "--num-speculative-tokens",
        "3",
        "--token-counts",
        ",".join(map(str, TOKEN_COUNTS)),
        "--request-counts",
        ",".join(map(str, REQUEST_COUNTS)),
        "--repeats",
        "3",
        "--clock",
        "cpu",
        "--engine-arg",
        "gpu_memory_utilization=0.3",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"calibration failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return out, proc.stdout


def test_the_cost_file_is_written_and_parses(calibrated: tuple[Path, str]) -> None:
    path, stdout = calibrated
    assert f"wrote {path}" in stdout
    data = json.loads(path.read_text())
    assert data["format"] == COST_FILE_FORMAT
    assert [n for n, _ in data["verify"]] == TOKEN_COUNTS
    assert [n for n, _ in data["draft"]] == REQUEST_COUNTS
    assert data["device"] == "cpu"
    assert data["max_reqs"] == 16
    assert data["num_speculative_tokens"] == 3
    assert data["draft_method"] == "ngram" and data["draft_measured"] is True
    assert data["vllm_version"] == "0.32.0"
    assert data["clock"] == "cpu" and data["statistic"] == "min"
    assert Path(data["model"]).name == "model"
    profile = read_cost_file(path)
    assert profile.to_json() == data


def test_whole_steps_were_timed_and_fitted(calibrated: tuple[Path, str]) -> None:
    """With a drafter the command also times real decode steps and records what they cost beyond the forward."""
    path, stdout = calibrated
    data = json.loads(path.read_text())
    whole = data["whole_steps"]
    assert whole["batch_sizes"] == [1, 4, 16]
    # Every batch runs 24 output tokens: many decode steps, some of them with drafts.
    assert whole["steps"] >= 20 and whole["drafts_per_step"] > 0
    for key in ("step_overhead_ms", "token_overhead_ms"):
        assert math.isfinite(data[key]) and data[key] >= 0
    # A whole step of vLLM's engine costs more than its forward pass: scheduling, sampling, bookkeeping.
    assert data["step_overhead_ms"] + data["token_overhead_ms"] > 0
    assert "whole steps:" in stdout and "decode steps" in stdout


def test_measured_costs_are_positive_and_finite(calibrated: tuple[Path, str]) -> None:
    profile = read_cost_file(calibrated[0])
    for _, ms in (*profile.verify, *profile.draft):
        assert math.isfinite(ms) and ms > 0
    # The curves are the lower envelope of what was measured (kept beside them).
    measured = [tuple(p) for p in json.loads(calibrated[0].read_text())["verify_measured"]]
    assert [n for n, _ in measured] == TOKEN_COUNTS
    assert all(ms <= raw for (_, ms), (_, raw) in zip(profile.verify, measured, strict=True))
    assert list(profile.verify) == [(n, pytest.approx(ms, abs=1e-6)) for n, ms in lower_envelope(measured)]
    # A forward of the model is far dearer than proposing n-gram drafts for one request.
    assert profile.verify[0][1] > profile.draft[0][1]


def test_the_cost_model_from_the_file_drives_the_schedulers(calibrated: tuple[Path, str]) -> None:
    profile = read_cost_file(calibrated[0])
    cost = profile.cost_model()
    assert isinstance(cost, CostModel)
    verify = dict(profile.verify)
    a, c = profile.step_overhead_ms, profile.token_overhead_ms
    # The model interpolates the measured curve (made monotone: a bigger step never costs less),
    # plus the whole-step overheads: a per token on the verify side, a per step on the drafter's.
    monotone = np.maximum.accumulate([verify[n] + c * n for n in TOKEN_COUNTS])
    for n, want in zip(TOKEN_COUNTS, monotone, strict=True):
        assert cost.verify_ms(n) == pytest.approx(want)
    assert cost.draft_ms(REQUEST_COUNTS[-1]) == pytest.approx(max(ms for _, ms in profile.draft) + a)
    layout = ScheduledLayout([f"r{i}" for i in range(8)], [3] * 8, [1] * 8)
    confidences = np.full((8, 3), 0.9)
    schedulers = [get_scheduler(name) for name in ("goodput", "dspark", "verify-all", "no-spec")]
    schedulers.append(get_scheduler("grammar-aware", inner="goodput"))
    for scheduler in schedulers:
        decision = scheduler.budget(StepView(layout, cost, confidences=confidences))
        assert 0 <= decision.budget <= layout.total_drafts
        assert decision.cost_ms == pytest.approx(cost.draft_ms(8) + cost.verify_ms(8 + decision.budget))


def test_the_engine_reads_the_file(calibrated: tuple[Path, str]) -> None:
    """The engine side's loader (``MASKPLUG_VLLM_COST``) gives the same costs as the profile."""
    from maskplug_vllm.adaptive import load_cost_model

    cost = load_cost_model(calibrated[0])
    profile = read_cost_file(calibrated[0])
    ref = profile.cost_model()
    for n in range(0, 64):
        assert cost.verify_ms(n) == pytest.approx(ref.verify_ms(n))
    for n in range(0, 16):
        assert cost.draft_ms(n) == pytest.approx(ref.draft_ms(n))


def _good() -> dict[str, Any]:
    return {
        "format": COST_FILE_FORMAT,
        "verify": [[1, 2.0], [8, 3.0]],
        "draft": [[1, 0.1]],
        "model": "m",
        "device": "cpu",
        "max_reqs": 4,
        "max_tokens": 32,
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format": "other/9"}, "expected format 'maskplug-cost/1'"),
        ({"verify": []}, "verify: expected a non-empty list"),
        ({"verify": [[1, -2.0]]}, r"verify: expected \[int size >= 0, finite ms >= 0\] pairs, got \[1, -2.0\]"),
        ({"verify": [[1, float("nan")]]}, "verify: expected"),
        ({"verify": [[1, 0.0]]}, "verify: expected positive times"),
        ({"verify": [[1, 1.0], [1, 2.0]]}, "verify: expected distinct sizes"),
        ({"draft": [[1.5, 1.0]]}, "draft: expected"),
        ({"max_reqs": 0}, "max_reqs: expected an int >= 1, got 0"),
        ({"graph_limit": -1}, "graph_limit: expected an int >= 0, got -1"),
        ({"step_overhead_ms": -0.5}, "step_overhead_ms: expected a finite number of ms >= 0, got -0.5"),
        ({"token_overhead_ms": "1"}, "token_overhead_ms: expected a finite number of ms >= 0, got '1'"),
        ({"token_overhead_ms": float("inf")}, "token_overhead_ms: expected a finite number"),
    ],
)
def test_bad_cost_files_are_refused_by_name(tmp_path: Path, change: dict[str, Any], match: str) -> None:
    data = {**_good(), **change}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BudgetError, match=match) as info:
        read_cost_file(path)
    assert str(path) in str(info.value)


def test_missing_keys_unreadable_and_non_json_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({k: v for k, v in _good().items() if k != "draft"}))
    with pytest.raises(BudgetError, match=r"missing \['draft'\]"):
        read_cost_file(path)
    path.write_text("{not json")
    with pytest.raises(BudgetError, match="path: expected JSON"):
        read_cost_file(path)
    with pytest.raises(BudgetError, match="path: expected a readable cost file"):
        read_cost_file(tmp_path / "absent.json")


def test_a_profile_round_trips_through_its_file(tmp_path: Path) -> None:
    profile = CostProfile.from_json({**_good(), "dtype": "float32"})
    written = profile.write(tmp_path / "a" / "cost.json")
    again = read_cost_file(written)
    assert again == profile
    assert again.meta == {"dtype": "float32"}
    assert again.cost_model().verify_ms(8) == pytest.approx(3.0)


def test_overheads_round_trip_and_price_every_budget(tmp_path: Path) -> None:
    profile = CostProfile.from_json({**_good(), "step_overhead_ms": 0.5, "token_overhead_ms": 0.25})
    again = read_cost_file(profile.write(tmp_path / "cost.json"))
    assert again == profile and again.meta == {}
    cost = again.cost_model()
    # verify 2.0 ms at 1 token, 3.0 at 8; draft 0.1 ms: plus 0.25 ms a token and 0.5 ms a step.
    assert cost.verify_ms(1) == pytest.approx(2.25)
    assert cost.verify_ms(8) == pytest.approx(5.0)
    assert cost.verify_ms(4) == pytest.approx(2.0 + 3 / 7 + 1.0)  # linear between samples, exact for the line
    assert cost.draft_ms(3) == pytest.approx(0.6)
    assert cost.step_costs(2, 2, 3).tolist() == pytest.approx(
        [cost.draft_ms(2) + cost.verify_ms(2 + b) for b in range(3)]
    )
    # An older file without the keys prices the forward alone.
    old = CostProfile.from_json(_good())
    assert old.step_overhead_ms == 0.0 and old.token_overhead_ms == 0.0
    assert old.cost_model().verify_ms(8) == pytest.approx(3.0)


def test_the_overhead_fit_recovers_a_step_and_a_token_cost() -> None:
    from maskplug_vllm.calibrate import StepSample, fit_step_overhead

    cost = CostModel.from_curves([(0, 0.1), (16, 0.5)], [(1, 2.0), (64, 20.0)], 16, 64)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(200):
        n = int(rng.integers(1, 17))
        d = int(rng.integers(0, 3 * n + 1))
        t = n + d
        ms = cost.verify_ms(t) + cost.draft_ms(n) + 1.5 + 0.08 * t + rng.normal(0, 0.01)
        samples.append(StepSample(ms, n, t, d))
    fit = fit_step_overhead(samples, cost)
    assert fit["step_overhead_ms"] == pytest.approx(1.5, abs=0.01)
    assert fit["token_overhead_ms"] == pytest.approx(0.08, abs=0.001)
    assert fit["steps"] == 200 and fit["residual_ms"] < 0.02
    # Steps cheaper than the profile (a noisy forward) never make a negative cost: both terms stay >= 0.
    cheap = [
        StepSample(0.5 * (cost.verify_ms(s.num_tokens) + cost.draft_ms(s.num_reqs)), s.num_reqs, s.num_tokens, 0)
        for s in samples
    ]
    low = fit_step_overhead(cheap, cost)
    assert low["step_overhead_ms"] >= 0 and low["token_overhead_ms"] >= 0
    # One size only: no slope, the mean excess per step.
    same = [StepSample(cost.verify_ms(5) + cost.draft_ms(4) + 2.0, 4, 5, 1)] * 3
    assert fit_step_overhead(same, cost) == {
        "step_overhead_ms": pytest.approx(2.0),
        "token_overhead_ms": 0.0,
        "steps": 3,
        "residual_ms": pytest.approx(0.0, abs=1e-9),
    }
    with pytest.raises(BudgetError, match="samples: expected timed decode steps, got none"):
        fit_step_overhead([], cost)


def test_whole_steps_need_the_engine_core_in_this_process() -> None:
    from maskplug_vllm.calibrate import measure_whole_steps

    class Remote:
        class llm_engine:
            engine_core = object()

    with pytest.raises(
        BudgetError, match=r"whole steps: expected the engine core in this process \(VLLM_ENABLE_V1_MULTIPROCESSING=0\)"
    ):
        measure_whole_steps(Remote(), [1])
    with pytest.raises(BudgetError, match="clock: expected 'wall' or 'cpu', got 'gpu'"):
        measure_whole_steps(Remote(), [1], clock="gpu")


def test_the_lower_envelope_caps_a_small_size_by_larger_ones() -> None:
    raw = [(1, 19.4), (2, 2.6), (4, 2.4), (8, 2.5), (16, 11.6), (32, 9.0), (64, 55.6)]
    assert lower_envelope(raw) == [(1, 2.4), (2, 2.4), (4, 2.4), (8, 2.5), (16, 9.0), (32, 9.0), (64, 55.6)]
    assert lower_envelope(list(reversed(raw))) == lower_envelope(raw)
    assert lower_envelope([(3, 1.0)]) == [(3, 1.0)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"repeats": 0}, "repeats: expected an int >= 1, got 0"),
        ({"warmup": -1}, "warmup: expected an int >= 0, got -1"),
        ({"statistic": "mean"}, "statistic: expected 'min' or 'median', got 'mean'"),
        ({"clock": "gpu"}, "clock: expected 'wall' or 'cpu', got 'gpu'"),
    ],
)
def test_profile_arguments_are_checked_before_the_runner_is_touched(kwargs: dict[str, Any], match: str) -> None:
    from maskplug_vllm.calibrate import profile_runner

    with pytest.raises(BudgetError, match=match):
        profile_runner(object(), **kwargs)
