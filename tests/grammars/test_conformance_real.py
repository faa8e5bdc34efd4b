"""Real-world JSON schemas (a fixed JSONSchemaBench subset) through maskplug's providers.

Each valid instance is serialised as ``json.dumps(data, ensure_ascii=False)``,
tokenised by the model's own tokenizer (tekken), fed to a fresh matcher and
then the stop token. The vocabulary's encoder is what llguidance holds forced
text to, so the model's natural spelling is accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from maskplug_outlines import OUTLINES_COMPILE_LIMIT_S

from maskplug.conformance import SUBSET_PATH
from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec, Vocab, grammar_provider
from maskplug.grammar.vocabs import (
    load_tokenizer_json,
    mistral_sentencepiece,
    mistral_tekken,
    mistral_tekken_encoding,
)

DATA = SUBSET_PATH


def cases() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]


def instance_text(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


# --------------------------------------------------------------------------
# The model's own tokenization
# --------------------------------------------------------------------------


def test_tekken_vocab_carries_tiktoken_encoder() -> None:
    v = mistral_tekken()
    assert v.has_encoder and v.encoder_name == "tiktoken:tekken_240911.json"
    assert "encoder='tiktoken:tekken_240911.json'" in repr(v)
    enc = mistral_tekken_encoding()
    for case in cases()[:10]:
        for t in case["tests"]:
            text = instance_text(t["data"])
            ids = v.encode(text)
            assert ids == [r + enc.maskplug_offset for r in enc.encode(text)]
            assert b"".join(v.tokens[i] for i in ids) == text.encode("utf-8")


def test_bare_byte_table_says_it_has_no_encoder() -> None:
    bare = Vocab([b"a", b"b", b"</s>"], eos_ids=[2])
    assert not bare.has_encoder and bare.encoder is None and bare.encoder_name is None
    assert "no encoder" in repr(bare)
    with pytest.raises(GrammarError, match=r"vocab: .*no encoder"):
        bare.encode("ab")
    stripped = mistral_tekken().with_encoder(None)
    assert not stripped.has_encoder and stripped.tokens is mistral_tekken().tokens
    assert stripped.fingerprint != mistral_tekken().fingerprint
    with pytest.raises(GrammarError, match="encoder"):
        Vocab([b"a"], eos_ids=[0], encoder="not callable")  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="text"):
        mistral_tekken().encode(b"bytes")  # type: ignore[arg-type]


def test_encoder_answers_outside_the_vocabulary_are_refused() -> None:
    v = Vocab([b"a", b"b", b"</s>"], eos_ids=[2], encoder=lambda s: [7], encoder_name="broken")
    assert repr(v).endswith("encoder='broken')")
    with pytest.raises(GrammarError, match=r"encoder: expected ids in \[0, 3\)"):
        v.encode("a")


def test_sentencepiece_encoder_spells_text_mid_output() -> None:
    import sentencepiece

    v = mistral_sentencepiece()
    assert v.has_encoder and v.encoder_name == "sentencepiece:tokenizer.model.v1"
    from maskplug.grammar.vocabs import mistral_data_dir

    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_data_dir() / "tokenizer.model.v1"))
    for text in ['{"a": 1}', "ORD-", "paid", " x", "hello world", "naïve café"]:
        ids = v.encode(text)
        assert b"".join(v.tokens[i] for i in ids) == text.encode("utf-8"), text
        # The same pieces SentencePiece gives the text after a newline (mid-output spelling).
        after = sp.encode("\n" + text)
        assert after[-len(ids) :] == ids if ids else True


def test_tokenizer_json_vocab_carries_tokenizers_encoder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([f'{{"id": {i}, "name": "item {i}"}}' for i in range(200)], trainer)
    path = tmp_path / "tok.json"
    tok.save(str(path))
    v = load_tokenizer_json(path)
    assert v.has_encoder and v.encoder_name == "tokenizers:tok.json"
    for text in ['{"id": 12, "name": "x"}', "naïve", ""]:
        assert v.encode(text) == tok.encode(text, add_special_tokens=False).ids


def _accepts(grammar: Any, vocab: Vocab, ids: list[int]) -> bool:
    m = grammar.matcher()
    return all(m.accept(i) for i in ids) and m.accept(vocab.eos_ids[0])


def test_llguidance_accepts_the_models_own_spelling_of_valid_instances() -> None:
    """With tekken's encoder every valid instance is accepted; the greedy byte table refuses some of them."""
    from maskplug_llguidance import LLGuidanceProvider

    v = mistral_tekken()
    bare = v.with_encoder(None)
    # No compile limit: this is about tokenisation, not about a loaded machine's compile times.
    prov, prov_bare = LLGuidanceProvider(v, compile_limit_s=None), LLGuidanceProvider(bare, compile_limit_s=None)
    total = accepted = accepted_bare = 0
    for case in cases():
        # JSON Schema's meaning of the schema (unlisted keys allowed where it does not say), as the instances assume.
        spec = GrammarSpec("json_schema", case["schema"], strict_keys=False)
        try:
            g = prov.compile(spec)
        except GrammarError:
            continue
        g_bare = prov_bare.compile(spec)
        for t in case["tests"]:
            if not t["valid"]:
                continue
            ids = v.encode(instance_text(t["data"]))
            total += 1
            accepted += _accepts(g, v, ids)
            accepted_bare += _accepts(g_bare, bare, ids)
    assert total >= 40
    assert accepted == total
    assert accepted_bare < total  # the greedy spelling of forced text is not the model's


# --------------------------------------------------------------------------
# maskplug.conformance: maskplug's verdict equals the engine's
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def subset_reports() -> list[Any]:
    from maskplug.conformance import load_cases, run

    # A generous limit: every subset schema compiles well within it on an idle machine.
    return run(["xgrammar", "llguidance"], load_cases(DATA), options={"strict_keys": False}, compile_limit_s=120.0)


def test_load_cases_reads_the_subset() -> None:
    from maskplug.conformance import load_cases

    cs = load_cases(DATA)
    assert len(cs) == 44 and sum(len(c.tests) for c in cs) == 112
    assert len(load_cases(DATA, limit=5)) == 5
    with pytest.raises(GrammarError, match=r"^data: "):
        load_cases(DATA.parent / "missing.jsonl")


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_maskplug_verdicts_equal_the_engines(subset_reports: list[Any], name: str) -> None:
    from maskplug.conformance import disagreements

    by = {(r.provider, r.path): r for r in subset_reports}
    mine, theirs = by[(name, "maskplug")], by[(name, "engine")]
    assert mine.compiled == theirs.compiled == 44
    assert mine.verdicts.keys() == theirs.verdicts.keys() and len(mine.verdicts) == 112
    assert disagreements(subset_reports)[name] == []
    assert mine.valid == 53 and mine.invalid == 59
    assert mine.mask_tokens > 0 and len(mine.compile_s) == 44


def test_llguidance_through_maskplug_accepts_what_llguidance_accepts(subset_reports: list[Any]) -> None:
    by = {(r.provider, r.path): r for r in subset_reports}
    # llguidance holds forced text to tekken's own spelling: valid instances are not refused for their spelling.
    assert by[("llguidance", "maskplug")].valid_accepted == by[("llguidance", "engine")].valid_accepted
    assert by[("llguidance", "maskplug")].valid_accepted >= 50


def _small_cases(n: int) -> list[Any]:
    """The ``n`` smallest subset schemas outlines-core can turn into a regex."""
    from maskplug_outlines import OutlinesProvider

    from maskplug.conformance import load_cases

    p = OutlinesProvider(mistral_sentencepiece(), compile_limit_s=None)
    out = []
    for c in sorted(load_cases(DATA), key=lambda c: len(json.dumps(c.schema))):
        try:
            p.regex_for(GrammarSpec("json_schema", c.schema))
        except GrammarError:
            continue
        out.append(c)
        if len(out) == n:
            break
    return out


def test_outlines_engine_walks_the_index_maskplug_built() -> None:
    """Normalisation: outlines-core compiles once; its Guide walks maskplug's Index, verdict by verdict."""
    from maskplug.conformance import disagreements, run

    reports = run(["outlines-core"], _small_cases(3), mistral_sentencepiece(), compile_limit_s=120.0)
    mine, theirs = reports
    assert mine.compiled >= 1 and theirs.compiled == mine.compiled
    assert theirs.compile_s == mine.compile_s
    assert disagreements(reports)["outlines-core"] == []
    assert mine.verdicts == theirs.verdicts


def test_a_compile_stopped_at_its_limit_is_an_error_on_both_paths() -> None:
    """Normalisation: a schema maskplug stopped at its limit has no instances counted on either path."""
    import dataclasses
    import uuid

    from maskplug.conformance import load_cases, run

    # A schema whose compile takes about a second here (its untyped values become outlines-core's nested
    # any-JSON regex), a thousand times the limit; a fresh description misses every cache, so it is
    # compiled under the limit. (The smallest schema compiles in a few milliseconds: too close to call.)
    (case,) = [c for c in load_cases(DATA) if c.id == "BFCL_javascript_48"]
    fresh = {**case.schema, "description": f"fresh {uuid.uuid4()}"} if isinstance(case.schema, dict) else case.schema
    cases = [dataclasses.replace(case, schema=fresh)]
    shared: Any = grammar_provider("outlines-core", mistral_sentencepiece())  # an OutlinesProvider
    mine, theirs = run(["outlines-core"], cases, mistral_sentencepiece(), compile_limit_s=0.001)
    assert list(mine.errors) == [cases[0].id] and "limit" in mine.errors[cases[0].id]
    assert list(theirs.errors) == [cases[0].id]
    assert mine.verdicts == {} and theirs.verdicts == {}
    # The limit was the calls' own: the shared provider keeps its default.
    assert shared.compile_limit_s == OUTLINES_COMPILE_LIMIT_S


def test_conformance_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from maskplug.conformance import main

    assert main(["--provider", "llguidance", "--data", str(DATA), "--limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "| llguidance | maskplug | 4 / 4 |" in out and "| llguidance | engine | 4 / 4 |" in out
    assert "disagree on 0 instances" in out
    assert main(["--provider", "llguidance", "--data", str(DATA), "--limit", "2", "--json", "--no-engine"]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["reports"]
    assert row["provider"] == "llguidance" and row["schemas"] == 2 and row["compiled"] == 2


def test_maskplug_conformance_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    from maskplug.cli import main

    args = ["conformance", "--provider", "llguidance", "--data", str(DATA), "--limit", "2", "--json", "--no-engine"]
    assert main(args) == 0
    (row,) = json.loads(capsys.readouterr().out)["reports"]
    assert row["provider"] == "llguidance" and row["path"] == "maskplug" and row["compiled"] == 2
    assert main(["conformance", "--data", str(DATA.parent / "missing.jsonl")]) == 2
    assert "data: could not read" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Splitting a long run: --offset, --shard, --details and --merge
# --------------------------------------------------------------------------


def test_offset_and_shards_partition_the_file() -> None:
    from maskplug.conformance import load_cases

    ids = [c.id for c in load_cases(DATA)]
    assert [c.id for c in load_cases(DATA, offset=10)] == ids[10:]
    assert [c.id for c in load_cases(DATA, offset=10, limit=3)] == ids[10:13]
    parts = [[c.id for c in load_cases(DATA, shard=(i, 3))] for i in (1, 2, 3)]
    assert parts == [ids[0::3], ids[1::3], ids[2::3]]
    pooled = [i for part in parts for i in part]
    assert sorted(pooled) == sorted(ids) and len(set(pooled)) == len(ids)
    # The offset comes first, then the shard, then the limit.
    assert [c.id for c in load_cases(DATA, offset=5, shard=(2, 4), limit=2)] == ids[6:14:4]
    assert load_cases(DATA, offset=len(ids)) == []


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"offset": -1}, "offset"),
        ({"offset": 1.5}, "offset"),
        ({"limit": 0}, "limit"),
        ({"shard": (0, 2)}, "shard"),
        ({"shard": (3, 2)}, "shard"),
        ({"shard": (1, 0)}, "shard"),
        ({"shard": [1, 2]}, "shard"),
    ],
)
def test_bad_split_arguments_are_named(kwargs: dict[str, Any], arg: str) -> None:
    from maskplug.conformance import load_cases

    with pytest.raises(GrammarError, match=rf"^{arg}: "):
        load_cases(DATA, **kwargs)


@pytest.mark.parametrize("text", ["1", "a/b", "0/2", "3/2", "1/2/3", ""])
def test_bad_shard_text_is_named(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    from maskplug.conformance import main, parse_shard

    with pytest.raises(GrammarError, match=r"^shard: "):
        parse_shard(text)
    assert main(["--provider", "llguidance", "--data", str(DATA), "--shard", text]) == 2
    assert "shard: " in capsys.readouterr().err
    assert parse_shard("2/5") == (2, 5)


def test_merged_shards_equal_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from maskplug.conformance import main

    common = ["--provider", "llguidance", "--data", str(DATA), "--offset", "20", "--limit", "3", "--limit-s", "120"]
    files = []
    for i in (1, 2):
        assert main([*common, "--shard", f"{i}/2", "--json", "--details"]) == 0
        f = tmp_path / f"part{i}.json"
        f.write_text(capsys.readouterr().out, encoding="utf-8")
        files.append(str(f))
    whole = ["--provider", "llguidance", "--data", str(DATA), "--offset", "20", "--limit", "6", "--limit-s", "120"]
    assert main([*whole, "--json", "--details"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["--merge", *files, "--json", "--details"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert [(r["provider"], r["path"]) for r in merged["reports"]] == [
        ("llguidance", "maskplug"),
        ("llguidance", "engine"),
    ]
    counts = ("schemas", "compiled", "valid", "valid_accepted", "invalid", "invalid_accepted", "warned")
    for a, b in zip(merged["details"], one["details"], strict=True):
        assert a["schemas"] == 6 and a["valid"] + a["invalid"] > 0
        assert {k: a[k] for k in counts} == {k: b[k] for k in counts}
        assert a["verdicts"] == b["verdicts"] and a["errors"] == b["errors"]
        assert len(a["compile_s"]) == len(b["compile_s"]) == a["compiled"]
    assert merged["disagreements"] == {"llguidance": []}
    # The table of the merged parts; a part given twice is refused, as is a file that holds no details.
    assert main(["--merge", *files]) == 0
    assert "| llguidance | maskplug | 6 / 6 |" in capsys.readouterr().out
    assert main(["--merge", files[0], files[0]]) == 2
    assert "parts: llguidance (maskplug) reports" in capsys.readouterr().err
    assert main([*common, "--shard", "1/2", "--json"]) == 0
    plain = tmp_path / "plain.json"
    plain.write_text(capsys.readouterr().out, encoding="utf-8")
    assert main(["--merge", str(plain)]) == 2
    assert "merge: " in capsys.readouterr().err


def test_maskplug_conformance_subcommand_splits(capsys: pytest.CaptureFixture[str]) -> None:
    from maskplug.cli import main
    from maskplug.conformance import load_cases

    args = ["conformance", "--provider", "llguidance", "--data", str(DATA), "--no-engine", "--json", "--details"]
    assert main([*args, "--offset", "3", "--shard", "2/4", "--limit", "2"]) == 0
    (d,) = json.loads(capsys.readouterr().out)["details"]
    want = [c.id for c in load_cases(DATA, offset=3, shard=(2, 4), limit=2)]
    assert d["schemas"] == 2 and sorted({k.split("#")[0] for k in d["verdicts"]} | set(d["errors"])) == sorted(want)
