"""Vocabulary loaders on the real mistral-common tokenizers and on tokenizer.json files."""

from __future__ import annotations

import base64
import json
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from maskplug import GrammarError, Vocab
from maskplug.grammar.vocabs import (
    bytes_to_unicode,
    load_sentencepiece,
    load_tokenizer_json,
    mistral_data_dir,
    mistral_sentencepiece,
    mistral_tekken,
    mistral_tekken_encoding,
)

# Text that exercises spaces, newlines, tabs, punctuation, accents, CJK and emoji.
TEXT = st.text(
    alphabet=st.sampled_from(list("abcxyzABC019 \n\t{}[]\":,.-_'ééüß日本語🚀\u00a0"))
    | st.characters(exclude_categories=["Cs"]),
    max_size=60,
)


@lru_cache(maxsize=1)
def _spm():  # type: ignore[no-untyped-def]
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(mistral_data_dir() / "tokenizer.model.v1"))


def test_tekken_layout() -> None:
    v = mistral_tekken()
    assert len(v) == v.vocab_size == 131072
    assert v.eos_ids == (2,)
    assert v.special_ids == frozenset(range(1000))
    assert v.tokens[:3] == [b"<unk>", b"<s>", b"</s>"]
    # Ordinary tokens start at id 1000 with the 256 single bytes, in byte order.
    assert v.tokens[1000:1256] == [bytes([b]) for b in range(256)]
    data = json.loads((mistral_data_dir() / "tekken_240911.json").read_text())
    last = data["vocab"][131072 - 1000 - 1]
    assert v.tokens[-1] == base64.b64decode(last["token_bytes"])


@given(TEXT)
def test_tekken_round_trip(text: str) -> None:
    v = mistral_tekken()
    enc = mistral_tekken_encoding()
    ids = [i + enc.maskplug_offset for i in enc.encode(text, disallowed_special=())]
    assert b"".join(v.tokens[i] for i in ids) == text.encode()


def test_sentencepiece_matches_the_sentencepiece_library() -> None:
    v = mistral_sentencepiece()
    sp = _spm()
    assert len(v) == sp.get_piece_size() == 32000
    assert v.eos_ids == (sp.eos_id(),) == (2,)
    for i in range(len(v)):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            assert v.tokens[i] == bytes([int(piece[3:5], 16)])
        elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            assert i in v.special_ids
        else:
            assert i not in v.special_ids
            assert v.tokens[i] == piece.replace("▁", " ").encode()
    assert v.tokens[13] == b"\n"  # <0x0A>


@given(TEXT)
def test_sentencepiece_round_trip(text: str) -> None:
    v = mistral_sentencepiece()
    ids = _spm().encode(text)
    # The encoder prefixes the text with a space marker; this model applies no other normalisation.
    assert b"".join(v.tokens[i] for i in ids) == ((" " + text).encode() if text else b"")


@lru_cache(maxsize=1)
def _trained_byte_level(tmp: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [f'{{"id": {i}, "name": "item {i}", "tags": ["a", "b"]}} naïve café 日本 {i * 7}' for i in range(400)]
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(["<user text>"])  # a non-special added token: literal text
    path = str(Path(tmp) / "bytelevel.json")
    tok.save(path)
    return path


@pytest.fixture(scope="module")
def byte_level_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _trained_byte_level(str(tmp_path_factory.mktemp("tok")))


def test_tokenizer_json_byte_level(byte_level_json: str) -> None:
    from tokenizers import Tokenizer

    v = load_tokenizer_json(byte_level_json)
    tok = Tokenizer.from_file(byte_level_json)
    assert len(v) == tok.get_vocab_size()
    assert v.eos_ids == (tok.token_to_id("<|endoftext|>"),)
    assert tok.token_to_id("<pad>") in v.special_ids
    user = tok.token_to_id("<user text>")
    assert user is not None and user not in v.special_ids and v.tokens[user] == b"<user text>"
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    for text in ["", "hello", '{"id": 12, "name": "x"}', "naïve café 日本 🚀\n\t  x", "<user text> ok"]:
        ids = tok.encode(text).ids
        assert b"".join(v.tokens[i] for i in ids) == text.encode()


@given(text=TEXT)
def test_tokenizer_json_byte_level_round_trip(byte_level_json: str, text: str) -> None:
    from tokenizers import Tokenizer

    v = load_tokenizer_json(byte_level_json)
    ids = Tokenizer.from_file(byte_level_json).encode(text).ids
    assert b"".join(v.tokens[i] for i in ids) == text.encode()


def _metaspace_json(tmp: Path) -> Path:
    """The v1 SentencePiece model written out as a byte-fallback, metaspace tokenizer.json (Llama style)."""
    sp = _spm()
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    added = [
        {"id": i, "content": sp.id_to_piece(i), "special": True, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False}
        for i in range(3)
    ]  # fmt: skip
    data = {
        "version": "1.0",
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "byte_fallback": True, "unk_token": "<unk>"},
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
    }
    path = tmp / "metaspace.json"
    path.write_text(json.dumps(data, ensure_ascii=False))
    return path


def test_tokenizer_json_metaspace_byte_fallback(tmp_path: Path) -> None:
    path = _metaspace_json(tmp_path)
    v = load_tokenizer_json(path, vocab_size=32768)
    ref = mistral_sentencepiece()
    assert v.tokens == ref.tokens
    assert v.eos_ids == ref.eos_ids
    assert {0, 1, 2} <= v.special_ids
    assert v.vocab_size == 32768 and v.mask_words == 1024


def test_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(GrammarError, match="path"):
        load_tokenizer_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(GrammarError, match="path"):
        load_tokenizer_json(tmp_path / "bad.json")
    (tmp_path / "wp.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}}}))
    with pytest.raises(GrammarError, match="WordPiece"):
        load_tokenizer_json(tmp_path / "wp.json")
    (tmp_path / "noeos.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}))
    with pytest.raises(GrammarError, match="eos_tokens"):
        load_tokenizer_json(tmp_path / "noeos.json")
    with pytest.raises(GrammarError, match="eos_tokens"):
        load_tokenizer_json(tmp_path / "noeos.json", eos_tokens=["</s>"])
    (tmp_path / "x.model").write_bytes(b"")
    with pytest.raises(GrammarError, match="path"):
        load_sentencepiece(tmp_path / "x.model")
    with pytest.raises(GrammarError, match="ranks"):
        Vocab.from_tiktoken({b"a": 0, b"b": 2}, ["</s>"])
    with pytest.raises(GrammarError, match="eos_ids"):
        Vocab.from_tiktoken({b"a": 0}, ["<s>"])
    with pytest.raises(GrammarError, match="vocab_size"):
        Vocab([b"a", b"b"], [0], vocab_size=1)


def test_from_tiktoken_layout() -> None:
    v = Vocab.from_tiktoken({b"a": 0, b"bc": 1, b" d": 2}, ["<unk>", "</s>"], num_special_tokens=4, vocab_size=8)
    assert v.tokens == [b"<unk>", b"</s>", b"<SPECIAL_2>", b"<SPECIAL_3>", b"a", b"bc", b" d"]
    assert v.eos_ids == (1,) and v.special_ids == frozenset(range(4)) and v.vocab_size == 8
    cut = Vocab.from_tiktoken({b"a": 0, b"bc": 1, b" d": 2}, ["</s>"], vocab_size=3)
    assert cut.tokens == [b"</s>", b"a", b"bc"]


def test_mistral_helpers_report_a_missing_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from maskplug.grammar import vocabs

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(GrammarError, match="pip install --no-deps mistral-common"):
        vocabs.mistral_data_dir()
