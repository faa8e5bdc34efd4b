"""The known crash, pinned down: mask rows are mapped from the scheduled layout.

Two verification requests, two drafts each plus one bonus position. An engine
once rebuilt the row→logits mapping from the compacted offsets, so under budget
0 its six mask rows met a two-entry mapping and the step crashed. Here the
mapping always has one entry per mask row and the compacted offsets only decide
which of those rows are live.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import maskplug as mp
from maskplug import reference

WIDTH = 96  # three mask words per row
NUM_DRAFTS = [2, 2]


def _layout() -> mp.ScheduledLayout:
    return mp.ScheduledLayout(["req-a", "req-b"], NUM_DRAFTS, [1, 1], num_bonus=1)


def _bitmask() -> torch.Tensor:
    """Six distinct rows: mask row ``i`` allows exactly token ``10 * i + 3``."""
    bm = torch.zeros(6, WIDTH // 32, dtype=torch.int32)
    for i in range(6):
        tok = 10 * i + 3
        bm[i, tok >> 5] = 1 << (tok & 31)
    return bm


def _allowed(row: torch.Tensor) -> list[int]:
    return torch.nonzero(row != float("-inf")).flatten().tolist()


def _logits(rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows)
    return torch.randn(rows, WIDTH, generator=gen)


def test_mapping_has_one_entry_per_mask_row_in_every_regime() -> None:
    layout = _layout()
    rows = mp.GrammarRows(["req-a", "req-b"])
    # (budget, capacities, compacted offsets): zero, partial with its capacities known, full.
    for budget, capacity, cu_logits in ((0, None, [0, 1, 2]), (2, [1, 1], [0, 2, 4]), (4, None, [0, 3, 6])):
        comp = mp.compact(layout, budget, capacity=capacity)
        assert comp.exact and comp.cu_logits.tolist() == cu_logits  # compaction rewrote the offsets ...
        mapping = rows.mapping(layout)  # ... and the mapping, built from the scheduled layout, ignores them
        assert rows.num_rows(layout) == 6
        assert len(mapping) == 6
        assert mapping.request.tolist() == [0, 0, 0, 1, 1, 1]
        assert mapping.position.tolist() == [0, 1, 2, 0, 1, 2]
        # The compacted offsets only decide which entries are live: each compacted row gets exactly one.
        cu = comp.cu_logits
        live = mapping.position < cu[mapping.request + 1] - cu[mapping.request]
        targets = cu[mapping.request[live]] + mapping.position[live]
        assert targets.tolist() == list(range(cu_logits[-1]))


def test_three_regime_table() -> None:
    layout = _layout()
    table = {}
    for budget in (0, 2, 4):
        c = mp.compact(layout, budget)
        table[budget] = (c.regime, c.cu_logits.tolist(), c.exact, c.num_tokens)
    assert table == {
        0: ("zero", [0, 1, 2], True, 2),
        # The host cannot know the split before the device allocation: the
        # offsets are the scheduled upper bound and say so.
        2: ("partial", [0, 3, 6], False, 4),
        4: ("full", [0, 3, 6], True, 6),
    }


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_budget_zero_applies_row_zero_of_each_request(backend: str) -> None:
    layout = _layout()
    mapping = mp.GrammarRows(["req-a", "req-b"]).mapping(layout)
    comp = mp.compact(layout, 0)
    logits = _logits(2)
    before = logits.clone()
    mp.apply_grammar_bitmask(logits, _bitmask(), mapping, comp.cu_logits, backend=backend)
    # Request a's only row carries its mask row 0 (token 3); request b's only
    # row carries mask row 3, b's position 0 (token 33). Rows for positions 1
    # and 2 (tokens 13, 23, 43, 53) write nothing.
    assert _allowed(logits[0]) == [3]
    assert _allowed(logits[1]) == [33]
    assert logits[0, 3] == before[0, 3] and logits[1, 33] == before[1, 33]


def test_full_budget_masks_every_position() -> None:
    layout = _layout()
    mapping = mp.GrammarRows(["req-a", "req-b"]).mapping(layout)
    comp = mp.compact(layout, 4)
    logits = _logits(6)
    mp.apply_grammar_bitmask(logits, _bitmask(), mapping, comp.cu_logits, backend="torch")
    assert [_allowed(logits[i]) for i in range(6)] == [[3], [13], [23], [33], [43], [53]]


@pytest.mark.parametrize(
    ("conf", "capacity", "live_tokens"),
    [
        # Request a is confident: both admitted drafts go to it.
        ([[0.9, 0.8], [0.3, 0.2]], [2, 0], [[3], [13], [23], [33]]),
        # Equal first drafts: one each.
        ([[0.6, 0.1], [0.6, 0.1]], [1, 1], [[3], [13], [33], [43]]),
        # Request b is confident.
        ([[0.2, 0.2], [0.95, 0.9]], [0, 2], [[3], [33], [43], [53]]),
    ],
)
def test_partial_budget_uses_device_offsets(
    conf: list[list[float]], capacity: list[int], live_tokens: list[list[int]]
) -> None:
    layout = _layout()
    mapping = mp.GrammarRows(["req-a", "req-b"]).mapping(layout)
    comp = mp.compact(layout, 2)
    assert comp.regime == "partial" and not comp.exact
    cap = mp.allocate(torch.tensor(conf, dtype=torch.float32), torch.tensor(NUM_DRAFTS), 2)
    assert cap.tolist() == capacity
    cu = mp.active_cu_logits(cap, layout.num_bonus)
    assert cu.tolist() == [0, capacity[0] + 1, capacity[0] + capacity[1] + 2]
    # The exact host view agrees once the capacities are known.
    assert mp.compact(layout, 2, capacity=cap.numpy()).cu_logits.tolist() == cu.tolist()
    logits = _logits(4)
    expected = logits.clone()
    reference.apply_grammar_bitmask(expected, _bitmask(), mapping, cu)
    mp.apply_grammar_bitmask(logits, _bitmask(), mapping, cu, backend="torch")
    assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))
    assert [_allowed(logits[i]) for i in range(4)] == live_tokens


def test_offsets_from_a_compacted_mapping_are_refused() -> None:
    """The crash's shape: six mask rows but a mapping with one entry per compacted row."""
    layout = _layout()
    comp = mp.compact(layout, 0)
    logits = _logits(2)
    before = logits.clone()
    wrong = (np.array([0, 1], dtype=np.int32), np.array([0, 0], dtype=np.int32))
    with pytest.raises(mp.LayoutError, match="mapping"):
        mp.apply_grammar_bitmask(logits, _bitmask(), wrong, comp.cu_logits, backend="torch")
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))
