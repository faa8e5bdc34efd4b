"""``benchmarks/gpu_bench.py`` on the CPU: its oracle, its masks, and a full dry run (about 10 s)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskplug

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("maskplug_gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kind", ["dense", "half", "sparse"])
def test_mask_kinds(bench: ModuleType, kind: str) -> None:
    rng = np.random.default_rng(0)
    bm = bench.make_bitmask(rng, 5, 4000, kind, 50)
    assert bm.dtype == np.int32 and bm.shape == (5, 125)
    allowed = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little").sum(axis=1).astype(np.int64)
    if kind == "dense":
        assert np.all((allowed > 0) & (allowed <= 50))
    elif kind == "sparse":
        assert np.all((4000 - allowed > 0) & (4000 - allowed <= 50))
    else:
        assert np.all(np.abs(allowed - 2000) < 200)


def test_dense_oracle_agrees_with_reference(bench: ModuleType) -> None:
    """The benchmark's vectorised oracle against maskplug.reference, duplicates and skipped rows included."""

    @given(seed=st.integers(0, 2**32 - 1))
    def prop(seed: int) -> None:
        rng = np.random.default_rng(seed)
        step = bench.random_step(rng, torch.float32, int(rng.integers(1, 400)), 5)
        fast = bench.step_oracle(step, small=False)
        slow = bench.step_oracle(step, small=True)
        assert bench.bits_equal(fast, slow)

    prop()


def test_dry_run(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = bench.main(["--dry-run", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "| dtype | batch | mask | implementation |" in text
    data = json.loads(out.read_text())
    assert data["failures"] == []
    impls = {r["impl"] for r in data["rows"]}
    assert "torch" in impls
    assert {r["batch"] for r in data["rows"]} == {1, 4}
    assert {r["mask"] for r in data["rows"]} == {"dense", "half", "sparse"}
    assert all(r["us"] > 0 for r in data["rows"])
    assert data["bandwidth"]["copy"] > 0
    assert maskplug.backend_status("cpu")["torch"] is None
