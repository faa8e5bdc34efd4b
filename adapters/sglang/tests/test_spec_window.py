"""Speculative verify windows: SGLang's own draft-tree traversal on both grammar objects.

SGLang builds the grammar mask of a speculative step with ``traverse_tree``
(``sglang.srt.speculative.spec_utils``, imported as is): a depth-first walk
over the draft tree that accepts each draft the parent's mask allows, fills
that node's row, descends, and rolls back one token on the way up. It runs
unchanged on SGLang's xgrammar object and on ours.

Each step: a random draft tree (chains and branches, drafts the grammar allows
and drafts it refuses), both masks compared row by row, the grammars back in
their starting state, then the verifier's outcome committed to both
(accepted drafts plus the bonus token sampled from the masked row) and, in
some steps, accepted in full and rolled back to the verified prefix.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
from conftest import allowed_ids, compile_pair, control_columns, grammar_keys
from hypothesis import given
from hypothesis import strategies as st
from maskplug_sglang.backend import MaskplugGrammar, allocate_mask
from sglang.srt.speculative.spec_utils import traverse_tree

KEYS = grammar_keys()


def _random_tree(
    rng: np.random.Generator,
    oracle: Any,
    vocab_size: int,
    width: int,
    bad_rate: float,
    avoid: set[int],
    chain: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft tree of ``width`` nodes in SGLang's format (first child / next sibling, node 0 = root).

    Drafts are drawn from what ``oracle`` (SGLang's grammar object, advanced along
    the tree and rolled back) allows at the parent, or, with probability
    ``bad_rate``, any token (usually one the grammar refuses).
    """
    parent = [-1] + [int(rng.integers(0, i)) if rng.random() < 0.35 and not chain else i - 1 for i in range(1, width)]
    children: list[list[int]] = [[] for _ in range(width)]
    for i in range(1, width):
        children[parent[i]].append(i)
    tokens = np.zeros(width, dtype=np.int64)
    mask = oracle.allocate_vocab_mask(vocab_size, 1, "cpu")

    def grow(node: int, depth_ok: bool) -> None:
        allowed = np.zeros(0, dtype=np.int64)
        if depth_ok and not oracle.is_terminated():
            oracle.fill_vocab_mask(mask, 0)
            allowed = np.array([t for t in allowed_ids(mask[0], vocab_size) if t not in avoid], dtype=np.int64)
        for c in children[node]:
            if allowed.size and rng.random() >= bad_rate:
                tokens[c] = int(rng.choice(allowed))
                oracle.accept_token(int(tokens[c]))
                grow(c, True)
                oracle.rollback(1)
            else:
                tokens[c] = int(rng.choice([t for t in range(vocab_size) if t not in avoid]))
                grow(c, False)

    grow(0, True)
    next_token = np.full(width, -1, dtype=np.int64)
    next_sibling = np.full(width, -1, dtype=np.int64)
    for node, kids in enumerate(children):
        if kids:
            next_token[node] = kids[0]
            for a, b in itertools.pairwise(kids):
                next_sibling[a] = b
    return torch.from_numpy(next_token), torch.from_numpy(next_sibling), torch.from_numpy(tokens)


def _verified_path(next_token: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, eos: int) -> list[int]:
    """The first-child chain of drafts the masks allow, up to a stop token: what a verifier could accept."""
    path: list[int] = []
    node = 0
    while int(next_token[node]) != -1:
        child = int(next_token[node])
        t = int(tokens[child])
        if not (int(mask[node][t >> 5]) >> (t & 31)) & 1:
            break
        path.append(t)
        if t == eos:  # nothing is verified past a stop token (its row is never filled)
            break
        node = child
    return path


@given(seed=st.integers(0, 2**32 - 1), key_index=st.integers(0, len(KEYS) - 1))
def test_draft_windows_agree_with_sglang(bpe_backends: tuple[Any, Any], seed: int, key_index: int) -> None:
    theirs, ours = compile_pair(bpe_backends, KEYS[key_index])
    assert isinstance(ours, MaskplugGrammar)
    vocab = ours.vocab
    size = vocab.vocab_size
    eos = vocab.eos_ids[0]
    keep = ~control_columns(vocab)
    # Control tokens never appear as drafts here: their literal text is the one named difference.
    avoid = set(vocab.special_ids) - {eos}
    rng = np.random.default_rng(seed)
    for _step in range(int(rng.integers(1, 6))):
        if ours.is_terminated():
            break
        width = int(rng.integers(1, 9))
        nt, ns, toks = _random_tree(rng, theirs, size, width, float(rng.choice([0.0, 0.2, 0.6])), avoid)
        mt = theirs.allocate_vocab_mask(size, width, "cpu")
        mo = ours.allocate_vocab_mask(size, width, "cpu")
        traverse_tree(nt, ns, toks, theirs, mt, vocab_size=size)
        traverse_tree(nt, ns, toks, ours, mo, vocab_size=size)
        assert torch.equal(mt & keep, mo & keep), f"step {_step}: masks differ for tree {toks.tolist()}"
        # Both are back where they started.
        assert ours.is_terminated() == theirs.is_terminated()
        one_t = theirs.allocate_vocab_mask(size, 1, "cpu")
        one_o = ours.allocate_vocab_mask(size, 1, "cpu")
        theirs.fill_vocab_mask(one_t, 0)
        ours.fill_vocab_mask(one_o, 0)
        assert torch.equal(one_t & keep, one_o & keep) and torch.equal(mo[0], one_o[0])

        # The verifier keeps a prefix of the allowed chain, then samples the bonus from its row.
        path = _verified_path(nt, toks, mo, eos)
        keep_n = int(rng.integers(0, len(path) + 1))
        row = 0
        for _ in range(keep_n):
            row = int(nt[row])
        bonus_ids = allowed_ids(mo[row], size)
        if rng.random() < 0.5:
            # The engine's other commit order: every allowed draft first, then roll back.
            for t in path:
                theirs.accept_token(t)
                ours.accept_token(t)
            back = len(path) - keep_n
            if back:
                theirs.rollback(back)
                ours.rollback(back)
            emitted = [] if not bonus_ids.size else [int(rng.choice(bonus_ids))]
        else:
            emitted = path[:keep_n] + ([int(rng.choice(bonus_ids))] if bonus_ids.size else [])
        for t in emitted:
            # SGLang stops feeding at termination; both ignore tokens after it.
            theirs.accept_token(t)
            ours.accept_token(t)
            assert theirs.is_terminated() == ours.is_terminated()
        if not ours.is_terminated():
            theirs.fill_vocab_mask(one_t, 0)
            ours.fill_vocab_mask(one_o, 0)
            assert torch.equal(one_t & keep, one_o & keep)


@given(seed=st.integers(0, 2**32 - 1))
def test_batched_chain_windows_match_sglangs_traversal(bpe_backends: tuple[Any, Any], seed: int) -> None:
    """``fill_draft_chains`` (all requests at once) writes the bits SGLang's ``traverse_tree`` writes per request."""
    from maskplug_sglang.backend import fill_draft_chains

    rng = np.random.default_rng(seed)
    batch, width = int(rng.integers(1, 6)), int(rng.integers(1, 7))
    size = bpe_backends[1].vocab.vocab_size
    eos = bpe_backends[1].vocab.eos_ids[0]
    avoid = set(bpe_backends[1].vocab.special_ids) - {eos}
    theirs_list: list[Any] = []
    ours_list: list[MaskplugGrammar | None] = []
    tokens = np.zeros((batch, width), dtype=np.int64)
    for i in range(batch):
        if rng.random() < 0.2:  # a request without a grammar
            theirs_list.append(None)
            ours_list.append(None)
            continue
        theirs, ours = compile_pair(bpe_backends, KEYS[int(rng.integers(0, len(KEYS)))])
        # A few tokens of history, then a chain of drafts drawn like the trees above.
        _, _, pre = _random_tree(rng, theirs, size, int(rng.integers(1, 4)), 0.0, avoid | {eos}, chain=True)
        one = allocate_mask(size, 1)
        for t in pre[1:].tolist():
            theirs.fill_vocab_mask(one, 0)
            if not (int(one[0][t >> 5]) >> (t & 31)) & 1:
                break  # the chain ran past what the grammar allows (only a stop token was left)
            theirs.accept_token(t)
            ours.accept_token(t)
        drafts = _random_tree(rng, theirs, size, width, float(rng.choice([0.0, 0.3])), avoid, chain=True)[2]
        tokens[i] = drafts.numpy()
        theirs_list.append(theirs)
        ours_list.append(ours)
    nt = torch.from_numpy(np.where(np.arange(width) + 1 < width, np.arange(width) + 1, -1))
    ns = torch.full((width,), -1, dtype=torch.int64)
    want = allocate_mask(size, batch * width)
    want_theirs = allocate_mask(size, batch * width)
    for i in range(batch):
        if ours_list[i] is not None:
            rows = slice(i * width, (i + 1) * width)
            traverse_tree(nt, ns, torch.from_numpy(tokens[i]), ours_list[i], want[rows], vocab_size=size)
            traverse_tree(nt, ns, torch.from_numpy(tokens[i]), theirs_list[i], want_theirs[rows], vocab_size=size)
    got = allocate_mask(size, batch * width)
    acceptable = fill_draft_chains(ours_list, torch.from_numpy(tokens), got)
    assert torch.equal(got, want)
    keep = ~control_columns(bpe_backends[1].vocab)
    assert torch.equal(got & keep, want_theirs & keep)
    for i, g in enumerate(ours_list):
        if g is None:
            assert acceptable[i] == -1
            continue
        # The grammars are back where they started: the first row is the current mask.
        row = allocate_mask(size, 1)
        g.fill_vocab_mask(row, 0)
        assert torch.equal(row[0], got[i * width])
        assert 0 <= acceptable[i] <= width - 1
