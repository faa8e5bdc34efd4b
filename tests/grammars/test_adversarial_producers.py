"""The draft and tree producers under adversarial use: pools, interrupts, shared matchers, odd inputs.

Each case is a bad or hostile use of :func:`maskplug.fill_draft_masks`,
:func:`maskplug.fill_tree_masks` or the grammar pool, checked for the
exact outcome: the named :class:`~maskplug.MaskplugError` with the bitmask
and every matcher untouched, or the result the same call gives without the
hostile part.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from grammar_testkit import PROVIDERS, small_vocab, state_of

from maskplug import (
    GrammarError,
    GrammarRows,
    GrammarSpec,
    LayoutError,
    MatcherInUse,
    ScheduledLayout,
    commit,
    fill_draft_masks,
    fill_tree_masks,
    grammar_provider,
)
from maskplug.grammar import Vocab
from maskplug.grammar.pools import MAX_THREADS, shared_pool, spread_tasks
from maskplug.grammar.rows import stop_row
from maskplug.grammar.sdk import FailedMatcher
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


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` on the main thread during the test, as in a fresh interpreter.

    Whatever ran before in this process (a library that installs its own SIGINT handler in C,
    ``faulthandler.register(SIGINT)``, or SIGINT left blocked) would keep the signal from ever
    becoming an exception, and the walk would end as if never interrupted. Python's own handler
    is installed for the test and SIGINT unblocked on the main thread; both are put back after.
    """
    before = signal.getsignal(signal.SIGINT)
    was_blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)
        if was_blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


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
def test_nothing_runs_after_an_interrupted_pooled_walk(provider: str, kind: str, how: str, sigint_raises: None) -> None:
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


# --- Chains and trees agree on chain-shaped input ----------------------------------------------------------


class NotAMatcher:
    """Has a fill but not the matcher protocol."""

    def fill(self, bitmask: Any, row: int) -> bool:
        raise AssertionError("never called")


Call = dict[str, Any]


def _with(**change: Any) -> Any:
    return lambda call: {**call, **{k: (v(call) if callable(v) else v) for k, v in change.items()}}


_A = VOCAB.tokens.index(b"a")
# (name, the good call changed, error class, message as fill_draft_masks words it).
BAD_INPUTS: list[tuple[str, Any, type[Exception], str]] = [
    (
        "same matcher twice",
        _with(matchers=lambda c: [c["matchers"][0]] * 2),
        GrammarError,
        r"matchers\[1\]: expected one matcher per grammar request, got the same matcher as matchers\[0\]$",
    ),
    (
        "not a matcher",
        _with(matchers=lambda c: [NotAMatcher(), c["matchers"][1]]),
        GrammarError,
        r"matchers\[0\]: expected a Matcher, got NotAMatcher$",
    ),
    ("a string", _with(matchers="ab"), GrammarError, r"matchers: expected a sequence of matchers"),
    ("None", _with(matchers=None), GrammarError, r"matchers: expected a sequence of matchers"),
    (
        "one short",
        _with(matchers=lambda c: c["matchers"][:1]),
        LayoutError,
        r"matchers: expected 2 \(one per grammar request\), got 1$",
    ),
    ("negative threads", _with(threads=-1), LayoutError, r"threads: expected None or an int >= 0, got -1$"),
    ("bool threads", _with(threads=True), LayoutError, r"threads: expected None or an int >= 0, got True$"),
    ("str threads", _with(threads="2"), LayoutError, r"threads: expected None or an int >= 0, got '2'$"),
    ("float threads", _with(threads=2.5), LayoutError, r"threads: expected None or an int >= 0, got 2.5$"),
    (
        "float drafts",
        _with(drafts=[np.ones(3), [_A] * 3]),
        LayoutError,
        r"drafts\[0\]: expected a 1-D sequence of token ids, got shape \(3,\) float64$",
    ),
    (
        "bool drafts",
        _with(drafts=[np.ones(3, dtype=bool), [_A] * 3]),
        LayoutError,
        r"drafts\[0\]: expected a 1-D sequence of token ids, got shape \(3,\) bool$",
    ),
    ("float flat", _with(drafts=np.zeros(6)), LayoutError, r"drafts: expected integer token ids, got dtype float64$"),
    (
        "2-D tensor",
        _with(drafts=torch.zeros(2, 3, dtype=torch.int64)),
        LayoutError,
        r"drafts: expected one token sequence per grammar request or a flat 1-D array, got a 2-D Tensor",
    ),
    (
        "short drafts",
        _with(drafts=[[_A] * 2, [_A] * 3]),
        LayoutError,
        r"drafts\[0\]: expected num_drafts = 3 tokens for request 'a', got 2$",
    ),
    ("no drafts", _with(drafts=None), LayoutError, r"drafts: expected one token sequence per grammar request"),
    (
        "float bitmask",
        _with(bitmask=lambda c: c["bitmask"].float()),
        GrammarError,
        r"bitmask: expected dtype torch.int32, got torch.float32$",
    ),
    (
        "strided bitmask",
        _with(bitmask=lambda c: torch.zeros(8, 2 * VOCAB.mask_words, dtype=torch.int32)[:, ::2]),
        GrammarError,
        r"bitmask: expected a contiguous tensor",
    ),
    (
        "short bitmask",
        _with(bitmask=lambda c: c["bitmask"][:-1]),
        GrammarError,
        r"row: expected a row in \[0, 7\), got 7$",
    ),
    ("rows", _with(rows="rows"), LayoutError, r"rows: expected a GrammarRows, got str$"),
]


def _run(producer: str, call: Call, lay: ScheduledLayout) -> Any:
    args = (call["matchers"], call["drafts"], call["bitmask"], call["rows"])
    if producer == "chain":
        return fill_draft_masks(*args, lay, threads=call.get("threads"))
    tree = DraftTree.chain(lay)
    return fill_tree_masks(*args, tree, threads=call.get("threads"), strategy=producer)


PRODUCERS = ["chain", "auto", "native", "walk"]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(("name", "change", "exc", "msg"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_chains_and_trees_refuse_the_same_arguments_the_same_way(
    provider: str, name: str, change: Any, exc: type[Exception], msg: str
) -> None:
    """Every bad argument: the same error from both producers (the tokens named as each call names them)."""
    lay = ScheduledLayout(["a", "b"], [3, 3], [1, 1])
    rows = GrammarRows(["a", "b"])
    for producer in PRODUCERS:
        ms = _matchers(provider, 2)
        before = _fingerprints(ms)
        bm = torch.full((rows.num_rows(lay), VOCAB.mask_words), 7, dtype=torch.int32)
        call = change({"matchers": ms, "drafts": [[_A] * 3] * 2, "bitmask": bm, "rows": rows})
        with pytest.raises(exc) as info:
            _run(producer, call, lay)
        want = msg if producer == "chain" else re.sub(r"^drafts", "tokens", msg)
        assert re.match(want, str(info.value)), (producer, str(info.value))
        assert torch.equal(bm, torch.full_like(bm, 7)), producer
        assert _fingerprints(ms) == before, producer


def _stop_token() -> int:
    return int(VOCAB.eos_ids[0])


def _terminated(provider: str) -> Any:
    m = _matchers(provider, 1)[0]
    for t in [_A, _stop_token()]:
        assert m.accept(t)
    assert m.is_terminated()
    return m


SPACE, DIGIT = VOCAB.tokens.index(b" "), VOCAB.tokens.index(b"7")
# (name, per request: a matcher maker and its drafts; the drafts' form): chain-shaped inputs both producers serve.
GOOD_INPUTS: list[tuple[str, Any, Any]] = [
    ("accepted", lambda p: _matchers(p, 2), [[_A, _A, _A], [_A, SPACE, DIGIT]]),
    ("refused mid-chain", lambda p: _matchers(p, 2), [[_A, DIGIT, _A], [SPACE, _A, _A]]),
    ("stop mid-chain", lambda p: _matchers(p, 2), [[_A, _stop_token(), _A], [_A, _A, _stop_token()]]),
    ("out of vocabulary", lambda p: _matchers(p, 2), [[_A, VOCAB.vocab_size, _A], [_A, _A, _A]]),
    ("negative id", lambda p: _matchers(p, 2), [[_A, _A, _A], [-1, _A, _A]]),
    ("terminated", lambda p: [_terminated(p), *_matchers(p, 1)], [[_A, _A, _A], [_A, _A, _A]]),
    ("terminated, stop drafted", lambda p: [_terminated(p), *_matchers(p, 1)], [[_stop_token()] * 3, [_A] * 3]),
    ("failed grammar", lambda p: [FailedMatcher(VOCAB, "it did not compile"), *_matchers(p, 1)], [[_A] * 3] * 2),
    ("failed, no vocabulary", lambda p: [FailedMatcher(None, "gone"), *_matchers(p, 1)], [[_A] * 3] * 2),
    ("empty drafts", lambda p: _matchers(p, 2), [[], []]),
    ("one empty", lambda p: _matchers(p, 2), [[], [_A, _A, _A]]),
    ("empty, terminated", lambda p: [_terminated(p), *_matchers(p, 1)], [[], []]),
]
FORMS = ["lists", "uint8 arrays", "int8 flat", "int32 flat tensor", "tensors", "numpy ints", "tuples", "empty flat"]


def _form(drafts: list[list[int]], form: str) -> Any:
    if any(t < 0 or t > 127 for d in drafts for t in d) and form in ("uint8 arrays", "int8 flat"):
        form = "lists"  # ids these dtypes cannot hold
    flat = [t for d in drafts for t in d]
    if form == "empty flat":
        return [] if not flat else drafts
    makers: dict[str, Any] = {
        "lists": lambda: drafts,
        "uint8 arrays": lambda: [np.array(d, dtype=np.uint8) for d in drafts],
        "int8 flat": lambda: np.array(flat, dtype=np.int8),
        "int32 flat tensor": lambda: torch.tensor(flat, dtype=torch.int32),
        "tensors": lambda: [torch.tensor(d, dtype=torch.int64) for d in drafts],
        "numpy ints": lambda: [[np.int32(t) for t in d] for d in drafts],
        "tuples": lambda: tuple(tuple(d) for d in drafts),
    }
    return makers[form]()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(("name", "make", "drafts"), GOOD_INPUTS, ids=[g[0] for g in GOOD_INPUTS])
def test_chains_and_trees_serve_chain_shaped_input_alike(provider: str, name: str, make: Any, drafts: Any) -> None:
    """Same rows, the same accepted prefix, forced flags and failures from both producers, in every input form."""
    for nb in (1, 0, 2):
        lay = ScheduledLayout(["a", "b"], [len(d) for d in drafts], [1, 1], num_bonus=nb)
        rows = GrammarRows(["b", "a"])
        ordered = [drafts[1], drafts[0]]
        for form in FORMS:
            ms = make(provider)[::-1]
            ref_bm = torch.full((rows.num_rows(lay) + 1, VOCAB.mask_words), 7, dtype=torch.int32)
            want = fill_draft_masks(ms, _form(ordered, form), ref_bm, rows, lay)
            k = lay.num_drafts[want.request]
            for strategy in ("auto", "native", "walk"):
                ms = make(provider)[::-1]
                before = _fingerprints([m for m in ms if not isinstance(m, FailedMatcher)])
                bm = torch.full_like(ref_bm, 7)
                got = fill_tree_masks(ms, _form(ordered, form), bm, rows, DraftTree.chain(lay), strategy=strategy)
                where = (name, nb, form, strategy)
                assert torch.equal(bm, ref_bm), where
                assert got.request.tolist() == want.request.tolist(), where
                width = int(k.max()) if k.size else 0
                cols = np.arange(width)[None, :]
                assert np.array_equal(got.valid[:, :width], cols < want.acceptable[:, None]), where
                assert np.array_equal(got.forced[:, :width], want.forced[:, :width] & (cols < want.acceptable[:, None]))
                assert {r: re.sub(r"^tokens", "drafts", str(e)) for r, e in got.failed.items()} == {
                    r: str(e) for r, e in want.failed.items()
                }, where
                assert _fingerprints([m for m in ms if not isinstance(m, FailedMatcher)]) == before, where


class LoopOps:
    """Batch operations as loops over the matchers (so the position-major walk runs on any provider)."""

    def fill(self, matchers: Sequence[Any], bitmask: Any, rows: Sequence[int]) -> None:
        for m, r in zip(matchers, rows, strict=True):
            m.fill(bitmask, r)

    def accept(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        return [m.accept(t) for m, t in zip(matchers, tokens, strict=True)]

    def rollback(self, matchers: Sequence[Any], counts: Sequence[int]) -> None:
        for m, k in zip(matchers, counts, strict=True):
            m.rollback(k)


class Counted(Probe):
    """A :class:`Probe` with batch operations and a ``num_accepted`` that raises when ``count_fails``."""

    batch_ops = LoopOps()  # type: ignore[assignment]

    def __init__(self, inner: Any, watch: Watch) -> None:
        super().__init__(inner, watch, gil=False)
        self.count_fails = False
        self.taken = 0

    @property
    def num_accepted(self) -> int:
        if self.count_fails:
            raise RuntimeError("the engine lost its count")
        return self.taken


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("bad", [0, 2])
def test_a_num_accepted_that_raises_fails_its_request_alone(provider: str, bad: int) -> None:
    inner, _ = _walkable(provider, 3, 3)
    ms = [Counted(m, Watch()) for m in inner]
    ms[bad].count_fails = True
    drafts = [[_A, _A, _A], [_A, SPACE, DIGIT], [_A, DIGIT, _A]]
    lay = ScheduledLayout(["a", "b", "c"], [3, 3, 3], [1, 1, 1])
    rows = GrammarRows(["a", "b", "c"])
    before = _fingerprints(inner)
    bm = VOCAB.new_bitmask(rows.num_rows(lay))
    got = fill_draft_masks(ms, drafts, bm, rows, lay, strategy="batch")
    assert list(got.failed) == [bad]
    assert str(got.failed[bad]) == (
        f"matchers[{bad}]: the matcher raised RuntimeError in num_accepted: the engine lost its count"
    )
    assert isinstance(got.failed[bad].__cause__, RuntimeError)
    assert _fingerprints(inner) == before
    ref_bm = VOCAB.new_bitmask(rows.num_rows(lay))
    want = fill_draft_masks(_matchers(provider, 3), drafts, ref_bm, rows, lay, strategy="serial")
    for g in range(3):
        span = slice(4 * g, 4 * g + 4)
        if g == bad:
            assert torch.equal(bm[span], stop_row(VOCAB).expand(4, -1)), g
            assert got.acceptable[g] == 0 and not got.forced[g].any()
        else:
            assert torch.equal(bm[span], ref_bm[span]), g
            assert got.acceptable[g] == want.acceptable[g] and got.forced[g].tolist() == want.forced[g].tolist()
