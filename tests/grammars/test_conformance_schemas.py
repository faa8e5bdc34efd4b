"""Documents that satisfy the bundled JSON schemas are accepted by every provider, token by token.

For each bundled schema (:func:`maskplug.data.load_schemas`),
documents are drawn with the simulator's own instance sampler
(:func:`maskplug.sim.workload.sample_instance`, validated here with
``jsonschema``), tokenised over the real 32k SentencePiece vocabulary, and fed
to every provider that supports ``json_schema``: before each token the mask is
filled and must allow it, ``accept`` must take it, and at the end the stop
token must be allowed and accepted. Walking a document back with ``rollback``
must give the same masks. Strings with characters JSON must escape are fed
the same way from fixed documents.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from maskplug.data import load_schemas
from maskplug.grammar import GrammarSpec, Vocab, grammar_provider, grammar_providers, mistral_sentencepiece
from maskplug.sim.workload import sample_instance

SCHEMAS = dict(load_schemas())
PROVIDERS = ("xgrammar", "outlines-core", "llguidance")
DOCS_PER_SCHEMA = 3


def test_schemas_are_found() -> None:
    assert len(SCHEMAS) >= 10, f"expected the bundled schemas, got {sorted(SCHEMAS)}"
    assert set(PROVIDERS) <= set(grammar_providers())


def documents(schema: dict[str, Any], seed: int, count: int) -> list[str]:
    """``count`` serialised instances from the simulator's sampler, each validated against the schema."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        doc = sample_instance(schema, rng)
        jsonschema.validate(doc, schema)
        # Compact separators in every other document, the common ", "/": " in the rest;
        # raw UTF-8 (outlines-core's JSON strings take no \\u escapes).
        seps = (",", ":") if k % 2 == 0 else (", ", ": ")
        out.append(json.dumps(doc, ensure_ascii=False, separators=seps))
    return out


def test_sampled_documents_are_valid_for_every_schema() -> None:
    for name, schema in SCHEMAS.items():
        texts = documents(schema, 1, 20)
        assert len(set(texts)) > 1, f"{name}: the sampler gave one document twenty times"
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


# --------------------------------------------------------------------------
# Feeding the documents
# --------------------------------------------------------------------------


def _bit(row: torch.Tensor, t: int) -> bool:
    return bool((int(row[t >> 5]) >> (t & 31)) & 1)


def tokenize(vocab: Vocab, text: str) -> list[int]:
    """The text as llguidance's canonical tokens over ``vocab`` (what its masks keep forced text to)."""
    tok = grammar_provider("llguidance", vocab).tokenizer  # type: ignore[attr-defined]
    ids = [int(t) for t in tok.tokenize_bytes(text.encode("utf-8"))]
    assert b"".join(vocab.tokens[t] for t in ids) == text.encode("utf-8")
    return ids


@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
def test_generated_documents_accepted_token_by_token(schema_name: str) -> None:
    schema = SCHEMAS[schema_name]
    _feed(schema, documents(schema, seed=zlib.crc32(schema_name.encode()), count=DOCS_PER_SCHEMA))


# Unbounded strings: quotes, backslashes, control characters and non-ASCII text
# (escaped as JSON writes them), which the sampler's word lists never produce.
ESCAPES_SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["note", "tags"],
}
ESCAPED_VALUES = [
    {"note": 'say "hi"', "tags": ["a\\b", "tab\there"]},
    {"note": "line one\nline two\r\n", "tags": []},
    {"note": "café 日本語 €", "tags": ["naïve", '"', "\\"]},
    {"note": "", "tags": ["/", 'a \\ b " c']},
]


def test_strings_with_escapes_accepted_token_by_token() -> None:
    docs = []
    for k, value in enumerate(ESCAPED_VALUES):
        jsonschema.validate(value, ESCAPES_SCHEMA)
        seps = (",", ":") if k % 2 == 0 else (", ", ": ")
        docs.append(json.dumps(value, ensure_ascii=False, separators=seps))
    assert any("\\" in d for d in docs) and any('\\"' in d for d in docs) and any("\\n" in d for d in docs)
    _feed(ESCAPES_SCHEMA, docs)


def _feed(schema: dict[str, Any], docs: list[str]) -> None:
    """Every provider takes every document token by token, allows the stop after it, and walks back."""
    vocab = mistral_sentencepiece()
    spec = GrammarSpec("json_schema", schema)
    for name in PROVIDERS:
        provider = grammar_provider(name, vocab)
        assert provider.supports("json_schema")
        compiled = provider.compile(spec)
        for text in docs:
            m = compiled.matcher()
            ids = tokenize(vocab, text)
            bm = vocab.new_bitmask(len(ids) + 1)
            for p, t in enumerate(ids):
                m.fill(bm, p)
                assert _bit(bm[p], t), f"{name}: mask refuses token {p} {vocab.tokens[t]!r} of {text!r}"
                assert m.accept(t), f"{name}: accept refuses token {p} {vocab.tokens[t]!r} of {text!r}"
            m.fill(bm, len(ids))
            eos = vocab.eos_ids[0]
            assert _bit(bm[len(ids)], eos), f"{name}: stop not allowed at the end of {text!r}"
            assert m.accept(eos) and m.is_terminated()
            # Walking back gives the masks of the way forward.
            m.rollback(1)
            again = vocab.new_bitmask(1)
            for p in range(len(ids), -1, -1):
                m.fill(again, 0)
                assert torch.equal(again[0], bm[p]), f"{name}: mask {p} differs after rolling back"
                if p:
                    m.rollback(1)


def test_a_schema_violation_is_refused_by_every_provider() -> None:
    """The other side: a document breaking the schema stops at the first offending token."""
    vocab = mistral_sentencepiece()
    schema = SCHEMAS["address"]
    good = '{"street":"Main St 1","city":"Paris","postal_code":"75001","country":"FR"}'
    bad = good.replace("75001", "7500x")
    ids = tokenize(vocab, bad)
    cut = len(tokenize(vocab, bad[: bad.index("x")]))
    for name in PROVIDERS:
        m = grammar_provider(name, vocab).compile(GrammarSpec("json_schema", schema)).matcher()
        taken = m.validate(ids)
        assert taken <= cut, f"{name}: took {taken} tokens, past the violation at token {cut}"
        assert taken < len(ids)
        # validate never advances
        b0, b1 = vocab.new_bitmask(1), vocab.new_bitmask(1)
        fresh = grammar_provider(name, vocab).compile(GrammarSpec("json_schema", schema)).matcher()
        m.fill(b0, 0)
        fresh.fill(b1, 0)
        assert torch.equal(b0, b1)
        assert np.array_equal(b0.numpy(), b1.numpy())


def test_named_difference_xgrammar_bounded_strings() -> None:
    """Measured: xgrammar refuses JSON escapes inside strings with minLength/maxLength; the others take them.

    The language allows ``"a\\nb\\"c"`` (five characters) under ``maxLength: 5``.
    If this starts failing because xgrammar accepts it, the escapes test
    above can put its strings under length bounds too.
    """
    vocab = mistral_sentencepiece()
    text = '"a\\nb\\"c"'
    ids = tokenize(vocab, text)
    for schema in ({"type": "string", "maxLength": 5}, {"type": "string", "minLength": 1}):
        taken = {
            n: grammar_provider(n, vocab).compile(GrammarSpec("json_schema", schema)).matcher().validate(ids)
            for n in PROVIDERS
        }
        assert taken["outlines-core"] == taken["llguidance"] == len(ids), taken
        assert taken["xgrammar"] < len(ids), taken
        # It stops at the token that carries the escape's backslash.
        assert b"\\" in vocab.tokens[ids[taken["xgrammar"]]], taken
    # Unbounded strings take escapes everywhere.
    for n in PROVIDERS:
        m = grammar_provider(n, vocab).compile(GrammarSpec("json_schema", {"type": "string"})).matcher()
        assert m.validate(ids) == len(ids)
