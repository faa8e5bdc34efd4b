"""The demo, selftest and bench commands: output format, determinism and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from maskplug.cli import main

SMALL = ["demo", "--steps", "6", "--concurrency", "3", "--tokenizer", "spm", "--no-progress"]
FIELDS = {
    "steps",
    "tokens",
    "tokens_per_step",
    "accepted_length",
    "regimes",
    "goodput_tok_s",
    "valid",
    "invalid",
    "cut_off",
    "host_us_per_step",
}


def test_same_seed_gives_byte_identical_json(capsys: pytest.CaptureFixture[str]) -> None:
    outs = []
    for _ in range(2):
        assert main([*SMALL, "--json", "--no-timing", "--seed", "7"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0].encode() == outs[1].encode()
    obj = json.loads(outs[0])
    assert set(obj) == {"seed", "config", "schedulers"}
    assert obj["seed"] == 7
    assert list(obj["schedulers"]) == ["no-spec", "verify-all", "dspark", "grammar-aware:dspark", "goodput"]
    for rec in obj["schedulers"].values():
        assert set(rec) == FIELDS
        assert set(rec["regimes"]) == {"full", "partial", "zero"}
        assert rec["host_us_per_step"] is None
        assert rec["steps"] == 6


def test_timing_changes_only_host_time(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*SMALL, "--json", "--seed", "3", "--scheduler", "dspark"]
    assert main([*args, "--no-timing"]) == 0
    quiet = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    timed = json.loads(capsys.readouterr().out)
    t = timed["schedulers"]["dspark"].pop("host_us_per_step")
    quiet["schedulers"]["dspark"].pop("host_us_per_step")
    assert isinstance(t, float) and t > 0
    assert timed == quiet


def test_another_seed_gives_another_run(capsys: pytest.CaptureFixture[str]) -> None:
    outs = []
    for seed in ("1", "2"):
        assert main([*SMALL, "--json", "--no-timing", "--seed", seed, "--scheduler", "verify-all"]) == 0
        outs.append(json.loads(capsys.readouterr().out)["schedulers"]["verify-all"])
    assert outs[0] != outs[1]


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--scheduler", "no-spec,dspark"]) == 0
    out = capsys.readouterr().out
    assert "goodput tok/s" in out and "invariant checks: all passed" in out
    assert out.count("\nno-spec") == 1 and out.count("\ndspark") == 1


@pytest.mark.parametrize(
    "extra",
    [["--steps", "0"], ["--concurrency", "0"], ["--drafts", "-1"], ["--scheduler", "no-such-scheduler"]],
)
def test_bad_demo_arguments_exit_2(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, *extra]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "expected" in err


def test_unknown_provider_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--provider", "no-such-provider"]) == 2
    assert "no-such-provider" in capsys.readouterr().err


def test_selftest_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--cases", "12", "--json", "--no-progress"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["passed"] is True
    names = {c["name"]: c for c in obj["checks"]}
    assert names["core host path vs reference"]["cases"] == 12
    assert names["kernel torch on cpu"]["status"] == "passed"
    assert any(n.startswith("grammar ") and c["status"] == "passed" for n, c in names.items())


def test_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--json", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)
    benches = {r["bench"].split(" (")[0] for r in rows}
    assert benches == {"host path", "apply", "draft rows"}
    assert all(r["maskplug_us"] > 0 and r["peer_us"] > 0 for r in rows)


def test_python_dash_m_and_no_command() -> None:
    done = subprocess.run([sys.executable, "-m", "maskplug", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "maskplug" in done.stdout
    done = subprocess.run([sys.executable, "-m", "maskplug"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2


def test_a_broken_kernel_fails_selftest_and_demo(capsys: pytest.CaptureFixture[str]) -> None:
    from sim_testkit import BrokenPlugin

    from maskplug import reset_registry
    from maskplug.plugins import get_registry

    reset_registry()
    try:
        get_registry().add_plugin(BrokenPlugin(), "broken-for-test")
        assert main(["selftest", "--cases", "9", "--json", "--no-progress"]) == 1
        obj = json.loads(capsys.readouterr().out)
        status = {c["name"]: c["status"] for c in obj["checks"]}
        assert status["kernel broken-for-test on cpu"] == "FAILED"
        assert status["kernel torch on cpu"] == "passed"
        demo = [*SMALL, "--backend", "broken-for-test", "--scheduler", "verify-all", "--steps", "20"]
        assert main(demo) == 1
        assert "VIOLATIONS" in capsys.readouterr().out
    finally:
        reset_registry()
