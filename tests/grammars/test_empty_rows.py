"""A filled row that allows no token is a failed request, never an all -inf row.

A fake matcher allows every token until it has taken ``dead_after``
tokens, then fills rows with no bit set. Mixed into a batch of real
provider matchers (which take their chain, batch or per-request paths), it
fails alone for every strategy of the chain and tree producers: the named
GrammarError in ``failed``, stop-only rows, acceptable 0 / valid False, and
the other requests' rows equal the same batch without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from grammar_testkit import PROVIDERS, small_vocab
from hypothesis import given, settings
from hypothesis import strategies as st

from maskplug import GrammarRows, GrammarSpec, ScheduledLayout, fill_draft_masks, fill_tree_masks, grammar_provider
from maskplug.engines.sdk import fill_windows_serially
from maskplug.grammar import serial
from maskplug.grammar.draft import dead_rows
from maskplug.grammar.rows import stop_row
from maskplug.trees import DraftTree

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")

VOCAB = small_vocab(extra=5)  # vocab_size not a multiple of 32: padding bits exist
CHAIN_STRATEGIES = ["auto", "chains", "batch", "threads", "serial"]
TREE_STRATEGIES = ["auto", "native", "walk"]


class DeadAfter:
    """A matcher that allows every token until it has taken ``dead_after`` tokens, then nothing."""

    releases_gil = False
    batch_ops = None

    def __init__(self, dead_after: int, pad_bits: bool = False) -> None:
        self.vocab = VOCAB
        self.dead_after = dead_after
        self.pad_bits = pad_bits  # also set the padding bits past vocab_size (they must not count)
        self.n = 0

    def accept(self, token: int) -> bool:
        self.n += 1
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        if self.n < self.dead_after:
            bitmask[row] = -1
        else:
            bitmask[row] = 0
            if self.pad_bits:
                bitmask[row, -1] = -(1 << (VOCAB.vocab_size % 32))
        return False

    def rollback(self, n: int) -> None:
        self.n -= n

    def is_terminated(self) -> bool:
        return False

    def validate(self, tokens: Sequence[int]) -> int:
        return len(tokens)

    def reset(self) -> None:
        self.n = 0

    def fork(self) -> DeadAfter:
        return DeadAfter(self.dead_after, self.pad_bits)


def _real(n: int) -> list[Any]:
    g = grammar_provider(PROVIDERS[0], VOCAB).compile(GrammarSpec("regex", r"[a-z]{1,6}"))
    return [g.matcher() for _ in range(n)]


# (dead_after, pad_bits, bad position in the batch): dead at the first row, mid-chain, at the bonus row.
CASES = [(0, False, 0), (1, True, 1), (2, False, 2), (3, True, 1)]


@pytest.mark.parametrize("strategy", CHAIN_STRATEGIES)
@pytest.mark.parametrize(("dead_after", "pad_bits", "bad"), CASES)
def test_chain_fill_fails_the_request_whose_row_allows_nothing(
    strategy: str, dead_after: int, pad_bits: bool, bad: int
) -> None:
    a = VOCAB.tokens.index(b"a")
    k, n = 3, 4
    ids = [f"r{i}" for i in range(n)]
    ms: list[Any] = _real(n)
    ms[bad] = DeadAfter(dead_after, pad_bits)
    lay = ScheduledLayout(ids, [k] * n, [1] * n)
    bm = VOCAB.new_bitmask(GrammarRows(ids).num_rows(lay))
    dm = fill_draft_masks(ms, [[a] * k] * n, bm, GrammarRows(ids), lay, strategy=strategy)
    assert list(dm.failed) == [bad]
    msg = str(dm.failed[bad])
    assert msg.startswith(f"matchers[{bad}]: its grammar allows no token at draft position {dead_after},")
    assert dm.acceptable[bad] == 0 and not dm.forced[bad].any()
    rows_per = k + 1
    assert bool((bm[bad * rows_per : (bad + 1) * rows_per] == stop_row(VOCAB)).all())
    keep = [i for i in range(n) if i != bad]
    ref_ids = [ids[i] for i in keep]
    ref_lay = ScheduledLayout(ref_ids, [k] * len(keep), [1] * len(keep))
    ref_bm = VOCAB.new_bitmask(GrammarRows(ref_ids).num_rows(ref_lay))
    ref = fill_draft_masks(
        _real(len(keep)), [[a] * k] * len(keep), ref_bm, GrammarRows(ref_ids), ref_lay, strategy=strategy
    )
    assert not ref.failed
    got = torch.cat([bm[i * rows_per : (i + 1) * rows_per] for i in keep])
    assert torch.equal(got, ref_bm)
    assert dm.acceptable[keep].tolist() == ref.acceptable.tolist()
    assert np.array_equal(dm.forced[keep], ref.forced)


@pytest.mark.parametrize("strategy", TREE_STRATEGIES)
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize(("dead_after", "pad_bits", "bad"), CASES[:3])
def test_tree_fill_fails_the_request_whose_row_allows_nothing(
    strategy: str, shape: str, dead_after: int, pad_bits: bool, bad: int
) -> None:
    a = VOCAB.tokens.index(b"a")
    k, n = 3, 4
    ids = [f"r{i}" for i in range(n)]
    parents = [[-1, 0, 1] if shape == "chain" else [-1, 0, 0]] * n
    ms: list[Any] = _real(n)
    ms[bad] = DeadAfter(dead_after, pad_bits)
    lay = ScheduledLayout(ids, [k] * n, [1] * n)
    bm = VOCAB.new_bitmask(GrammarRows(ids).num_rows(lay))
    tm = fill_tree_masks(ms, [[a] * k] * n, bm, GrammarRows(ids), DraftTree(lay, parents), strategy=strategy)
    assert list(tm.failed) == [bad]
    assert "its grammar allows no token at" in str(tm.failed[bad])
    assert str(tm.failed[bad]).startswith(f"matchers[{bad}]: ")
    assert not tm.valid[bad].any() and not tm.forced[bad].any()
    rows_per = k + 1
    assert bool((bm[bad * rows_per : (bad + 1) * rows_per] == stop_row(VOCAB)).all())
    keep = [i for i in range(n) if i != bad]
    ref_ids = [ids[i] for i in keep]
    ref_lay = ScheduledLayout(ref_ids, [k] * len(keep), [1] * len(keep))
    ref_bm = VOCAB.new_bitmask(GrammarRows(ref_ids).num_rows(ref_lay))
    ref_tree = DraftTree(ref_lay, [parents[i] for i in keep])
    ref = fill_tree_masks(
        _real(len(keep)), [[a] * k] * len(keep), ref_bm, GrammarRows(ref_ids), ref_tree, strategy=strategy
    )
    assert not ref.failed
    got = torch.cat([bm[i * rows_per : (i + 1) * rows_per] for i in keep])
    assert torch.equal(got, ref_bm)
    assert np.array_equal(tm.valid[keep], ref.valid) and np.array_equal(tm.forced[keep], ref.forced)


def test_dead_rows_counts_only_bits_within_the_vocabulary() -> None:
    bm = VOCAB.new_bitmask(3)
    bm[0] = 0
    bm[0, -1] = -(1 << (VOCAB.vocab_size % 32))  # only padding bits: dead
    bm[1] = 0
    bm[1, -1] = 1 << ((VOCAB.vocab_size % 32) - 1)  # the last real token: alive
    bm[2] = 0  # nothing: dead, but not filled (never asked)
    filled = np.array([[True, True, False]])
    assert dead_rows(bm, np.array([0]), filled, [VOCAB]) == {0: 0}
    assert dead_rows(bm, np.array([0]), np.array([[False, True, False]]), [VOCAB]) == {}


# -- the serial walk's check on rows of the usual width ------------------------------------------

EXACT = small_vocab(extra=128 - 102)  # vocab_size 128: every word holds tokens, rows are checked as bytes
# Row kinds: every token, none, only the last token (zeros from the row's start), only token 0 (zeros to its end).
KINDS = ("first", "last", "none", "open")


def _kind_row(kind: str) -> torch.Tensor:
    row = torch.full((EXACT.mask_words,), -1 if kind == "open" else 0, dtype=torch.int32)
    if kind == "last":
        row[-1] = -(1 << 31)
    elif kind == "first":
        row[0] = 1
    return row


class Scripted(DeadAfter):
    """Takes every token; after ``n`` tokens it fills the row of kind ``kinds[n]``."""

    def __init__(self, kinds: Sequence[str]) -> None:
        super().__init__(0)
        self.vocab = EXACT
        self.kinds = list(kinds)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        bitmask[row] = _kind_row(self.kinds[self.n])
        return True


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from(KINDS), min_size=1, max_size=5), min_size=1, max_size=4))
def test_serial_walk_fails_exactly_the_requests_with_an_empty_row(kinds: list[list[str]]) -> None:
    """Rows of the usual width are checked as one byte string: a run of zeros across two rows (one
    mask's end, the next one's start) is no empty row; an all-zero row anywhere fails its request,
    with or without the single-token rows looked for, and the other requests keep their rows."""
    windows = [[5] * (len(k) - 1) for k in kinds]
    row0 = np.concatenate([[0], np.cumsum([len(k) for k in kinds])[:-1]]).tolist()
    total = sum(len(k) for k in kinds)
    dead = {g for g, k in enumerate(kinds) if "none" in k}
    results = []
    for find_forced in (False, True):
        bm = EXACT.new_bitmask(total)
        ms = [Scripted(k) for k in kinds]
        if dead:
            dm = fill_windows_serially(ms, windows, row0, bm, total, find_forced=find_forced)
        else:
            # Every request served: decided by the walk's own check, not handed to the general assembly.
            with mock.patch.object(serial, "_general", side_effect=AssertionError("general assembly")):
                dm = fill_windows_serially(ms, windows, row0, bm, total, find_forced=find_forced)
        assert set(dm.failed) == dead
        for g, k in enumerate(kinds):
            rows = bm[row0[g] : row0[g] + len(k)]
            if g in dead:
                assert bool((rows == stop_row(EXACT)).all())
                assert dm.acceptable[g] == 0
            else:
                assert torch.equal(rows, torch.stack([_kind_row(x) for x in k]))
                assert dm.acceptable[g] == len(k) - 1
        results.append(dm)
    assert results[0].acceptable.tolist() == results[1].acceptable.tolist()
    assert not results[0].forced.any()


@pytest.mark.parametrize("find_forced", [False, True])
@pytest.mark.parametrize("pad_bits", [False, True])
@pytest.mark.parametrize("dead_after", [0, 1, 3, 4])
def test_one_request_filling_every_row_is_checked_below_its_vocabulary_size(
    dead_after: int, pad_bits: bool, find_forced: bool
) -> None:
    """One request whose rows are the whole step (one request in flight): its own short path.

    A row whose only bits are past ``vocab_size`` (the last word's padding)
    allows nothing: the request fails as the general assembly fails it; a
    step whose every row allows a token is served by the walk's own check.
    """
    nd = 3
    bm = VOCAB.new_bitmask(nd + 1)
    m = DeadAfter(dead_after, pad_bits=pad_bits)
    if dead_after > nd:
        with mock.patch.object(serial, "_general", side_effect=AssertionError("general assembly")):
            dm = fill_windows_serially([m], [[5] * nd], [0], bm, nd + 1, find_forced=find_forced)
        assert not dm.failed and dm.acceptable.tolist() == [nd]
        assert bool((bm == -1).all())
    else:
        dm = fill_windows_serially([m], [[5] * nd], [0], bm, nd + 1, find_forced=find_forced)
        assert set(dm.failed) == {0} and dm.acceptable.tolist() == [0]
        assert bool((bm == stop_row(VOCAB)).all())
    assert m.n == 0  # the walk's tokens rolled back
