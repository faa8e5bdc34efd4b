"""The small-batch producer (:func:`maskplug_vllm.scheduler._fill_few`) writes what the general path writes.

Below :data:`~maskplug_vllm.scheduler.SERIAL_BELOW` grammar requests,
:func:`~maskplug_vllm.scheduler.fill_step_rows` skips the general input
handling of :func:`maskplug.fill_draft_masks` and walks vLLM's draft lists
directly. Checked here, with hypothesis over random steps: the rows, the row
count and every :class:`~maskplug.DraftMasks` field (the failures' messages
included) equal those of the general path (``fill_draft_masks(...,
strategy="serial")`` on the windows cut at the first ``-1``), and the
matchers end where they started, for live, terminated, already-failed and
raising matchers (in ``fill``, ``accept`` or ``rollback``), drafts the grammar
accepts, refuses or ends on, ``-1`` padding and ids outside the vocabulary;
inputs the fast path does not take (a repeated matcher, a bad bitmask, ids
outside the vocabulary) go to the general path and raise or fail exactly as
it does.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_model
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from maskplug_vllm import scheduler as mp_sched
from maskplug_vllm.backend import MaskplugBackend, MaskplugGrammar, producer_matcher
from test_scheduler_masks import _vllm_config
from vllm.v1.structured_output.backend_types import StructuredOutputOptions

from maskplug import GrammarError, MaskplugError

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "grammars"))
from grammar_testkit import reference_rows


class Faulty:
    """A matcher that raises ``RuntimeError`` from its ``at``-th call of ``what`` on; the rest goes to ``inner``."""

    batch_ops = None
    releases_gil = False

    def __init__(self, inner: Any, what: str, at: int) -> None:
        self.inner, self.what, self.at, self.calls = inner, what, at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, what: str) -> None:
        if what == self.what:
            self.calls += 1
            if self.calls >= self.at:
                raise RuntimeError(f"injected {what} fault, call {self.calls}")

    def fill(self, bitmask: Any, row: int) -> bool:
        self._count("fill")
        return bool(self.inner.fill(bitmask, row))

    def accept(self, token: int) -> bool:
        self._count("accept")
        return bool(self.inner.accept(token))

    def rollback(self, n: int) -> None:
        self._count("rollback")
        self.inner.rollback(n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tiny_model.build(tmp_path_factory.mktemp("tiny"))
    tok = tiny_model.load_tokenizer(folder)
    eos = {int(tok.eos_token_id)}
    backend = MaskplugBackend(_vllm_config(), tok, tiny_model.VOCAB_SIZE, "xgrammar")
    bases = [
        backend.compile_grammar(StructuredOutputOptions.JSON, p.read_text(), stop_token_ids=eos)
        for p in tiny_model.schema_paths()[:6]
    ]
    return tok, eos, bases


def _state(m: Any, words: int) -> bytes:
    """What a matcher would allow next (its position, as far as the rows can tell)."""
    row = torch.zeros((1, words), dtype=torch.int32)
    try:
        m.fill(row, 0)
    except Exception as exc:  # a raising matcher's state is its error
        return repr(exc).encode()
    return bytes(row.numpy().tobytes()) + bytes([int(m.is_terminated())])


def _step(
    setup: Any, seed: int, *, clean: bool = False
) -> tuple[list[list[Any]], list[str], dict[str, list[int]], list[str]]:
    """Two identical copies of a random step's matchers, its ids, its drafts and the fault kinds.

    ``clean``: no faults, padding or ids outside the vocabulary (accepted and refused drafts only).
    """
    tok, eos, bases = setup
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    vocab = tiny_model.VOCAB_SIZE
    copies: list[list[Any]] = [[], []]
    ids, spec, kinds = [], {}, []
    for i in range(n):
        base = bases[int(rng.integers(0, len(bases)))]
        g = MaskplugGrammar(base.matcher.fork(), base.spec)
        tiny_model.walk(g, rng, int(rng.integers(0, 40)), len(tok), frozenset(eos))
        probe = MaskplugGrammar(g.matcher.fork(), g.spec)
        drafts = tiny_model.walk(probe, rng, int(rng.integers(0, 5)), vocab)
        kinds_of = (
            ["ok", "reject"] if clean else ["ok", "ok", "ok", "reject", "pad", "fill", "accept", "rollback", "failed"]
        )
        kind = str(rng.choice(kinds_of))
        if kind == "reject" and drafts:
            drafts[int(rng.integers(0, len(drafts)))] = int(rng.integers(0, vocab))
        elif kind == "pad" and drafts:
            cut = int(rng.integers(0, len(drafts)))
            drafts[cut:] = [-1] * (len(drafts) - cut)
        if drafts and not clean and rng.random() < 0.05:
            drafts[-1] = vocab + int(rng.integers(0, 40))  # outside the vocabulary: fails that request
        rid = f"q{i}"
        ids.append(rid)
        if drafts or rng.random() < 0.5:
            spec[rid] = drafts
        at = int(rng.integers(1, 4))
        for c in copies:
            gc = MaskplugGrammar(g.matcher.fork(), g.spec)
            if kind == "failed":
                gc.error = GrammarError("earlier failure")
            m = producer_matcher(gc)
            c.append(Faulty(m, kind, at) if kind in ("fill", "accept", "rollback") else m)
        kinds.append(kind)
    return copies, ids, spec, kinds


def _window(drafts: list[int]) -> list[int]:
    """The drafts before vLLM's first ``-1`` padding (the rest is never walked nor checked)."""
    return drafts[: drafts.index(-1)] if -1 in drafts else drafts


def _general(bitmask: torch.Tensor, matchers: list[Any], ids: list[str], spec: dict[str, list[int]]) -> Any:
    return mp_sched._fill_general(bitmask, matchers, ids, spec)


def _same(a: Any, b: Any, find_forced: bool = True) -> None:
    """``a`` is ``b`` (the general path's); without ``find_forced`` ``a``'s ``forced`` is all False, of ``b``'s shape."""
    # The fast path also hands back the buffer's numpy view (the rows the manager returns).
    total_a, dm_a = a[:2]
    total_b, dm_b = b[:2]
    assert total_a == total_b
    assert np.array_equal(dm_a.request, dm_b.request)
    assert np.array_equal(dm_a.acceptable, dm_b.acceptable)
    want_forced = dm_b.forced if find_forced else np.zeros_like(dm_b.forced)
    assert dm_a.forced.shape == dm_b.forced.shape and np.array_equal(dm_a.forced, want_forced)
    assert {k: str(v) for k, v in dm_a.failed.items()} == {k: str(v) for k, v in dm_b.failed.items()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), find_forced=st.booleans())
def test_fast_path_equals_general_path(
    setup: Any, seed: int, find_forced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows, draft masks and matcher states of the general path (without ``find_forced``: no forced rows)."""
    (fast_ms, slow_ms), ids, spec, kinds = _step(setup, seed)
    words = fast_ms[0].vocab.mask_words
    rows = len(ids) + sum(len(v) for v in spec.values())
    garbage = np.random.default_rng(seed).integers(-(2**31), 2**31, size=(rows + 2, words), dtype=np.int64)
    bm_fast = torch.from_numpy(garbage.astype(np.int32))
    bm_slow = bm_fast.clone()
    # The fast path must be the one taken on every step it can serve.
    few = mp_sched._fill_few(bm_fast, fast_ms, ids, spec, find_forced)
    outside = any(t >= tiny_model.VOCAB_SIZE for v in spec.values() for t in _window(v))
    fast: Any
    if outside:
        assert few is None
        fast = mp_sched._fill_general(bm_fast, fast_ms, ids, spec)
        find_forced = True  # the general path always finds them
    else:
        assert few is not None and np.shares_memory(few[2], bm_fast.numpy()) and few[2].shape == bm_fast.shape
        fast = few
    slow = _general(bm_slow, slow_ms, ids, spec)
    _same(fast, slow, find_forced)
    assert torch.equal(bm_fast, bm_slow)
    for mf, ms in zip(fast_ms, slow_ms, strict=True):
        assert _state(mf, words) == _state(ms, words)
    assert kinds  # every step has at least one request


def test_fast_path_rows_match_the_reference(setup: Any) -> None:
    """Without faults or padding, every row, ``acceptable`` and ``forced`` flag is the oracle's (replayed from scratch)."""
    checked = 0
    for seed in range(40):
        (fast_ms, ref_ms), ids, spec, _ = _step(setup, 1000 + seed, clean=True)
        vocab = fast_ms[0].vocab
        rows = len(ids) + sum(len(v) for v in spec.values())
        bm = torch.zeros((rows, vocab.mask_words), dtype=torch.int32)
        fast = mp_sched._fill_few(bm, fast_ms, ids, spec)
        assert fast is not None
        start = 0
        for g, r in enumerate(ids):
            drafts = list(spec.get(r, ()))
            ref = reference_rows(ref_ms[g], vocab, drafts, 1, 0)
            assert int(fast[1].acceptable[g]) == ref.acceptable
            for p, row in enumerate(ref.rows):
                np.testing.assert_array_equal(bm[start + p].numpy(), row, err_msg=f"request {g} row {p}")
                assert bool(fast[1].forced[g, p]) == ref.forced[p]
            start += len(drafts) + 1
        checked += 1
    assert checked == 40


def test_inputs_the_fast_path_leaves_to_the_general_path(setup: Any) -> None:
    (ms, _), ids, spec, _ = _step(setup, 7)
    words = ms[0].vocab.mask_words
    rows = len(ids) + sum(len(v) for v in spec.values())
    bm = torch.zeros((rows, words), dtype=torch.int32)
    before = bm.clone()
    if len(ms) > 1:
        # The same matcher twice: refused by the general path, naming it; nothing written.
        dup = [ms[0]] * len(ms)
        assert mp_sched._fill_few(bm, dup, ids, spec) is None
        with pytest.raises(GrammarError, match=r"matchers\[1\]"):
            mp_sched.fill_step_rows(bm, [_Bare(m) for m in dup], ids, spec)
        assert torch.equal(bm, before)
    # A bitmask one word too narrow: the general path's error, nothing written.
    narrow = torch.zeros((rows, words - 1), dtype=torch.int32)
    assert mp_sched._fill_few(narrow, ms, ids, spec) is None
    with pytest.raises(MaskplugError, match="bitmask"):
        mp_sched.fill_step_rows(narrow, [_Bare(m) for m in ms], ids, spec)
    assert not narrow.any()


class _Bare:
    """A stand-in grammar object whose producer matcher is the given one (not a MaskplugGrammar)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher


def test_a_buffer_changed_in_place_is_checked_again(setup: Any) -> None:
    """The bitmask check is remembered per buffer; a resize in place, a view or too few rows are checked anew."""
    (ms, _), ids, spec, _ = _step(setup, 11)
    words = ms[0].vocab.mask_words
    rows = len(ids) + sum(len(v) for v in spec.values())
    bm = torch.zeros((rows, words), dtype=torch.int32)
    assert mp_sched._fill_few(bm, ms, ids, spec) is not None  # checked and remembered
    assert mp_sched._fill_few(bm, ms, ids, spec) is not None  # the same buffer: passes again
    # Too few rows for the step (the same storage): refused, the general path names the bitmask.
    short = bm.resize_((rows - 1, words))
    assert short is bm and mp_sched._fill_few(bm, ms, ids, spec) is None
    bm.resize_((rows, words))
    assert mp_sched._fill_few(bm, ms, ids, spec) is not None
    # Re-shaped in place to a width the vocabulary does not have: refused, nothing written.
    bm.zero_()
    shape = (rows // 2, 2 * words) if rows % 2 == 0 else (rows, words - 1)
    bm.set_(bm.untyped_storage(), 0, shape)  # type: ignore[call-overload]
    assert mp_sched._fill_few(bm, ms, ids, spec) is None
    assert not bm.any()
    # A strided view of a valid buffer: not contiguous, refused.
    wide = torch.zeros((rows, words + 1), dtype=torch.int32)
    assert mp_sched._fill_few(wide[:, :words], ms, ids, spec) is None


def _manager(backend: Any, rows: int, words: int) -> Any:
    """A stand-in ``StructuredOutputManager`` with the attributes the wrapped ``grammar_bitmask`` reads."""
    ns = types.SimpleNamespace
    cfg = ns(num_speculative_tokens=4, scheduler_config=ns(max_num_seqs=8), model_config=ns(is_diffusion=False))
    return ns(
        backend=backend,
        reasoner_cls=None,
        enable_in_reasoning=False,
        vllm_config=cfg,
        _grammar_bitmask=torch.zeros((rows, words), dtype=torch.int32),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), wanted=st.booleans())
def test_the_wrapped_manager_serves_few_requests_as_the_general_path(
    setup: Any, seed: int, wanted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``grammar_bitmask`` with :func:`~maskplug_vllm.scheduler.few_rows` first: the general path's rows and outcome.

    The rows it returns, the step's record, the grammars it binds and fails
    and the matchers' states equal those of the same wrapper without the
    few-request pass, for every fault kind; the pass serves every step
    without an earlier-failed grammar or an id outside the vocabulary.
    Without :data:`~maskplug_vllm.scheduler.WANT_DRAFT_MASKS_ATTR` on the
    manager the same rows, failures and states come out and nothing is
    recorded.
    """
    _, _, bases = setup
    (fast_ms, slow_ms), ids, spec, kinds = _step(setup, seed)
    words = fast_ms[0].vocab.mask_words
    rows = len(ids) + sum(len(v) for v in spec.values())
    backend = MaskplugBackend.__new__(MaskplugBackend)
    backend.vocab = fast_ms[0].vocab
    general_steps = []
    fill_step_rows = mp_sched.fill_step_rows

    def spy(*args: Any) -> Any:
        general_steps.append(args)
        return fill_step_rows(*args)

    # The wrapper's general path (looked up at each step).
    monkeypatch.setattr(mp_sched, "fill_step_rows", spy)
    with_few = mp_sched.make_grammar_bitmask(lambda *a: None)
    general = mp_sched.common.make_grammar_bitmask(
        lambda *a: None,
        rows=lambda ids, spec, stride: len(ids) + sum(len(spec.get(r, ())) for r in ids),
        fill=lambda bm, grammars, ids, spec, stride: mp_sched._fill_general(
            bm, [producer_matcher(g) for g in grammars], ids, spec
        ),
        record=mp_sched.DRAFT_MASKS_ATTR,
    )
    outs = []
    for wrapper, ms in ((with_few, fast_ms), (general, slow_ms)):
        grammars = []
        for m, kind in zip(ms, kinds, strict=True):
            g = MaskplugGrammar(m, bases[0].spec, m.vocab)
            if kind == "failed":
                g.error = GrammarError("earlier failure")
            grammars.append(g)
        requests = {
            r: types.SimpleNamespace(request_id=r, structured_output_request=types.SimpleNamespace(grammar=g))
            for r, g in zip(ids, grammars, strict=True)
        }
        mgr = _manager(backend, rows + 2, words)
        if wanted:
            setattr(mgr, mp_sched.WANT_DRAFT_MASKS_ATTR, True)
        got = wrapper(mgr, requests, list(ids), spec)
        outs.append((np.array(got), getattr(mgr, mp_sched.DRAFT_MASKS_ATTR), grammars))
    (rows_a, rec_a, gr_a), (rows_b, rec_b, gr_b) = outs
    assert np.array_equal(rows_a, rows_b)
    assert rec_b[0] == ids  # the general wrapper records on every step
    if wanted:
        assert rec_a[0] == ids
        _same((rows_a.shape[0], rec_a[1]), (rows_b.shape[0], rec_b[1]))
    else:
        assert rec_a is None
    assert [g.request_id for g in gr_a] == [g.request_id for g in gr_b] == ids
    assert [str(g.error) for g in gr_a] == [str(g.error) for g in gr_b]
    for mf, msl in zip(fast_ms, slow_ms, strict=True):
        assert _state(mf, words) == _state(msl, words)
    outside = any(t >= tiny_model.VOCAB_SIZE for v in spec.values() for t in _window(v))
    assert len(general_steps) == int("failed" in kinds or outside)
