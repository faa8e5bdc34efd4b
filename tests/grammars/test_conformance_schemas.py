"""Documents that satisfy the shared JSON schemas are accepted by every provider, token by token.

For each schema in ``../shared/schemas/`` (beside the repository), documents
are generated from the schema itself (validated with ``jsonschema``), tokenised
over the real 32k SentencePiece vocabulary, and fed to every provider that
supports ``json_schema``: before each token the mask is filled and must allow
it, ``accept`` must take it, and at the end the stop token must be allowed and
accepted. Walking a document back with ``rollback`` must give the same masks.
"""

from __future__ import annotations

import json
import random
import string
import zlib
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from maskplug.grammar import GrammarSpec, Vocab, grammar_provider, grammar_providers, mistral_sentencepiece

SCHEMA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "schemas"
SCHEMAS = sorted(SCHEMA_DIR.glob("*.json"))
PROVIDERS = ("xgrammar", "outlines-core", "llguidance")
DOCS_PER_SCHEMA = 3


def test_schemas_are_found() -> None:
    assert len(SCHEMAS) >= 10, f"expected the shared schemas in {SCHEMA_DIR}, got {len(SCHEMAS)}"
    assert set(PROVIDERS) <= set(grammar_providers())


# --------------------------------------------------------------------------
# A document generator driven by the schema
# --------------------------------------------------------------------------

# Free text: letters, digits, punctuation, spaces, non-ASCII and characters
# JSON must escape (quote, backslash, newline, tab).
_PLAIN = string.ascii_letters + string.digits + " .,:;-_/'!?" + "éüß日本語€"
_TEXT = _PLAIN + '"\\\n\t'


def _sample_regex(pattern: str, rng: random.Random) -> str:
    """A string matching a simple anchored pattern: literals, escapes, [classes] and {m}, {m,n}, + quantifiers."""
    body = pattern.removeprefix("^").removesuffix("$")
    atoms: list[list[str]] = []  # each atom: the characters it may produce
    reps: list[tuple[int, int]] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "[":
            j = body.index("]", i)
            cls, chars, k = body[i + 1 : j], [], 0
            while k < len(cls):
                if k + 2 < len(cls) and cls[k + 1] == "-":
                    chars += [chr(x) for x in range(ord(cls[k]), ord(cls[k + 2]) + 1)]
                    k += 3
                else:
                    chars.append(cls[k])
                    k += 1
            atoms.append(chars)
            i = j + 1
        elif c == "\\":
            atoms.append([body[i + 1]])
            i += 2
        elif c in "{+":
            if c == "+":
                reps[-1] = (1, 4)
                i += 1
            else:
                j = body.index("}", i)
                lo, _, hi = body[i + 1 : j].partition(",")
                reps[-1] = (int(lo), int(hi) if hi else int(lo))
                i = j + 1
            continue
        else:
            atoms.append([c])
            i += 1
        reps.append((1, 1))
    return "".join(rng.choice(a) for a, (lo, hi) in zip(atoms, reps, strict=True) for _ in range(rng.randint(lo, hi)))


def generate(schema: dict[str, Any], rng: random.Random) -> Any:
    """A random instance of ``schema`` (the subset of JSON Schema the shared schemas use)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return generate(rng.choice(schema["anyOf"]), rng)
    kind = schema.get("type")
    if kind == "object":
        required = set(schema.get("required", []))
        # Properties in schema order: xgrammar and outlines-core expect it.
        return {
            k: generate(sub, rng)
            for k, sub in schema.get("properties", {}).items()
            if k in required or rng.random() < 0.6
        }
    if kind == "array":
        lo = schema.get("minItems", 0)
        hi = min(schema.get("maxItems", lo + 3), lo + 3)
        return [generate(schema["items"], rng) for _ in range(rng.randint(lo, hi))]
    if kind == "string":
        if "pattern" in schema:
            return _sample_regex(schema["pattern"], rng)
        lo = schema.get("minLength", 0)
        hi = min(schema.get("maxLength", 24), 24)
        # xgrammar takes no escape sequences in length-bounded strings (see
        # test_named_difference_xgrammar_bounded_strings): plain text there.
        bounded = "minLength" in schema or "maxLength" in schema
        alphabet = _PLAIN if bounded else _TEXT
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, max(lo, hi))))
    if kind == "integer":
        return rng.randint(schema.get("minimum", -1000), schema.get("maximum", 100000))
    if kind == "number":
        lo, hi = schema.get("minimum", -1000.0), schema.get("maximum", 1000.0)
        return round(rng.uniform(lo, hi), rng.choice([0, 1, 2]))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    raise AssertionError(f"the generator does not know {schema!r}")


def documents(schema: dict[str, Any], seed: int, count: int) -> list[str]:
    """``count`` serialised instances, each validated against the schema."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        doc = generate(schema, rng)
        jsonschema.validate(doc, schema)
        # Compact separators in every other document, the common ", "/": " in the rest;
        # raw UTF-8 (outlines-core's JSON strings take no \\u escapes).
        seps = (",", ":") if k % 2 == 0 else (", ", ": ")
        out.append(json.dumps(doc, ensure_ascii=False, separators=seps))
    return out


def test_generator_is_valid_for_every_schema() -> None:
    for path in SCHEMAS:
        schema = json.loads(path.read_text())
        for text in documents(schema, 1, 20):
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


@pytest.mark.parametrize("path", SCHEMAS, ids=[p.stem for p in SCHEMAS])
def test_generated_documents_accepted_token_by_token(path: Path) -> None:
    vocab = mistral_sentencepiece()
    schema = json.loads(path.read_text())
    spec = GrammarSpec("json_schema", schema)
    docs = documents(schema, seed=zlib.crc32(path.stem.encode()), count=DOCS_PER_SCHEMA)
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
    schema = json.loads((SCHEMA_DIR / "address.json").read_text())
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
    If this starts failing because xgrammar accepts it, the generator above
    can put escapes into bounded strings again.
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
