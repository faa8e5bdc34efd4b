"""The scenario maskplug exists for, in vLLM's own code: mask rows for every scheduled draft, then a smaller budget.

vLLM's scheduler produces one grammar row per scheduled draft (plus the bonus
row) before the step's verify budget is known. When the budget then trims
drafts (to zero, or partially), the model runner's logits hold only the kept
drafts' rows, but the mask rows still follow the scheduled drafts.

vLLM 0.32's CPU mask path (``vllm.v1.structured_output.utils.apply_grammar_bitmask``,
unpatched) derives both the logits offsets and the mask-row offsets from the
one ``scheduled_spec_decode_tokens`` it is handed:

* handed the trimmed step (the drafts kept for verification, what the runner
  computes with), it walks the mask rows by the kept counts, so every grammar
  request after one that lost drafts gets another request's rows, or rows
  meant for draft positions of its own;
* handed the drafts as scheduled, it places rows at logits offsets that no
  longer exist and raises (or, where the offset happens to exist, writes into
  another request's row).

maskplug builds the row mapping from the scheduled layout and lets the active
offsets decide which rows are live (:func:`maskplug_vllm.worker.apply_scatter`
with the drafts as scheduled on the scheduler output), which is exactly the
oracle (:func:`maskplug.reference.apply_grammar_bitmask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from maskplug_vllm import patches
from maskplug_vllm.worker import SCHEDULED_SPEC_ATTR, apply_scatter
from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.structured_output import utils as so_utils

from maskplug import GrammarRows, ScheduledLayout, reference

MAX_DRAFTS = 5


def vllm_cpu_apply() -> Any:
    """vLLM's own CPU mask path, whether or not the adapter's patches are installed."""
    return patches.original(so_utils, "apply_grammar_bitmask")


@dataclass
class TrimmedStep:
    req_ids: list[str]
    grammar_req_ids: list[str]
    scheduled: dict[str, list[int]]
    kept: dict[str, list[int]]
    bitmask: np.ndarray
    logits: torch.Tensor

    def runner_output(self) -> SimpleNamespace:
        """The scheduler output the runner computes with: the kept drafts, and (for maskplug) the scheduled ones."""
        out = SimpleNamespace(scheduled_spec_decode_tokens=self.kept)
        setattr(out, SCHEDULED_SPEC_ATTR, self.scheduled)
        return out

    def expected(self) -> torch.Tensor:
        """The oracle: mapping from the scheduled layout, live rows from the kept drafts."""
        sched = [len(self.scheduled.get(r, ())) for r in self.req_ids]
        layout = ScheduledLayout(self.req_ids, sched, [1] * len(self.req_ids))
        mapping = GrammarRows(self.grammar_req_ids).mapping(layout)
        cu = np.concatenate([[0], np.cumsum([1 + len(self.kept.get(r, ())) for r in self.req_ids])])
        out = self.logits.clone()
        reference.apply_grammar_bitmask(out, torch.from_numpy(self.bitmask), mapping, cu)
        return out

    def earlier_request_lost_drafts(self) -> bool:
        """Whether a grammar request that is not the last one in row order had drafts trimmed."""
        return any(len(self.kept.get(r, ())) < len(self.scheduled.get(r, ())) for r in self.grammar_req_ids[:-1])


def _one_hot_rows(columns: list[int], words: int) -> np.ndarray:
    bm = np.zeros((len(columns), words), dtype=np.int64)
    for i, c in enumerate(columns):
        bm[i, c // 32] = 1 << (c % 32)
    return bm.astype(np.uint32).view(np.int32)


def _pinned_step(budget: str) -> TrimmedStep:
    """Two grammar requests: ``a`` with two drafts, ``b`` with one; each row allows exactly one token.

    Rows in producer order: a@0 → 0, a@1 → 1, a@2 → 2, b@0 → 3, b@1 → 4. Budget
    0 keeps no draft; the partial budget keeps ``a``'s first draft only.
    """
    scheduled = {"a": [7, 8], "b": [9]}
    kept = {"a": [], "b": []} if budget == "zero" else {"a": [7], "b": []}
    rows = sum(1 + len(v) for v in kept.values())
    logits = torch.zeros(rows, 64)
    return TrimmedStep(["a", "b"], ["a", "b"], scheduled, kept, _one_hot_rows([0, 1, 2, 3, 4], 2), logits)


def _allowed(row: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(row)).flatten().tolist()


@pytest.mark.parametrize("budget", ["zero", "partial"])
def test_difference_vllm_cpu_path_gives_a_request_another_rows_mask_after_a_trim(budget: str) -> None:
    step = _pinned_step(budget)
    theirs, ours = step.logits.clone(), step.logits.clone()
    vllm_cpu_apply()(
        step.runner_output(),
        GrammarOutput(step.grammar_req_ids, step.bitmask),
        SimpleNamespace(req_ids=step.req_ids),
        theirs,
    )
    apply_scatter(
        step.runner_output(),
        GrammarOutput(step.grammar_req_ids, step.bitmask),
        SimpleNamespace(req_ids=step.req_ids),
        ours,
    )
    b_row = theirs.shape[0] - 1  # b's bonus row, the last logits row either way
    # b's bonus position may only take token 3 (its own row b@0) ...
    assert _allowed(ours[b_row]) == [3]
    # ... but vLLM hands it the row produced for one of a's trimmed draft positions.
    assert _allowed(theirs[b_row]) == ([1] if budget == "zero" else [2])
    # a's own rows are right in both (its rows come first).
    for p in range(b_row):
        assert _allowed(theirs[p]) == _allowed(ours[p]) == [p]
    assert torch.equal(ours, step.expected())


@pytest.mark.parametrize("budget", ["zero", "partial"])
def test_difference_vllm_cpu_path_raises_when_handed_the_scheduled_drafts(budget: str) -> None:
    """Handed the drafts as scheduled (the rows' layout) with the trimmed logits, vLLM indexes past them."""
    step = _pinned_step(budget)
    theirs = step.logits.clone()
    scheduled_output = SimpleNamespace(scheduled_spec_decode_tokens=step.scheduled)
    with pytest.raises(IndexError):
        vllm_cpu_apply()(
            scheduled_output,
            GrammarOutput(step.grammar_req_ids, step.bitmask),
            SimpleNamespace(req_ids=step.req_ids),
            theirs,
        )
    ours = step.logits.clone()
    apply_scatter(
        step.runner_output(),
        GrammarOutput(step.grammar_req_ids, step.bitmask),
        SimpleNamespace(req_ids=step.req_ids),
        ours,
    )
    assert torch.equal(ours, step.expected())


def _random_step(rng: np.random.Generator, budget: str) -> TrimmedStep:
    n = int(rng.integers(1, 9))
    ids = [f"r{i}" for i in rng.permutation(3 * n)[:n]]
    scheduled = {r: rng.integers(0, 100, size=int(rng.integers(0, MAX_DRAFTS + 1))).tolist() for r in ids}
    scheduled = {r: d for r, d in scheduled.items() if d}
    if budget == "zero":
        kept: dict[str, list[int]] = {r: [] for r in scheduled}
    else:
        kept = {r: d[: int(rng.integers(0, len(d) + 1))] for r, d in scheduled.items()}
    gids = [ids[i] for i in rng.permutation(n)[: int(rng.integers(1, n + 1))]]
    vocab = 32 * int(rng.integers(2, 6))  # model-like widths (xgrammar's CPU kernel misbehaves below 32 columns)
    rows = sum(1 + len(scheduled.get(r, ())) for r in gids)
    bm = rng.integers(-(2**31), 2**31, size=(rows, vocab // 32), dtype=np.int64).astype(np.int32)
    logits = torch.from_numpy(rng.standard_normal((n + sum(len(v) for v in kept.values()), vocab))).to(torch.float32)
    return TrimmedStep(ids, gids, scheduled, kept, bm, logits)


@pytest.mark.parametrize("budget", ["zero", "partial"])
def test_difference_vllm_cpu_path_is_wrong_exactly_when_an_earlier_grammar_request_lost_drafts(budget: str) -> None:
    """Random trimmed steps: maskplug always matches the oracle; vLLM's path matches it only when no
    grammar request before the last one (in row order) lost a draft, and is wrong in every other case."""
    rng = np.random.default_rng({"zero": 70, "partial": 71}[budget])
    wrong = right = 0
    for _ in range(300):
        step = _random_step(rng, budget)
        grammar = GrammarOutput(step.grammar_req_ids, step.bitmask)
        batch = SimpleNamespace(req_ids=step.req_ids)
        want = step.expected()
        ours = step.logits.clone()
        apply_scatter(step.runner_output(), grammar, batch, ours)
        assert torch.equal(ours, want)
        theirs = step.logits.clone()
        vllm_cpu_apply()(step.runner_output(), grammar, batch, theirs)
        if step.earlier_request_lost_drafts():
            assert not torch.equal(theirs, want)
            wrong += 1
        else:
            assert torch.equal(theirs, want)
            right += 1
    # Both kinds of step occurred, so both halves of the claim were exercised.
    assert wrong > 50 and right > 20


def test_untrimmed_steps_agree() -> None:
    """Control: at the full budget (nothing trimmed) vLLM's path and maskplug's agree with the oracle."""
    rng = np.random.default_rng(72)
    for _ in range(100):
        step = _random_step(rng, "partial")
        step.kept = {r: list(d) for r, d in step.scheduled.items()}
        step.logits = torch.from_numpy(
            rng.standard_normal((len(step.req_ids) + sum(len(v) for v in step.kept.values()), step.logits.shape[1]))
        ).to(torch.float32)
        grammar = GrammarOutput(step.grammar_req_ids, step.bitmask)
        batch = SimpleNamespace(req_ids=step.req_ids)
        theirs, ours = step.logits.clone(), step.logits.clone()
        vllm_cpu_apply()(step.runner_output(), grammar, batch, theirs)
        apply_scatter(step.runner_output(), grammar, batch, ours)
        assert torch.equal(theirs, step.expected())
        assert torch.equal(ours, theirs)
