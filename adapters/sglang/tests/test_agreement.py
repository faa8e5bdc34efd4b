"""Masks, accepts and rollbacks of maskplug's grammar objects against SGLang's own xgrammar backend object.

Both objects are driven through SGLang's ``BaseGrammarObject`` methods with the
same token streams; after every step the two vocab masks must be identical and
both must agree on termination and on which tokens they refuse.

One deliberate difference, tested by name below: with a Hugging Face tokenizer,
SGLang's xgrammar path treats the literal text of non-stop special tokens
(``<s>``, ``<pad>``) as ordinary text, so inside a JSON string it allows them;
maskplug's vocabulary marks them as control tokens that no grammar produces.
Every other bit must match.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import BPE_VOCAB_SIZE, allowed_ids, compile_pair, control_columns, grammar_keys
from hypothesis import given
from hypothesis import strategies as st
from maskplug_sglang.backend import MaskplugGrammar, TokenRejected

from maskplug import GrammarError, LayoutError

KEYS = grammar_keys()


class Pair:
    """SGLang's grammar object and ours, stepped together and compared after every step."""

    def __init__(self, theirs: Any, ours: MaskplugGrammar, vocab_size: int) -> None:
        self.theirs, self.ours = theirs, ours
        self.vocab_size = vocab_size
        self.ignore = ~control_columns(ours.vocab)
        self.mt = theirs.allocate_vocab_mask(vocab_size, 1, "cpu")
        self.mo = ours.allocate_vocab_mask(vocab_size, 1, "cpu")
        self.accepted = 0

    def masks(self) -> torch.Tensor:
        """Fill both masks, check they agree (outside the named control columns); return ours.

        SGLang never fills a terminated grammar (its batch skips them, and
        xgrammar refuses to); ours then allows only the stop tokens.
        """
        if self.ours.is_terminated():
            assert self.theirs.is_terminated()
            self.ours.fill_vocab_mask(self.mo, 0)
            assert allowed_ids(self.mo[0], self.vocab_size).tolist() == sorted(self.ours.vocab.eos_ids)
            return self.mo[0]
        self.theirs.fill_vocab_mask(self.mt, 0)
        self.ours.fill_vocab_mask(self.mo, 0)
        assert torch.equal(self.mt[0] & self.ignore, self.mo[0] & self.ignore), (
            f"masks differ after {self.accepted} tokens: "
            f"{sorted(set(allowed_ids(self.mt[0], self.vocab_size)) ^ set(allowed_ids(self.mo[0], self.vocab_size)))[:10]}"
        )
        # maskplug never lets grammar text use a control token.
        assert not torch.any(self.mo[0] & ~self.ignore)
        return self.mo[0]

    def accept(self, token: int) -> bool:
        """Offer ``token`` to both; they must agree whether it is refused (state then unchanged)."""
        was_terminated = self.theirs.is_terminated()
        refused = []
        for obj in (self.theirs, self.ours):
            try:
                obj.accept_token(token)
                refused.append(False)
            except ValueError:
                refused.append(True)
        assert refused[0] == refused[1], f"token {token}: SGLang refused={refused[0]}, maskplug refused={refused[1]}"
        if not refused[0] and not was_terminated:
            self.accepted += 1
        assert self.theirs.is_terminated() == self.ours.is_terminated()
        return not refused[0]

    def rollback(self, k: int) -> None:
        self.theirs.rollback(k)
        self.ours.rollback(k)
        self.accepted -= k
        assert self.theirs.is_terminated() == self.ours.is_terminated()


def _pair(backends: tuple[Any, ...], key: tuple[str, str]) -> Pair:
    theirs, ours = compile_pair(backends, key)
    assert isinstance(ours, MaskplugGrammar), f"{key[0]} grammar did not compile: {ours!r}"
    return Pair(theirs, ours, ours.vocab.vocab_size)


@given(data=st.data())
def test_random_streams_agree(bpe_backends: tuple[Any, Any], data: st.DataObject) -> None:
    """Random walks of accepts (allowed and arbitrary tokens), rollbacks and stop tokens."""
    key = data.draw(st.sampled_from(KEYS), label="key")
    pair = _pair(bpe_backends, key)
    eos = pair.ours.vocab.eos_ids[0]
    control = set(pair.ours.vocab.special_ids) - {eos}
    steps = data.draw(st.integers(1, 40), label="steps")
    for _ in range(steps):
        row = pair.masks()
        op = data.draw(st.sampled_from(["allowed", "allowed", "allowed", "any", "eos", "rollback"]), label="op")
        if op == "allowed":
            ok = allowed_ids(row, pair.vocab_size)
            if ok.size == 0:
                continue
            assert pair.accept(int(ok[data.draw(st.integers(0, ok.size - 1), label="pick")]))
        elif op == "any":
            # Any id the model could emit, control tokens aside (the named difference).
            t = data.draw(st.integers(0, pair.vocab_size - 1).filter(lambda t: t not in control), label="token")
            expect = bool(row[t >> 5] >> (t & 31) & 1) or pair.ours.is_terminated()
            assert pair.accept(t) == expect
        elif op == "eos":
            pair.accept(eos)
        elif pair.accepted:
            pair.rollback(data.draw(st.integers(1, pair.accepted), label="k"))
    pair.masks()


@pytest.mark.parametrize("key", KEYS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(KEYS)])
def test_complete_outputs_terminate_alike(bpe_backends: tuple[Any, Any], key: tuple[str, str]) -> None:
    """Walk each grammar to a complete output, stop, then roll the stop token back (it counts as one)."""
    pair = _pair(bpe_backends, key)
    vocab = pair.ours.vocab
    eos = vocab.eos_ids[0]
    closers = np.array(
        [bool(t) and set(t) <= set(b'"}]') for t in vocab.tokens] + [False] * (pair.vocab_size - len(vocab))
    )
    rng = np.random.default_rng(7)
    for _ in range(400):
        row = pair.masks()
        if row[eos >> 5] >> (eos & 31) & 1 and rng.random() < 0.3:
            break
        ok = allowed_ids(row, pair.vocab_size)
        ok = ok[ok != eos]
        if ok.size == 0:
            assert row[eos >> 5] >> (eos & 31) & 1, "a dead end: neither text nor the stop token allowed"
            break
        # Lean towards closing quotes and brackets so every walk reaches a complete output.
        close = ok[closers[ok]]
        pick = close if close.size and rng.random() < 0.5 else ok
        assert pair.accept(int(rng.choice(pick)))
    else:
        raise AssertionError(
            f"the walk did not reach a complete output in 400 tokens: {bytes(b''.join(vocab.tokens[t] for t in pair.theirs.accepted_tokens))[-300:]!r}"
        )
    assert pair.accept(eos)
    assert pair.theirs.is_terminated() and pair.ours.is_terminated()
    # After termination SGLang ignores further tokens; so do we.
    before = pair.ours.num_accepted
    pair.ours.accept_token(int(allowed_ids(pair.masks(), pair.vocab_size)[0]))
    assert pair.ours.num_accepted == before
    pair.rollback(1)
    assert not pair.ours.is_terminated()
    pair.masks()
    pair.rollback(pair.accepted)
    pair.masks()


def test_special_token_text_is_the_named_difference(bpe_backends: tuple[Any, Any], bpe_tokenizer: Any) -> None:
    """Inside a JSON string SGLang's xgrammar path allows ``<s>``/``<pad>`` as text; maskplug does not."""
    pair = _pair(bpe_backends, ("json", '{"type": "string"}'))
    assert pair.accept(bpe_tokenizer.convert_tokens_to_ids('"'))
    pair.masks()  # equal outside the control columns
    specials = [bpe_tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "<pad>")]
    for t in specials:
        assert pair.mt[0][t >> 5] >> (t & 31) & 1, "SGLang's xgrammar path allows the special token's text"
        assert not pair.mo[0][t >> 5] >> (t & 31) & 1, "maskplug treats it as a control token"
        with pytest.raises(TokenRejected):
            pair.ours.accept_token(t)


def test_copy_is_a_fresh_grammar_like_sglangs(bpe_backends: tuple[Any, Any]) -> None:
    pair = _pair(bpe_backends, ("regex", r"(yes|no|maybe)( please)?"))
    row = pair.masks()
    assert pair.accept(int(allowed_ids(row, pair.vocab_size)[0]))
    fresh = Pair(pair.theirs.copy(), pair.ours.copy(), pair.vocab_size)
    fresh.masks()
    stats = fresh.ours.grammar_stats
    assert fresh.ours.num_accepted == 0 and stats is not None and stats.is_cache_hit
    # The original is untouched by the copy.
    pair.masks()


def test_sglang_cache_path_hands_out_copies(bpe_backends: tuple[Any, Any]) -> None:
    """SGLang's own ``get_cached_or_future_value``/``set_cache`` on our backend."""
    _, ours = bpe_backends
    key = ("regex", r"[a-z]{2,6}-\d{2,4}")
    value, hit = ours.get_cached_or_future_value(key, False)
    assert not hit
    grammar = value.result(timeout=60)
    assert isinstance(grammar, MaskplugGrammar)
    ours.set_cache(key, grammar.copy())
    again, hit = ours.get_cached_or_future_value(key, False)
    assert hit and isinstance(again, MaskplugGrammar) and again is not grammar
    assert again.compiled is grammar.compiled
    ours.reset()
    assert not ours.cache


def test_batched_fill_matches_sglangs_rows(bpe_backends: tuple[Any, Any]) -> None:
    """``fill_vocab_mask_batched`` writes exactly the listed rows, each equal to SGLang's row."""
    from sglang.srt.constrained.base_grammar_backend import GrammarRow

    pairs = [_pair(bpe_backends, k) for k in KEYS[:6]]
    rng = np.random.default_rng(3)
    for p in pairs:  # put the grammars in different states
        for _ in range(int(rng.integers(0, 6))):
            ok = allowed_ids(p.masks(), p.vocab_size)
            ok = ok[ok != p.ours.vocab.eos_ids[0]]
            if ok.size:
                p.accept(int(rng.choice(ok)))
    rows = [1, 3, 4, 6, 7, 9]
    theirs = pairs[0].theirs.allocate_vocab_mask(BPE_VOCAB_SIZE, 11, "cpu")
    ours = pairs[0].ours.allocate_vocab_mask(BPE_VOCAB_SIZE, 11, "cpu")
    type(pairs[0].theirs).fill_vocab_mask_batched(
        [GrammarRow(r, p.theirs) for r, p in zip(rows, pairs, strict=True)], theirs
    )
    MaskplugGrammar.fill_vocab_mask_batched([GrammarRow(r, p.ours) for r, p in zip(rows, pairs, strict=True)], ours)
    keep = pairs[0].ignore
    assert torch.equal(theirs & keep, ours & keep)
    untouched = [r for r in range(11) if r not in rows]
    assert torch.all(ours[untouched] == -1)
    MaskplugGrammar.reset_vocab_mask(ours)
    assert torch.all(ours == -1)


@pytest.mark.parametrize(
    ("key", "prefix"),
    [
        (
            (
                "json",
                '{"type": "object", "properties": {"street_name": {"type": "string"}}, "required": ["street_name"]}',
            ),
            '{"',
        ),
        (("ebnf", 'root ::= "status: " ("accepted" | "rejected") " at " [0-9]+'), ""),
        (("regex", r"order-[0-9]{3} confirmed"), "order-123"),
    ],
)
def test_jump_forward_is_forced_under_sglangs_masks(
    bpe_backends: tuple[Any, Any], bpe_tokenizer: Any, key: tuple[str, str], prefix: str
) -> None:
    """Every jumped token is forced text under SGLang's own masks; the look-ahead leaves the state as it was."""
    pair = _pair(bpe_backends, key)
    for t in bpe_tokenizer.encode(prefix, add_special_tokens=False):
        pair.masks()
        assert pair.accept(t)
    helper = pair.ours.try_jump_forward(bpe_tokenizer)
    pair.masks()  # state unchanged by the look-ahead
    assert helper is not None
    tokens, text = helper
    assert bpe_tokenizer.decode(tokens) == text
    # SGLang's xgrammar object finds a forced string; ours is a prefix of it.
    forced = pair.theirs.try_jump_forward(bpe_tokenizer)
    assert forced is not None and forced[1].startswith(text), (forced, text)
    vocab = pair.ours.vocab
    for t in tokens:
        pair.masks()
        ids = allowed_ids(pair.mt[0] & pair.ignore, pair.vocab_size)
        assert t in ids and all(vocab.tokens[i].startswith(vocab.tokens[t]) for i in ids)
        assert pair.accept(t)
    assert pair.ours.jump_forward_str_state(helper) == (text, len(tokens))
    # SGLang's jump: the output text grows by the forced text and is re-tokenized;
    # both objects roll back to the common prefix and accept the new ids.
    pair.rollback(len(tokens))
    old_ids = bpe_tokenizer.encode(prefix, add_special_tokens=False)
    new_ids = bpe_tokenizer.encode(prefix + text, add_special_tokens=False)
    pair.ours.jump_and_retokenize(old_ids, new_ids, len(tokens))
    pair.theirs.jump_and_retokenize(old_ids, new_ids, -1)
    pair.accepted = pair.ours.num_accepted
    assert pair.accepted == len(new_ids)
    pair.masks()


def test_bad_input_raises_and_leaves_state(bpe_backends: tuple[Any, Any]) -> None:
    pair = _pair(bpe_backends, ("regex", r"(yes|no|maybe)( please)?"))
    row = pair.masks().clone()
    with pytest.raises(GrammarError, match="token"):
        pair.ours.accept_token(BPE_VOCAB_SIZE + 5)
    with pytest.raises(GrammarError, match="k: expected an int in \\[0, 0\\]"):
        pair.ours.rollback(1)
    with pytest.raises(LayoutError, match="vocab_size"):
        pair.ours.allocate_vocab_mask(BPE_VOCAB_SIZE + 64, 2, "cpu")
    wrong = torch.full((2, 3), -1, dtype=torch.int32)
    with pytest.raises(GrammarError, match="words"):
        pair.ours.fill_vocab_mask(wrong, 0)
    assert torch.all(wrong == -1)
    assert torch.equal(pair.masks(), row)


def test_unsupported_and_invalid_grammars_are_sglang_invalid_objects(bpe_backends: tuple[Any, Any]) -> None:
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    _, ours = bpe_backends
    bad = ours._init_value_dispatch(("regex", "(unclosed"), False)
    assert isinstance(bad, InvalidGrammarObject) and "regex" in bad.error_message
    tag = ours._init_value_dispatch(("structural_tag", "{}"), False)
    assert isinstance(tag, InvalidGrammarObject)
