"""The engine SDK (maskplug.engines.sdk): patch bookkeeping, guarded grammars, the serial window fill."""

from __future__ import annotations

import functools
import sys
import threading
import types
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from maskplug import (
    GrammarError,
    GrammarRows,
    LayoutError,
    MatcherInUse,
    PluginError,
    ScheduledLayout,
    fill_draft_masks,
)
from maskplug.engines import sdk as engine_sdk
from maskplug.engines.sdk import (
    GuardedGrammar,
    PatchSet,
    accept_emitted,
    draft_validator,
    emitted_acceptor,
    fill_windows_serially,
    ragged_mapping,
    wraps,
)
from maskplug.grammar import serial
from maskplug.grammar.jobs import claim, release
from maskplug.grammar.sdk import (
    FailedMatcher,
    GrammarSpec,
    MatcherBase,
    Vocab,
    bits_row,
    grammar_provider,
    grammar_providers,
    stop_row,
)


def _engine() -> types.SimpleNamespace:
    def step(x: int) -> int:
        """The engine's step."""
        return x + 1

    return types.SimpleNamespace(step=step, other=lambda: "engine")


def test_replace_once_keep_the_original_and_put_everything_back() -> None:
    eng = _engine()
    own_step, own_other = eng.step, eng.other
    ps = PatchSet("toy", "toy 1.0")
    assert not ps.installed()

    def make(orig: types.FunctionType) -> types.FunctionType:
        @wraps(orig)
        def step(x: int) -> int:
            return 10 * orig(x)

        return step  # type: ignore[return-value]

    ps.wrap(eng, "step", make)
    assert eng.step(1) == 20 and eng.step.__doc__ == "The engine's step." and eng.step.__wrapped__ is own_step
    # A second wrap (a plugin loaded twice in one process) changes nothing: no wrapper around the wrapper.
    ps.wrap(eng, "step", make)
    assert eng.step(1) == 20
    ps.replace(eng, "step", lambda x: -1)
    assert eng.step(1) == 20
    assert ps.original(eng, "step") is own_step and ps.replaced(eng, "step")
    assert ps.original(eng, "other") is own_other and not ps.replaced(eng, "other")
    ps.replace(eng, "other", lambda: "maskplug")
    assert ps.installed() and eng.other() == "maskplug"
    ps.uninstall()
    assert eng.step is own_step and eng.other is own_other and not ps.installed()


def test_copies_bound_at_import_are_replaced_and_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that binds the attribute at its import gets the original back, imported before or after."""
    owner = types.ModuleType("toy_owner")
    own = owner.step = lambda: "engine"  # type: ignore[attr-defined]
    new = lambda: "maskplug"  # noqa: E731
    before = types.ModuleType("toy_before")
    before.step = own  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "toy_before", before)
    monkeypatch.delitem(sys.modules, "toy_after", raising=False)
    ps = PatchSet("toy", "toy 1.0")
    ps.replace(owner, "step", new, copies=("toy_before", "toy_after"))
    assert owner.step is new and before.step is new  # type: ignore[attr-defined]
    # Imported after the replacement: ``from toy_owner import step`` binds it.
    after = types.ModuleType("toy_after")
    after.step = owner.step  # type: ignore[attr-defined]
    unrelated = types.ModuleType("toy_unrelated")
    unrelated.step = owner.step  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "toy_after", after)
    monkeypatch.setitem(sys.modules, "toy_unrelated", unrelated)
    ps.uninstall()
    assert owner.step is own and before.step is own and after.step is own  # type: ignore[attr-defined]
    assert unrelated.step is new  # type: ignore[attr-defined]  # not named: left alone
    assert not ps.installed()
    # A copy imported later that holds something else (its own choice) is left as it is.
    monkeypatch.delitem(sys.modules, "toy_after")
    ps.replace(owner, "step", new, copies=("toy_after",))
    after.step = other = lambda: "other"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "toy_after", after)
    ps.uninstall()
    assert owner.step is own and after.step is other  # type: ignore[attr-defined]


def test_a_missing_attribute_names_it_and_what_was_tested() -> None:
    eng = _engine()
    ps = PatchSet("toy", lambda: "toy 1.0")
    with pytest.raises(PluginError, match=r"toy internals: expected .*'gone'.*tested with toy 1\.0"):
        ps.replace(eng, "gone", lambda: None)
    assert not ps.installed() and not hasattr(eng, "gone")


# -- GuardedGrammar --------------------------------------------------------------------------


def _vocab() -> Vocab:
    tokens = [b"</s>", *(bytes([c]) for c in range(97, 123)), b"ab"]
    return Vocab(tokens, eos_ids=(0,), vocab_size=len(tokens) + 3)


class _Matcher:
    """Just enough of a matcher for the guard: ``is_terminated`` answers or raises."""

    def __init__(self, vocab: Vocab | None, raises: bool = False) -> None:
        self.vocab = vocab
        self.raises = raises
        self.calls = 0

    def is_terminated(self) -> bool:
        self.calls += 1
        if self.raises:
            raise OSError("the engine fell over")
        return False


class _Grammar(GuardedGrammar):
    def __init__(self, matcher: Any, vocab: Vocab | None) -> None:
        self.matcher = matcher
        self.vocab = vocab
        self.reported: list[GrammarError] = []

    def _describe(self, text: str) -> str:
        return f"request 'r1': {text}"

    def _failed_now(self, error: GrammarError) -> None:
        self.reported.append(error)


def test_a_guarded_grammar_fails_once_and_never_calls_its_matcher_again() -> None:
    v = _vocab()
    m = _Matcher(v, raises=True)
    g = _Grammar(m, v)
    assert g.error is None and g.producer_matcher() is m
    # The matcher raises: the grammar fails (named by the subclass), reported once.
    assert g.is_terminated() is False
    assert isinstance(g.error, GrammarError) and m.calls == 1
    assert str(g.error) == "request 'r1': the matcher raised OSError in is_terminated: the engine fell over"
    assert isinstance(g.error.__cause__, GrammarError) and isinstance(g.error.__cause__.__cause__, OSError)
    assert g.reported == [g.error]
    # Failed: no more matcher calls, a second failure changes nothing.
    first = g.error
    assert g.is_terminated() is False and m.calls == 1
    g.fail(ValueError("later"))
    assert g.error is first and g.reported == [first]
    # The producers get a stand-in that raises the error (the same one every time).
    stand_in = g.producer_matcher()
    assert stand_in is g.producer_matcher() and stand_in is not m
    with pytest.raises(GrammarError, match="the engine fell over"):
        stand_in.fill(v.new_bitmask(1), 0)


def test_fail_keeps_a_grammar_error_text_and_names_other_exceptions() -> None:
    v = _vocab()
    g = _Grammar(_Matcher(v), v)
    g.fail(GrammarError("token 7 refused"))
    assert str(g.error) == "request 'r1': token 7 refused"
    h = _Grammar(_Matcher(v), v)
    cause = KeyError("state")
    h.fail(cause)
    assert h.error is not None and h.error.__cause__ is cause
    assert str(h.error) == "request 'r1': the matcher raised KeyError: 'state'"


def test_the_stop_row_allows_only_the_stop_tokens_or_everything_without_a_vocabulary() -> None:
    v = _vocab()
    g = _Grammar(_Matcher(v), v)
    bm = torch.zeros((3, v.mask_words), dtype=torch.int32)
    g.fill_stop_row(bm, 1)
    assert torch.equal(bm[1], stop_row(v)) and not bm[0].any() and not bm[2].any()
    # A narrower row takes the words it has.
    narrow = torch.full((1, 1), -1, dtype=torch.int32)
    g.fill_stop_row(narrow, 0)
    assert torch.equal(narrow[0], stop_row(v)[:1])
    # Without a vocabulary there are no stop tokens to allow: the row stays open.
    blind = _Grammar(_Matcher(None), None)
    blind.fill_stop_row(bm, 2)
    assert bool((bm[2] == -1).all())


# -- fill_windows_serially --------------------------------------------------------------------


def _matchers(v: Vocab, n: int) -> list[Any]:
    providers = grammar_providers()
    if not providers:
        pytest.skip("no grammar provider is installed")
    compiled = grammar_provider(providers[0], v).compile(GrammarSpec("regex", "[a-c]{1,4}"))
    return [compiled.matcher() for _ in range(n)]


def test_fill_windows_serially_writes_what_the_serial_producer_writes() -> None:
    v = _vocab()
    a, b, c, x = (v.tokens.index(t) for t in (b"a", b"b", b"c", b"x"))
    windows = [[a, b], [], [x, a], [c, c, c, c, c], [a, 0, b]]
    n = len(windows)
    ids = [f"r{i}" for i in range(n)]
    counts = np.array([len(w) for w in windows], dtype=np.int64)
    total = int(counts.sum()) + n
    want = torch.zeros((total, v.mask_words), dtype=torch.int32)
    ms = _matchers(v, n)
    # One request's grammar has already failed: its stand-in raises, the others go on.
    ms[2] = FailedMatcher(v, GrammarError("earlier failure"))
    flat = np.array([t for w in windows for t in w], dtype=np.int64)
    ref = fill_draft_masks(
        ms, flat, want, GrammarRows(ids), ScheduledLayout(ids, counts, np.ones(n, np.int64)), strategy="serial"
    )
    got = torch.zeros_like(want)
    row0 = np.concatenate([[0], np.cumsum(counts + 1)[:-1]]).tolist()
    dm = fill_windows_serially(ms, windows, row0, got, total)
    assert torch.equal(got, want)
    assert dm.acceptable.tolist() == ref.acceptable.tolist() and sorted(dm.failed) == sorted(ref.failed) == [2]
    # The matchers are back where they started.
    assert all(not m.is_terminated() for i, m in enumerate(ms) if i != 2)


def test_fill_windows_serially_opens_the_rows_between_windows() -> None:
    v = _vocab()
    a, b = v.tokens.index(b"a"), v.tokens.index(b"b")
    ms = _matchers(v, 2)
    # Request 0's rows are 0..2, request 1's 5..6; rows 3 and 4 belong to nobody, row 7 is past the step.
    bm = torch.full((8, v.mask_words), 0x5A5A5A5A, dtype=torch.int32)
    dm = fill_windows_serially(ms, [[a, b], [b]], [0, 5], bm, 7)
    assert bool((bm[3:5] == -1).all()) and bool((bm[7] == 0x5A5A5A5A).all())
    alone = torch.zeros((2, v.mask_words), dtype=torch.int32)
    fill_windows_serially(ms[1:], [[b]], [0], alone, 2)
    assert torch.equal(bm[5:7], alone) and dm.acceptable.tolist() == [2, 1]


def test_fill_windows_serially_claims_its_matchers_unless_told_not_to() -> None:
    """Claimed (the default), a matcher another thread's call holds is refused, nothing written;
    with ``claim_matchers=False`` the same rows and result come out and no claim is left behind."""
    v = _vocab()
    a, b = v.tokens.index(b"a"), v.tokens.index(b"b")
    ms = _matchers(v, 2)
    windows = [[a, b], [b]]
    want = torch.zeros((5, v.mask_words), dtype=torch.int32)
    ref = fill_windows_serially(ms, windows, [0, 3], want, 5)
    held: list[Any] = []
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        held.append(claim([ms[1]], [id(ms[1])], "matchers"))
        taken.set()
        done.wait(10)
        release(held[0])

    t = threading.Thread(target=hold, name="holder")
    t.start()
    try:
        assert taken.wait(10)
        bm = torch.full((5, v.mask_words), 7, dtype=torch.int32)
        with pytest.raises(MatcherInUse, match=r"matchers\[1\]"):
            fill_windows_serially(ms, windows, [0, 3], bm, 5)
        assert bool((bm == 7).all())
    finally:
        done.set()
        t.join()
    got = torch.zeros_like(want)
    dm = fill_windows_serially(ms, windows, [0, 3], got, 5, claim_matchers=False)
    assert torch.equal(got, want) and dm.acceptable.tolist() == ref.acceptable.tolist() == [2, 1]
    # Nothing is held: a claimed call right after takes both matchers.
    again = torch.zeros_like(want)
    fill_windows_serially(ms, windows, [0, 3], again, 5)
    assert torch.equal(again, want)


def test_fill_row_writes_the_matchers_row_until_the_matcher_raises() -> None:
    v = _vocab()

    class Filling(_Matcher):
        def fill(self, bitmask: torch.Tensor, row: int) -> bool:
            if self.raises:
                raise RuntimeError("no state")
            bitmask[row] = 7
            return True

    m = Filling(v)
    g = _Grammar(m, v)
    bm = torch.zeros((2, v.mask_words), dtype=torch.int32)
    g.fill_row(bm, 0)
    assert bool((bm[0] == 7).all()) and g.error is None
    m.raises = True
    g.fill_row(bm, 1)
    assert torch.equal(bm[1], stop_row(v)) and "in filling mask row 1: no state" in str(g.error)
    # Failed: the matcher is not asked again, even once it could answer.
    m.raises = False
    g.fill_row(bm, 0)
    assert torch.equal(bm[0], stop_row(v))


# -- fill_windows_serially against the general producer, under hypothesis --------------------------


class _Wrapped:
    """A matcher around a real one that, from its ``at``-th ``what`` call on, raises or writes a row allowing nothing."""

    batch_ops = None
    releases_gil = False

    def __init__(self, inner: Any, what: str, at: int) -> None:
        self.inner, self.what, self.at, self.calls = inner, what, at, 0
        self.vocab = inner.vocab

    def _hit(self, what: str) -> bool:
        if what != self.what.split(":")[0]:
            return False
        self.calls += 1
        return self.calls >= self.at

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        if self._hit("fill"):
            if self.what == "fill:dead":
                bitmask[row] = 0
                return True
            if self.what == "fill:tail":
                # Only bits past the vocabulary set (none where it fills its words): allows nothing either.
                size = self.vocab.vocab_size
                bitmask[row] = 0
                if size % 32:
                    bitmask[row, size // 32] = -(1 << (size % 32))
                return True
            if self.what == "fill:one":
                # One token allowed, and bits past the vocabulary: a forced row by the vocabulary's count.
                size = self.vocab.vocab_size
                bitmask[row] = 0
                bitmask[row, 0] = 1 << 1
                if size % 32:
                    bitmask[row, size // 32] |= -(1 << (size % 32))
                return True
            raise RuntimeError(f"injected fill fault at call {self.calls}")
        return bool(self.inner.fill(bitmask, row))

    def accept(self, token: int) -> bool:
        if self._hit("accept"):
            raise RuntimeError(f"injected accept fault at call {self.calls}")
        return bool(self.inner.accept(token))

    def rollback(self, n: int) -> None:
        if self._hit("rollback"):
            raise RuntimeError(f"injected rollback fault at call {self.calls}")
        self.inner.rollback(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_COMPILED: dict[int, Any] = {}


def _compiled(size: int) -> Any:
    if size not in _COMPILED:
        providers = grammar_providers()
        if not providers:
            pytest.skip("no grammar provider is installed")
        tokens = [b"</s>", *(bytes([c]) for c in range(97, 123)), b"ab", b"bc"]
        v = Vocab(tokens, eos_ids=(0,), vocab_size=size)
        _COMPILED[size] = grammar_provider(providers[0], v).compile(GrammarSpec("regex", "[a-c]{1,4}"))
    return _COMPILED[size]


@settings(max_examples=120, deadline=None)
# A row with only bits past the vocabulary, and an empty one, each checked by numpy without the forced rows.
@example(size=69, reqs=[([1, 2], "", 1, False), ([1, 2], "fill:tail", 2, False)], find_forced=False, numpy_counts=True)
@example(size=64, reqs=[([1, 2], "fill:dead", 3, True)], find_forced=False, numpy_counts=True)
@given(
    size=st.sampled_from([29, 31, 32, 64, 69, 100]),
    reqs=st.lists(
        st.tuples(
            st.lists(st.sampled_from([0, 1, 2, 3, 4, 27, 28, 5]), max_size=5),
            st.sampled_from(["", "fill", "fill:dead", "fill:tail", "fill:one", "accept", "rollback"]),
            st.integers(1, 4),
            st.booleans(),
        ),
        min_size=1,
        max_size=5,
    ),
    find_forced=st.booleans(),
    numpy_counts=st.booleans(),
)
def test_fill_windows_serially_equals_the_general_serial_producer(
    size: int, reqs: list[Any], find_forced: bool, numpy_counts: bool
) -> None:
    """The rows, draft masks and matcher states of ``fill_draft_masks(..., strategy="serial")``.

    Without ``find_forced`` everything but ``forced`` (then all False);
    ``numpy_counts`` checks the rows with numpy whatever their size (else a
    step this small is checked in Python).
    """
    compiled = _compiled(size)
    v = compiled.matcher().vocab
    n = len(reqs)
    windows = [list(w) for w, *_ in reqs]

    def matchers() -> list[Any]:
        out: list[Any] = []
        for _w, fault, at, advanced in reqs:
            m = compiled.matcher()
            if advanced:
                m.accept(1)  # "a": some requests start inside the grammar
            out.append(_Wrapped(m, fault, at) if fault else m)
        return out

    ids = [f"r{i}" for i in range(n)]
    counts = np.array([len(w) for w in windows], dtype=np.int64)
    total = int(counts.sum()) + n
    want = torch.full((total + 1, v.mask_words), 0x5A5A5A5A, dtype=torch.int32)
    got = want.clone()
    ref_ms, fast_ms = matchers(), matchers()
    flat = np.array([t for w in windows for t in w], dtype=np.int64)
    ref = fill_draft_masks(
        ref_ms, flat, want, GrammarRows(ids), ScheduledLayout(ids, counts, np.ones(n, np.int64)), strategy="serial"
    )
    row0 = np.concatenate([[0], np.cumsum(counts + 1)[:-1]]).astype(int).tolist()
    with mock.patch.object(serial, "_PY_COUNT_BYTES", -1 if numpy_counts else serial._PY_COUNT_BYTES):
        dm = fill_windows_serially(fast_ms, windows, row0, got, total, find_forced=find_forced)
    assert torch.equal(got, want)
    assert dm.request.tolist() == ref.request.tolist()
    assert dm.acceptable.tolist() == ref.acceptable.tolist()
    want_forced = ref.forced.tolist() if find_forced else np.zeros_like(ref.forced).tolist()
    assert dm.forced.shape == ref.forced.shape and dm.forced.tolist() == want_forced
    assert {g: str(e) for g, e in dm.failed.items()} == {g: str(e) for g, e in ref.failed.items()}
    # Every matcher that did not fail is back where it started, on both paths alike.
    for g, (a, b) in enumerate(zip(ref_ms, fast_ms, strict=True)):
        if g not in ref.failed:
            assert a.is_terminated() == b.is_terminated()
            assert a.validate([1, 2, 3]) == b.validate([1, 2, 3])


class _Lenient(MatcherBase):
    """An engine that takes any id it is handed (control ids and ids past the tokens too), bar a few.

    Only :class:`MatcherBase`'s own checks refuse the ids a grammar never
    takes, so a walk that skips them shows here (a real engine refuses those
    ids itself). Complete after every ``every``-th token; its rows depend on
    how many tokens it holds.
    """

    def __init__(self, vocab: Vocab, every: int) -> None:
        super().__init__(vocab)
        self.every = every
        self.taken: list[int] = []

    def _accept(self, token: int) -> bool:
        if token % 7 == 6:
            return False
        self.taken.append(token)
        return True

    def _rollback(self, n: int) -> None:
        del self.taken[len(self.taken) - n :]

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        held = len(self.taken)
        bitmask[row] = torch.from_numpy(
            bits_row([t for t in range(self.vocab.vocab_size) if (t + held) % 3], self.vocab.mask_words)
        )

    def _is_complete(self) -> bool:
        return len(self.taken) % self.every == 0

    def _reset(self) -> None:
        self.taken.clear()

    def _fork(self) -> _Lenient:
        twin = type(self)(self.vocab, self.every)
        twin.taken = list(self.taken)
        return twin


class _LenientChecked(_Lenient):
    """The same engine, its ``accept`` overridden: a walk calls it through the public methods."""

    def accept(self, token: int) -> bool:
        return super().accept(token)


@settings(max_examples=150, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(
            st.lists(st.integers(0, 39), max_size=6),  # 0: stop; 1, 2: control ids; 20..39: past the tokens
            st.lists(st.integers(3, 19), max_size=3),  # tokens held before the step
            st.integers(1, 3),
            st.booleans(),  # the matcher has already stopped
        ),
        min_size=1,
        max_size=5,
    )
)
def test_the_walk_of_a_plain_matcher_refuses_what_accept_refuses(reqs: list[Any]) -> None:
    """The serial walk calls a plain :class:`MatcherBase`'s engine directly; its public methods give the same.

    Rows, acceptable counts, forced tokens, failures and every matcher's
    state after the walk are those of a walk through ``fill``, ``accept`` and
    ``rollback`` on the same engine: a stop token taken only when the text is
    complete, control ids and ids past the tokens refused, a stopped matcher
    walked on its stop rows.
    """
    v = Vocab(
        [b"</s>", b"<c1>", b"<c2>", *(bytes([97 + i]) for i in range(17))],
        eos_ids=(0,),
        special_ids=(1, 2),
        vocab_size=40,
    )
    windows = [list(w) for w, *_ in reqs]

    def matchers(cls: type[_Lenient]) -> list[_Lenient]:
        out = []
        for _w, held, every, stopped in reqs:
            m = cls(v, every)
            m.taken = list(held)
            if stopped:
                m._set_terminated(True)
            out.append(m)
        return out

    counts = [len(w) for w in windows]
    total = sum(counts) + len(windows)
    row0 = np.concatenate([[0], np.cumsum(np.array(counts) + 1)[:-1]]).astype(int).tolist()
    results = []
    for cls in (_Lenient, _LenientChecked):
        ms = matchers(cls)
        bm = torch.full((total + 1, v.mask_words), 0x5A5A5A5A, dtype=torch.int32)
        dm = fill_windows_serially(ms, windows, row0, bm, total)
        results.append((bm, dm, [(m.taken, m.is_terminated()) for m in ms]))
    (bm, dm, states), (want_bm, want, want_states) = results
    assert torch.equal(bm, want_bm)
    assert dm.acceptable.tolist() == want.acceptable.tolist()
    assert dm.forced.tolist() == want.forced.tolist()
    assert {g: str(e) for g, e in dm.failed.items()} == {g: str(e) for g, e in want.failed.items()}
    assert states == want_states == [(list(h), st_) for _w, h, _e, st_ in reqs]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.one_of(st.integers(0, 39), st.sampled_from([-1, 40, True, np.int64(5), 3.0])), max_size=6).map(
        lambda xs: xs if len(xs) % 2 else tuple(xs)
    ),
    held=st.lists(st.integers(3, 19), max_size=3),
    every=st.integers(1, 3),
    stopped=st.booleans(),
)
def test_validate_of_a_plain_matcher_is_validate_through_accept(
    tokens: Any, held: list[int], every: int, stopped: bool
) -> None:
    """``MatcherBase.validate`` takes plain in-range ids in one frame: the same count, error and state as through ``accept``."""
    v = Vocab(
        [b"</s>", b"<c1>", b"<c2>", *(bytes([97 + i]) for i in range(17))],
        eos_ids=(0,),
        special_ids=(1, 2),
        vocab_size=40,
    )
    results = []
    for cls in (_Lenient, _LenientChecked):
        m = cls(v, every)
        m.taken = list(held)
        m._set_terminated(stopped)
        try:
            got: Any = m.validate(tokens)
        except GrammarError as exc:
            got = str(exc)
        results.append((got, m.taken, m.is_terminated()))
    assert results[0] == results[1]
    assert results[0][1:] == (held, stopped)


def test_validate_leaves_the_state_as_it_was_when_the_engine_raises() -> None:
    """An engine that raises half-way through ``validate``: the tokens taken before are rolled back, on both paths."""
    v = Vocab([b"</s>", *(bytes([97 + i]) for i in range(19))], eos_ids=(0,), vocab_size=20)

    class Raising(_Lenient):
        def _accept(self, token: int) -> bool:
            if token == 9:
                raise RuntimeError("engine fault")
            return super()._accept(token)

    class RaisingChecked(Raising):
        def accept(self, token: int) -> bool:
            return super().accept(token)

    for cls in (Raising, RaisingChecked):
        m = cls(v, 1)
        m.taken = [3]
        with pytest.raises(RuntimeError, match="engine fault"):
            m.validate([4, 5, 9, 7])
        assert m.taken == [3] and not m.is_terminated()
        # The engine's per-step draft check too (the plain class's own loop, the other's validate).
        for drafts in ([4, 5, 9, 7], (9,), [4, 9, 1]):
            with pytest.raises(RuntimeError, match="engine fault"):
                draft_validator(m)(drafts)
            assert m.taken == [3] and not m.is_terminated()


# -- accept_emitted against accept(), under hypothesis ----------------------------------------------


def _by_accept(m: Any, tokens: list[Any]) -> tuple[int, str | None]:
    """What an engine's loop over ``accept`` does with emitted tokens: taken count, or the error it raised."""
    n = 0
    try:
        for t in tokens:
            if m.is_terminated() or not m.accept(t):
                break
            n += 1
    except GrammarError as exc:
        return n, str(exc)
    return n, None


class _ValidatesAfterItsEnd(_Lenient):
    """An engine whose own ``validate`` still counts drafts after its stop token (as a careless one might)."""

    def validate(self, tokens: Any) -> int:
        was = self.is_terminated()
        self._set_terminated(False)
        try:
            return super().validate(tokens)
        finally:
            self._set_terminated(was)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.one_of(st.integers(0, 39), st.sampled_from([-1, 40, True, np.int64(5)])), max_size=5).map(
        lambda xs: xs if len(xs) % 2 else tuple(xs)
    ),
    held=st.lists(st.integers(3, 19), max_size=3),
    every=st.integers(1, 3),
    stopped=st.booleans(),
    cls=st.sampled_from([_Lenient, _LenientChecked, _ValidatesAfterItsEnd]),
)
@example(tokens=[3, 4], held=[], every=1, stopped=True, cls=_ValidatesAfterItsEnd)
@example(tokens=[3, 6, 40], held=[], every=1, stopped=False, cls=_Lenient)  # a refusal, then a bad id: raises
@example(tokens=[6, -1], held=[], every=1, stopped=False, cls=_Lenient)
@example(tokens=[3, 4, 20], held=[], every=1, stopped=False, cls=_Lenient)  # an id past the tokens: the general run
@example(tokens=[3, 40], held=[], every=1, stopped=True, cls=_Lenient)
def test_draft_validator_is_validate_and_nothing_once_ended(
    tokens: Any, held: list[int], every: int, stopped: bool, cls: type[_Lenient]
) -> None:
    """:func:`draft_validator`: ``validate``'s count and errors, 0 unasked once the matcher has ended.

    The state is untouched either way. A plain :class:`MatcherBase` gets one
    bound method of its own; a class that overrides ``accept`` or
    ``validate`` is asked whether it has ended first.
    """
    v = Vocab(
        [b"</s>", b"<c1>", b"<c2>", *(bytes([97 + i]) for i in range(17))],
        eos_ids=(0,),
        special_ids=(1, 2),
        vocab_size=40,
    )
    m, twin = cls(v, every), cls(v, every)
    for x in (m, twin):
        x.taken = list(held)
        x._set_terminated(stopped)
    run = draft_validator(m)
    assert (getattr(run, "__self__", None) is m) == (cls is _Lenient)
    want: Any
    try:
        want = 0 if stopped else twin.validate(tokens)
    except GrammarError as exc:
        want = str(exc)
    try:
        got: Any = run(tokens)
    except GrammarError as exc:
        got = str(exc)
    assert got == want
    assert (m.taken, m.is_terminated()) == (list(held), stopped)


@settings(max_examples=150, deadline=None)
@given(
    size=st.sampled_from([29, 32, 100]),
    tokens=st.lists(
        st.one_of(
            st.sampled_from([0, 1, 2, 3, 27, 28, 5]),  # stop, letters, "ab"/"bc", a refused one
            st.sampled_from([-1, 29, 100, 10**6]).map(int),  # outside the vocabulary (for some sizes)
            st.sampled_from([1, 2, 0]).map(np.int64),  # numpy ids go through accept()'s checks
        ),
        max_size=7,
    ),
    wrapped=st.booleans(),
    bound=st.booleans(),
)
@example(size=29, tokens=[1, 29], wrapped=False, bound=False)  # just past the vocabulary: accept()'s error
@example(size=32, tokens=[1, 0, 5, 2], wrapped=False, bound=True)  # nothing after the stop token is offered
def test_accept_emitted_takes_what_accept_takes(size: int, tokens: list[Any], wrapped: bool, bound: bool) -> None:
    """The same count, end state and errors as a loop over ``accept``; nothing after a stop token is offered.

    ``bound``: through :func:`emitted_acceptor`, the same call looked up once.
    """
    compiled = _compiled(size)
    ours, theirs = compiled.matcher(), compiled.matcher()
    if wrapped:  # a matcher that is not a MatcherBase: every id through its accept()
        ours = _Wrapped(ours, "", 1)
    run = emitted_acceptor(ours) if bound else functools.partial(accept_emitted, ours)
    want, err = _by_accept(theirs, tokens)
    if err is not None:
        with pytest.raises(GrammarError) as got:
            run(tokens)
        assert str(got.value) == err
    else:
        assert run(tokens) == want
    assert ours.is_terminated() == theirs.is_terminated()
    assert ours.num_accepted == theirs.num_accepted
    words = theirs.vocab.mask_words
    a, b = torch.zeros((1, words), dtype=torch.int32), torch.zeros((1, words), dtype=torch.int32)
    ours.fill(a, 0)
    theirs.fill(b, 0)
    assert torch.equal(a, b)


# -- ragged_mapping against GrammarRows.mapping ------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    drafts=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    seed=st.integers(0, 2**32 - 1),
    bonus=st.integers(1, 2),
    few=st.sampled_from([0, 64]),
)
def test_ragged_mapping_is_what_grammar_rows_map(drafts: list[int], seed: int, bonus: int, few: int) -> None:
    """Any subset of the batch, in any order, as grammar requests: the same rows, trusted by the apply.

    ``few``: the most requests mapped with Python lists (0: every mapping through numpy).
    """
    saved = engine_sdk._FEW_REQUESTS
    engine_sdk._FEW_REQUESTS = few
    try:
        _ragged_matches(drafts, seed, bonus)
    finally:
        engine_sdk._FEW_REQUESTS = saved


def _ragged_matches(drafts: list[int], seed: int, bonus: int) -> None:
    rng = np.random.default_rng(seed)
    n = len(drafts)
    ids = [f"r{i}" for i in range(n)]
    gidx = [int(i) for i in rng.permutation(n)[: int(rng.integers(0, n + 1))]]
    layout = ScheduledLayout(ids, np.array(drafts), np.ones(n, dtype=np.int64), num_bonus=bonus)
    want = GrammarRows([ids[i] for i in gidx]).mapping(layout)
    got = ragged_mapping(gidx, [drafts[i] + bonus for i in gidx], n)
    assert got.request.dtype == want.request.dtype and got.position.dtype == want.position.dtype
    assert np.array_equal(got.request, want.request) and np.array_equal(got.position, want.position)
    assert got._trusted_needs() == want._trusted_needs()
    assert not got.request.flags.writeable and not got.position.flags.writeable


@pytest.mark.parametrize(
    ("batch_index", "rows", "num_batch", "message"),
    [
        ([0, 1], [1], 2, r"rows: expected 2 counts"),
        ([0, 2], [1, 1], 2, r"batch_index: expected indices in \[0, 2\), got 2"),
        ([-1], [1], 2, r"batch_index: expected indices in \[0, 2\), got -1"),
        ([1, 1], [1, 2], 2, r"batch_index: expected each batch request at most once"),
        ([0, 1], [1, 0], 2, r"rows: expected at least 1 row per grammar request, got 0"),
        ([0], [2**31], 1, r"rows: expected at most 2\*\*31 - 1 mask rows"),
    ],
)
@pytest.mark.parametrize("few", [0, 64])
def test_ragged_mapping_refuses_bad_input_naming_it(
    batch_index: list[int], rows: list[int], num_batch: int, message: str, few: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_sdk, "_FEW_REQUESTS", few)
    with pytest.raises(LayoutError, match=message):
        ragged_mapping(batch_index, rows, num_batch)
