"""Bad input, misuse and concurrency against fill_draft_masks and commit: refused by name, nothing written.

Table-driven by class of mistake (each case asserts the error type, that the
message names the argument, and that the bitmask rows and every matcher's
state are bit-identical after the refused call), on every registered
provider and on the SDK's pure-Python provider of ``test_grammar_sdk``.
"""

from __future__ import annotations

import logging
import random
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from grammar_testkit import PROVIDERS, REGEXES, compiled, random_walk, reference_rows, small_vocab, state_of, vocab
from test_grammar_sdk import WORDS, PrefixProvider

from maskplug import (
    DraftMasks,
    GrammarError,
    GrammarRows,
    GrammarSpec,
    LayoutError,
    MaskplugError,
    MatcherInUse,
    ScheduledLayout,
    commit,
    fill_draft_masks,
)
from maskplug.grammar import Matcher, Vocab
from maskplug.grammar.rows import stop_row

ALL_PROVIDERS = [*PROVIDERS, "sdk-prefix"]
STRATEGIES = ["auto", "chains", "batch", "threads", "serial"]


@dataclass
class Case:
    """Three grammar requests of one provider, their drafts and a bitmask of random words."""

    v: Vocab
    ms: list[Matcher]
    drafts: list[list[int]]
    layout: ScheduledLayout
    rows: GrammarRows
    bm: torch.Tensor
    probes: list[list[int]]
    make: Callable[[], Matcher]

    def snapshot(self) -> tuple[torch.Tensor, list[Any]]:
        return self.bm.clone(), [state_of(m, self.v, p) for m, p in zip(self.ms, self.probes, strict=True)]

    def kwargs(self, **over: Any) -> dict[str, Any]:
        base = dict(matchers=self.ms, drafts=self.drafts, bitmask=self.bm, rows=self.rows, layout=self.layout)
        base.update(over)
        return base


def make_case(provider: str, seed: int = 0, n: int = 3) -> Case:
    rng = random.Random(seed)
    if provider == "sdk-prefix":
        p = PrefixProvider(small_vocab(extra=5, eos=(0,)))
        v = p.vocab
        grammar = p.compile(GrammarSpec("choice", WORDS))
        make: Callable[[], Matcher] = grammar.matcher
    else:
        v = vocab("spm")
        g = compiled(provider, "spm", GrammarSpec("regex", REGEXES[0]))
        make = g.matcher
    ms = [make() for _ in range(n)]
    pre = random_walk(ms[0], v, rng, 1, stop=False)  # one request starts mid-text
    for t in pre:
        assert ms[0].accept(t)
    drafts = [random_walk(m, v, rng, 3, stop=False) for m in ms]
    if not drafts[0] and pre:  # nothing follows that start: begin at the start instead
        ms[0].rollback(len(pre))
        drafts[0] = random_walk(ms[0], v, rng, 3, stop=False)
    assert all(drafts), "every request has a draft to corrupt"
    ids = [f"r{i}" for i in range(n)]
    layout = ScheduledLayout(ids, [len(d) for d in drafts], [1] * n)
    rows = GrammarRows(ids)
    bm = torch.randint(-(2**31), 2**31 - 1, (rows.num_rows(layout) + 1, v.mask_words), dtype=torch.int32)
    return Case(v, ms, drafts, layout, rows, bm, [[*d, 0] for d in drafts], make)


def refused(case: Case, call: Callable[[], Any], exc: type[BaseException], arg: str) -> None:
    """``call`` raises ``exc`` naming ``arg`` first, and leaves the rows and every matcher bit-identical."""
    bm0, states0 = case.snapshot()
    with pytest.raises(exc) as info:
        call()
    assert isinstance(info.value, MaskplugError)
    assert re.match(rf"{re.escape(arg)}: ", str(info.value)), str(info.value)
    bm1, states1 = case.snapshot()
    assert torch.equal(bm0, bm1), "rows were written by a refused call"
    assert states0 == states1, "a matcher moved in a refused call"


# ---------------------------------------------------------------- argument checks before any write

# (id, keyword overrides built from the case, error type, the argument named)
BAD_FILL: list[tuple[str, Callable[[Case], dict[str, Any]], type[MaskplugError], str]] = [
    # a matcher that is not one: checked before the first row (it used to write, then fail)
    ("none-last", lambda c: {"matchers": [*c.ms[:2], None]}, GrammarError, "matchers[2]"),
    ("none-first", lambda c: {"matchers": [None, *c.ms[1:]]}, GrammarError, "matchers[0]"),
    ("str-middle", lambda c: {"matchers": [c.ms[0], "m", c.ms[2]]}, GrammarError, "matchers[1]"),
    ("not-a-sequence", lambda c: {"matchers": None}, GrammarError, "matchers"),
    ("too-few", lambda c: {"matchers": c.ms[:2]}, LayoutError, "matchers"),
    # threads
    ("threads-str", lambda c: {"threads": "x"}, LayoutError, "threads"),
    ("threads-negative", lambda c: {"threads": -1}, LayoutError, "threads"),
    ("threads-float", lambda c: {"threads": 1.5}, LayoutError, "threads"),
    ("threads-bool", lambda c: {"threads": True}, LayoutError, "threads"),
    # strategy, rows, layout
    ("strategy-unknown", lambda c: {"strategy": "fast"}, LayoutError, "strategy"),
    ("strategy-not-str", lambda c: {"strategy": ["auto"]}, LayoutError, "strategy"),
    ("rows-none", lambda c: {"rows": None}, LayoutError, "rows"),
    ("layout-dict", lambda c: {"layout": {}}, LayoutError, "layout"),
    # drafts
    ("drafts-short", lambda c: {"drafts": c.drafts[:2]}, LayoutError, "drafts"),
    ("drafts-str", lambda c: {"drafts": "abc"}, LayoutError, "drafts"),
    ("drafts-float", lambda c: {"drafts": [[0.5] * len(d) for d in c.drafts]}, LayoutError, "drafts[0]"),
    # bitmask
    ("bitmask-int64", lambda c: {"bitmask": c.bm.long()}, GrammarError, "bitmask"),
    ("bitmask-short", lambda c: {"bitmask": c.bm[:1]}, GrammarError, "row"),
    ("bitmask-numpy", lambda c: {"bitmask": c.bm.numpy()}, GrammarError, "bitmask"),
    # active_from
    ("gate-short", lambda c: {"active_from": [0]}, LayoutError, "active_from"),
    ("gate-negative", lambda c: {"active_from": [0, -1, 0]}, LayoutError, "active_from"),
    ("gate-float", lambda c: {"active_from": [0.5, 0, 0]}, LayoutError, "active_from"),
]


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
@pytest.mark.parametrize(("name", "over", "exc", "arg"), BAD_FILL, ids=[c[0] for c in BAD_FILL])
def test_bad_fill_arguments_are_refused_before_any_write(
    provider: str, name: str, over: Callable[[Case], dict[str, Any]], exc: type[MaskplugError], arg: str
) -> None:
    case = make_case(provider)
    kwargs = case.kwargs(**over(case))
    refused(case, lambda: fill_draft_masks(**kwargs), exc, arg)
    # wait=False checks the same arguments in the call itself, before a job starts.
    refused(case, lambda: fill_draft_masks(**kwargs, wait=False), exc, arg)


# ---------------------------------------------------------------- a bad draft id fails its request alone

# (id, the drafts given the case, the request that fails, the error's start)
BAD_IDS: list[tuple[str, Callable[[Case], list[list[int]]], int, Callable[[Case], str]]] = [
    (
        "out-of-vocab",
        lambda c: [c.drafts[0], [c.v.vocab_size] * len(c.drafts[1]), c.drafts[2]],
        1,
        lambda c: f"drafts[1][0]: expected a token id in [0, {c.v.vocab_size}), got {c.v.vocab_size}",
    ),
    (
        "negative-last",
        lambda c: [c.drafts[0], c.drafts[1], [*c.drafts[2][:-1], -1]],
        2,
        lambda c: f"drafts[2][{len(c.drafts[2]) - 1}]: expected a token id in [0, {c.v.vocab_size}), got -1",
    ),
]


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("name", "bad", "g", "msg"), BAD_IDS, ids=[c[0] for c in BAD_IDS])
def test_a_bad_draft_id_fails_its_request_alone(
    provider: str,
    strategy: str,
    name: str,
    bad: Callable[[Case], list[list[int]]],
    g: int,
    msg: Callable[[Case], str],
) -> None:
    """Stop-only rows and ``failed`` for that request; the others as in the batch without it; no matcher moves."""
    case = make_case(provider)
    drafts = bad(case)
    _, states0 = case.snapshot()
    # The same batch without the bad request, for the others' rows.
    keep = [i for i in range(3) if i != g]
    ids = [f"r{i}" for i in keep]
    lay = ScheduledLayout(ids, [len(case.drafts[i]) for i in keep], [1] * 2)
    want_bm = case.v.new_bitmask(GrammarRows(ids).num_rows(lay))
    want = fill_draft_masks([case.ms[i] for i in keep], [case.drafts[i] for i in keep], want_bm, GrammarRows(ids), lay)
    stop = stop_row(case.v)
    for wait in (True, False):
        bm = case.bm.clone()
        res = fill_draft_masks(**case.kwargs(drafts=drafts, bitmask=bm, strategy=strategy), wait=wait)
        out = res if isinstance(res, DraftMasks) else res.result(30)
        assert list(out.failed) == [g]
        assert str(out.failed[g]).startswith(msg(case)), str(out.failed[g])
        assert isinstance(out.failed[g], GrammarError)
        row0 = np.concatenate([[0], np.cumsum([len(d) + 1 for d in case.drafts])])
        for j, i in enumerate(keep):
            n = len(case.drafts[i]) + 1
            w0 = sum(len(case.drafts[k]) + 1 for k in keep[:j])
            assert torch.equal(bm[row0[i] : row0[i] + n], want_bm[w0 : w0 + n])
            assert int(out.acceptable[i]) == int(want.acceptable[j])
            assert out.forced[i, :n].tolist() == want.forced[j, :n].tolist()
        for p in range(len(case.drafts[g]) + 1):
            assert torch.equal(bm[row0[g] + p], stop)
        assert int(out.acceptable[g]) == 0 and not out.forced[g].any()
        assert torch.equal(bm[row0[-1] :], case.bm[row0[-1] :]), "a row past the batch's was written"
        assert case.snapshot()[1] == states0


# ---------------------------------------------------------------- one matcher for two requests

DUPLICATES: list[tuple[str, Callable[[list[Matcher]], list[Matcher]], str]] = [
    ("first-twice", lambda ms: [ms[0], ms[0], ms[2]], "matchers[1]"),
    ("first-and-last", lambda ms: [ms[0], ms[1], ms[0]], "matchers[2]"),
    ("last-twice", lambda ms: [ms[0], ms[1], ms[1]], "matchers[2]"),
    ("all-three", lambda ms: [ms[2], ms[2], ms[2]], "matchers[1]"),
]


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("name", "pick", "arg"), DUPLICATES, ids=[c[0] for c in DUPLICATES])
def test_one_matcher_for_two_requests_is_refused(
    provider: str, strategy: str, name: str, pick: Callable[[list[Matcher]], list[Matcher]], arg: str
) -> None:
    case = make_case(provider, seed=1)
    kwargs = case.kwargs(matchers=pick(case.ms), strategy=strategy)
    refused(case, lambda: fill_draft_masks(**kwargs), GrammarError, arg)
    refused(case, lambda: fill_draft_masks(**kwargs, wait=False), GrammarError, arg)


# ---------------------------------------------------------------- commit


BAD_COMMIT: list[tuple[str, Callable[[Case], tuple[Any, Any]], type[MaskplugError], str]] = [
    ("matcher-none", lambda c: (None, c.drafts[0]), GrammarError, "matcher"),
    ("matcher-str", lambda c: ("m", c.drafts[0]), GrammarError, "matcher"),
    ("matcher-list", lambda c: (c.ms, c.drafts[0]), GrammarError, "matcher"),
    ("tokens-none", lambda c: (c.ms[0], None), GrammarError, "tokens"),
    ("tokens-str", lambda c: (c.ms[0], "ab"), GrammarError, "tokens"),
    ("tokens-2d", lambda c: (c.ms[0], [c.drafts[0]]), GrammarError, "tokens"),
    ("tokens-float", lambda c: (c.ms[0], [1.5]), GrammarError, "tokens"),
    ("tokens-out-of-vocab", lambda c: (c.ms[1], [0, c.v.vocab_size]), GrammarError, "tokens[1]"),
    ("tokens-negative", lambda c: (c.ms[2], [-3]), GrammarError, "tokens[0]"),
]


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
@pytest.mark.parametrize(("name", "args", "exc", "arg"), BAD_COMMIT, ids=[c[0] for c in BAD_COMMIT])
def test_bad_commit_arguments_are_refused_before_the_matcher_moves(
    provider: str, name: str, args: Callable[[Case], tuple[Any, Any]], exc: type[MaskplugError], arg: str
) -> None:
    case = make_case(provider, seed=2)
    m, toks = args(case)
    refused(case, lambda: commit(m, toks), exc, arg)


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_commit_takes_valid_tokens_and_an_empty_list(provider: str) -> None:
    case = make_case(provider, seed=3)
    m, d = case.ms[1], case.drafts[1]
    before = state_of(m, case.v, [0])
    assert commit(m, []) == 0
    assert commit(m, np.zeros(0, dtype=np.int64)) == 0
    assert state_of(m, case.v, [0]) == before
    assert commit(m, d) == len(d)
    m.rollback(len(d))
    assert state_of(m, case.v, [0]) == before


# ---------------------------------------------------------------- drafts=[] without drafts


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "drafts", [[], np.zeros(0, dtype=np.int64), [[], [], []]], ids=["list", "array", "per-request"]
)
def test_a_batch_without_drafts_takes_an_empty_drafts_list(provider: str, strategy: str, drafts: Any) -> None:
    case = make_case(provider, seed=4)
    ids = [f"r{i}" for i in range(3)]
    layout = ScheduledLayout(ids, [0, 0, 0], [1] * 3, num_bonus=2)
    bm = case.v.new_bitmask(case.rows.num_rows(layout))
    refs = [reference_rows(m, case.v, [], 2, 0) for m in case.ms]
    out = fill_draft_masks(case.ms, drafts, bm, case.rows, layout, strategy=strategy)
    assert out.acceptable.tolist() == [0, 0, 0]
    for g, ref in enumerate(refs):
        for p, want in enumerate(ref.rows):
            np.testing.assert_array_equal(bm[2 * g + p].numpy(), want)
            assert bool(out.forced[g, p]) == ref.forced[p]


# ---------------------------------------------------------------- a matcher in use on another thread


class Blocking:
    """A matcher that, once inside ``fill``, waits until the test lets it go (it holds its call meanwhile)."""

    def __init__(self, inner: Matcher) -> None:
        self.inner = inner
        self.vocab = getattr(inner, "vocab", None)
        self.entered = threading.Event()
        self.go = threading.Event()

    def accept(self, token: int) -> bool:
        return self.inner.accept(token)

    def validate(self, tokens: Sequence[int]) -> int:
        return self.inner.validate(tokens)

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        self.entered.set()
        assert self.go.wait(30)
        return self.inner.fill(bitmask, row)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> Matcher:
        return self.inner.fork()


IN_USE: list[tuple[str, Callable[[Case, Case], Callable[[], Any]], str]] = [
    # (id, the second call, given the busy case and a second case of fresh matchers; the argument named)
    (
        "fill-first",
        lambda busy, other: lambda: fill_draft_masks(**other.kwargs(matchers=[busy.ms[1], *other.ms[1:]])),
        "matchers[0]",
    ),
    (
        "fill-last",
        lambda busy, other: lambda: fill_draft_masks(**other.kwargs(matchers=[*other.ms[:2], busy.ms[2]])),
        "matchers[2]",
    ),
    (
        "fill-job",
        lambda busy, other: (
            lambda: fill_draft_masks(**other.kwargs(matchers=[other.ms[0], busy.ms[1], other.ms[2]]), wait=False)
        ),
        "matchers[1]",
    ),
    ("commit", lambda busy, other: lambda: commit(busy.ms[1], busy.drafts[1]), "matcher"),
]


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
@pytest.mark.parametrize(("name", "second", "arg"), IN_USE, ids=[c[0] for c in IN_USE])
def test_a_matcher_another_thread_is_using_is_refused(
    provider: str, name: str, second: Callable[[Case, Case], Callable[[], Any]], arg: str
) -> None:
    busy = make_case(provider, seed=5)
    other = make_case(provider, seed=6)
    # The other case's drafts must fit the busy matchers given in its place: give them no drafts.
    ids = [f"r{i}" for i in range(3)]
    other.layout = ScheduledLayout(ids, [0, 0, 0], [1] * 3)
    other.drafts = [[], [], []]
    blocker = Blocking(busy.ms[0])
    first_bm = busy.bm.clone()
    states0 = [state_of(m, busy.v, p) for m, p in zip(busy.ms, busy.probes, strict=True)]
    result: list[Any] = []
    worker = threading.Thread(
        target=lambda: result.append(fill_draft_masks(**busy.kwargs(matchers=[blocker, *busy.ms[1:]])))
    )
    worker.start()
    try:
        assert blocker.entered.wait(30)
        # The busy matchers are held by the running call: refused, nothing written anywhere.
        refused(other, second(busy, other), MatcherInUse, arg)
    finally:
        blocker.go.set()
        worker.join(30)
    assert len(result) == 1, "the first call failed"
    assert [state_of(m, busy.v, p) for m, p in zip(busy.ms, busy.probes, strict=True)] == states0
    assert not torch.equal(busy.bm, first_bm) or busy.bm.shape[0] == 0
    # Given back: the same call now goes through.
    second(busy, other)()


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_two_threads_racing_on_one_matcher_never_corrupt_it(provider: str) -> None:
    """Every call either gives the synchronous rows or is refused by name; the matchers end where they started."""
    case = make_case(provider, seed=7)
    want_bm = case.v.new_bitmask(case.bm.shape[0])
    want = fill_draft_masks(case.ms, case.drafts, want_bm, case.rows, case.layout)
    total = case.rows.num_rows(case.layout)
    states0 = [state_of(m, case.v, p) for m, p in zip(case.ms, case.probes, strict=True)]
    errors: list[BaseException] = []
    counts = {"ok": 0, "refused": 0}
    lock = threading.Lock()

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        bm = case.v.new_bitmask(case.bm.shape[0])
        for _ in range(60):
            try:
                if rng.random() < 0.2:
                    g = rng.randrange(3)
                    commit(case.ms[g], [])
                    ok = True
                else:
                    got = fill_draft_masks(case.ms, case.drafts, bm, case.rows, case.layout, threads=2)
                    ok = torch.equal(bm[:total], want_bm[:total]) and np.array_equal(got.acceptable, want.acceptable)
                    if not ok:
                        errors.append(AssertionError("rows or acceptable counts differ from the synchronous call"))
                with lock:
                    counts["ok"] += 1
            except MatcherInUse:
                with lock:
                    counts["refused"] += 1
            except BaseException as exc:  # anything else is a failure
                errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert counts["ok"] + counts["refused"] == 180 and counts["ok"] > 0
    assert [state_of(m, case.v, p) for m, p in zip(case.ms, case.probes, strict=True)] == states0


class _RollbackFails:
    """Batch operations as loops over the matchers whose batch ``rollback`` raises before moving any."""

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        for m, r in zip(matchers, rows, strict=True):
            m.fill(bitmask, r)

    def accept(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        return [m.accept(int(t)) for m, t in zip(matchers, tokens, strict=True)]

    def rollback(self, matchers: Sequence[Any], counts: Sequence[int]) -> None:
        raise RuntimeError("the batch rollback is out of order")


class _OnOps:
    """A provider's matcher offered with other batch operations."""

    def __init__(self, inner: Any, ops: Any) -> None:
        self.inner, self.batch_ops, self.vocab = inner, ops, inner.vocab

    def accept(self, token: int) -> bool:
        return bool(self.inner.accept(token))

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        return bool(self.inner.fill(bitmask, row))

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())

    def validate(self, tokens: Sequence[int]) -> int:
        return int(self.inner.validate(tokens))

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> Matcher:
        return _OnOps(self.inner.fork(), self.batch_ops)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_batch_rollback_that_raises_is_logged_and_undone_one_at_a_time(
    provider: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing fails: each matcher is rolled back by itself, the warning names the operation and the count."""
    v = vocab("spm")
    rng = random.Random(5)
    inner = [compiled(provider, "spm", GrammarSpec("regex", REGEXES[g % len(REGEXES)])).matcher() for g in range(3)]
    drafts = [random_walk(m, v, rng, 3, stop=False) for m in inner]
    lay = ScheduledLayout(["a", "b", "c"], [len(d) for d in drafts], [1, 1, 1])
    rows = GrammarRows(["a", "b", "c"])
    probes = [[*d, 0] for d in drafts]
    before = [state_of(m, v, p) for m, p in zip(inner, probes, strict=True)]
    want_bm = v.new_bitmask(rows.num_rows(lay))
    want = fill_draft_masks(inner, drafts, want_bm, rows, lay, strategy="serial")
    ops = _RollbackFails()
    bm = v.new_bitmask(rows.num_rows(lay))
    with caplog.at_level(logging.WARNING, logger="maskplug.draft"):
        got = fill_draft_masks([_OnOps(m, ops) for m in inner], drafts, bm, rows, lay, strategy="batch")
    assert not got.failed
    assert torch.equal(bm, want_bm)
    assert got.acceptable.tolist() == want.acceptable.tolist() and got.forced.tolist() == want.forced.tolist()
    assert [state_of(m, v, p) for m, p in zip(inner, probes, strict=True)] == before
    moved = sum(1 for a in want.acceptable.tolist() if a)
    logged = [r.getMessage() for r in caplog.records if r.name == "maskplug.draft"]
    assert logged == [
        f"_RollbackFails.rollback raised RuntimeError for {moved} grammar requests "
        "(the batch rollback is out of order); rolling them back one at a time"
    ]
