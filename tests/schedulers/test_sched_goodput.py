"""``goodput``: acceptance learned from history, for drafters without a confidence head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sched_testkit import oracle_rate

import maskplug as mp
from maskplug import reference
from maskplug.schedulers import GoodputScheduler

COST = mp.CostModel.linear(draft_base_ms=0.0, draft_per_req_ms=0.0, verify_base_ms=1.0, verify_per_token_ms=0.02)


def first_rejection(rng: np.random.Generator, q: np.ndarray, n: int) -> np.ndarray:
    """Accepted drafts per request when draft p is accepted with probability q[p] given its prefix."""
    ok = rng.random((n, q.shape[0])) < q[None, :]
    return np.where(ok.all(axis=1), q.shape[0], np.argmin(ok, axis=1))


def test_converges_to_the_true_acceptance_rate() -> None:
    rng = np.random.default_rng(0)
    q = np.array([0.9, 0.7, 0.5, 0.3])
    ids = np.arange(100, 164)
    sched = mp.get_scheduler("goodput")
    assert isinstance(sched, GoodputScheduler)
    for _ in range(400):
        order = rng.permutation(ids)  # batch order changes every step
        acc = first_rejection(rng, q, order.shape[0])
        sched.observe(mp.StepOutcome(order, np.full(order.shape[0], 4), acc))
    est = sched.estimates(ids, 4)
    np.testing.assert_allclose(est.mean(axis=0), q, atol=0.04)
    # the population prior (what a new request starts from) learned the same rates
    np.testing.assert_allclose(sched.population(4), q, atol=0.05)
    np.testing.assert_allclose(sched.estimates(["never-seen"], 4)[0], sched.population(4))

    # and the budget it picks is (nearly) as good as one chosen knowing the true rates
    lay = mp.ScheduledLayout(ids, [4] * 64, [1] * 64)
    view = mp.StepView(lay, COST)
    d = sched.budget(view)
    truth = [list(q)] * 64
    best = max(e / c for e, c in (oracle_rate(view, truth, b) for b in range(lay.total_drafts + 1)))
    e, c = oracle_rate(view, truth, d.budget)
    assert e / c >= 0.98 * best
    assert d == reference.choose_budget(sched.estimates(ids, 4), lay, COST)


def test_budget_zero_when_drafts_are_never_accepted() -> None:
    sched = mp.get_scheduler("goodput")
    assert isinstance(sched, GoodputScheduler)
    next_id = 0
    live_ids = list(range(8))
    next_id = 8
    budgets = []
    for step in range(100):
        if step % 5 == 4:  # requests come and go
            done, live_ids = live_ids[:2], [*live_ids[2:], next_id, next_id + 1]
            next_id += 2
        else:
            done = []
        lay = mp.ScheduledLayout(live_ids, [4] * 8, [1] * 8)
        view = mp.StepView(lay, COST)
        d = sched.budget(view)
        budgets.append(d.budget)
        beliefs = torch.tensor(sched.estimates(lay.req_ids, 4))
        cap = mp.allocate_step(view, beliefs, d.budget).numpy()
        sched.observe(mp.StepOutcome(lay.req_ids, cap, np.zeros(8, dtype=np.int64), finished=np.array(done)))
    assert budgets[0] > 0  # the neutral prior makes the first drafts worth a try
    assert budgets[-20:] == [0] * 20
    # new requests start from the population's (now pessimistic) estimate of the first draft
    assert sched.estimates([10_000], 4)[0, 0] < 0.5 / 2
    fresh = mp.ScheduledLayout(np.arange(10_000, 10_008), [4] * 8, [1] * 8)
    assert sched.budget(mp.StepView(fresh, COST)).budget == 0


def test_history_follows_request_ids_and_forgets_finished_ones() -> None:
    sched = GoodputScheduler(alpha=0.5, prior=0.6, population_alpha=0.5)
    np.testing.assert_allclose(sched.estimates(["a"], 3), [[0.6, 0.6, 0.6]])
    # "a" accepts both verified drafts; "b" has its first draft rejected
    sched.observe(mp.StepOutcome(np.array(["b", "a"]), np.array([3, 2]), np.array([0, 2])))
    # a: positions 0,1 observed 1 -> 0.6 + 0.5*(1-0.6) = 0.8; position 2 unverified -> still its prior
    # population before the update was 0.6 everywhere; b starts there: position 0 observed 0 -> 0.3
    pop_before = 0.6
    np.testing.assert_allclose(sched.estimates(["a"], 3), [[0.8, 0.8, pop_before]])
    np.testing.assert_allclose(sched.estimates(["b"], 3), [[0.3, 0.6, 0.6]])
    # population: position 0 saw {1, 0} (mean .5), position 1 saw {1}, position 2 nothing
    np.testing.assert_allclose(sched.population(3), [0.55, 0.8, 0.6])
    sched.observe(mp.StepOutcome(np.array(["a"]), np.array([1]), np.array([1]), finished=np.array(["a"])))
    np.testing.assert_allclose(sched.estimates(["a"], 3)[0], sched.population(3))  # forgotten
    np.testing.assert_allclose(sched.estimates(["b"], 3), [[0.3, 0.6, 0.6]])  # untouched
    # a new id reuses the freed row without inheriting its history
    sched.observe(mp.StepOutcome(np.array(["c"]), np.array([0]), np.array([0])))
    np.testing.assert_allclose(sched.estimates(["c"], 3)[0], sched.population(3))


def test_goodput_config_and_outcome_validation() -> None:
    for bad in ({"alpha": 0.0}, {"alpha": 1.5}, {"prior": -0.1}, {"prior": float("nan")}, {"population_alpha": "x"}):
        with pytest.raises(mp.BudgetError, match=next(iter(bad))):
            mp.get_scheduler("goodput", **bad)
    with pytest.raises(mp.BudgetError, match="accepted"):
        mp.StepOutcome(np.array([1, 2]), np.array([2, 2]), np.array([1, 3]))
    with pytest.raises(mp.BudgetError, match="verified"):
        mp.StepOutcome(np.array([1, 2]), np.array([2]), np.array([1, 1]))
    with pytest.raises(mp.BudgetError, match="unique"):
        mp.StepOutcome(np.array([1, 1]), np.array([2, 2]), np.array([1, 1]))
    sched = mp.get_scheduler("goodput")
    sched.observe(mp.StepOutcome(np.array([1]), np.array([1]), np.array([1])))
    with pytest.raises(mp.BudgetError, match="req_ids"):
        sched.observe(mp.StepOutcome(np.array(["s"]), np.array([1]), np.array([1])))


def test_first_observations_weigh_as_a_running_mean_with_the_prior() -> None:
    """prior_weight=1: the prior counts as one observation until the mean's step falls to alpha."""
    sched = GoodputScheduler(alpha=0.1, prior=0.5, population_alpha=0.05)
    plain = GoodputScheduler(alpha=0.1, prior=0.5, population_alpha=0.05, prior_weight=None)
    want, want_plain, pop, n_pop = 0.5, 0.5, 0.5, 0
    for n in range(1, 16):
        # "a" accepts its only verified draft every step; "b" never verifies past position 0 and rejects it
        out = mp.StepOutcome(np.array(["a", "b"]), np.array([1, 1]), np.array([1, 0]))
        sched.observe(out)
        plain.observe(out)
        want += max(0.1, 1 / (1 + n)) * (1.0 - want)
        want_plain += 0.1 * (1.0 - want_plain)
        n_pop += 1
        pop += max(0.05, 1 / (1 + n_pop)) * (0.5 - pop)  # the step's mean at position 0: (1 + 0) / 2
        np.testing.assert_allclose(sched.estimates(["a"], 1)[0, 0], want)
        np.testing.assert_allclose(sched.estimates(["b"], 1)[0, 0], 1.0 - want)
        np.testing.assert_allclose(plain.estimates(["a"], 1)[0, 0], want_plain)
        np.testing.assert_allclose(sched.population(1)[0], pop)
    # running mean: (0.5 + 1 + ... + 1) / (1 + n) while 1 / (1 + n) >= alpha, i.e. 0.95 after nine hits
    sched2 = GoodputScheduler(alpha=0.1)
    for _ in range(9):
        sched2.observe(mp.StepOutcome(np.array([7]), np.array([1]), np.array([1])))
    np.testing.assert_allclose(sched2.estimates([7], 1)[0, 0], 9.5 / 10)
    # a row freed and handed to a new id starts its count again
    sched2.observe(mp.StepOutcome(np.array([7]), np.array([0]), np.array([0]), finished=np.array([7])))
    p0 = sched2.population(1)[0]
    np.testing.assert_allclose(p0, 9.5 / 10)  # the population saw the same nine steps
    sched2.observe(mp.StepOutcome(np.array([8]), np.array([1]), np.array([0])))
    # 8 starts from the population estimate before this step and weighs its first rejection by 1/2
    np.testing.assert_allclose(sched2.estimates([8], 1)[0, 0], p0 / 2)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "1", True])
def test_prior_weight_is_checked(bad: object) -> None:
    with pytest.raises(mp.BudgetError, match="prior_weight"):
        GoodputScheduler(prior_weight=bad)  # type: ignore[arg-type]
