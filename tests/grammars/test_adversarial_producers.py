"""The draft and tree producers under adversarial use: pools, interrupts, shared matchers, odd inputs.

Each case is a bad or hostile use of :func:`maskplug.fill_draft_masks`,
:func:`maskplug.fill_tree_masks` or the grammar pool, checked for the
exact outcome: the named :class:`~maskplug.MaskplugError` with the bitmask
and every matcher untouched, or the result the same call gives without the
hostile part.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from grammar_testkit import PROVIDERS, small_vocab, state_of

from maskplug import (
    GrammarError,
    GrammarRows,
    GrammarSpec,
    MatcherInUse,
    ScheduledLayout,
    commit,
    fill_draft_masks,
    fill_tree_masks,
    grammar_provider,
)
from maskplug.grammar import Vocab
from maskplug.grammar.pools import MAX_THREADS, shared_pool, spread_tasks
from maskplug.trees import DraftTree

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")

# Providers whose matchers release the GIL: their requests are walked on the pool.
POOLED = [p for p in PROVIDERS if p in ("xgrammar", "llguidance")]
VOCAB: Vocab = small_vocab(extra=5)


def _matchers(provider: str, n: int) -> list[Any]:
    g = grammar_provider(provider, VOCAB).compile(GrammarSpec("regex", r"[a-z]{1,6}( [0-9]{1,2}){0,2}"))
    return [g.matcher() for _ in range(n)]


def _grammar_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("maskplug-grammar")]


def test_one_pool_serves_every_size() -> None:
    assert shared_pool(2) is shared_pool(7) is shared_pool(MAX_THREADS * 3)


def test_spread_tasks_keeps_the_thread_count_bounded() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        with lock:
            seen.append(i)

    for workers in [*range(2, 40), 200, 1000]:
        seen.clear()
        spread_tasks(task, workers + 3, workers)
        assert sorted(seen) == list(range(workers + 3))
        assert len(_grammar_threads()) <= MAX_THREADS
    assert all(t.name.startswith("maskplug-") for t in _grammar_threads())


@pytest.mark.parametrize("provider", POOLED)
def test_pooled_walks_of_every_size_reuse_a_bounded_set_of_threads(provider: str) -> None:
    before = threading.active_count()
    y = VOCAB.tokens.index(b"a")
    for size in [2, 9, 3, 17, 5, 33, 12]:
        ms = _matchers(provider, size)
        lay = ScheduledLayout([f"r{i}" for i in range(size)], [2] * size, [1] * size)
        rows = GrammarRows([f"r{i}" for i in range(size)])
        bm = VOCAB.new_bitmask(rows.num_rows(lay))
        for threads in (size, 2 * size + 1, 3):
            dm = fill_draft_masks(ms, [[y, y]] * size, bm, rows, lay, strategy="threads", threads=threads)
            assert dm.acceptable.tolist() == [2] * size
            tm = fill_tree_masks(ms, [[y, y]] * size, bm, rows, DraftTree(lay, [[-1, -1]] * size), threads=threads)
            assert tm.valid.all()
        assert len(_grammar_threads()) <= MAX_THREADS
    # The grammar pool's threads and nothing else have been added (the job pool has at most 4).
    assert threading.active_count() - before <= MAX_THREADS + 4


# --- A matcher that watches its own calls ------------------------------------------------------------------


class Abort(BaseException):
    """What stops production as a whole (as KeyboardInterrupt does), raised from inside a matcher."""


class Watch:
    """Calls in flight over every :class:`Probe` of one test, and the calls made once a call was over."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.calls = 0

    def enter(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.calls += 1

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class Probe:
    """A provider's matcher behind the matcher protocol, counted by a :class:`Watch`.

    ``slow`` seconds pass in every ``fill`` (walkers are mid-walk when
    something stops the call); at the ``at``-th ``fill``, ``on_fill`` runs
    (raises, or interrupts the main thread). ``rollback_fails`` makes
    ``rollback`` raise. No batch operations: the request-by-request walks.
    """

    batch_ops = None

    def __init__(self, inner: Any, watch: Watch, *, gil: bool = True, slow: float = 0.0) -> None:
        self.inner = inner
        self.vocab = inner.vocab
        self.watch = watch
        self.releases_gil = gil
        self.slow = slow
        self.fills = 0
        self.at = 0
        self.on_fill: Any = None
        self.rollback_fails = False

    def _call(self, fn: Any, *a: Any) -> Any:
        self.watch.enter()
        try:
            return fn(*a)
        finally:
            self.watch.leave()

    def fill(self, bitmask: Any, row: int) -> bool:
        def run() -> bool:
            self.fills += 1
            if self.on_fill is not None and self.fills == self.at:
                self.on_fill()
            if self.slow:
                time.sleep(self.slow)
            return bool(self.inner.fill(bitmask, row))

        return bool(self._call(run))

    def accept(self, token: int) -> bool:
        return bool(self._call(self.inner.accept, token))

    def rollback(self, n: int) -> None:
        if self.rollback_fails:
            raise RuntimeError("the engine cannot roll back")
        self._call(self.inner.rollback, n)

    def validate(self, tokens: Sequence[int]) -> int:
        return int(self.inner.validate(tokens))

    def is_terminated(self) -> bool:
        return bool(self._call(self.inner.is_terminated))

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> Any:
        return self.inner.fork()


def _walkable(provider: str, n: int, k: int) -> tuple[list[Any], list[list[int]]]:
    """``n`` fresh matchers of one regex and ``k`` drafts each that the grammar accepts (letters)."""
    ms = _matchers(provider, n)
    letter = VOCAB.tokens.index(b"a")
    return ms, [[letter] * k for _ in range(n)]


def _fingerprints(ms: Sequence[Any]) -> list[tuple[bytes, bool, int]]:
    return [state_of(m, VOCAB, [VOCAB.tokens.index(b"a")] * 7) for m in ms]


def _assert_quiet(watch: Watch) -> None:
    """Nothing runs on the matchers once the call has raised: no call in flight, none started later."""
    assert watch.in_flight == 0
    calls = watch.calls
    time.sleep(0.15)
    assert watch.calls == calls and watch.in_flight == 0


def _interrupt_main() -> None:
    """A real SIGINT to the main thread, handled there (KeyboardInterrupt) while this walker sleeps."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
    time.sleep(0.05)


def _raise_abort() -> None:
    raise Abort("production stopped")


CALLS = ["draft-threads", "draft-job", "tree-chain", "tree-walk", "tree-native"]


def _call(kind: str, ms: Sequence[Any], drafts: list[list[int]], bm: Any, rows: Any, lay: Any) -> Any:
    if kind == "draft-threads":
        return fill_draft_masks(ms, drafts, bm, rows, lay, strategy="threads", threads=4)
    if kind == "draft-job":
        return fill_draft_masks(ms, drafts, bm, rows, lay, strategy="threads", threads=4, wait=False).result(30)
    tree = DraftTree.chain(lay)
    strategy = {"tree-chain": "auto", "tree-walk": "walk", "tree-native": "native"}[kind]
    if kind != "tree-chain":  # a real tree: the root's two children, then a chain below the first
        k = int(lay.num_drafts[0])
        tree = DraftTree(lay, [[-1, -1, *range(1, k - 1)]] * lay.n)
    return fill_tree_masks(ms, drafts, bm, rows, tree, strategy=strategy, threads=4)


# A job runs on its own thread: a signal interrupts the main thread, not the job (whose result() waits).
STOPS = [
    (kind, how) for kind in CALLS for how in ("matcher-raises", "sigint") if (kind, how) != ("draft-job", "sigint")
]


@pytest.mark.parametrize("provider", POOLED)
@pytest.mark.parametrize(("kind", "how"), STOPS)
def test_nothing_runs_after_an_interrupted_pooled_walk(provider: str, kind: str, how: str) -> None:
    """Stopped mid-walk, the call raises only once every walk has ended; the matchers are back and free."""
    n, k = 6, 4
    for trial in range(3):
        watch = Watch()
        inner, drafts = _walkable(provider, n, k)
        ms = [Probe(m, watch, slow=0.01) for m in inner]
        first = trial % n  # which request stops the call
        ms[first].at = 2
        ms[first].on_fill = _interrupt_main if how == "sigint" else _raise_abort
        before = _fingerprints(inner)
        ids = [f"r{i}" for i in range(n)]
        lay = ScheduledLayout(ids, [k] * n, [1] * n)
        rows = GrammarRows(ids)
        bm = VOCAB.new_bitmask(rows.num_rows(lay))
        stop = KeyboardInterrupt if how == "sigint" else Abort
        with pytest.raises(stop):
            _call(kind, ms, drafts, bm, rows, lay)
        _assert_quiet(watch)
        assert _fingerprints(inner) == before
        # The claim is given back: a commit takes its tokens at once.
        a = VOCAB.tokens.index(b"a")
        assert commit(ms[(first + 1) % n], [a, a]) == 2


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("kind", ["draft-serial", "tree-walk"])
def test_a_rollback_that_fails_after_an_interrupt_is_reported(
    provider: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The interrupt is still what the call raises; the matcher left advanced is logged and noted, by index."""
    watch = Watch()
    inner, drafts = _walkable(provider, 2, 3)
    ms = [Probe(m, watch, gil=False) for m in inner]
    ms[1].at = 3  # rows 0 and 1 filled, two drafts accepted: then the interrupt
    ms[1].on_fill = _raise_abort
    ms[1].rollback_fails = True
    lay = ScheduledLayout(["a", "b"], [3, 3], [1, 1])
    rows = GrammarRows(["a", "b"])
    bm = VOCAB.new_bitmask(rows.num_rows(lay))
    with caplog.at_level(logging.ERROR), pytest.raises(Abort) as info:
        if kind == "draft-serial":
            fill_draft_masks(ms, drafts, bm, rows, lay, strategy="serial")
        else:
            fill_tree_masks(ms, drafts, bm, rows, DraftTree.chain(lay), strategy="walk")
    what = "drafts" if kind == "draft-serial" else "tokens"
    expect = (
        f"matchers[1]: rolling back the 2 {what} it had accepted, after the fill was stopped by Abort, raised "
        "RuntimeError (the engine cannot roll back): the matcher is not where it started and should be dropped"
    )
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [expect]
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == [expect]
    # The other request is back where it started; the matchers are free.
    assert _fingerprints(inner[:1]) == _fingerprints(_matchers(provider, 1))
    assert commit(ms[0], [VOCAB.tokens.index(b"a")]) == 1


# --- One matcher, one call: the tree producer claims its matchers as the chain producer does ---------------


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("strategy", ["auto", "native", "walk"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_one_matcher_for_two_tree_requests_is_refused(provider: str, strategy: str, shape: str) -> None:
    (m,), drafts = _walkable(provider, 1, 3)
    before = _fingerprints([m])
    lay = ScheduledLayout(["a", "b"], [3, 3], [1, 1])
    tree = DraftTree.chain(lay) if shape == "chain" else DraftTree(lay, [[-1, -1, 0]] * 2)
    rows = GrammarRows(["a", "b"])
    bm = torch.full((rows.num_rows(lay), VOCAB.mask_words), 7, dtype=torch.int32)
    with pytest.raises(GrammarError, match=r"^matchers\[1\]: expected one matcher per grammar request, got the same "):
        fill_tree_masks([m, m], drafts * 2, bm, rows, tree, strategy=strategy, threads=4)
    assert torch.equal(bm, torch.full_like(bm, 7))
    assert _fingerprints([m]) == before


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("strategy", ["auto", "native", "walk"])
def test_a_tree_fill_refuses_a_matcher_another_call_is_using(provider: str, strategy: str) -> None:
    """While a commit on another thread holds a matcher, a tree fill on it is refused before anything is written."""
    watch = Watch()
    inner, drafts = _walkable(provider, 2, 3)
    ms = [Probe(m, watch, gil=False) for m in inner]
    inside, leave = threading.Event(), threading.Event()

    def held_accept(token: int) -> bool:
        inside.set()
        assert leave.wait(30)
        return bool(inner[0].accept(token))

    ms[0].accept = held_accept  # type: ignore[method-assign]
    a = VOCAB.tokens.index(b"a")
    took: list[int] = []
    t = threading.Thread(target=lambda: took.append(commit(ms[0], [a])))
    t.start()
    try:
        assert inside.wait(30)
        calls = watch.calls
        lay = ScheduledLayout(["a", "b"], [3, 3], [1, 1])
        rows = GrammarRows(["a", "b"])
        bm = torch.full((rows.num_rows(lay), VOCAB.mask_words), 7, dtype=torch.int32)
        with pytest.raises(MatcherInUse, match=r"^matchers\[0\]: expected a matcher no other call is using"):
            fill_tree_masks(ms, drafts, bm, rows, DraftTree(lay, [[-1, -1, 0]] * 2), strategy=strategy)
        assert torch.equal(bm, torch.full_like(bm, 7))
        assert watch.calls == calls
    finally:
        leave.set()
        t.join(30)
    assert took == [1]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_tree_fill_waits_for_the_job_holding_its_matchers(provider: str) -> None:
    """A wait=False chain fill still in flight holds its matchers: the tree fill runs after it, on the same state."""
    watch = Watch()
    inner, drafts = _walkable(provider, 2, 3)
    ms = [Probe(m, watch, gil=False) for m in inner]
    gate = threading.Event()
    ms[1].at = 1
    ms[1].on_fill = lambda: gate.wait(30)
    lay = ScheduledLayout(["a", "b"], [3, 3], [1, 1])
    rows = GrammarRows(["a", "b"])
    bm = VOCAB.new_bitmask(rows.num_rows(lay))
    job = fill_draft_masks(ms, drafts, bm, rows, lay, wait=False)
    threading.Timer(0.1, gate.set).start()
    bm2 = VOCAB.new_bitmask(rows.num_rows(lay))
    got = fill_tree_masks(ms, drafts, bm2, rows, DraftTree.chain(lay), strategy="walk")
    assert job.done()
    assert job.result().acceptable.tolist() == [3, 3]
    assert got.valid.all()
    assert torch.equal(bm, bm2)
