"""fill_draft_masks(..., wait=False): the rows of a step produced while the caller does something else.

A serving loop is replayed twice, step by step: once synchronously on forked
matchers (the reference), once with jobs, under interleavings hypothesis
draws (commit before ``result()``, commit from another thread while the job
runs, the next fill issued before the previous job is done, a matcher that
raises inside a job, a job that is aborted). After every step the rows, the
:class:`DraftMasks` and every matcher's state must be those of the
reference; a matcher that raises fails its own request alone, and an aborted
job must leave the rows and the matchers as they were.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from grammar_testkit import allowed_ids, random_walk, state_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_draft_safety import ALL_PROVIDERS, make_case

from maskplug import (
    DraftMasksJob,
    GrammarError,
    GrammarRows,
    MatcherInUse,
    ScheduledLayout,
    commit,
    fill_draft_masks,
)
from maskplug.grammar import Matcher
from maskplug.grammar.rows import stop_row


class Abort(BaseException):
    """Not an engine error: what stops production altogether (as KeyboardInterrupt would)."""


class Gated:
    """A matcher whose ``fill`` waits for ``gate`` (and raises ``fail`` when set): it holds a job in flight."""

    def __init__(self, inner: Matcher) -> None:
        self.inner = inner
        self.vocab = getattr(inner, "vocab", None)
        self.gate = threading.Event()
        self.gate.set()
        self.fail: type[BaseException] | None = None

    def accept(self, token: int) -> bool:
        return self.inner.accept(token)

    def validate(self, tokens: Sequence[int]) -> int:
        return self.inner.validate(tokens)

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail("the engine failed")
        return self.inner.fill(bitmask, row)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> Matcher:
        return self.inner.fork()


KINDS = ("sync", "job", "commit-first", "commit-thread", "next-fill-first", "fail", "abort")


def _later(gate: threading.Event, seconds: float = 0.02) -> threading.Timer:
    t = threading.Timer(seconds, gate.set)
    t.start()
    return t


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5))
def test_jobs_match_the_synchronous_path_under_any_interleaving(provider: str, seed: int, kinds: list[str]) -> None:
    rng = random.Random(seed)
    case = make_case(provider, seed=seed % 1000, n=3)
    v, ms = case.v, case.ms
    twins = [m.fork() for m in ms]
    # One more request on a gated matcher that never moves: it holds a job in flight while it is closed.
    gated, gate_ref = Gated(case.make()), Gated(case.make())
    ids = ["r0", "r1", "r2", "gate"]
    rows = GrammarRows(ids)
    for kind in kinds:
        drafts = [
            [] if t.is_terminated() else random_walk(t, v, rng, rng.randint(0, 3), stop=rng.random() < 0.3)
            for t in twins
        ]
        if rng.random() < 0.3 and drafts[1]:
            drafts[1][-1] = rng.randrange(len(v.tokens))  # perhaps one the grammar refuses
        drafts.append([])
        layout = ScheduledLayout(ids, [len(d) for d in drafts], [1] * 4, num_bonus=rng.choice([1, 2]))
        total = rows.num_rows(layout)
        ref_bm = v.new_bitmask(total)
        want = fill_draft_masks([*twins, gate_ref], drafts, ref_bm, rows, layout)
        per = rows.rows_per_request(layout)
        row0 = np.concatenate([[0], np.cumsum(per)[:-1]])
        # The step's outcome: some accepted drafts, then one token the row after them allows.
        emitted = []
        for g in range(3):
            n_acc = rng.randint(0, int(want.acceptable[g]))
            ok = allowed_ids(ref_bm[int(row0[g]) + n_acc], v.vocab_size)
            emitted.append(drafts[g][:n_acc] + ([int(rng.choice(ok.tolist()))] if ok.size else []))
        bm = torch.randint(-(2**31), 2**31 - 1, (total + 1, v.mask_words), dtype=torch.int32)
        before = bm.clone()
        args = ([*ms, gated], drafts, bm, rows, layout)

        def commit_all(out: list[int], emitted: list[list[int]] = emitted) -> None:
            out.extend(commit(m, e) for m, e in zip(ms, emitted, strict=True))

        took: list[int] = []
        if kind == "fail":
            # The gated request alone fails: stop-only rows and ``failed``; the others as the reference.
            gated.fail = RuntimeError
            failed = fill_draft_masks(*args, wait=False).result(30)
            gated.fail = None
            assert list(failed.failed) == [3]
            err = failed.failed[3]
            assert isinstance(err, GrammarError) and isinstance(err.__cause__, RuntimeError)
            assert str(err).startswith("matchers[3]: the matcher raised RuntimeError in its fill of row 0")
            g3 = int(row0[3])
            assert torch.equal(bm[:g3], ref_bm[:g3])
            assert bool((bm[g3:total] == stop_row(v)).all())
            assert torch.equal(bm[total:], before[total:])
            assert np.array_equal(failed.acceptable, [*want.acceptable[:3], 0])
            assert np.array_equal(failed.forced[:3], want.forced[:3]) and not failed.forced[3].any()
            assert [state_of(m, v, [0]) for m in ms] == [state_of(t, v, [0]) for t in twins]
            # The step is retried synchronously once the engine works again.
            got = fill_draft_masks(*args)
        elif kind == "abort":
            gated.fail = Abort
            job = fill_draft_masks(*args, wait=False)
            with pytest.raises(Abort, match="the engine failed"):
                job.result(30)
            gated.fail = None
            assert job.done()
            assert torch.equal(bm, before), "a failed job left rows written"
            assert [state_of(m, v, [0]) for m in ms] == [state_of(t, v, [0]) for t in twins]
            # The step is retried synchronously.
            got = fill_draft_masks(*args)
        elif kind == "sync":
            got = fill_draft_masks(*args)
        elif kind == "job":
            job = fill_draft_masks(*args, wait=False)
            assert isinstance(job, DraftMasksJob)
            got = job.result(30)
            spent, end = job.elapsed(), job.finished_at()
            assert spent is not None and spent > 0
            assert end is not None and end <= time.perf_counter()
        elif kind == "commit-first":
            # The commit comes before result() while the job is still running: it waits for the job.
            gated.gate.clear()
            job = fill_draft_masks(*args, wait=False)
            assert not job.done()
            timer = _later(gated.gate)
            commit_all(took)
            assert job.done()
            got = job.result(30)
            timer.join()
        elif kind == "commit-thread":
            gated.gate.clear()
            job = fill_draft_masks(*args, wait=False)
            worker = threading.Thread(target=commit_all, args=(took,))
            worker.start()
            time.sleep(0.02)
            assert worker.is_alive() and not job.done() and not took, "the commit did not wait for the fill"
            gated.gate.set()
            worker.join(30)
            got = job.result(30)
        else:  # "next-fill-first": a second fill of the same step, issued before the first is done
            gated.gate.clear()
            job = fill_draft_masks(*args, wait=False)
            bm2 = v.new_bitmask(total)
            timer = _later(gated.gate)
            job2 = fill_draft_masks([*ms, gated], drafts, bm2, rows, layout, wait=False)
            assert job.done()
            got = job.result(30)
            second = job2.result(30)
            timer.join()
            assert torch.equal(bm2, ref_bm)
            assert np.array_equal(second.acceptable, want.acceptable)
        if not took:
            commit_all(took)
        assert torch.equal(bm[:total], ref_bm), f"{kind}: rows differ from the synchronous path"
        assert torch.equal(bm[total:], before[total:]), f"{kind}: rows past the step's were written"
        assert np.array_equal(got.request, want.request)
        assert np.array_equal(got.acceptable, want.acceptable)
        assert np.array_equal(got.forced, want.forced)
        ref_took = [commit(t, e) for t, e in zip(twins, emitted, strict=True)]
        assert took == ref_took
        probe = [0, *range(len(v.tokens) - 3, len(v.tokens))]
        assert [state_of(m, v, probe) for m in ms] == [state_of(t, v, probe) for t in twins], kind


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_a_job_holds_its_matchers_until_done(provider: str) -> None:
    """While a job runs: a fill or commit on its matchers waits (also from another thread); others are free."""
    case = make_case(provider, seed=11)
    v = case.v
    gated = Gated(case.make())
    gated.gate.clear()
    ids = ["r0", "r1", "r2", "gate"]
    rows = GrammarRows(ids)
    layout = ScheduledLayout(ids, [*(len(d) for d in case.drafts), 0], [1] * 4)
    bm = v.new_bitmask(rows.num_rows(layout))
    job = fill_draft_masks([*case.ms, gated], [*case.drafts, []], bm, rows, layout, wait=False)
    # A matcher outside the job is free.
    free = case.make()
    assert commit(free, []) == 0
    results: dict[str, Any] = {}

    def other() -> None:
        try:
            results["took"] = commit(case.ms[0], [])
        except MatcherInUse as exc:  # would be a failure: the job is not a call on another thread
            results["error"] = exc

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.02)
    assert t.is_alive() and not job.done()
    gated.gate.set()
    t.join(30)
    assert results == {"took": 0}
    out = job.result(30)
    assert out.request.tolist() == [0, 1, 2, 3]
    assert job.exception() is None and job.done()


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_a_job_with_bad_arguments_is_refused_by_the_call(provider: str) -> None:
    """Arguments are checked before a job starts; nothing is written and no job is returned."""
    case = make_case(provider, seed=12)
    keep = case.bm.clone()
    with pytest.raises(Exception, match=r"^matchers\[1\]: ") as info:
        fill_draft_masks([case.ms[0], case.ms[0], case.ms[2]], case.drafts, case.bm, case.rows, case.layout, wait=False)
    assert type(info.value).__name__ == "GrammarError"
    assert torch.equal(case.bm, keep)
    # The matchers were never claimed: a synchronous call goes through at once.
    fill_draft_masks(case.ms, case.drafts, case.bm, case.rows, case.layout)
