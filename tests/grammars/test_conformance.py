"""Cross-provider conformance along random walks over real vocabularies.

Every registered provider (xgrammar, outlines-core, llguidance) is walked in
lockstep through the same regexes over the same real vocabulary, and at every
step, for every provider:

* the mask is sound: each allowed token keeps the text a prefix of the
  language, checked with the ``regex`` package's partial matching (an oracle
  independent of all three engines);
* a stop token is allowed exactly when the text is a full match;
* no control or padding id is ever allowed;
* ``accept`` takes allowed tokens and refuses the others, leaving the state as
  it was;
* maskplug's mask is bit-for-bit the raw engine's own mask (the wrapping adds
  no difference of its own), stop ids aside for outlines-core: its index
  carries maskplug's sentinel token under the first stop id, which maskplug
  turns into "stop ids exactly where the text is complete" (checked against
  the oracle like every provider's stop ids).

The engines do not allow the same sets. Each difference is measured and
must be exactly one of the two named ones (:func:`outlines_sentinel_gap`
and :func:`llguidance_canonical_gap`); anything else fails. outlines-core's
own omission (:func:`passes_final_state`) is closed by maskplug's sentinel
pattern and pinned on the raw engine alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
import outlines_core
import pytest
import regex
import torch
import xgrammar as xgr
from maskplug_outlines.provider import OutlinesProvider

from maskplug.grammar import GrammarSpec, Vocab, grammar_provider, mistral_sentencepiece, mistral_tekken

PROVIDERS = ("xgrammar", "outlines-core", "llguidance")

# Regexes in the common subset of Python's `regex`, Rust's regex-syntax
# (outlines-core, llguidance) and xgrammar. Between them: fixed-length and
# unbounded repetition, alternation, optional tails, free text (so tokens
# that end inside a UTF-8 character) and non-ASCII literals.
REGEXES = {
    "phone": r"[0-9]{3}-[0-9]{4}",
    "words": r"[a-z]+( [a-z]+){0,3}\.",
    "number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
    "quoted": r'"[^"\\]{0,12}"',
    "accents": r"(café|naïve|über)+",
    "pairs": r"(ab|cd)+",
}
# (vocabulary, regex, walks, steps per walk). The 32k SentencePiece vocabulary
# carries most cases; the 131k byte-level BPE a few cheaper ones.
CASES = [("spm", name, 3, 24) for name in REGEXES] + [
    ("tekken", "phone", 2, 12),
    ("tekken", "number", 2, 12),
    ("tekken", "accents", 2, 12),
]

VOCABS: dict[str, Callable[[], Vocab]] = {"spm": mistral_sentencepiece, "tekken": mistral_tekken}


# --------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------

_CONT = (0x80, 0x90, 0xA0, 0xB0, 0xBF)


def _utf8_split(data: bytes) -> tuple[str, bytes] | None:
    """``data`` as (decoded complete part, incomplete trailing bytes), or None if it cannot start valid UTF-8."""
    for cut in range(0, min(3, len(data)) + 1):
        head, tail = data[: len(data) - cut], data[len(data) - cut :]
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not tail:
            return text, b""
        # A tail is a valid start of a character when some continuation completes it.
        if _completions(tail):
            return text, tail
    return None


def _completions(tail: bytes) -> list[str]:
    """A few characters whose UTF-8 encoding starts with ``tail`` (from the corners of each byte range)."""
    lead = tail[0]
    need = 1 if 0xC2 <= lead <= 0xDF else 2 if 0xE0 <= lead <= 0xEF else 3 if 0xF0 <= lead <= 0xF4 else 0
    missing = need + 1 - len(tail)
    if need == 0 or missing <= 0:
        return []
    out = []
    for fill in itertools.product(_CONT, repeat=missing):
        try:
            ch = (tail + bytes(fill)).decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(ch)
    return out


@dataclass
class Oracle:
    """Prefix and full-match questions about one regex, answered by the ``regex`` package."""

    pattern: str
    compiled: Any = field(init=False)
    literal_chars: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.compiled = regex.compile(self.pattern)
        self.literal_chars = {c for c in self.pattern if ord(c) > 0x7F}

    def viable(self, data: bytes) -> bool:
        """Whether some string of the language starts with the bytes ``data``."""
        split = _utf8_split(data)
        if split is None:
            return False
        text, tail = split
        if not tail:
            return self.compiled.fullmatch(text, partial=True) is not None
        # Incomplete last character: try the pattern's own non-ASCII characters
        # that start with these bytes, and characters from the corners of the
        # byte ranges (exact for the classes used here: literals and [^...]).
        cands = [c for c in self.literal_chars if c.encode("utf-8").startswith(tail)] + _completions(tail)
        return any(self.compiled.fullmatch(text + c, partial=True) is not None for c in cands)

    def complete(self, data: bytes) -> bool:
        """Whether the bytes ``data`` are a full match."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return self.compiled.fullmatch(text) is not None


def test_oracle_on_known_prefixes() -> None:
    o = Oracle(REGEXES["accents"])
    assert o.viable(b"") and o.viable(b"caf") and o.viable(b"caf" + "é".encode()[:1])
    assert o.viable(b"\xc3") and not o.viable(b"\xe6") and not o.viable(b"cafe") and not o.viable(b"caf\xa9")
    assert o.complete("naïve".encode()) and not o.complete(b"na")
    q = Oracle(REGEXES["quoted"])
    assert q.viable(b'"\xe6\x97') and q.viable(b'"\xf0') and not q.viable(b'"\xff')
    assert q.complete(b'"ab"') and not q.viable(b'"ab"c')


# --------------------------------------------------------------------------
# Raw engines, driven directly, to compare with maskplug's wrappers
# --------------------------------------------------------------------------


class RawEngine:
    """One raw engine matcher for a compiled maskplug grammar: accept and fill, nothing normalised."""

    def __init__(self, name: str, compiled: Any, vocab: Vocab) -> None:
        self.name = name
        self.vocab = vocab
        if name == "xgrammar":
            self.m: Any = xgr.GrammarMatcher(compiled.raw, terminate_without_stop_token=False)
        elif name == "outlines-core":
            self.m = outlines_core.Guide(compiled.index)
        else:
            self.m = llguidance.LLMatcher(compiled.provider.tokenizer, compiled.grammar, log_level=0)

    def accept(self, token: int) -> None:
        if self.name == "xgrammar":
            assert self.m.accept_token(token)
        elif self.name == "outlines-core":
            self.m.advance(token, return_tokens=False)
        else:
            assert self.m.consume_token(token)

    def fill(self) -> torch.Tensor:
        row = self.vocab.new_bitmask(1)
        row.zero_()
        if self.name == "xgrammar":
            self.m.fill_next_token_bitmask(row, 0)
        elif self.name == "outlines-core":
            self.m.write_mask_into(row.data_ptr(), row.shape[1], 4)
            row[0] &= text_row(self.vocab)  # the sentinel / stop bits are maskplug's (see the module notes)
        else:
            self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.shape[1] * 4)
        return row[0]

    def forced_bytes(self) -> bytes:
        """llguidance only: the bytes the grammar forces next."""
        return bytes(self.m.compute_ff_bytes())


def allowed_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Sorted token ids whose bit is set in one mask row."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


# --------------------------------------------------------------------------
# The named differences between the raw engines
# --------------------------------------------------------------------------


def passes_final_state(oracle: Oracle, text: bytes, token: bytes) -> bool:
    """Whether the token's last byte follows a full match and leaves the text unfinished.

    This is outlines-core's omission. Its index is built on a DFA whose match
    states are entered one byte after a match ends, and it keeps a token only
    when the state after the token's last byte is not such a delayed match
    state, or when the text is complete at the end. So a token whose last byte
    comes right after a full match, and does not complete the text again, is
    left out though the language allows it: the ``.`` after the integer ``2``,
    a bare space after a completed word, ``en`` after ``naï`` (``naïve``
    complete, then the ``n`` of the next ``naïve``); ``ena`` is kept.
    """
    return oracle.complete(text + token[:-1]) and not oracle.complete(text + token)


def outlines_sentinel_gap(vocab: Vocab, xg: set[int], oc: set[int]) -> bool:
    """Whether xgrammar's extra tokens over maskplug's outlines-core are all tokens holding byte ``F4``.

    maskplug's sentinel (U+10FFFF) starts with that byte, so tokens holding
    it are left out of outlines-core's vocabulary (plane-16 characters only).
    """
    return all(b"\xf4" in vocab.tokens[t] for t in xg - oc)


def text_row(vocab: Vocab) -> torch.Tensor:
    """One mask row with every id set except the stop ids."""
    row = vocab.new_bitmask(1)[0]
    for e in vocab.eos_ids:
        row[e >> 5] &= ~(1 << (e & 31)) if (e & 31) != 31 else 0x7FFFFFFF
    return row


def llguidance_canonical_gap(vocab: Vocab, forced: bytes, xg: set[int], ll: set[int]) -> bool:
    """Whether xgrammar's extra tokens over llguidance are all alternative spellings of forced bytes.

    Where the grammar forces the next bytes, llguidance allows only their
    canonical tokenisation (e.g. one of the two tokens that both decode to
    ``-``: a piece and a byte-fallback token), so every token it leaves out
    must overlap the forced bytes.
    """
    extra = xg - ll
    if not extra:
        return True
    if not forced:
        return False
    return all(forced.startswith(vocab.tokens[t]) or vocab.tokens[t].startswith(forced) for t in extra)


# --------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------


@dataclass
class Tally:
    """Counts of what a walk saw (reported on failure, checked for coverage)."""

    steps: int = 0
    outlines_gap: int = 0
    llguidance_gap: int = 0
    accepts_checked: int = 0


def _check_accept_agrees(m: Any, vocab: Vocab, row: torch.Tensor, allowed: np.ndarray, rng: Any, t: Tally) -> None:
    """``accept`` takes every allowed token, refuses others (a random sample, the controls, padding), and leaves the state as it was."""
    allowed_set = set(allowed.tolist())
    texts = [i for i in range(len(vocab.tokens)) if i not in vocab.special_ids]
    pick_no = [i for i in rng.choice(texts, 64, replace=False).tolist() if i not in allowed_set][:32]
    controls = sorted(vocab.special_ids - set(vocab.eos_ids))[:4]
    padding = list(range(len(vocab.tokens), vocab.vocab_size))[:2]
    was_done = m.is_terminated()
    for tok in [*allowed.tolist(), *pick_no, *controls, *padding, *vocab.eos_ids]:
        ok = m.accept(int(tok))
        assert ok == (tok in allowed_set), f"accept({tok}={vocab.tokens[tok] if tok < len(vocab) else b''!r})"
        if ok:
            m.rollback(1)
        t.accepts_checked += 1
    again = vocab.new_bitmask(1)
    m.fill(again, 0)
    assert torch.equal(again[0], row), "accept/rollback changed the matcher's state"
    assert m.is_terminated() == was_done


def walk(vocab: Vocab, pattern: str, seed: int, steps: int) -> Tally:
    """One lockstep random walk of every provider through ``pattern``; asserts at every step."""
    rng = np.random.default_rng(seed)
    oracle = Oracle(pattern)
    spec = GrammarSpec("regex", pattern)
    compiled = {n: grammar_provider(n, vocab).compile(spec) for n in PROVIDERS}
    ms = {n: c.matcher() for n, c in compiled.items()}
    raw = {n: RawEngine(n, c, vocab) for n, c in compiled.items()}
    special = np.array(sorted(vocab.special_ids - set(vocab.eos_ids)), dtype=np.int64)
    tally = Tally()
    text = b""
    accepted = 0
    history: list[dict[str, torch.Tensor]] = []
    for _ in range(steps):
        rows: dict[str, torch.Tensor] = {}
        sets: dict[str, set[int]] = {}
        for n, m in ms.items():
            b = vocab.new_bitmask(1)
            m.fill(b, 0)
            rows[n] = b[0].clone()
            mine = rows[n] & text_row(vocab) if n == "outlines-core" else rows[n]
            assert torch.equal(mine, raw[n].fill()), f"{n}: maskplug's mask differs from the raw engine's"
            ids = allowed_ids(rows[n], vocab.vocab_size)
            assert not np.isin(ids, special).any(), f"{n}: a control token is allowed"
            assert ids.size == 0 or ids[-1] < len(vocab.tokens), f"{n}: a padding id is allowed"
            stop_ok = [e in set(ids.tolist()) for e in vocab.eos_ids]
            assert all(s == oracle.complete(text) for s in stop_ok), f"{n}: stop allowed={stop_ok} after {text!r}"
            sets[n] = set(ids.tolist()) - set(vocab.eos_ids)
        union = set().union(*sets.values())
        unsound = [t for t in union if not oracle.viable(text + vocab.tokens[t])]
        assert not unsound, f"unsound tokens after {text!r}: " + ", ".join(
            f"{vocab.tokens[t]!r} allowed by {[n for n in PROVIDERS if t in sets[n]]}" for t in unsound[:5]
        )
        # The measured differences, each one named.
        xg, oc, ll = sets["xgrammar"], sets["outlines-core"], sets["llguidance"]
        assert oc <= xg and ll <= xg, f"an engine allows what xgrammar does not after {text!r}"
        assert outlines_sentinel_gap(vocab, xg, oc), (
            f"outlines-core leaves out {sorted(vocab.tokens[t] for t in xg - oc)[:8]} after {text!r}, "
            "not (only) tokens holding the sentinel's lead byte"
        )
        forced = raw["llguidance"].forced_bytes()
        assert llguidance_canonical_gap(vocab, forced, xg, ll), (
            f"llguidance leaves out {sorted(vocab.tokens[t] for t in xg - ll)[:8]} after {text!r}, forced {forced!r}"
        )
        tally.outlines_gap += len(xg - oc)
        tally.llguidance_gap += len(xg - ll)
        for n, m in ms.items():
            _check_accept_agrees(m, vocab, rows[n], allowed_ids(rows[n], vocab.vocab_size), rng, tally)
        history.append(rows)
        tally.steps += 1
        common = sorted(set.intersection(*sets.values()))
        if oracle.complete(text) and (not common or rng.random() < 0.25):
            break
        assert common, f"no token every provider allows after {text!r}, and the text is not complete"
        tok = int(rng.choice(common))
        for n in PROVIDERS:
            assert ms[n].accept(tok)
            raw[n].accept(tok)
        text += vocab.tokens[tok]
        accepted += 1

    # Stop when complete; a terminated matcher allows only the stop tokens,
    # refuses everything else, and rolls the stop back as one token.
    for m in ms.values():
        eos = vocab.eos_ids[0]
        assert m.accept(eos) == oracle.complete(text)
        if m.is_terminated():
            b = vocab.new_bitmask(1)
            m.fill(b, 0)
            assert set(allowed_ids(b[0], vocab.vocab_size).tolist()) == set(vocab.eos_ids)
            assert not m.accept(eos)
            m.rollback(1)
            assert not m.is_terminated()
    # Rolling back restores the earlier masks exactly (history[i] is the mask after i tokens).
    for n, m in ms.items():
        depth = accepted
        k = int(rng.integers(1 if depth == len(history) else 0, depth + 1))
        m.rollback(k)
        b = vocab.new_bitmask(1)
        m.fill(b, 0)
        assert torch.equal(b[0], history[depth - k][n]), f"{n}: rollback({k}) did not restore the mask"
        m.rollback(depth - k)
        m.fill(b, 0)
        assert torch.equal(b[0], history[0][n]), f"{n}: rolling back to the start did not restore the first mask"
    return tally


@pytest.mark.parametrize(("vocab_name", "name", "walks", "steps"), CASES, ids=[f"{v}-{n}" for v, n, _, _ in CASES])
def test_random_walks_agree(vocab_name: str, name: str, walks: int, steps: int) -> None:
    vocab = VOCABS[vocab_name]()
    total = Tally()
    for seed in range(walks):
        t = walk(vocab, REGEXES[name], seed, steps)
        total.steps += t.steps
        total.accepts_checked += t.accepts_checked
    assert total.steps >= walks
    assert total.accepts_checked > 0


def _sets_after(vocab: Vocab, pattern: str, text: list[bytes]) -> tuple[dict[str, set[int]], dict[str, Any]]:
    spec = GrammarSpec("regex", pattern)
    ms = {n: grammar_provider(n, vocab).compile(spec).matcher() for n in PROVIDERS}
    for piece in text:
        t = vocab.tokens.index(piece)
        for m in ms.values():
            assert m.accept(t)
    out = {}
    for n, m in ms.items():
        b = vocab.new_bitmask(1)
        m.fill(b, 0)
        out[n] = set(allowed_ids(b[0], vocab.vocab_size).tolist()) - set(vocab.eos_ids)
    return out, ms


def test_named_difference_outlines_final_state() -> None:
    """A bare space after a completed word, or the ``.`` after ``2``: the raw outlines-core index leaves it out.

    The engine's own index of the regex omits exactly the tokens whose last
    byte follows a full match (:func:`passes_final_state`); maskplug's
    outlines-core grammar (the sentinel pattern) allows what xgrammar does.
    """
    vocab = mistral_sentencepiece()
    provider = grammar_provider("outlines-core", vocab)
    assert isinstance(provider, OutlinesProvider)
    raw_vocab = provider.raw_vocabulary()
    for pattern, text, omitted in (
        (r"[a-z]+( [a-z]+)*", [b"hello"], b" "),
        (REGEXES["number"], [b"2"], b"."),
        (REGEXES["pairs"], [b"ab"], b"c"),
    ):
        sets, _ = _sets_after(vocab, pattern, text)
        xg, oc, ll = sets["xgrammar"], sets["outlines-core"], sets["llguidance"]
        ids = {i for i, t in enumerate(vocab.tokens) if t == omitted}
        assert ids <= xg and ids & ll and ids <= oc
        assert oc == xg
        # The engine alone: its index of the plain regex, walked along the same text.
        index = outlines_core.Index(pattern, raw_vocab)
        guide = outlines_core.Guide(index)
        for piece in text:
            guide.advance(vocab.tokens.index(piece), return_tokens=False)
        row = vocab.new_bitmask(1)
        row.zero_()
        guide.write_mask_into(row.data_ptr(), row.shape[1], 4)
        raw = set(allowed_ids(row[0], vocab.vocab_size).tolist()) - set(vocab.eos_ids)
        assert not ids & raw
        oracle, done = Oracle(pattern), b"".join(text)
        # The engine's whole gap, measured exactly: the tokens whose last byte follows a full match.
        assert xg - raw == {t for t in xg if passes_final_state(oracle, done, vocab.tokens[t])}
        assert xg - raw and raw < xg


def test_named_difference_llguidance_canonical() -> None:
    """Forced text: xgrammar and outlines-core take every spelling, llguidance only the canonical one."""
    vocab = mistral_sentencepiece()
    sets, ms = _sets_after(vocab, REGEXES["phone"], [b"8", b"2", b"0"])
    dashes = {i for i, t in enumerate(vocab.tokens) if t == b"-"}
    assert len(dashes) == 2  # the piece "-" and the byte-fallback token <0x2D>
    assert sets["xgrammar"] == sets["outlines-core"] == dashes
    assert len(sets["llguidance"]) == 1 and sets["llguidance"] < dashes
    engine = ms["llguidance"].engine
    assert bytes(engine.compute_ff_bytes()) == b"-"
    assert sets["llguidance"] == {int(engine.compute_ff_tokens()[0])}
