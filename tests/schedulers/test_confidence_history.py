"""ConfidenceHistory: host copies exactly two steps old, slots reset for new requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskplug as mp


class _Oracle:
    """Dense, step-by-step model of what the history should hand out."""

    def __init__(self, num_slots: int, max_drafts: int) -> None:
        self.table = np.ones((num_slots, max_drafts), dtype=np.float32)
        self.snapshots: list[np.ndarray] = []  # table after each record
        self.reset_at = np.full(num_slots, -1)

    def reset(self, slots: list[int]) -> None:
        for s in slots:
            self.reset_at[s] = len(self.snapshots)
            self.table[s, :] = 1.0

    def record(self, slots: list[int], conf: np.ndarray) -> None:
        for i, s in enumerate(slots):
            self.table[s, :] = 1.0
            self.table[s, : conf.shape[1]] = conf[i]
        self.snapshots.append(self.table.copy())

    def stale(self, slots: list[int], cols: int) -> np.ndarray:
        t = len(self.snapshots) - 2
        out = np.ones((len(slots), cols))
        for i, s in enumerate(slots):
            if t >= 0 and self.reset_at[s] <= t:
                out[i] = self.snapshots[t][s, :cols]
        return out


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, int, list[tuple[str, list[int], np.ndarray | None, int]]]:
    num_slots = draw(st.integers(1, 6))
    max_drafts = draw(st.integers(0, 4))
    ops: list[tuple[str, list[int], np.ndarray | None, int]] = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["record", "record", "reset", "stale"]))
        slots = draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
        k = draw(st.integers(0, max_drafts))
        conf = None
        if kind == "record":
            vals = draw(st.lists(st.floats(0, 1, width=32), min_size=len(slots) * k, max_size=len(slots) * k))
            conf = np.array(vals, dtype=np.float32).reshape(len(slots), k)
        ops.append((kind, slots, conf, k))
    return num_slots, max_drafts, ops


@given(schedules())
def test_history_matches_the_step_by_step_oracle(sched: tuple[int, int, list]) -> None:  # type: ignore[type-arg]
    num_slots, max_drafts, ops = sched
    hist = mp.ConfidenceHistory(num_slots, max_drafts)
    oracle = _Oracle(num_slots, max_drafts)
    for kind, slots, conf, k in ops:
        if kind == "reset":
            hist.reset(slots)
            oracle.reset(slots)
        elif kind == "record":
            assert conf is not None
            hist.record(np.array(slots, dtype=np.int64), torch.from_numpy(conf))
            oracle.record(slots, conf)
        else:
            got = hist.stale(slots, num_columns=k)
            assert got.dtype == np.float64 and got.shape == (len(slots), k)
            np.testing.assert_array_equal(got, oracle.stale(slots, k))
        # the full-width view always agrees too
        np.testing.assert_array_equal(
            hist.stale(list(range(num_slots))), oracle.stale(list(range(num_slots)), max_drafts)
        )
    assert hist.step == len(oracle.snapshots)


def test_exactly_two_steps_old_and_new_requests_read_one() -> None:
    hist = mp.ConfidenceHistory(num_slots=4, max_drafts=3)
    assert np.array_equal(hist.stale([0, 1]), np.ones((2, 3)))
    for t in range(6):
        if t == 3:
            hist.reset([1])  # slot 1 is taken over by a new request at step 3
        stale = hist.stale([0, 1])
        if t >= 2:
            assert np.allclose(stale[0], 0.1 * (t - 2) + np.array([0.0, 0.01, 0.02]))
            if 3 <= t < 5:
                assert np.array_equal(stale[1], np.ones(3))  # the previous occupant's values are not handed out
            else:
                assert np.allclose(stale[1], 0.05 + 0.1 * (t - 2))
        live = torch.tensor([[0.1 * t, 0.1 * t + 0.01, 0.1 * t + 0.02], [0.05 + 0.1 * t] * 3])
        hist.record([0, 1], live)
    # a returned host array is a copy: writing it changes nothing
    s = hist.stale([0])
    s[:] = -1
    assert np.all(hist.stale([0]) >= 0)


def _rows(t: int, n: int, k: int) -> torch.Tensor:
    """Step ``t``'s live confidences: exact in float32, different for every step, slot and column."""
    base = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    return (base + 64.0 * t + 1.0) / 1024.0


def test_stale_is_the_recording_two_steps_back_and_never_a_later_one() -> None:
    hist = mp.ConfidenceHistory(num_slots=3, max_drafts=4)
    slots = [2, 0, 1]
    recorded: list[np.ndarray] = []
    for t in range(8):
        got = hist.stale(slots)
        if t < 2:
            np.testing.assert_array_equal(got, np.ones((3, 4)))  # nothing two steps old yet
        else:
            np.testing.assert_array_equal(got, recorded[t - 2])
            # the newer recording (step t-1) was made to the same slots and is not what stale() hands out
            assert not np.array_equal(got, recorded[t - 1])
        live = _rows(t, 3, 4)
        hist.record(slots, live)
        recorded.append(live.numpy().astype(np.float64))
        assert hist.step == t + 1


def test_a_returned_stale_array_does_not_follow_later_records() -> None:
    hist = mp.ConfidenceHistory(num_slots=2, max_drafts=3)
    for t in range(2):
        hist.record([0, 1], _rows(t, 2, 3))
    held = hist.stale([0, 1])
    expect = _rows(0, 2, 3).numpy().astype(np.float64)
    np.testing.assert_array_equal(held, expect)
    # Two more steps overwrite both host buffers, the one `held` was read from included.
    for t in range(2, 4):
        hist.record([0, 1], _rows(t, 2, 3))
    np.testing.assert_array_equal(held, expect)
    np.testing.assert_array_equal(hist.stale([0, 1]), _rows(2, 2, 3).numpy())
    # And writing the returned array changes nothing inside the history.
    held[:] = -1.0
    again = hist.stale([0, 1])
    np.testing.assert_array_equal(again, _rows(2, 2, 3).numpy())
    again[:] = -1.0
    np.testing.assert_array_equal(hist.stale([1]), _rows(2, 2, 3).numpy()[1:])


def test_changing_the_live_tensor_after_record_does_not_change_the_history() -> None:
    hist = mp.ConfidenceHistory(num_slots=4, max_drafts=3)
    live = _rows(0, 2, 3)
    expect = live.numpy().astype(np.float64).copy()
    hist.record([3, 1], live)
    live.fill_(0.5)  # the engine reuses its buffer for the next step's confidences
    hist.record([3, 1], live)
    live.zero_()
    np.testing.assert_array_equal(hist.stale([3, 1]), expect)  # step 0 as it was recorded
    hist.record([], torch.zeros((0, 3)))
    np.testing.assert_array_equal(hist.stale([3, 1]), np.full((2, 3), 0.5))  # step 1 as it was recorded
    # a non-contiguous live tensor (a column slice of a wider buffer) is copied the same way
    wide = torch.stack([_rows(5, 2, 3), _rows(6, 2, 3)], dim=2).reshape(2, 6)
    view = wide[:, ::2]
    want = view.numpy().astype(np.float64).copy()
    hist.record([0, 2], view)
    wide.fill_(0.25)
    hist.record([], torch.zeros((0, 3)))
    hist.record([], torch.zeros((0, 3)))
    np.testing.assert_array_equal(hist.stale([0, 2]), want)


def test_reset_reads_one_until_a_recording_after_it_is_two_steps_old() -> None:
    hist = mp.ConfidenceHistory(num_slots=3, max_drafts=2)
    for t in range(3):
        hist.record([0, 1, 2], _rows(t, 3, 2))
    assert hist.step == 3
    old = _rows(1, 3, 2).numpy().astype(np.float64)
    np.testing.assert_array_equal(hist.stale([0, 1, 2]), old)
    # Slot 1 is taken by a new request at step 3, slot 2 at step 3 too but never recorded again.
    hist.reset([1, 2])
    assert hist.step == 3  # reset does not advance the step
    got = hist.stale([0, 1, 2])
    np.testing.assert_array_equal(got[0], old[0])
    np.testing.assert_array_equal(got[1:], np.ones((2, 2)))  # not the previous occupants' step-1 values
    hist.record([0, 1], _rows(3, 2, 2))  # step 3: the new request's first confidences
    np.testing.assert_array_equal(hist.stale([1, 2]), np.ones((2, 2)))  # step 2 predates the reset
    hist.record([0, 1], _rows(4, 2, 2))
    np.testing.assert_array_equal(hist.stale([1]), _rows(3, 2, 2).numpy()[1:])  # step 3: after the reset
    # slot 2 was not covered by any recording since its reset: it reads 1, never its old values
    for _ in range(3):
        np.testing.assert_array_equal(hist.stale([2]), np.ones((1, 2)))
        hist.record([0], _rows(9, 1, 2))
    # resetting nothing changes nothing
    before = hist.stale([0, 1, 2])
    hist.reset([])
    np.testing.assert_array_equal(hist.stale([0, 1, 2]), before)


def test_reset_then_record_in_the_same_step_counts_from_that_step() -> None:
    hist = mp.ConfidenceHistory(num_slots=2, max_drafts=2)
    hist.record([0], _rows(0, 1, 2))
    hist.reset([0])  # step 1: a new request in slot 0, whose confidences are recorded in the same step
    hist.record([0], _rows(1, 1, 2))
    np.testing.assert_array_equal(hist.stale([0]), np.ones((1, 2)))  # step 0 belongs to the old occupant
    hist.record([], torch.zeros((0, 2)))
    np.testing.assert_array_equal(hist.stale([0]), _rows(1, 1, 2).numpy())
    # a second reset of the same slot starts over
    hist.reset([0])
    np.testing.assert_array_equal(hist.stale([0]), np.ones((1, 2)))


def test_recording_fewer_columns_pads_with_one() -> None:
    hist = mp.ConfidenceHistory(num_slots=2, max_drafts=4)
    hist.record([1], torch.tensor([[0.25, 0.5]]))
    hist.record([], torch.zeros((0, 4)))
    np.testing.assert_array_equal(hist.stale([1, 0]), [[0.25, 0.5, 1.0, 1.0], [1.0] * 4])


def test_history_validation() -> None:
    hist = mp.ConfidenceHistory(num_slots=3, max_drafts=2)
    with pytest.raises(mp.LayoutError, match=r"slots: expected slot indices in \[0, 3\), got 3"):
        hist.stale([3])
    with pytest.raises(mp.LayoutError, match="unique"):
        hist.reset([1, 1])
    with pytest.raises(mp.LayoutError, match="integer"):
        hist.reset([0.5])  # type: ignore[list-item]
    with pytest.raises(mp.BudgetError, match=r"confidences: expected shape \(1, <= 2\)"):
        hist.record([0], torch.ones((1, 3)))
    with pytest.raises(mp.BudgetError, match="floating"):
        hist.record([0], torch.ones((1, 2), dtype=torch.int64))
    with pytest.raises(mp.BudgetError, match="num_columns"):
        hist.stale([0], num_columns=3)
    with pytest.raises(mp.BudgetError, match="num_slots"):
        mp.ConfidenceHistory(num_slots=-1, max_drafts=2)
    assert hist.step == 0  # nothing was recorded by the refused calls
    np.testing.assert_array_equal(hist.stale([0, 1, 2]), np.ones((3, 2)))


@pytest.mark.gpu
def test_cuda_history_is_exact() -> None:
    """The CUDA path (pinned buffers, events) hands out the same values as the step-by-step oracle."""
    dev = torch.device("cuda")
    hist = mp.ConfidenceHistory(num_slots=64, max_drafts=4, device=dev)
    oracle = _Oracle(64, 4)
    gen = torch.Generator(device=dev).manual_seed(0)
    slots = np.arange(0, 64, 2)
    for t in range(20):
        if t % 7 == 3:
            hist.reset(slots[:3])
            oracle.reset(slots[:3].tolist())
        got = hist.stale(slots)
        np.testing.assert_array_equal(got, oracle.stale(slots.tolist(), 4))
        live = torch.rand((slots.shape[0], 4), device=dev, generator=gen)
        hist.record(slots, live)
        oracle.record(slots.tolist(), live.cpu().numpy())
    with pytest.raises(mp.BudgetError, match="on cuda"):
        hist.record(slots, torch.rand((slots.shape[0], 4)))
