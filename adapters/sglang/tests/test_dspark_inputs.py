"""The DSpark pieces refuse bad input with a clear maskplug error, touching nothing; the cost tables convert exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import compile_pair, grammar_keys
from maskplug_sglang.backend import allocate_mask
from maskplug_sglang.dspark import (
    DSparkBudgetPlanner,
    blank_rows_past,
    cost_from_sps_table,
    fill_verify_rows,
    grammar_corrected_confidence,
)
from sglang.srt.speculative.dspark_components.dspark_planner import _additive_step_time_tensor, _lookup_sps_tensor
from sglang.srt.speculative.dspark_components.dspark_sps import SpsAdditiveCostTable, SpsCostTable

from maskplug import BudgetError, DraftMasks, LayoutError, PluginError

KEYS = grammar_keys()


def _pair(backends: tuple[Any, Any]) -> Any:
    return compile_pair(backends, ("json", "$$ANY$$"))[1]


def test_fill_verify_rows_refuses_bad_shapes_and_lengths(bpe_backends: tuple[Any, Any]) -> None:
    g = _pair(bpe_backends)
    size = g.vocab.vocab_size
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mask = allocate_mask(size, 6)
    mask[:, 0] = 123
    before = mask.clone()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"grammars": [g], "verify_ids": ids}, "grammars"),
        ({"grammars": [g, None], "verify_ids": ids[0]}, "verify_ids"),
        ({"grammars": [g, None], "verify_ids": ids, "verify_lens": [1, 4]}, "verify_lens"),
        ({"grammars": [g, None], "verify_ids": ids, "verify_lens": [0, 1]}, "verify_lens"),
        ({"grammars": [g, None], "verify_ids": ids, "verify_lens": [1]}, "verify_lens"),
        ({"grammars": [g, None], "verify_ids": ids, "vocab_mask": allocate_mask(size, 5)}, "vocab_mask"),
    ]
    for kwargs, name in cases:
        buf = kwargs.pop("vocab_mask", mask)
        with pytest.raises(LayoutError, match=name):
            fill_verify_rows(vocab_mask=buf, **kwargs)
        assert torch.equal(mask, before)
    assert g.num_accepted == 0


def test_blank_rows_past_checks_its_arguments() -> None:
    mask = torch.zeros((6, 2), dtype=torch.int32)
    with pytest.raises(LayoutError, match="width"):
        blank_rows_past(mask, [1, 2], 0)
    with pytest.raises(LayoutError, match="vocab_mask"):
        blank_rows_past(mask, [1, 2], 4)
    with pytest.raises(LayoutError, match="verify_lens"):
        blank_rows_past(mask, [1, 4], 3)
    assert bool((mask == 0).all())
    blank_rows_past(mask, [1, 3], 3)
    assert mask[:, 0].tolist() == [0, -1, -1, 0, 0, 0]


def test_planner_refuses_bad_configuration_and_input() -> None:
    with pytest.raises(BudgetError, match="gamma"):
        DSparkBudgetPlanner("verify-all", gamma=0)
    with pytest.raises(BudgetError, match="max_verify_len"):
        DSparkBudgetPlanner("verify-all", gamma=3, max_verify_len=5)
    with pytest.raises(PluginError, match="registered schedulers"):
        DSparkBudgetPlanner("no-such-scheduler", gamma=3)
    with pytest.raises(PluginError, match="registered schedulers"):
        DSparkBudgetPlanner("grammar-aware:no-such-scheduler", gamma=3)
    with pytest.raises(BudgetError, match="cost"):
        DSparkBudgetPlanner("verify-all", gamma=3, cost="linear")  # type: ignore[arg-type]
    planner = DSparkBudgetPlanner("verify-all", gamma=3)
    with pytest.raises(BudgetError, match="confidence"):
        planner.plan(["a", "b"], torch.ones((2, 2)))
    with pytest.raises(BudgetError, match="confidence"):
        planner.plan(["a"], torch.ones((2, 3)))
    with pytest.raises(BudgetError, match="plan"):
        planner.observe("not a plan", [0])  # type: ignore[arg-type]


def test_grammar_corrected_confidence_rules() -> None:
    conf = torch.full((3, 4), 0.5)
    dm = DraftMasks(
        request=np.array([0, 2]),
        acceptable=np.array([2, 4]),
        forced=np.array([[True, False, True, False, False], [False, True, False, False, True]]),
    )
    got = grammar_corrected_confidence(conf, dm)
    assert got.tolist() == [
        [1.0, 0.5, 0.0, 0.0],  # forced + accepted → 1; from the refused draft on → 0 (forced or not)
        [0.5, 0.5, 0.5, 0.5],  # no grammar
        [0.5, 1.0, 0.5, 0.5],
    ]
    assert bool((conf == 0.5).all())  # the input is not changed
    with pytest.raises(BudgetError, match="confidence"):
        grammar_corrected_confidence(torch.ones(3), dm)
    bad = DraftMasks(request=np.array([3]), acceptable=np.array([1]), forced=np.zeros((1, 5), dtype=bool))
    with pytest.raises(BudgetError, match=r"grammar\.request"):
        grammar_corrected_confidence(conf, bad)


def test_cost_from_sps_tables_matches_sglangs_step_time() -> None:
    table = SpsCostTable([1, 8, 32, 64], [120.0, 100.0, 60.0, 30.0], 64)
    cost = cost_from_sps_table(table, 64, 64)
    for t in table.sample_batch_tokens:
        sps = float(_lookup_sps_tensor(sps_table=table, batch_tokens=torch.tensor([t]))[0])
        assert cost.draft_ms(4) + cost.verify_ms(t) == pytest.approx(1000.0 / sps)
    add = SpsAdditiveCostTable(
        bias_seconds=0.002, bs_probes=[1, 16, 64], alpha_seconds=[0.001, 0.002, 0.004],
        m_probes=[1, 64, 512], theta_seconds=[0.003, 0.005, 0.02],
    )  # fmt: skip
    cost = cost_from_sps_table(add, 64, 512)
    for bs in add.bs_probes:
        for m in add.m_probes:
            if m < bs:
                continue
            want = _additive_step_time_tensor(table=add, num_requests=bs, num_budgets=m - bs + 1)[-1]
            assert cost.draft_ms(bs) + cost.verify_ms(m) == pytest.approx(1000.0 * float(want))
    with pytest.raises(BudgetError, match="table"):
        cost_from_sps_table({"sps": 1}, 4, 4)


@pytest.mark.parametrize("scheduler", ["grammar-aware:dspark", "verify-all", "dspark"])
def test_max_verify_len_bounds_the_plan(scheduler: str) -> None:
    """SGLang's ``max_verify_len`` below ``gamma + 1``: the scheduler sees only the drafts it allows."""
    planner = DSparkBudgetPlanner(scheduler, gamma=5, max_verify_len=3)
    dm = DraftMasks(request=np.array([0, 1]), acceptable=np.array([5, 1]), forced=np.ones((2, 6), dtype=bool))
    conf = torch.full((3, 5), 0.9)
    plan = planner.plan(["a", "b", "c"], conf, grammar=dm)
    lens = plan.verify_lens.tolist()
    assert max(lens) <= 3 and lens[1] <= 2
    assert plan.budget <= 3 * 2
