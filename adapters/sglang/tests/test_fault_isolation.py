"""One failing maskplug grammar ends as its request's abort; the other requests go on as without it.

On SGLang's real DSpark verify chain (``dspark_chain``: the tree, maskplug's
``build_verify_mask``, ``GrammarMask.apply``, the accept kernels, the
scheduler's ``advance_grammar_fsm``) a random batch runs one step twice: with
one request's matcher raising (while its rows are produced, or when SGLang
commits the step's tokens), and the same batch without that request. The
faulty request ends with ``FINISH_ABORT`` carrying the error, logged once
with its id; every other request gets the same mask rows, the same accept
outcome and the same committed tokens. The same fault through the DSpark
patches (the decode step of ``test_dspark_patches``, with a budget that reads
the grammar and with one that verifies everything), SGLang's own fill paths
(``fill_vocab_mask_batched``), :func:`maskplug_sglang.backend.fill_draft_chains`
and :func:`maskplug_sglang.trees.fill_draft_trees`.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import test_tree_windows as trees_test
import torch
from conftest import compile_pair, grammar_keys
from dspark_chain import Req, advance, make_batch, make_chain, make_logits, run_verify
from hypothesis import given
from hypothesis import strategies as st
from maskplug_sglang import patches
from maskplug_sglang.backend import ERROR_PREFIX, MaskplugGrammar, allocate_mask, fill_draft_chains
from maskplug_sglang.trees import fill_draft_trees
from sglang.srt.constrained.base_grammar_backend import GrammarRow
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from test_dspark_patches import Worker, patched_forward_decode, verify_planner

from maskplug import GrammarError
from maskplug.grammar.rows import stop_row

KEYS = grammar_keys()


class Raising:
    """A matcher whose ``what`` method raises while ``armed``; everything else goes to ``inner``."""

    batch_ops = None
    releases_gil = False

    def __init__(self, inner: Any, what: str, armed: bool = True) -> None:
        self.inner, self.what, self.armed, self.vocab = inner, what, armed, inner.vocab

    def _call(self, name: str, *args: Any) -> Any:
        if self.armed and name == self.what:
            raise RuntimeError(f"injected fault in {name}")
        return getattr(self.inner, name)(*args)

    def accept(self, token: int) -> bool:
        return bool(self._call("accept", token))

    def validate(self, tokens: Any) -> int:
        return int(self._call("validate", tokens))

    def rollback(self, n: int) -> None:
        self._call("rollback", n)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        return bool(self._call("fill", bitmask, row))

    def is_terminated(self) -> bool:
        return bool(self._call("is_terminated"))

    def reset(self) -> None:
        self._call("reset")

    def fork(self) -> Any:
        return Raising(self.inner.fork(), self.what, self.armed)


def _batch(backends: tuple[Any, Any], seed: int, bs: int) -> tuple[list[Any], list[Any], np.random.Generator]:
    """A random batch (``dspark_chain.make_batch``): the same grammars in the same states for the same seed."""
    rng = np.random.default_rng(seed)
    theirs, ours = make_batch(rng, backends, bs)
    return theirs, ours, rng


def _live(ours: list[Any]) -> list[int]:
    return [i for i, g in enumerate(ours) if g is not None and not g.is_terminated()]


class Records(logging.Handler):
    """The log records of error level and above, from every logger."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, logger: str | None = None) -> list[str]:
        return [r.getMessage() for r in self.records if logger is None or r.name == logger]


@contextlib.contextmanager
def recording() -> Iterator[Records]:
    root = logging.getLogger()
    handler = Records()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def _step(
    backends: tuple[Any, Any], seed: int, what: str
) -> tuple[list[Req], dict[str, Any], list[Req], dict[str, Any], int, int]:
    """One verify step on the batch with request ``f`` faulty, and on the same batch without it."""
    ours_backend = backends[1]
    vocab = ours_backend.vocab
    size = vocab.vocab_size
    avoid = set(vocab.special_ids) - set(vocab.eos_ids)
    no_go = sorted(vocab.special_ids - set(vocab.eos_ids))
    bs = 2 + seed % 4
    theirs_a, ours_a, rng = _batch(backends, seed, bs)
    _, ours_b, _ = _batch(backends, seed, bs)
    live = _live(ours_a)
    if not live:
        # Every batch gets one live grammar to break.
        t, o = compile_pair(backends, KEYS[seed % len(KEYS)])
        theirs_a[0], ours_a[0] = t, o
        _, ours_b[0] = compile_pair(backends, KEYS[seed % len(KEYS)])
        live = [0]
    f = live[seed % len(live)]
    width = 2 + seed % 4
    ids = make_chain(rng, theirs_a, size, width, avoid)
    logits = make_logits(rng, ids, size, no_go)
    lens = torch.from_numpy(rng.integers(1, width + 1, bs)).to(torch.int32)
    # The faulty request's matcher raises in its fill (armed now) or at commit (armed after the verify).
    ours_a[f].matcher = Raising(ours_a[f].matcher, "fill" if what == "fill" else "accept", armed=what == "fill")
    reqs_a = [Req(f"r{i}", g) for i, g in enumerate(ours_a)]
    keep = [i for i in range(bs) if i != f]
    reqs_b = [Req(f"r{i}", ours_b[i]) for i in keep]
    rows_b = np.concatenate([np.arange(i * width, (i + 1) * width) for i in keep])
    got_a = run_verify(reqs_a, ids, logits, lens, size, maskplug_rows=True)
    got_a["lens"] = lens
    got_b = run_verify(reqs_b, ids[keep], logits[rows_b], lens[keep], size, maskplug_rows=True)
    if what == "commit":
        ours_a[f].matcher.armed = True
    got_a["retained"] = advance(reqs_a, got_a, width)
    got_b["retained"] = advance(reqs_b, got_b, width)
    return reqs_a, got_a, reqs_b, got_b, f, width


def _same_for_the_others(got_a: dict[str, Any], got_b: dict[str, Any], f: int, width: int) -> None:
    bs = got_a["correct_len"].shape[0]
    keep = [i for i in range(bs) if i != f]
    for k in ("correct_len", "bonus", "commit_lens", "out"):
        assert torch.equal(got_a[k][keep], got_b[k]), k
    rows = np.concatenate([np.arange(i * width, (i + 1) * width) for i in keep])
    if got_b["mask"] is not None:
        assert torch.equal(got_a["mask"][rows], got_b["mask"])
    else:
        assert bool((got_a["mask"][rows] == -1).all())
    # advance() gives None for a batch without grammars, else one entry per request (None: no grammar).
    retained_b = got_b["retained"] if got_b["retained"] is not None else [None] * len(keep)
    assert [got_a["retained"][i] for i in keep] == retained_b


@given(seed=st.integers(0, 2**32 - 1))
def test_a_fill_fault_aborts_its_request_once_and_leaves_the_others(bpe_backends: tuple[Any, Any], seed: int) -> None:
    with recording() as log:
        reqs_a, got_a, reqs_b, got_b, f, width = _step(bpe_backends, seed, "fill")
    bad = reqs_a[f]
    assert isinstance(bad.to_finish, FINISH_ABORT)
    assert bad.to_finish.message.startswith(ERROR_PREFIX) and "injected fault in fill" in bad.to_finish.message
    assert bad.to_finish.status_code == 500
    assert isinstance(bad.grammar.error, GrammarError)
    assert all(r.to_finish is None for i, r in enumerate(reqs_a) if i != f)
    assert all(r.to_finish is None for r in reqs_b)
    # Its kept rows allow only the stop tokens.
    stop = stop_row(bpe_backends[1].vocab)
    kept = int(got_a["lens"][f])
    assert all(torch.equal(row, stop) for row in got_a["mask"][f * width : f * width + kept])
    _same_for_the_others(got_a, got_b, f, width)
    # Logged once, naming the request; SGLang's barrier did not abort it a second time.
    records = log.messages("maskplug_sglang.backend")
    assert len(records) == 1 and f"r{f}" in records[0]
    assert not any("Grammar accept_token failed" in m for m in log.messages())


@given(seed=st.integers(0, 2**32 - 1))
def test_a_commit_fault_aborts_its_request_through_sglang_and_leaves_the_others(
    bpe_backends: tuple[Any, Any], seed: int
) -> None:
    with recording() as log:
        reqs_a, got_a, _, got_b, f, width = _step(bpe_backends, seed, "commit")
    bad = reqs_a[f]
    grammar = bad.grammar
    assert isinstance(grammar.error, GrammarError)
    # SGLang's own commit path caught the error and aborted the request with its text, naming it in its log.
    assert isinstance(bad.to_finish, FINISH_ABORT)
    assert "injected fault in accept" in bad.to_finish.message and ERROR_PREFIX in bad.to_finish.message
    assert sum("Grammar accept_token failed" in m and f"r{f}" in m for m in log.messages()) == 1
    assert log.messages("maskplug_sglang.backend") == []
    assert all(r.to_finish is None for i, r in enumerate(reqs_a) if i != f)
    _same_for_the_others(got_a, got_b, f, width)
    # The next step: stop-only rows for it, no second abort, the matcher is not called again.
    grammar.matcher = None
    mask = allocate_mask(bpe_backends[1].vocab.vocab_size, 1)
    grammar.fill_vocab_mask(mask, 0)
    assert torch.equal(mask[0], stop_row(bpe_backends[1].vocab))
    grammar.accept_token(1)  # ignored: already reported
    assert not grammar.is_terminated()


def test_fill_vocab_mask_batched_isolates_a_raising_matcher(bpe_backends: tuple[Any, Any]) -> None:
    """SGLang's own (non-speculative) fill path: one raising grammar gets the stop row, the others their masks."""
    vocab = bpe_backends[1].vocab
    grammars = [compile_pair(bpe_backends, KEYS[k])[1] for k in (0, 3, 5)]
    clean = allocate_mask(vocab.vocab_size, 3)
    MaskplugGrammar.fill_vocab_mask_batched([GrammarRow(row=i, grammar=g) for i, g in enumerate(grammars)], clean)
    grammars[1].matcher = Raising(grammars[1].matcher, "fill")
    got = allocate_mask(vocab.vocab_size, 3)
    MaskplugGrammar.fill_vocab_mask_batched([GrammarRow(row=i, grammar=g) for i, g in enumerate(grammars)], got)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[2], clean[2])
    assert torch.equal(got[1], stop_row(vocab))
    assert grammars[1].error is not None and "injected fault in fill" in str(grammars[1].error)
    with pytest.raises(ValueError, match="injected fault in fill"):
        grammars[1].accept_token(5)  # SGLang's commit paths abort the request on this ValueError
    grammars[1].accept_token(5)  # once


def test_a_batched_fill_that_raises_is_redone_one_grammar_at_a_time(bpe_backends: tuple[Any, Any]) -> None:
    vocab = bpe_backends[1].vocab
    grammars = [compile_pair(bpe_backends, KEYS[k])[1] for k in (1, 2)]
    clean = allocate_mask(vocab.vocab_size, 2)
    for i, g in enumerate(grammars):
        g.fill_vocab_mask(clean, i)
    ops = grammars[0].matcher.batch_ops
    assert ops is not None and grammars[1].matcher.batch_ops is ops

    class Broken:
        def fill(self, *args: Any) -> None:
            raise RuntimeError("batched fill broke")

    for g in grammars:
        g.matcher = _WithOps(g.matcher, Broken())
    got = allocate_mask(vocab.vocab_size, 2)
    MaskplugGrammar.fill_vocab_mask_batched([GrammarRow(row=i, grammar=g) for i, g in enumerate(grammars)], got)
    assert torch.equal(got, clean)
    assert all(g.error is None for g in grammars)


class _WithOps:
    """A matcher whose ``batch_ops`` is replaced (every other attribute is the inner matcher's)."""

    def __init__(self, inner: Any, ops: Any) -> None:
        self.inner, self.batch_ops = inner, ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_fill_draft_chains_isolates_a_raising_matcher(bpe_backends: tuple[Any, Any]) -> None:
    backends = bpe_backends
    vocab = backends[1].vocab
    size = vocab.vocab_size
    rng = np.random.default_rng(7)
    theirs, ours = zip(*(compile_pair(backends, KEYS[k]) for k in (0, 4, 6)), strict=True)
    width = 4
    avoid = set(vocab.special_ids) - set(vocab.eos_ids)
    ids = make_chain(rng, list(theirs), size, width, avoid)
    clean = allocate_mask(size, 3 * width)
    acc_clean = fill_draft_chains(list(ours), ids, clean)
    ours[1].matcher = Raising(ours[1].matcher, "accept")
    got = allocate_mask(size, 3 * width)
    acc = fill_draft_chains(list(ours), ids, got)
    assert acc[0] == acc_clean[0] and acc[2] == acc_clean[2] and acc[1] == 0
    assert torch.equal(got[:width], clean[:width]) and torch.equal(got[2 * width :], clean[2 * width :])
    stop = stop_row(vocab)
    assert all(torch.equal(row, stop) for row in got[width : 2 * width])
    assert ours[1].error is not None and "injected fault in accept" in str(ours[1].error)


@pytest.mark.parametrize("scheduler", ["verify-all", "grammar-aware:goodput"])
@given(seed=st.integers(0, 2**32 - 1))
def test_a_fill_fault_through_the_dspark_patches_aborts_only_its_request(
    bpe_backends: tuple[Any, Any], scheduler: str, seed: int
) -> None:
    """The decode step as SGLang's worker runs it with the patches in place (see ``test_dspark_patches``)."""
    vocab = bpe_backends[1].vocab
    size = vocab.vocab_size
    avoid = set(vocab.special_ids) - set(vocab.eos_ids)
    rng = np.random.default_rng(seed)
    bs, gamma = 2 + seed % 3, 1 + seed % 4
    width = gamma + 1
    theirs_g, ours_g = make_batch(rng, bpe_backends, bs)
    live = _live(ours_g)
    if not live:
        theirs_g[0], ours_g[0] = compile_pair(bpe_backends, KEYS[seed % len(KEYS)])
        live = [0]
    f = live[seed % len(live)]
    ids = make_chain(rng, theirs_g, size, width, avoid)
    logits = make_logits(rng, ids, size, sorted(avoid))
    ours_g[f].matcher = Raising(ours_g[f].matcher, "fill")
    reqs = [Req(f"q{i}", g) for i, g in enumerate(ours_g)]
    proposal = types.SimpleNamespace(
        draft_block_ids=ids[:, :1].clone(),
        draft_block=types.SimpleNamespace(draft_tokens=ids[:, 1:].clone()),
        confidence=torch.from_numpy(rng.uniform(0.05, 1.0, (bs, gamma)).astype(np.float32)),
        verify_ids=None,
    )
    batch = types.SimpleNamespace(
        reqs=reqs,
        forward_mode=types.SimpleNamespace(is_idle=lambda: False),
        sampling_info=types.SimpleNamespace(vocab_size=size, grammar_mask=None),
        spec_info=types.SimpleNamespace(verify_token_budget=None),
        seq_lens=torch.full((bs,), 10, dtype=torch.int64),
        req_pool_indices=torch.arange(bs, dtype=torch.int64),
    )
    worker = Worker(verify_planner(gamma), proposal, logits)
    already = patches.installed()
    patches.install()
    try:
        with pytest.MonkeyPatch.context() as mp, recording() as log:
            mp.setenv("MASKPLUG_SCHEDULER", scheduler)
            patched_forward_decode(worker, batch, None, grammar_barrier=None)
    finally:
        if not already:
            patches.uninstall()
    bad = reqs[f]
    assert isinstance(bad.to_finish, FINISH_ABORT) and "injected fault in fill" in bad.to_finish.message
    assert all(r.to_finish is None for i, r in enumerate(reqs) if i != f)
    records = log.messages("maskplug_sglang.backend")
    assert len(records) == 1 and f"q{f}" in records[0]
    lens = worker.seen["layout"].verify_lens.to(torch.int64)
    stop = stop_row(vocab)
    assert all(torch.equal(row, stop) for row in worker.seen["mask"][f * width : f * width + int(lens[f])])
    if scheduler.startswith("grammar-aware"):
        # Its drafts were worth nothing to the budget: none of them was verified.
        assert int(lens[f]) == 1
    else:
        # Every draft verified: the others' masks and outcomes are those of the batch without it.
        keep = [i for i in range(bs) if i != f]
        rows = np.concatenate([np.arange(i * width, (i + 1) * width) for i in keep])
        alone = run_verify(
            [reqs[i] for i in keep], ids[keep], logits[rows], lens[keep].to(torch.int32), size, maskplug_rows=True
        )
        assert torch.equal(worker.seen["correct_len"][keep], alone["correct_len"])
        assert torch.equal(worker.seen["bonus"][keep], alone["bonus"])
        if alone["mask"] is not None:
            assert torch.equal(worker.seen["mask"][rows], alone["mask"])


@pytest.mark.parametrize("strategy", ["auto", "walk"])
def test_fill_draft_trees_isolates_a_raising_matcher(bpe_backends: tuple[Any, Any], strategy: str) -> None:
    """EAGLE tree windows: the failing request gets the stop-only root row and no valid node; the others as before."""
    vocab = bpe_backends[1].vocab
    ran = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        size, _, batch, width, _, ours_l, nt, ns, tk = trees_test._batch(bpe_backends, rng)
        live = _live(ours_l)
        if not live or width < 2:
            continue
        f = live[seed % len(live)]
        clean = allocate_mask(size, batch * width)
        want = fill_draft_trees(ours_l, tk, nt, ns, clean, size, strategy=strategy)
        ours_l[f].matcher = Raising(ours_l[f].matcher, "fill")
        got_mask = allocate_mask(size, batch * width)
        got = fill_draft_trees(ours_l, tk, nt, ns, got_mask, size, strategy=strategy)
        others = [i for i in range(batch) if i != f]
        for i in others:
            assert torch.equal(got_mask[i * width : (i + 1) * width], clean[i * width : (i + 1) * width])
        assert np.array_equal(got.valid[others], want.valid[others])
        assert torch.equal(got_mask[f * width], stop_row(vocab))
        assert not got.valid[f, 1:].any()
        assert ours_l[f].error is not None and "injected fault in fill" in str(ours_l[f].error)
        ran += 1
    assert ran >= 4  # batches with a live grammar and a window to walk
