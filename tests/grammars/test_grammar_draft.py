"""fill_draft_masks and commit, against the slow per-row oracle, for every registered provider."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from grammar_testkit import (
    PROVIDERS,
    REGEXES,
    allowed_ids,
    compiled,
    disallowed_token,
    random_walk,
    reference_rows,
    state_of,
    vocab,
)
from hypothesis import given
from hypothesis import strategies as st

from maskplug import GrammarError, GrammarRows, GrammarSpec, LayoutError, ScheduledLayout, commit, fill_draft_masks

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")


def _make_case(provider: str, vocab_name: str, rng: random.Random, n_req: int, max_drafts: int, mode: str):
    """A random batch: some grammar requests (random order) with valid / invalid / stopping drafts."""
    v = vocab(vocab_name)
    num_bonus = rng.choice([1, 1, 2])
    num_drafts = [rng.randint(0, max_drafts) for _ in range(n_req)]
    req_ids = [f"r{i}" for i in range(n_req)]
    layout = ScheduledLayout(req_ids, num_drafts, [1] * n_req, num_bonus=num_bonus)
    grammar = [i for i in range(n_req) if rng.random() < 0.8] or [0]
    rng.shuffle(grammar)
    stride = max(num_drafts[i] for i in grammar) + num_bonus + rng.randint(0, 2)
    fixed = mode == "fixed"
    rows = GrammarRows(
        [req_ids[i] for i in grammar], mode="fixed" if fixed else "ragged", stride=stride if fixed else None
    )
    matchers, drafts, gates = [], [], []
    for i in grammar:
        spec = GrammarSpec("regex", rng.choice(REGEXES))
        m = compiled(provider, vocab_name, spec).matcher()
        # Some matchers start mid-text.
        pre = random_walk(m, v, rng, rng.randint(0, 3), stop=False)
        for t in pre:
            assert m.accept(t)
        k = num_drafts[i]
        kind = rng.choice(["valid", "invalid", "stop", "stop"])
        walk = random_walk(m, v, rng, k, stop=kind == "stop")
        walk += [rng.randrange(len(v.tokens)) for _ in range(k - len(walk))]  # past the end: random ids
        if kind == "invalid" and k:
            q = rng.randrange(k)
            took = 0
            for t in walk[:q]:
                if not m.accept(t):
                    break
                took += 1
            if took == q:
                walk[q] = disallowed_token(m, v, rng)
            if took:
                m.rollback(took)
        gates.append(rng.choice([0, 0, 0, rng.randint(0, k + num_bonus + 1)]))
        matchers.append(m)
        drafts.append(walk)
    return v, layout, rows, grammar, matchers, drafts, gates


def _check(v, layout, rows, grammar, matchers, drafts, gates, *, flat: bool, strategy: str = "auto") -> None:
    probes = [[*d, 0] for d in drafts]
    before = [state_of(m, v, p) for m, p in zip(matchers, probes, strict=True)]
    refs = [reference_rows(m, v, d, layout.num_bonus, g) for m, d, g in zip(matchers, drafts, gates, strict=True)]
    assert [state_of(m, v, p) for m, p in zip(matchers, probes, strict=True)] == before
    total = rows.num_rows(layout)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (total + 2, v.mask_words), dtype=torch.int32)
    tail = bitmask[total:].clone()
    arg = drafts
    if flat:
        by_req = dict(zip(grammar, drafts, strict=True))
        arg = np.array(
            [t for i in range(layout.n) for t in by_req.get(i, [7] * int(layout.num_drafts[i]))], dtype=np.int64
        )
    out = fill_draft_masks(matchers, arg, bitmask, rows, layout, active_from=gates, strategy=strategy, threads=2)
    assert [state_of(m, v, p) for m, p in zip(matchers, probes, strict=True)] == before
    assert torch.equal(bitmask[total:], tail), "rows past the producer's rows were written"
    mapping = rows.mapping(layout)
    per = rows.rows_per_request(layout)
    start = 0
    for g, i in enumerate(grammar):
        assert out.request[g] == i
        assert out.acceptable[g] == refs[g].acceptable
        need = int(layout.num_drafts[i]) + layout.num_bonus
        for p in range(int(per[g])):
            got = bitmask[start + p].numpy()
            if p < need:
                assert mapping.position[start + p] == p
                np.testing.assert_array_equal(got, refs[g].rows[p], err_msg=f"request {g} row {p}")
                assert bool(out.forced[g, p]) == refs[g].forced[p]
            else:
                assert mapping.request[start + p] == -1
                assert (got == -1).all()
        assert not out.forced[g, need:].any()
        start += int(per[g])


@pytest.mark.parametrize("provider", PROVIDERS)
@given(
    seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(["ragged", "fixed"]),
    flat=st.booleans(),
    strategy=st.sampled_from(["auto", "threads", "serial"]),
)
def test_fill_draft_masks_matches_reference(provider: str, seed: int, mode: str, flat: bool, strategy: str) -> None:
    rng = random.Random(seed)
    case = _make_case(provider, "spm", rng, rng.randint(1, 5), 5, mode)
    _check(*case, flat=flat, strategy=strategy)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("strategy", ["auto", "threads", "serial"])
def test_fill_draft_masks_real_131k_vocab(provider: str, strategy: str) -> None:
    rng = random.Random(1000 + len(strategy))
    case = _make_case(provider, "tekken", rng, 12, 7, rng.choice(["ragged", "fixed"]))
    _check(*case, flat=False, strategy=strategy)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fill_draft_masks_stop_and_rejection_semantics(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("choice", ["yes", "no"]))
    m = c.matcher()
    bm = v.new_bitmask(1)
    m.fill(bm, 0)
    first = [int(t) for t in allowed_ids(bm[0], v.vocab_size)]
    word = next(t for t in first if v.tokens[t] in (b"yes", b"no"))
    eos = v.eos_ids[0]
    layout = ScheduledLayout(["a", "b"], [4, 3], [1, 1])
    rows = GrammarRows(["b", "a"])
    m2 = c.matcher()
    bad = disallowed_token(m2, v, random.Random(0))
    drafts = [[bad, word, eos], [word, eos, word, word]]  # rows order: b, a
    bitmask = v.new_bitmask(rows.num_rows(layout))
    out = fill_draft_masks([m2, m], drafts, bitmask, rows, layout)
    assert out.request.tolist() == [1, 0]
    assert out.acceptable.tolist() == [0, 2]  # b: refused at once; a: the word and the stop token
    # b: row 0 constrained (the first mask), rows 1..3 all-allowed.
    assert (bitmask[0] != -1).any() and (bitmask[1:4] == -1).all()
    # a: row 0 the first mask, row 1 only the stop token (the choice is complete), rows 2..4 all-allowed.
    assert torch.equal(bitmask[4], bitmask[0])
    assert allowed_ids(bitmask[5], v.vocab_size).tolist() == [eos]
    assert out.forced[1, 1] and not out.forced[1, 0]
    assert (bitmask[6:9] == -1).all()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fill_draft_masks_bad_input_leaves_everything_untouched(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("regex", REGEXES[0]))
    ms = [c.matcher(), c.matcher()]
    layout = ScheduledLayout([0, 1], [2, 2], [1, 1])
    rows = GrammarRows([0, 1])
    bitmask = torch.zeros(rows.num_rows(layout), v.mask_words, dtype=torch.int32)
    walk = random_walk(ms[0], v, random.Random(1), 2, stop=False)
    cases = [
        (ms, [walk, [5]], bitmask, LayoutError),  # wrong draft count
        (ms[:1], [walk, walk], bitmask, LayoutError),  # one matcher short
        (ms, [walk, walk], bitmask[:, :-1].contiguous(), GrammarError),  # wrong width
        (ms, [walk, walk], bitmask[:-1], GrammarError),  # too few rows
        (ms, [walk, walk], bitmask.to(torch.int64), GrammarError),
    ]
    for matchers, drafts, bm, exc in cases:
        before = bm.clone()
        states = [state_of(m, v, walk) for m in ms]
        with pytest.raises(exc):
            fill_draft_masks(matchers, drafts, bm, rows, layout)
        assert torch.equal(bm, before)
        assert [state_of(m, v, walk) for m in ms] == states
    with pytest.raises(LayoutError, match="strategy"):
        fill_draft_masks(ms, [walk, walk], bitmask, rows, layout, strategy="gpu")
    with pytest.raises(LayoutError, match="active_from"):
        fill_draft_masks(ms, [walk, walk], bitmask, rows, layout, active_from=[0, -1])


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("bad", [-1, "vocab_size"])
def test_a_draft_outside_the_vocabulary_fails_only_its_request(provider: str, bad: object) -> None:
    """Not a batch-wide error: that request gets stop-only rows and is reported; the other is served as usual."""
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("regex", REGEXES[0]))
    ms = [c.matcher(), c.matcher()]
    layout = ScheduledLayout([0, 1], [2, 2], [1, 1])
    rows = GrammarRows([0, 1])
    walk = random_walk(ms[0], v, random.Random(1), 2, stop=False)
    walk += [5] * (2 - len(walk))
    tok = v.vocab_size if bad == "vocab_size" else int(bad)  # type: ignore[call-overload]
    states = [state_of(m, v, walk) for m in ms]
    ref = reference_rows(ms[0], v, walk, 1, 0)
    bitmask = torch.zeros(rows.num_rows(layout), v.mask_words, dtype=torch.int32)
    out = fill_draft_masks(ms, [walk, [5, tok]], bitmask, rows, layout)
    assert list(out.failed) == [1]
    err = out.failed[1]
    assert isinstance(err, GrammarError) and str(err).startswith(
        f"drafts[1][1]: expected a token id in [0, {v.vocab_size}), got {tok}"
    )
    for p, want in enumerate(ref.rows):
        np.testing.assert_array_equal(bitmask[p].numpy(), want)
    stop = np.zeros(v.mask_words, dtype=np.int32)
    for e in v.eos_ids:
        stop[e >> 5] |= np.int32(np.uint32(1 << (e & 31)).view(np.int32))
    for p in range(3):
        np.testing.assert_array_equal(bitmask[3 + p].numpy(), stop)
    assert out.acceptable.tolist() == [ref.acceptable, 0]
    assert out.forced[0, :3].tolist() == ref.forced and not out.forced[1].any()
    assert [state_of(m, v, walk) for m in ms] == states


@pytest.mark.parametrize("provider", PROVIDERS)
@given(seed=st.integers(0, 2**32 - 1))
def test_commit_after_random_verification_agrees_with_fresh_matcher(provider: str, seed: int) -> None:
    rng = random.Random(seed)
    v = vocab("spm")
    spec = GrammarSpec("regex", rng.choice(REGEXES))
    c = compiled(provider, "spm", spec)
    m = c.matcher()
    history: list[int] = []
    for _step in range(4):
        k = rng.randint(0, 4)
        drafts = random_walk(m, v, rng, k, stop=rng.random() < 0.3)
        if drafts and rng.random() < 0.4:
            drafts[rng.randrange(len(drafts))] = rng.randrange(len(v.tokens))
        drafts += [rng.randrange(len(v.tokens)) for _ in range(k - len(drafts))]
        layout = ScheduledLayout(["x"], [k], [1])
        bitmask = v.new_bitmask(k + 1)
        out = fill_draft_masks([m], [drafts], bitmask, GrammarRows(["x"]), layout)
        # Verification: accept a random prefix within what the grammar accepts, then sample
        # the bonus/recovered token from the row it falls on.
        a = rng.randint(0, int(out.acceptable[0]))
        emitted = drafts[:a]
        if not any(t in v.eos_ids for t in emitted):
            ok = allowed_ids(bitmask[a], v.vocab_size)
            if ok.size:
                emitted.append(int(rng.choice(ok.tolist())))
        taken = commit(m, emitted)
        assert taken == len(emitted)
        history += emitted
        if m.is_terminated():
            break
    # One comparison after all steps: any step that went wrong shows up in the final state.
    fresh = c.matcher()
    assert commit(fresh, history) == len(history)
    probe = [rng.randrange(len(v.tokens)) for _ in range(3)]
    assert state_of(m, v, probe) == state_of(fresh, v, probe)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_commit_stops_at_termination_and_refusal(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("choice", ["no"]))
    m = c.matcher()
    bm = v.new_bitmask(1)
    m.fill(bm, 0)
    word = next(int(t) for t in allowed_ids(bm[0], v.vocab_size) if v.tokens[int(t)] == b"no")
    eos = v.eos_ids[0]
    assert commit(m, [word, eos, word]) == 2
    assert m.is_terminated()
    m2 = c.matcher()
    bad = disallowed_token(m2, v, random.Random(3))
    assert commit(m2, [bad, word]) == 0
    with pytest.raises(GrammarError, match="tokens"):
        commit(m2, [word, v.vocab_size + 3])
    assert commit(m2, [word]) == 1  # the failed call took nothing


@pytest.mark.parametrize("provider", PROVIDERS)
def test_reasoning_gate_switches_inside_the_window(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("regex", r"[0-9]+"))
    m = c.matcher()
    digit = next(i for i, t in enumerate(v.tokens) if t == b"7")
    letter = next(i for i, t in enumerate(v.tokens) if t == b"x")
    first = v.new_bitmask(1)
    m.fill(first, 0)
    # Drafts 0-1 are reasoning text (a letter the grammar would refuse), the grammar starts at 2.
    drafts = [[letter, letter, digit, digit, letter]]
    layout = ScheduledLayout(["r"], [5], [1])
    bitmask = v.new_bitmask(6)
    out = fill_draft_masks([m], drafts, bitmask, GrammarRows(["r"]), layout, active_from=[2])
    assert (bitmask[0:2] == -1).all()
    assert torch.equal(bitmask[2], first[0])
    assert letter not in allowed_ids(bitmask[3], v.vocab_size) and digit in allowed_ids(bitmask[3], v.vocab_size)
    assert v.eos_ids[0] in allowed_ids(bitmask[4], v.vocab_size)  # "77" is complete
    assert (bitmask[5] == -1).all()  # after the refused letter at draft 4
    assert out.acceptable.tolist() == [4]
    # A gate past the window: nothing is constrained and every draft counts as acceptable.
    out = fill_draft_masks([m], drafts, bitmask, GrammarRows(["r"]), layout, active_from=[9])
    assert (bitmask == -1).all() and out.acceptable.tolist() == [5] and not out.forced.any()
    assert state_of(m, v, [digit]) == state_of(c.matcher(), v, [digit])
