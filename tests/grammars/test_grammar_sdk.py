"""The provider SDK (``maskplug.grammar.sdk``) on its own: a small pure-Python provider built on it.

The provider below compiles ``choice`` specs into a byte-prefix matcher and
uses only the SDK's public names, as a provider distribution does. Its rows
are checked against the from-scratch oracle of ``grammar_testkit`` on every
path of :func:`maskplug.fill_draft_masks` (chains, batch, threads, serial),
and the SDK's checks, rows and bookkeeping are tested directly.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from grammar_testkit import allowed, reference_rows, small_vocab, tid

from maskplug import GrammarRows, ScheduledLayout, fill_draft_masks, get_registry, reset_registry
from maskplug.grammar import ChainOps, grammar_provider
from maskplug.grammar.sdk import (
    BatchOps,
    ChainOpsBase,
    Chains,
    GrammarError,
    GrammarSpec,
    Matcher,
    MatcherBase,
    ProviderBase,
    Vocab,
    bits_row,
    check_choice,
    schema_dict,
    schema_text,
    stop_row,
    text_ids,
)

# ---------------------------------------------------------------- a provider built on the SDK


class PrefixGrammar:
    """The compiled form: the choice strings as bytes."""

    def __init__(self, provider: PrefixProvider, spec: GrammarSpec, words: list[bytes]) -> None:
        self.provider = provider
        self.spec = spec
        self.words = words

    def matcher(self) -> PrefixMatcher:
        return PrefixMatcher(self)


class PrefixMatcher(MatcherBase):
    """The text so far must stay a prefix of one of the words."""

    def __init__(self, grammar: PrefixGrammar) -> None:
        super().__init__(grammar.provider.vocab)
        self.grammar = grammar
        self.batch_ops = grammar.provider.batch_ops
        self.taken: list[int] = []

    def _text(self, extra: int | None = None) -> bytes:
        ids = self.taken if extra is None else [*self.taken, extra]
        return b"".join(self.vocab.tokens[t] for t in ids)

    def _accept(self, token: int) -> bool:
        if not self.vocab.tokens[token]:
            return False
        text = self._text(token)
        if not any(w.startswith(text) for w in self.grammar.words):
            return False
        self.taken.append(token)
        return True

    def _rollback(self, n: int) -> None:
        del self.taken[len(self.taken) - n :]

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        text = self._text()
        ok = [
            i
            for i in text_ids(self.vocab)
            if any(w.startswith(text + self.vocab.tokens[i]) for w in self.grammar.words)
        ]
        if self._is_complete():
            ok += list(self.vocab.eos_ids)
        bitmask[row] = torch.from_numpy(bits_row(ok, self.vocab.mask_words))

    def _is_complete(self) -> bool:
        return self._text() in self.grammar.words

    def _accepted_count(self) -> int:
        return len(self.taken)

    def _reset(self) -> None:
        self.taken.clear()

    def _fork(self) -> PrefixMatcher:
        twin = PrefixMatcher(self.grammar)
        twin.taken = list(self.taken)
        return twin


class PrefixOps(ChainOpsBase[PrefixMatcher]):
    """Batch operations from the SDK's defaults; chains walked matcher by matcher and rolled back."""

    matcher_type = PrefixMatcher

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self.chain_calls = 0
        self.last: Chains | None = None

    def _fill_chains(self, matchers: list[PrefixMatcher], chains: Chains) -> list[int]:
        self.chain_calls += 1
        self.last = chains
        return walk_chains(self, matchers, chains.bitmask, chains.rows, chains.drafts)


def walk_chains(
    ops: ChainOpsBase[PrefixMatcher],
    matchers: Sequence[PrefixMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int],
    drafts: Sequence[Sequence[int]],
) -> list[int]:
    """Each chain walked with the matcher's own calls, then rolled back."""
    out = []
    for m, r0, d in zip(matchers, rows, drafts, strict=True):
        took = 0
        try:
            for p in range(len(d) + 1):
                m.fill(bitmask, r0 + p)
                if p == len(d) or not m.accept(int(d[p])):
                    break
                took += 1
                if m.is_terminated():
                    break
        finally:
            if took:
                ops.rollback([m], [took])
        out.append(took)
    return out


class PrefixProvider(ProviderBase[PrefixGrammar]):
    name = "sdk-prefix"
    kinds = frozenset({"choice"})

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self.batch_ops = PrefixOps(vocab)

    def _compile(self, spec: GrammarSpec) -> PrefixGrammar:
        return PrefixGrammar(self, spec, [w.encode() for w in check_choice(spec.source)])


WORDS = ["abc", "abd", "a{", "b\n", "ab"]


def _provider() -> PrefixProvider:
    return PrefixProvider(small_vocab(extra=5, eos=(0,)))


def _compiled(p: PrefixProvider) -> PrefixGrammar:
    return p.compile(GrammarSpec("choice", WORDS))


def test_the_sdk_provider_satisfies_the_protocols() -> None:
    p = _provider()
    m = _compiled(p).matcher()
    assert isinstance(m, Matcher)
    assert isinstance(p.batch_ops, BatchOps) and isinstance(p.batch_ops, ChainOps)
    assert p.batch_ops.fills_forced is False


@pytest.mark.parametrize("strategy", ["chains", "batch", "threads", "serial"])
@pytest.mark.parametrize("seed", range(4))
def test_fill_draft_masks_over_the_sdk_provider_matches_the_oracle(strategy: str, seed: int) -> None:
    p = _provider()
    v = p.vocab
    c = _compiled(p)
    rng = random.Random(seed)
    pieces = [tid(v, bytes([ch])) for ch in b"abcd{\n"] + [tid(v, b"ab"), tid(v, b"abc"), 0]
    n = 5
    ms = [c.matcher() for _ in range(n)]
    for m in ms[:2]:  # two requests start one token in
        assert m.accept(tid(v, b"a"))
    terminated = ms[4]
    assert terminated.accept(tid(v, b"ab")) and terminated.accept(0)
    drafts = [[rng.choice(pieces) for _ in range(rng.randint(0, 4))] for _ in range(n)]
    gates = [0, 0, 1, 0, 0]
    layout = ScheduledLayout([f"r{i}" for i in range(n)], [len(d) for d in drafts], [1] * n)
    rows = GrammarRows([f"r{i}" for i in range(n)])
    bm = torch.zeros((rows.num_rows(layout), v.mask_words), dtype=torch.int32)
    before = [(m.taken.copy(), m.is_terminated()) for m in ms]
    out = fill_draft_masks(ms, drafts, bm, rows, layout, strategy=strategy, active_from=gates)
    assert [(m.taken, m.is_terminated()) for m in ms] == before
    row = 0
    for g, m in enumerate(ms):
        ref = reference_rows(m, v, drafts[g], 1, gates[g])
        assert out.acceptable[g] == ref.acceptable
        for p_, want in enumerate(ref.rows):
            assert np.array_equal(bm[row + p_].numpy(), want), (strategy, g, p_)
            assert out.forced[g, p_] == ref.forced[p_]
        row += len(drafts[g]) + 1
    chained = p.batch_ops.chain_calls
    assert (chained > 0) == (strategy == "chains")


def test_fill_chains_checks_everything_before_writing() -> None:
    p = _provider()
    v = p.vocab
    c = _compiled(p)
    live, done = c.matcher(), c.matcher()
    assert done.accept(tid(v, b"ab")) and done.accept(0)
    ops = p.batch_ops
    bm = v.new_bitmask(6)
    keep = bm.clone()
    twin = _compiled(PrefixProvider(v)).matcher()

    class Other(MatcherBase):
        pass

    cases: list[tuple[list[MatcherBase], list[int], list[list[int]], str]] = [
        ([live, done], [0, 3], [[1], [1]], r"matchers\[1\].*terminated"),
        ([live, Other(v)], [0, 3], [[1], [1]], r"matchers\[1\].*PrefixMatcher"),
        ([live], [5], [[tid(v, b"a")]], "row"),
        ([live], [0, 1], [[1]], "rows, drafts"),
        ([live], [-1], [[1]], "rows: expected first rows >= 0"),
    ]
    for matchers, rows, drafts, needle in cases:
        with pytest.raises(GrammarError, match=needle):
            ops.fill_chains(matchers, bm, rows, drafts)
        assert torch.equal(bm, keep)
    assert ops.chain_calls == 0
    assert ops.fill_chains([], bm, [], []) == [] and ops.chain_calls == 0
    # A matcher of another provider instance of the same class is a PrefixMatcher: taken.
    assert ops.fill_chains([twin], bm, [0], [[tid(v, b"a")]], threads=4) == [1]
    # The hook gets the checked arguments: rows as ints, workers at most one per request.
    assert ops.last is not None
    assert ops.last.bitmask is bm and ops.last.rows == [0] and ops.last.workers == 1 and ops.last.forced is None


class EarlierHookOps(ChainOpsBase[PrefixMatcher]):
    """A subclass written for the six-argument hook of earlier releases."""

    matcher_type = PrefixMatcher

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self.seen: tuple[list[int], int, Any] | None = None

    def _fill_chains(  # type: ignore[override]
        self,
        matchers: list[PrefixMatcher],
        bitmask: torch.Tensor,
        rows: list[int],
        drafts: Sequence[Sequence[int]],
        workers: int,
        forced: npt.NDArray[np.bool_] | None,
    ) -> list[int]:
        self.seen = (rows, workers, forced)
        return walk_chains(self, matchers, bitmask, rows, drafts)


def test_a_subclass_of_the_earlier_six_argument_hook_keeps_working() -> None:
    p = _provider()
    v = p.vocab
    c = _compiled(p)
    drafts = [[tid(v, b"a"), tid(v, b"b"), tid(v, b"c"), 0], [tid(v, b"b"), tid(v, b"x")]]
    old, new = EarlierHookOps(v), p.batch_ops
    got = []
    for ops in (old, new):
        bm = v.new_bitmask(8)
        counts = ops.fill_chains([c.matcher(), c.matcher()], bm, [0, 5], drafts, threads=3)
        got.append((counts, bm.clone()))
    assert got[0][0] == got[1][0] == [4, 1]
    assert torch.equal(got[0][1], got[1][1])
    assert old.seen == ([0, 5], 2, None)


def test_matcher_base_bookkeeping() -> None:
    p = _provider()
    v = p.vocab
    m = _compiled(p).matcher()
    assert m.num_accepted == 0
    with pytest.raises(GrammarError, match="at most the 0"):
        m.rollback(1)
    assert m.accept(tid(v, b"ab")) and m.accept(0) and m.is_terminated()
    assert m.num_accepted == 2
    with pytest.raises(GrammarError, match="at most the 2"):
        m.rollback(3)
    assert m.is_terminated() and m.taken == [tid(v, b"ab")]  # a refused rollback changes nothing
    # The protected hooks batch operations use: the stop token comes off first.
    assert m._unwind_stop(2) == 1 and not m.is_terminated()
    assert m._unwind_stop(1) == 1  # nothing left to unwind
    m._set_terminated(True)
    assert allowed(m, v) == {0}
    m.reset()
    assert not m.is_terminated() and m.num_accepted == 0
    with pytest.raises(GrammarError, match="n: expected an int >= 0"):
        m.rollback(-1)


def test_batch_ops_base_defaults_are_the_per_matcher_calls() -> None:
    p = _provider()
    v = p.vocab
    c = _compiled(p)
    ms, twins = [c.matcher() for _ in range(3)], [c.matcher() for _ in range(3)]
    toks = [tid(v, b"a"), tid(v, b"z"), 0]
    assert p.batch_ops.accept(ms, toks) == [t.accept(x) for t, x in zip(twins, toks, strict=True)]
    a, b = v.new_bitmask(3), v.new_bitmask(3)
    p.batch_ops.fill(ms, a, [2, 1, 0])
    for i, t in enumerate(twins):
        t.fill(b, 2 - i)
    assert torch.equal(a, b)
    p.batch_ops.rollback(ms, [1, 0, 0])
    assert [m.taken for m in ms] == [[], [], []]


# ---------------------------------------------------------------- checks and rows


def test_check_choice() -> None:
    assert check_choice(("a", "b")) == ["a", "b"]
    assert check_choice(["", "x"], allow_empty=True) == ["", "x"]
    for bad, needle in (
        ("ab", "non-empty list of strings"),
        ([], "non-empty list of strings"),
        (None, "non-empty list of strings"),
        (["a", ""], r"spec.source\[1\]: expected a non-empty str"),
        (["a", 3], r"spec.source\[1\]"),
    ):
        with pytest.raises(GrammarError, match=needle):
            check_choice(bad)


def test_schema_readers() -> None:
    schema = {"type": "object", "properties": {"é": {"type": "string"}}}
    assert schema_dict(schema) is schema
    assert schema_dict(schema_text(schema)) == schema
    assert schema_text('{"type": "integer"}') == '{"type": "integer"}'
    assert schema_text(b'{"type": "integer"}') == '{"type": "integer"}'
    bad_text: list[tuple[object, str]] = [("{not json", "not JSON"), (5, "dict or str")]
    for bad, needle in bad_text:
        with pytest.raises(GrammarError, match=needle):
            schema_text(bad)
    bad_dict: list[tuple[object, str]] = [("{not json", "not JSON"), ("[1]", "JSON schema object"), ([1], "object")]
    for bad, needle in bad_dict:
        with pytest.raises(GrammarError, match=needle):
            schema_dict(bad)


def test_rows() -> None:
    v = Vocab([b"</s>", b"a", b"", b"<c>", *[bytes([65 + i]) for i in range(30)], b"end"], [0, 34], [3], 70)
    assert v.mask_words == 3
    row = bits_row([0, 31, 32, 69], 3)
    assert row.dtype == np.int32 and row.tolist() == [1 | -(1 << 31), 1, 1 << 5]
    stops = stop_row(v)
    assert stops.dtype == torch.int32 and stops.tolist() == bits_row([0, 34], 3).tolist()
    assert text_ids(v) == [1, *range(4, 34)]  # no stop, empty, special or padding ids


# ---------------------------------------------------------------- the registry


def test_reset_registry_forgets_the_providers_made_by_the_old_factories() -> None:
    v = small_vocab()
    try:
        reset_registry()
        get_registry().grammar_providers["sdk-prefix"] = PrefixProvider
        p = grammar_provider("sdk-prefix", v)
        assert isinstance(p, PrefixProvider) and grammar_provider("sdk-prefix", v) is p
        reset_registry()  # the factory is gone with the old registry: so is its provider
        with pytest.raises(GrammarError, match="registered providers"):
            grammar_provider("sdk-prefix", v)
        get_registry().grammar_providers["sdk-prefix"] = PrefixProvider
        assert grammar_provider("sdk-prefix", v) is not p
    finally:
        reset_registry()


# ---------------------------------------------------------------- the three distributions

DISTRIBUTIONS = [
    ("maskplug_xgrammar", "xgrammar", "XGrammar"),
    ("maskplug_outlines", "outlines-core", "Outlines"),
    ("maskplug_llguidance", "llguidance", "LLGuidance"),
]


@pytest.mark.parametrize(("package", "name", "prefix"), DISTRIBUTIONS)
def test_each_distribution_has_the_same_layout(package: str, name: str, prefix: str) -> None:
    pkg = pytest.importorskip(package)
    plugin = importlib.import_module(f"{package}.plugin")
    provider = importlib.import_module(f"{package}.provider")
    got: dict[str, Any] = {}
    plugin.maskplug_register_grammar_providers(register=got.__setitem__)
    cls = getattr(provider, f"{prefix}Provider")
    assert got == {name: cls} and cls.name == name and issubclass(cls, ProviderBase)
    for part, base in (("Grammar", object), ("Matcher", MatcherBase), ("BatchOps", ChainOpsBase)):
        assert issubclass(getattr(pkg, f"{prefix}{part}"), base)
        assert getattr(pkg, f"{prefix}{part}") is getattr(provider, f"{prefix}{part}")
