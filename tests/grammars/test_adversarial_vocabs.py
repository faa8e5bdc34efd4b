"""Malformed tokenizer files are refused by name; they never load as a different vocabulary.

Each loader gets a small valid file (loaded and checked exactly), then one
corruption at a time: truncated or garbled bytes, wrong types, negative,
duplicate or out-of-range ids, added tokens that would overwrite vocabulary
entries, empty vocabularies, bytes where text is due.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from maskplug.data.tokenizers import load_tokenizer
from maskplug.errors import GrammarError
from maskplug.grammar import Vocab
from maskplug.grammar.vocabs import (
    load_sentencepiece,
    load_tekken_json,
    load_tiktoken,
    load_tokenizer_json,
    mistral_data_dir,
    vocab_from_hf_tokenizer,
)

# -- tokenizer.json -----------------------------------------------------------------------------


def _tok_json(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}},
        "added_tokens": [{"id": 3, "content": "</s>", "special": True}],
        "decoder": {"type": "ByteLevel"},
    }
    for k, v in over.items():
        if k == "vocab":
            data["model"]["vocab"] = v
        elif k == "model_type":
            data["model"]["type"] = v
        else:
            data[k] = v
    return data


def _write(tmp_path: Path, data: Any, name: str = "tokenizer.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data), encoding="utf-8")
    return p


def test_a_valid_tokenizer_json_loads_exactly(tmp_path: Path) -> None:
    v = load_tokenizer_json(_write(tmp_path, _tok_json()))
    assert v.tokens == [b"a", b"b", b"ab", b"</s>"] and v.eos_ids == (3,) and 3 in v.special_ids
    # An added token restating a vocabulary entry (same text, same id) is fine.
    same = _tok_json(vocab={"a": 0, "b": 1, "</s>": 2}, added_tokens=[{"id": 2, "content": "</s>", "special": True}])
    assert load_tokenizer_json(_write(tmp_path, same)).tokens == [b"a", b"b", b"</s>"]


TOKENIZER_JSON_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("negative id", _tok_json(vocab={"a": 0, "b": -1}), r"model\.vocab\['b'\]: expected a token id >= 0, got -1"),
    ("duplicate id", _tok_json(vocab={"a": 0, "b": 0, "c": 1}), r"gives id 0 to both 'a' and 'b'"),
    ("float id", _tok_json(vocab={"a": 0, "b": 1.5}), r"model\.vocab\['b'\]: expected an int token id, got 1\.5"),
    ("string id", _tok_json(vocab={"a": 0, "b": "1"}), r"expected an int token id, got '1'"),
    ("bool id", _tok_json(vocab={"a": 0, "b": True}), r"expected an int token id, got True"),
    ("huge id", _tok_json(vocab={"a": 0, "b": 2**40}), r"expected a token id below 16777216"),
    ("empty vocab", _tok_json(vocab={}, added_tokens=[]), r"empty model\.vocab"),
    ("vocab list for BPE", _tok_json(vocab=[["a", 0.0]]), r"expected a BPE, WordLevel or Unigram model"),
    (
        "unigram item not a pair",
        _tok_json(model_type="Unigram", vocab=[["a", 0.0], 5]),
        r"model\.vocab\[1\] .*expected \[piece, score\], got 5",
    ),
    (
        "unigram piece not text",
        _tok_json(model_type="Unigram", vocab=[[7, 0.0]]),
        r"model\.vocab\[0\] .*expected \[piece, score\]",
    ),
    (
        "added token overwrites a vocabulary entry",
        _tok_json(added_tokens=[{"id": 1, "content": "</s>", "special": True}]),
        r"added token '</s>' .* takes id 1 of the vocabulary's 'b'",
    ),
    (
        "two added tokens, one id",
        _tok_json(added_tokens=[{"id": 3, "content": "</s>", "special": True}, {"id": 3, "content": "<x>"}]),
        r"give id 3 to both '</s>' and '<x>'",
    ),
    (
        "one added token, two ids",
        _tok_json(added_tokens=[{"id": 3, "content": "</s>", "special": True}, {"id": 4, "content": "</s>"}]),
        r"added token '</s>' .* has two ids, 3 and 4",
    ),
    ("added id negative", _tok_json(added_tokens=[{"id": -1, "content": "</s>", "special": True}]), r">= 0, got -1"),
    (
        "added id float",
        _tok_json(added_tokens=[{"id": 3.0, "content": "</s>"}]),
        r"added_tokens\[0\]\.id: expected an int",
    ),
    ("added id missing", _tok_json(added_tokens=[{"content": "</s>"}]), r"added_tokens\[0\]\.id: expected an int"),
    ("added entry not an object", _tok_json(added_tokens=[5]), r"added_tokens\[0\] .*expected an object"),
    ("added content not text", _tok_json(added_tokens=[{"id": 3, "content": 5}]), r"added_tokens\[0\] .*'content'"),
    ("added_tokens not a list", _tok_json(added_tokens={"id": 3}), r"added_tokens of .*expected a list, got dict"),
    (
        "added special not a bool",
        _tok_json(added_tokens=[{"id": 3, "content": "</s>", "special": "yes"}]),
        r"added_tokens\[0\]\.special .*expected a bool",
    ),
]


@pytest.mark.parametrize(
    ("data", "message"), [c[1:] for c in TOKENIZER_JSON_CASES], ids=[c[0] for c in TOKENIZER_JSON_CASES]
)
def test_malformed_tokenizer_json_is_refused(tmp_path: Path, data: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=message) as info:
        load_tokenizer_json(_write(tmp_path, data))
    assert str(info.value).startswith("path: ")


def test_ids_beyond_the_logits_width_are_refused(tmp_path: Path) -> None:
    with pytest.raises(GrammarError, match=r"^vocab_size: expected >= the 4 ids"):
        load_tokenizer_json(_write(tmp_path, _tok_json()), vocab_size=3)


@pytest.mark.parametrize("eos", ["</s>", [3], [b"</s>"]])
def test_eos_tokens_must_be_texts(tmp_path: Path, eos: Any) -> None:
    with pytest.raises(GrammarError, match=r"^eos_tokens: expected a list of token texts"):
        load_tokenizer_json(_write(tmp_path, _tok_json()), eos_tokens=eos)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"model": {"type": "BPE", "vocab": {"a": 0', r"could not read .* as JSON"),  # truncated
        (b"\xff\xfe{not json", r"could not read .* as JSON"),  # garbled, not UTF-8
        (b"[1, 2, 3]", r"expected a tokenizer\.json with a 'model' object"),
        (b"", r"could not read .* as JSON"),
    ],
)
def test_truncated_or_garbled_tokenizer_json_is_refused(tmp_path: Path, content: bytes, message: str) -> None:
    p = tmp_path / "tokenizer.json"
    p.write_bytes(content)
    with pytest.raises(GrammarError, match=r"^path: .*" + message):
        load_tokenizer_json(p)


# -- tiktoken ranks and tekken files ------------------------------------------------------------------


def _entries(tokens: list[bytes]) -> list[dict[str, Any]]:
    return [{"rank": r, "token_bytes": base64.b64encode(t).decode()} for r, t in enumerate(tokens)]


def test_valid_ranks_load_exactly() -> None:
    v = load_tiktoken({b"a": 0, b"b": 1}, ["<unk>", "<s>", "</s>"])
    assert v.tokens == [b"<unk>", b"<s>", b"</s>", b"a", b"b"] and v.eos_ids == (2,)
    assert load_tiktoken(_entries([b"a", b"b"]), ["</s>"], eos_ids=[0]).tokens == [b"</s>", b"a", b"b"]


TIKTOKEN_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("eos id a float", {"eos_ids": [1.9]}, r"^eos_ids\[0\]: expected an int token id, got 1\.9"),
    ("eos id a bool", {"eos_ids": [True]}, r"^eos_ids\[0\]: expected an int token id, got True"),
    ("eos ids a str", {"eos_ids": "2"}, r"^eos_ids: expected an iterable of int token ids, got str"),
    ("eos id negative", {"eos_ids": [-1]}, r"^eos_ids\[0\]: expected a token id >= 0"),
    ("eos id beyond the vocabulary", {"eos_ids": [99]}, r"^eos_ids: expected ids in \[0, 5\)"),
    ("rank a float", {"ranks": {b"a": 0, b"b": 1.0}}, r"^ranks\[b'b'\]: expected an int >= 0, got 1\.0"),
    ("rank keys as text", {"ranks": {"a": 0}}, r"^ranks: expected bytes keys"),
    ("negative rank", {"ranks": {b"a": -1, b"b": 0}}, r"^ranks\[b'a'\]: expected an int >= 0"),
    ("a gap in the ranks", {"ranks": {b"a": 0, b"b": 2}}, r"^ranks: expected ranks 0\.\.1 without gaps"),
    ("no ranks", {"ranks": {}}, r"^ranks: expected at least one token"),
    ("ranks a str", {"ranks": "ab"}, r"^ranks: expected a mapping or a list of entries, got str"),
    (
        "one token, two ranks",
        {"ranks": _entries([b"a", b"b", b"a"])},
        r"^ranks: token bytes b'a' have two ranks, 0 and 2",
    ),
    (
        "token bytes not base64",
        {"ranks": [{"rank": 0, "token_bytes": "!!not base64!!"}]},
        r"^ranks: .*entry 0 that is neither",
    ),
    ("token bytes not text", {"ranks": [{"rank": 0, "token_bytes": 12}]}, r"^ranks: .*entry 0 that is neither"),
    ("rank missing", {"ranks": [{"token_bytes": "YQ=="}]}, r"^ranks: .*entry 0 that is neither"),
    (
        "rank as text",
        {"ranks": [{"rank": "0", "token_bytes": "YQ=="}]},
        r"^ranks: .*entry 0 .*ranks\[0\]\.rank: expected an int >= 0, got '0'",
    ),
    ("special tokens a str", {"special_tokens": "</s>"}, r"^special_tokens: expected a list of token texts, got str"),
    ("a special token not text", {"special_tokens": ["</s>", 5]}, r"^special_tokens\[1\]: expected a token text"),
    ("num_special_tokens a float", {"num_special_tokens": 3.0}, r"^num_special_tokens: expected an int >= 0"),
    ("num_special_tokens as text", {"num_special_tokens": "3"}, r"^num_special_tokens: expected an int >= 0"),
    ("vocab_size a float", {"vocab_size": 5.0}, r"^vocab_size: expected an int >= 1, got 5\.0"),
]


@pytest.mark.parametrize(("over", "message"), [c[1:] for c in TIKTOKEN_CASES], ids=[c[0] for c in TIKTOKEN_CASES])
def test_malformed_ranks_are_refused(over: dict[str, Any], message: str) -> None:
    kwargs: dict[str, Any] = {"ranks": {b"a": 0, b"b": 1}, "special_tokens": ["<unk>", "<s>", "</s>"], **over}
    with pytest.raises(GrammarError, match=message):
        load_tiktoken(kwargs.pop("ranks"), kwargs.pop("special_tokens"), **kwargs)


def _tekken(n_ranks: int = 4, **cfg: Any) -> dict[str, Any]:
    config = {"default_num_special_tokens": 3, "default_vocab_size": 7, "pattern": r"\w+|\s+", **cfg}
    entries = _entries([bytes([97 + i]) for i in range(n_ranks)])
    return {"config": config, "vocab": entries, "special_tokens": ["<unk>", "<s>", "</s>"]}


def test_a_valid_tekken_file_loads_exactly(tmp_path: Path) -> None:
    v = load_tekken_json(_write(tmp_path, _tekken(6), "tekken.json"))
    assert v.vocab_size == 7 and v.tokens[3:] == [b"a", b"b", b"c", b"d"]  # ranks past the size are cut


TEKKEN_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("fewer ranks than the config says", _tekken(3), r"holds 3 ranks, expected at least .* = 4 \(a truncated file\?\)"),
    ("sizes as text", _tekken(default_vocab_size="7"), r"config\.default_vocab_size: expected an int >= 1"),
    ("special count a float", _tekken(default_num_special_tokens=3.0), r"default_num_special_tokens: expected an int"),
    ("pattern not text", _tekken(pattern=5), r"config\.pattern .*expected a regex str"),
    ("vocab not a list", {"config": _tekken()["config"], "vocab": {"a": 0}}, r"vocab of .*expected a list of entries"),
    ("no config", {"vocab": []}, r"expected a tekken file with config and vocab"),
]


@pytest.mark.parametrize(("data", "message"), [c[1:] for c in TEKKEN_CASES], ids=[c[0] for c in TEKKEN_CASES])
def test_malformed_tekken_files_are_refused(tmp_path: Path, data: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=r"^path: .*" + message):
        load_tekken_json(_write(tmp_path, data, "tekken.json"))


# -- SentencePiece models -----------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire: int, payload: bytes | int) -> bytes:
    key = _varint(num << 3 | wire)
    if wire == 0:
        assert isinstance(payload, int)
        return key + _varint(payload)
    assert isinstance(payload, bytes)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def _piece(text: bytes, ptype: int) -> bytes:
    return _field(1, 2, _field(1, 2, text) + _field(2, 5, struct.pack("<f", 0.0)) + _field(3, 0, ptype))


def _model(pieces: list[tuple[bytes, int]], declared: int | None = -1) -> bytes:
    body = b"".join(_piece(t, k) for t, k in pieces)
    n = len(pieces) if declared == -1 else declared
    if n is not None:
        body += _field(2, 2, _field(4, 0, n))
    return body + _field(3, 2, _field(1, 2, b"nmt_nfkc"))


SPM_PIECES = [(b"<unk>", 2), (b"<s>", 3), (b"</s>", 3), ("▁a".encode(), 1), (b"b", 1), (b"<0x41>", 6)]


def _spm(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "tokenizer.model"
    p.write_bytes(data)
    return p


def test_a_valid_sentencepiece_model_loads_exactly(tmp_path: Path) -> None:
    v = load_sentencepiece(_spm(tmp_path, _model(SPM_PIECES)))
    assert v.tokens == [b"<unk>", b"<s>", b"</s>", b" a", b"b", b"A"] and v.eos_ids == (2,)
    assert v.special_ids == frozenset({0, 1, 2})


def test_the_real_model_cut_in_half_is_refused(tmp_path: Path) -> None:
    """It used to load as 16,065 tokens instead of 32,000."""
    full = (mistral_data_dir() / "tokenizer.model.v1").read_bytes()
    assert load_sentencepiece(_spm(tmp_path, full)).vocab_size == 32000
    with pytest.raises(GrammarError, match=r"^path: truncated SentencePiece model|no trainer spec"):
        load_sentencepiece(_spm(tmp_path, full[: len(full) // 2]))


SPM_CASES: list[tuple[str, bytes, str]] = [
    ("cut inside a piece", _model(SPM_PIECES)[:-30], r"truncated SentencePiece model"),
    ("cut between pieces", b"".join(_piece(t, k) for t, k in SPM_PIECES[:4]), r"has 4 pieces but no trainer spec"),
    ("a piece dropped", _model(SPM_PIECES[:5], declared=6), r"holds 5 pieces, its trainer spec says 6"),
    ("piece text not UTF-8", _model([*SPM_PIECES, (b"\xff\xfe", 1)]), r"piece 6 is not UTF-8"),
    ("empty piece", _model([*SPM_PIECES, (b"", 1)]), r"piece 6 has no text"),
    ("unknown piece type", _model([*SPM_PIECES, (b"c", 42)]), r"piece 6 \('c'\) has unknown type 42"),
    ("byte piece twice", _model([*SPM_PIECES, (b"<0x41>", 6)]), r"byte piece 6 \('<0x41>'\) repeats byte piece 5"),
    ("byte piece malformed", _model([*SPM_PIECES, (b"<0xZZ>", 6)]), r"byte piece 6 is '<0xZZ>'"),
    ("no stop piece", _model([(b"<unk>", 2), (b"a", 1)]), r"expected a '</s>' control piece"),
    ("endless varint", b"\x0a" + b"\xff" * 12, r"a varint longer than 10 bytes"),
    ("field number 0", b"\x02\x00", r"field number 0"),
    ("unknown wire type", b"\x0f", r"unsupported protobuf wire type 7"),
    ("empty file", b"", r"with pieces, got none"),
]


@pytest.mark.parametrize(("data", "message"), [c[1:] for c in SPM_CASES], ids=[c[0] for c in SPM_CASES])
def test_malformed_sentencepiece_models_are_refused(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(GrammarError, match=r"^path: .*" + message):
        load_sentencepiece(_spm(tmp_path, data))


@pytest.mark.parametrize("seed", range(8))
def test_garbled_sentencepiece_bytes_are_refused_or_load_whole(tmp_path: Path, seed: int) -> None:
    """Random byte flips in a valid model: a GrammarError, or (a flip in a score) the same pieces."""
    import random

    good = _model(SPM_PIECES)
    rng = random.Random(seed)
    data = bytearray(good)
    for _ in range(3):
        data[rng.randrange(len(data))] = rng.randrange(256)
    try:
        v = load_sentencepiece(_spm(tmp_path, bytes(data)))
    except GrammarError:
        return
    assert len(v.tokens) == len(SPM_PIECES)  # never another vocabulary size


# -- the engine adapters' helper and the bundled tokenizers ------------------------------------------


class _Tok:
    def __init__(self, vocab: Vocab, eos: Any = None) -> None:
        self.maskplug_vocab = vocab
        self.eos_token_id = eos


def _small_vocab() -> Vocab:
    return Vocab([b"</s>", b"a", b"b"], eos_ids=(0,), vocab_size=8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eos_token_ids": [1.9]}, r"^eos_token_ids\[0\]: expected an int token id, got 1\.9"),
        ({"eos_token_ids": "1"}, r"^eos_token_ids: expected an iterable of int token ids"),
        ({"eos_token_ids": [-2]}, r"^eos_token_ids\[0\]: expected a token id >= 0"),
        ({"eos_token_ids": [5]}, r"^eos_token_ids: expected ids in \[0, 3\)"),
        ({"eos_token_ids": [1], "vocab_size": 6.0}, r"^vocab_size: expected an int logits width, got 6\.0"),
        ({"eos_token_ids": [1], "vocab_size": True}, r"^vocab_size: expected an int logits width"),
    ],
)
def test_hf_helper_refuses_bad_ids_and_widths(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        vocab_from_hf_tokenizer(_Tok(_small_vocab()), **kwargs)


class _Backend:
    def to_str(self) -> str:
        return json.dumps(_tok_json())


class _HFTok:
    """A Hugging Face fast tokenizer, as far as the helper looks."""

    backend_tokenizer = _Backend()

    def __init__(self, eos: Any) -> None:
        self.eos_token_id = eos

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["a", "b", "ab", "</s>"][ids[0] : ids[0] + 1]


def test_a_hf_tokenizer_loads_exactly() -> None:
    v = vocab_from_hf_tokenizer(_HFTok(3), vocab_size=6)
    assert v.tokens == [b"a", b"b", b"ab", b"</s>"] and v.eos_ids == (3,) and v.vocab_size == 6


@pytest.mark.parametrize(
    ("eos", "message"),
    [
        (3.0, r"^eos_token_ids: expected the model's stop tokens"),  # a float is no eos id at all
        ([3, 2.5], r"^tokenizer\.eos_token_id\[1\]: expected an int token id, got 2\.5"),
        ([True], r"^tokenizer\.eos_token_id\[0\]: expected an int token id, got True"),
        (-1, r"^tokenizer\.eos_token_id: expected a token id >= 0"),
    ],
)
def test_a_tokenizers_own_eos_id_is_checked_too(eos: Any, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        vocab_from_hf_tokenizer(_HFTok(eos), vocab_size=10)


def test_numpy_ids_are_whole_numbers() -> None:
    np = pytest.importorskip("numpy")
    v = vocab_from_hf_tokenizer(_Tok(_small_vocab()), eos_token_ids=[np.int64(1)], vocab_size=np.int64(10))
    assert v.eos_ids == (1,) and v.vocab_size == 10


@pytest.mark.parametrize("name", [["tekken"], None, "nope", b"spm", 3])
def test_load_tokenizer_names_the_argument(name: Any) -> None:
    with pytest.raises(GrammarError, match=r"^tokenizer: expected one of \('tekken', 'spm'\)"):
        load_tokenizer(name)


def test_the_bundled_sentencepiece_tokenizer_agrees_with_its_vocabulary() -> None:
    tok = load_tokenizer("spm")
    assert tok.vocab.vocab_size == 32000
    text = '{"a": [1, 2.5, "x\\ny"]}'
    assert tok.decode(tok.encode(text)) == text.encode()
