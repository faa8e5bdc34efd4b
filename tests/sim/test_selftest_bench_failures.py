"""selftest and bench report a request that fill_draft_masks failed with the engine's error, not as rows that differ.

The provider under test wraps an installed one; its matchers raise inside
the engine when asked to fill a bitmask of more than one row (as
fill_draft_masks does, and the self-test's own one-row walk does not), so
the check reaches fill_draft_masks and the request fails there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import maskplug.grammar
from maskplug import GrammarError
from maskplug.bench import _draft_rows
from maskplug.selftest import run_selftest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grammars"))
from grammar_testkit import PROVIDERS
from test_fault_isolation import EngineFault, Fault, Faulty

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")


class WideRowsBreak(Faulty):
    """A matcher whose engine raises when it fills a row of a bitmask with more than one row."""

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        if bitmask.shape[0] > 1:
            raise EngineFault(f"fill: the engine lost its mask buffer ({bitmask.shape[0]} rows)")
        return super().fill(bitmask, row)


class _Grammar:
    def __init__(self, real: Any) -> None:
        self.real = real

    def matcher(self) -> WideRowsBreak:
        return WideRowsBreak(self.real.matcher(), Fault(), None)


class BreakingProvider:
    """An installed provider whose matchers are :class:`WideRowsBreak`."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def supports(self, kind: str) -> bool:
        return bool(self.real.supports(kind))

    def compile(self, spec: Any) -> _Grammar:
        return _Grammar(self.real.compile(spec))


@pytest.fixture
def breaking(monkeypatch: pytest.MonkeyPatch) -> str:
    """The first installed provider, made to break; the only one selftest and bench see."""
    name = PROVIDERS[0]
    real = maskplug.grammar.grammar_provider
    monkeypatch.setattr(maskplug.grammar, "grammar_providers", lambda: [name])
    monkeypatch.setattr(maskplug.grammar, "grammar_provider", lambda n, vocab: BreakingProvider(real(n, vocab)))
    return name


def test_selftest_reports_the_engine_error_of_a_failed_request(
    breaking: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_selftest(seed=3, cases=4, as_json=True, progress=False) == 1
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    grammar = checks[f"grammar {breaking}"]
    assert grammar["status"] == "FAILED" and grammar["cases"] == 3
    assert grammar["failures"], grammar
    for line in grammar["failures"]:
        assert "differ" not in line, line
        assert ": the request failed: matchers[0]: the matcher raised EngineFault in its fill of row 0: " in line
        assert line.endswith("fill: the engine lost its mask buffer (4 rows)"), line
    # Only the provider failed: the core and kernel checks still pass.
    assert [c["name"] for c in report["checks"] if c["status"] == "FAILED"] == [f"grammar {breaking}"]


def test_bench_reports_the_engine_error_of_a_failed_request(breaking: str) -> None:
    with pytest.raises(GrammarError) as info:
        _draft_rows("spm", 4, 3, 1)
    text = str(info.value)
    assert text.startswith(f"draft rows ({breaking}): fill_draft_masks failed 4 of 4 requests; request 0: ")
    assert (
        "matchers[0]: the matcher raised EngineFault in its fill of row 0: fill: the engine lost its mask buffer"
        in text
    )
    assert "disagree" not in text
    assert isinstance(info.value.__cause__, GrammarError)
    assert isinstance(info.value.__cause__.__cause__, EngineFault)
