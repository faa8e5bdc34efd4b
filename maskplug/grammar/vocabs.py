"""Vocabulary loaders: tokenizer.json, tiktoken ranks, SentencePiece models.

Every loader turns a tokenizer's files into a :class:`~maskplug.grammar.Vocab`:
the exact bytes each token id decodes to, the stop tokens, the control tokens
and the model's logits width. Nothing is downloaded; the files are read from
disk. The helpers :func:`mistral_tekken` and :func:`mistral_sentencepiece`
load the real tokenizers shipped inside the ``mistral-common`` wheel, found
through its import spec without importing the package (which would pull in
its many dependencies).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import GrammarError
from .spec import Vocab

__all__ = [
    "MISTRAL_SPECIAL_TOKENS",
    "SentencePieceEncoder",
    "TiktokenEncoder",
    "TokenizersEncoder",
    "bytes_to_unicode",
    "load_sentencepiece",
    "load_tekken_json",
    "load_tiktoken",
    "load_tokenizer_json",
    "mistral_data_dir",
    "mistral_sentencepiece",
    "mistral_tekken",
    "mistral_tekken_encoding",
    "vocab_from_hf_tokenizer",
]

PathLike = str | os.PathLike[str]

# The control tokens Mistral's tekken files of this vintage leave implicit
# (the file carries only the count, 1,000); later ids are numbered fillers.
MISTRAL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)

# Names of end-of-sequence tokens in common tokenizer.json files, tried in order
# when the caller does not say which tokens stop generation.
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<eos>", "<|end|>")

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The byte → printable character table of byte-level BPE (GPT-2 style).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in
    byte order, to code points from 256 upwards.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


#: The most ids a loaded vocabulary may span (a bad id in a file would otherwise allocate billions).
MAX_VOCAB_IDS = 1 << 24


def _int_id(value: Any, arg: str) -> int:
    """``value`` as a token id: an int >= 0 (not a bool, a float or a string), :class:`GrammarError` naming ``arg``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise GrammarError(f"{arg}: expected an int token id, got {value!r}")
    value = int(value)
    if value < 0:
        raise GrammarError(f"{arg}: expected a token id >= 0, got {value}")
    if value >= MAX_VOCAB_IDS:
        raise GrammarError(f"{arg}: expected a token id below {MAX_VOCAB_IDS}, got {value}")
    return value


def _int_field(value: Any, arg: str, low: int = 0) -> int:
    """A whole-number field of a tokenizer file (not a bool, a float or a string), at least ``low``."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < low:
        raise GrammarError(f"{arg}: expected an int >= {low}, got {value!r}")
    return int(value)


def _id_list(ids: Any, arg: str) -> list[int]:
    """Stop-token ids as given (an iterable of ints, not a str), each checked by :func:`_int_id`."""
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
        raise GrammarError(f"{arg}: expected an iterable of int token ids, got {type(ids).__name__}")
    return [_int_id(e, f"{arg}[{i}]") for i, e in enumerate(ids)]


def _read_json(path: PathLike, arg: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as exc:
        raise GrammarError(f"{arg}: expected an existing JSON file, got {os.fspath(path)!r} (not found)") from exc
    except (OSError, ValueError) as exc:
        raise GrammarError(f"{arg}: could not read {os.fspath(path)!r} as JSON: {exc}") from exc


def _finish(
    tokens: list[bytes | None],
    special: set[int],
    eos_ids: Sequence[int],
    vocab_size: int | None,
    encoder: Callable[[str], Sequence[int]] | None = None,
) -> Vocab:
    # Holes in the id space (ids no entry names) become empty control tokens:
    # they can never be produced as text, so no grammar may allow them.
    full: list[bytes] = []
    for i, t in enumerate(tokens):
        if t is None:
            special.add(i)
            full.append(b"")
        else:
            full.append(t)
    vocab = Vocab(full, eos_ids, special, vocab_size, encoder=encoder)
    if isinstance(encoder, _LazyEncoder):
        encoder.bind(vocab.tokens, vocab.special_ids)
    return vocab


# --------------------------------------------------------------------------
# Encoders: the tokenizer's own text -> ids, attached to the Vocab
# --------------------------------------------------------------------------


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _LazyEncoder:
    """An encoder built on first use (loading a tokenizer costs up to a second), thread-safe.

    SentencePiece and metaspace tokenizers put a space in front of the text
    they encode (the "dummy prefix") and spell a word's start differently
    from its middle; text a grammar forces sits in the middle of an output.
    So when the ids spell ``" " + text``, the text is encoded after a
    newline instead and the tokens spelling the prefix (``" \n"``) are cut
    off; when that does not split cleanly, the leading space is taken off
    the first token (dropped when it is the space alone, else swapped for
    the token spelling the rest). Ids that still do not spell the text are
    returned as they are: a provider checks them.
    """

    name = "encoder"

    def __init__(self) -> None:
        self._impl: Callable[[str], list[int]] | None = None
        self._lock = threading.Lock()
        self._tokens: list[bytes] = []
        self._by_bytes: dict[bytes, int] | None = None
        self._special: frozenset[int] = frozenset()

    def bind(self, tokens: list[bytes], special: frozenset[int]) -> None:
        self._tokens = tokens
        self._special = special

    def _load(self) -> Callable[[str], list[int]]:
        raise NotImplementedError

    def __call__(self, text: str) -> list[int]:
        impl = self._impl
        if impl is None:
            with self._lock:
                if self._impl is None:
                    self._impl = self._load()
                impl = self._impl
        ids = impl(text)
        return self._strip_prefix_space(impl, text, ids) if self._tokens else ids

    def _spell(self, ids: Sequence[int]) -> bytes | None:
        toks = self._tokens
        if not all(0 <= i < len(toks) for i in ids):
            return None
        return b"".join(toks[i] for i in ids)

    def _strip_prefix_space(self, impl: Callable[[str], list[int]], text: str, ids: list[int]) -> list[int]:
        raw = text.encode("utf-8")
        if not ids or self._spell(ids) != b" " + raw:
            return ids
        after = impl("\n" + text)
        for k in (1, 2):
            if self._spell(after[:k]) in (b"\n", b" \n") and self._spell(after[k:]) == raw:
                return after[k:]
        toks = self._tokens
        first = toks[ids[0]]
        if first == b" ":
            return ids[1:]
        if self._by_bytes is None:
            by: dict[bytes, int] = {}
            for i, t in enumerate(toks):
                if t and i not in self._special:
                    by.setdefault(t, i)
            self._by_bytes = by
        rest = self._by_bytes.get(first[1:])
        return ids if rest is None else [rest, *ids[1:]]


class TiktokenEncoder(_LazyEncoder):
    """tiktoken's BPE over ranks (``encode_ordinary``), ids shifted by the control ids in front (tekken)."""

    def __init__(self, ranks: Mapping[bytes, int], pattern: str, offset: int, label: str) -> None:
        super().__init__()
        self._ranks = dict(ranks)
        self._pattern = pattern
        self.offset = int(offset)
        self.name = f"tiktoken:{label}"

    def _load(self) -> Callable[[str], list[int]]:
        import tiktoken

        enc = tiktoken.Encoding(
            name=f"maskplug-{self.name}", pat_str=self._pattern, mergeable_ranks=self._ranks, special_tokens={}
        )
        off = self.offset
        return lambda text: [t + off for t in enc.encode_ordinary(text)]

    def _strip_prefix_space(self, impl: Callable[[str], list[int]], text: str, ids: list[int]) -> list[int]:
        return ids  # byte-level BPE adds no prefix


class _FileEncoder(_LazyEncoder):
    """An encoder loading a tokenizer file with the library ``library``; named ``library:<file name>``."""

    library = "file"

    def __init__(self, path: PathLike) -> None:
        super().__init__()
        self._path = os.fspath(path)
        self.name = f"{self.library}:{Path(self._path).name}"


class TokenizersEncoder(_FileEncoder):
    """Hugging Face ``tokenizers`` loading a ``tokenizer.json`` (``add_special_tokens=False``)."""

    library = "tokenizers"

    def _load(self) -> Callable[[str], list[int]]:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(self._path)
        return lambda text: list(tok.encode(text, add_special_tokens=False).ids)


class SentencePieceEncoder(_FileEncoder):
    """The ``sentencepiece`` package encoding with a ``.model`` file."""

    library = "sentencepiece"

    def _load(self) -> Callable[[str], list[int]]:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=self._path)
        return lambda text: [int(t) for t in sp.encode(text)]


# --------------------------------------------------------------------------
# tokenizer.json (Hugging Face tokenizers)
# --------------------------------------------------------------------------


def _decoder_kinds(decoder: Any) -> list[dict[str, Any]]:
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        out: list[dict[str, Any]] = []
        for d in decoder.get("decoders", []):
            out.extend(_decoder_kinds(d))
        return out
    return [decoder]


def _token_decoder(data: Mapping[str, Any]) -> Any:
    """A function str → bytes decoding one vocabulary entry the way the model's decoder would."""
    decs = _decoder_kinds(data.get("decoder"))
    types = {d.get("type") for d in decs}
    pre = data.get("pre_tokenizer") or {}
    pre_types = {d.get("type") for d in _decoder_kinds(pre)} | {
        d.get("type") for d in (pre.get("pretokenizers") or []) if isinstance(d, dict)
    }
    model = data.get("model") or {}
    if "ByteLevel" in types or ("ByteLevel" in pre_types and not types):
        table = _unicode_to_byte()

        def byte_level(piece: str) -> bytes:
            try:
                return bytes(table[c] for c in piece)
            except KeyError:
                # Not a byte-level string (e.g. an added token): its text is literal.
                return piece.encode("utf-8")

        return byte_level
    replace_from, replace_to = "▁", " "
    metaspace = False
    for d in decs:
        if d.get("type") == "Metaspace":
            metaspace = True
            replace_from = d.get("replacement", "▁")
        elif d.get("type") == "Replace":
            pat = d.get("pattern", {})
            src = pat.get("String") if isinstance(pat, dict) else None
            if isinstance(src, str):
                metaspace = True
                replace_from, replace_to = src, d.get("content", " ")
    byte_fallback = "ByteFallback" in types or bool(model.get("byte_fallback"))

    def plain(piece: str) -> bytes:
        if byte_fallback:
            m = _BYTE_PIECE.match(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        if metaspace:
            piece = piece.replace(replace_from, replace_to)
        return piece.encode("utf-8")

    return plain


def load_tokenizer_json(
    path: PathLike,
    *,
    eos_tokens: Sequence[str] | None = None,
    vocab_size: int | None = None,
) -> Vocab:
    """Load a Hugging Face ``tokenizer.json`` file.

    Handles byte-level BPE (every character of a token string stands for one
    byte) and metaspace vocabularies with byte fallback (``▁`` is a space,
    ``<0x0A>`` is the byte 0x0A). Added tokens marked special are control
    tokens; the others are literal text.

    Args:
        path: the ``tokenizer.json`` file.
        eos_tokens: the stop tokens by their text; default: the first of the
            usual end-of-sequence names present among the special tokens.
        vocab_size: the model's logits width (default: the number of ids).
    """
    data = _read_json(path, "path")
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise GrammarError(f"path: expected a tokenizer.json with a 'model' object, got {os.fspath(path)!r}")
    model = data["model"]
    where = os.fspath(path)
    mtype = model.get("type")
    raw = model.get("vocab")
    entries: list[tuple[str, int]]
    if isinstance(raw, dict) and mtype in (None, "BPE", "WordLevel"):
        entries = [(k, _int_id(v, f"path: model.vocab[{k!r}]")) for k, v in raw.items()]
    elif isinstance(raw, list) and mtype == "Unigram":
        entries = []
        for i, item in enumerate(raw):
            if not isinstance(item, list) or not item or not isinstance(item[0], str):
                raise GrammarError(f"path: model.vocab[{i}] of {where!r}: expected [piece, score], got {item!r}")
            entries.append((item[0], i))
    else:
        raise GrammarError(f"path: expected a BPE, WordLevel or Unigram model in {where!r}, got model type {mtype!r}")
    if not entries:
        raise GrammarError(f"path: expected a tokenizer.json with tokens, got an empty model.vocab in {where!r}")
    added_raw = data.get("added_tokens")
    if added_raw is None:
        added_raw = []
    if not isinstance(added_raw, list):
        raise GrammarError(f"path: added_tokens of {where!r}: expected a list, got {type(added_raw).__name__}")
    added: list[tuple[int, str, bool]] = []
    for k, a in enumerate(added_raw):
        if not isinstance(a, dict) or not isinstance(a.get("content"), str):
            raise GrammarError(f"path: added_tokens[{k}] of {where!r}: expected an object with 'id' and 'content'")
        sp = a.get("special", False)
        if not isinstance(sp, bool):
            raise GrammarError(f"path: added_tokens[{k}].special of {where!r}: expected a bool, got {sp!r}")
        added.append((_int_id(a.get("id"), f"path: added_tokens[{k}].id"), a["content"], sp))
    size = max([i for _, i in entries] + [i for i, _, _ in added]) + 1
    if (
        vocab_size is not None
        and not isinstance(vocab_size, bool)
        and isinstance(vocab_size, int)
        and size > vocab_size
    ):
        raise GrammarError(f"vocab_size: expected >= the {size} ids of {where!r}, got {vocab_size}")
    decode = _token_decoder(data)
    tokens: list[bytes | None] = [None] * size
    pieces: dict[int, str] = {}
    for piece, i in entries:
        if i in pieces:
            raise GrammarError(f"path: model.vocab of {where!r} gives id {i} to both {pieces[i]!r} and {piece!r}")
        pieces[i] = piece
        tokens[i] = decode(piece)
    special: set[int] = set()
    by_text: dict[str, int] = {}
    added_at: dict[int, str] = {}
    for i, text, is_special in added:
        # An added token may restate a vocabulary entry (the same text at the same id), never replace one.
        if i in pieces and pieces[i] != text:
            raise GrammarError(
                f"path: added token {text!r} of {where!r} takes id {i} of the vocabulary's {pieces[i]!r}"
            )
        if i in added_at and added_at[i] != text:
            raise GrammarError(f"path: added_tokens of {where!r} give id {i} to both {added_at[i]!r} and {text!r}")
        if text in by_text and by_text[text] != i:
            raise GrammarError(f"path: added token {text!r} of {where!r} has two ids, {by_text[text]} and {i}")
        added_at[i] = text
        tokens[i] = text.encode("utf-8")
        by_text[text] = i
        if is_special:
            special.add(i)
    if eos_tokens is None:
        found = [by_text[n] for n in _EOS_NAMES if n in by_text and by_text[n] in special]
        if not found:
            raise GrammarError(
                f"eos_tokens: no usual end-of-sequence token among the special tokens of {os.fspath(path)!r}; "
                f"expected one of {list(_EOS_NAMES)}, got none (pass eos_tokens=...)"
            )
        eos_ids = found[:1]
    else:
        if isinstance(eos_tokens, (str, bytes)) or not all(isinstance(t, str) for t in eos_tokens):
            raise GrammarError(f"eos_tokens: expected a list of token texts, got {eos_tokens!r}")
        missing = [t for t in eos_tokens if t not in by_text]
        if missing:
            raise GrammarError(f"eos_tokens: expected added tokens of {os.fspath(path)!r}, got unknown {missing}")
        eos_ids = [by_text[t] for t in eos_tokens]
    encoder = TokenizersEncoder(path) if _have("tokenizers") else None
    return _finish(tokens, special, eos_ids, vocab_size, encoder)


# --------------------------------------------------------------------------
# tiktoken ranks (tekken)
# --------------------------------------------------------------------------


def _ranks_to_list(ranks: Any) -> list[bytes]:
    """Token bytes ordered by rank, from a {bytes: rank} mapping or tekken vocab entries."""
    if isinstance(ranks, Mapping):
        for b in ranks:
            if not isinstance(b, bytes):
                raise GrammarError(f"ranks: expected bytes keys (token bytes), got {b!r}")
        items = sorted((_int_field(r, f"ranks[{b!r}]"), b) for b, r in ranks.items())
        out = [b for _, b in items]
        ranks_seen = [r for r, _ in items]
    elif isinstance(ranks, Iterable) and not isinstance(ranks, (str, bytes)):
        entries = list(ranks)
        decoded = []
        for k, e in enumerate(entries):
            try:
                tb = e["token_bytes"]
                if not isinstance(tb, str):
                    raise TypeError(f"token_bytes is {type(tb).__name__}, not base64 text")
                decoded.append((_int_field(e["rank"], f"ranks[{k}].rank"), base64.b64decode(tb, validate=True)))
            except (KeyError, TypeError, ValueError) as exc:
                raise GrammarError(
                    "ranks: expected a {bytes: rank} mapping or entries with 'rank' and base64 'token_bytes', "
                    f"got entry {k} that is neither ({exc})"
                ) from exc
        items = sorted(decoded)
        out = [b for _, b in items]
        ranks_seen = [r for r, _ in items]
    else:
        raise GrammarError(f"ranks: expected a mapping or a list of entries, got {type(ranks).__name__}")
    if not out:
        raise GrammarError("ranks: expected at least one token, got none")
    if ranks_seen != list(range(len(ranks_seen))):
        bad = next(i for i, r in enumerate(ranks_seen) if r != i)
        raise GrammarError(
            f"ranks: expected ranks 0..{len(ranks_seen) - 1} without gaps, got {ranks_seen[bad]} at {bad}"
        )
    if len(set(out)) != len(out):
        seen: dict[bytes, int] = {}
        for r, b in enumerate(out):
            if b in seen:
                raise GrammarError(f"ranks: token bytes {b!r} have two ranks, {seen[b]} and {r}")
            seen[b] = r
    return out


def load_tiktoken(
    ranks: Any,
    special_tokens: Any = (),
    *,
    num_special_tokens: int | None = None,
    vocab_size: int | None = None,
    eos_ids: Sequence[int] | None = None,
    pattern: str | None = None,
    name: str = "ranks",
) -> Vocab:
    """Build a vocabulary from tiktoken-format ranks with the special tokens in front.

    This is the layout of Mistral's tekken files: ids ``0 .. S-1`` are the
    control tokens, id ``S + rank`` is the ordinary token of that rank.

    Args:
        ranks: ``{token_bytes: rank}`` (tiktoken's mergeable ranks) or a list
            of entries ``{"rank": r, "token_bytes": base64}`` (a tekken file's
            ``vocab``).
        special_tokens: the control tokens' texts (or entries with
            ``token_str``), in id order.
        num_special_tokens: ``S``, the ids reserved in front (default:
            ``len(special_tokens)``); unnamed ones become ``<SPECIAL_i>``.
        vocab_size: the model's vocabulary size including the special ids;
            ranks beyond it are cut (tekken ships more ranks than it uses),
            a larger value pads the logits width.
        eos_ids: the stop tokens (default: the id of ``</s>``).
        pattern: tiktoken's pre-tokenisation regex (a tekken file's
            ``config.pattern``); with it, and ``tiktoken`` installed, the
            vocabulary carries tiktoken's encoder. Without it the result is
            a bare byte table.
        name: what the encoder is called (``tiktoken:<name>``).
    """
    if isinstance(special_tokens, (str, bytes)) or not isinstance(special_tokens, Iterable):
        raise GrammarError(f"special_tokens: expected a list of token texts, got {type(special_tokens).__name__}")
    names = []
    for k, sp in enumerate(special_tokens):
        text = sp.get("token_str") if isinstance(sp, Mapping) else sp
        if not isinstance(text, str):
            raise GrammarError(f"special_tokens[{k}]: expected a token text (or an entry with token_str), got {sp!r}")
        names.append(text)
    nspec = len(names) if num_special_tokens is None else _int_field(num_special_tokens, "num_special_tokens")
    if nspec < len(names):
        raise GrammarError(f"num_special_tokens: expected >= len(special_tokens) = {len(names)}, got {nspec}")
    names += [f"<SPECIAL_{i}>" for i in range(len(names), nspec)]
    inner = _ranks_to_list(ranks)
    if vocab_size is not None:
        vocab_size = _int_field(vocab_size, "vocab_size", 1)
    if vocab_size is not None and vocab_size < nspec:
        raise GrammarError(f"vocab_size: expected >= num_special_tokens = {nspec}, got {vocab_size}")
    if vocab_size is not None:
        inner = inner[: vocab_size - nspec]
    tokens: list[bytes | None] = [n.encode("utf-8") for n in names]
    tokens.extend(inner)
    if eos_ids is None:
        if "</s>" not in names:
            raise GrammarError("eos_ids: no '</s>' among the special tokens; expected eos_ids=..., got none")
        eos = [names.index("</s>")]
    else:
        eos = _id_list(eos_ids, "eos_ids")
    encoder = None
    if pattern is not None and _have("tiktoken"):
        encoder = TiktokenEncoder({b: r for r, b in enumerate(inner)}, pattern, nspec, name)
    return _finish(tokens, set(range(nspec)), eos, vocab_size, encoder)


def load_tekken_json(path: PathLike, *, vocab_size: int | None = None) -> Vocab:
    """Load a Mistral tekken JSON file (``config`` + ``vocab`` [+ ``special_tokens``])."""
    data = _read_json(path, "path")
    where = os.fspath(path)
    try:
        cfg = data["config"]
        entries = data["vocab"]
        nspec = _int_field(cfg["default_num_special_tokens"], "path: config.default_num_special_tokens")
        default_size = _int_field(cfg["default_vocab_size"], "path: config.default_vocab_size", 1)
    except (KeyError, TypeError) as exc:
        raise GrammarError(f"path: expected a tekken file with config and vocab, got {where!r}: {exc}") from exc
    if not isinstance(entries, list):
        raise GrammarError(f"path: vocab of {where!r}: expected a list of entries, got {type(entries).__name__}")
    # A file with fewer ranks than its config promises is cut short: loaded, it would be another vocabulary.
    if len(entries) < default_size - nspec:
        raise GrammarError(
            f"path: {where!r} holds {len(entries)} ranks, expected at least default_vocab_size - "
            f"default_num_special_tokens = {default_size - nspec} (a truncated file?)"
        )
    pattern = cfg.get("pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise GrammarError(f"path: config.pattern of {where!r}: expected a regex str, got {pattern!r}")
    specials = data.get("special_tokens") or list(MISTRAL_SPECIAL_TOKENS)
    return load_tiktoken(
        entries,
        specials,
        num_special_tokens=nspec,
        vocab_size=default_size if vocab_size is None else vocab_size,
        pattern=pattern,
        name=Path(path).name,
    )


# --------------------------------------------------------------------------
# SentencePiece models
# --------------------------------------------------------------------------

# SentencePiece piece types (sentencepiece_model.proto).
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED, _SP_UNUSED, _SP_BYTE = 1, 2, 3, 4, 5, 6
_SP_TYPES = frozenset({_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED, _SP_UNUSED, _SP_BYTE})


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise GrammarError("path: truncated SentencePiece model (varint runs past the end)")
        if shift > 63:
            raise GrammarError("path: garbled SentencePiece model (a varint longer than 10 bytes)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _take(buf: bytes, pos: int, n: int) -> tuple[bytes, int]:
    """``n`` bytes at ``pos``; a field running past the end is a truncated model, never a shorter field."""
    if pos + n > len(buf):
        raise GrammarError(
            f"path: truncated SentencePiece model (a field of {n} bytes at offset {pos} runs past the end, {len(buf)})"
        )
    return buf[pos : pos + n], pos + n


def _fields(buf: bytes) -> Iterable[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message, in order."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        val: Any
        if num == 0:
            raise GrammarError("path: garbled SentencePiece model (protobuf field number 0)")
        if wire == 0:
            val, pos = _varint(buf, pos)
        elif wire == 1:
            val, pos = _take(buf, pos, 8)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            val, pos = _take(buf, pos, n)
        elif wire == 5:
            val, pos = _take(buf, pos, 4)
        else:
            raise GrammarError(f"path: unsupported protobuf wire type {wire} in SentencePiece model")
        yield num, wire, val


def _sentencepiece_pieces(data: bytes) -> tuple[list[tuple[str, int]], int | None]:
    """The pieces (text, type) of a model, and the vocabulary size its trainer spec records (None: no spec)."""
    pieces: list[tuple[str, int]] = []
    declared: int | None = None
    for num, wire, val in _fields(data):
        if num == 2 and wire == 2:  # trainer_spec: field 4 is the vocabulary size it was trained to
            for tnum, twire, tval in _fields(val):
                if tnum == 4 and twire == 0:
                    declared = int(tval)
            continue
        if num != 1 or wire != 2:
            continue
        piece: str | None = None
        ptype = _SP_NORMAL
        for pnum, pwire, pval in _fields(val):
            if pnum == 1 and pwire == 2:
                try:
                    piece = pval.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise GrammarError(f"path: piece {len(pieces)} is not UTF-8 ({exc}): a garbled model?") from None
            elif pnum == 3 and pwire == 0:
                ptype = int(pval)
            # field 2 (the score) is irrelevant to decoding
        if not piece:
            raise GrammarError(f"path: piece {len(pieces)} has no text: a garbled model?")
        if ptype not in _SP_TYPES:
            raise GrammarError(f"path: piece {len(pieces)} ({piece!r}) has unknown type {ptype}: a garbled model?")
        pieces.append((piece, ptype))
    return pieces, declared


def load_sentencepiece(path: PathLike, *, vocab_size: int | None = None) -> Vocab:
    """Load a SentencePiece ``.model`` file (read directly, no sentencepiece import).

    ``▁`` becomes a space, byte pieces like ``<0x0A>`` become that byte,
    unknown/control/unused pieces are control tokens, ``</s>`` stops.
    Note SentencePiece encoders prefix the text with ``▁``, so the first
    token of an encoded text carries a leading space.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise GrammarError(f"path: expected a readable SentencePiece model, got {os.fspath(path)!r}: {exc}") from exc
    pieces, declared = _sentencepiece_pieces(data)
    where = os.fspath(path)
    if not pieces:
        raise GrammarError(f"path: expected a SentencePiece model with pieces, got none in {where!r}")
    # The pieces come first in the file, the trainer spec after them: a model cut short between two
    # pieces parses, but has lost its trainer spec, or records more pieces than it holds.
    if declared is None:
        raise GrammarError(
            f"path: {where!r} has {len(pieces)} pieces but no trainer spec after them (a truncated model?)"
        )
    if declared != len(pieces):
        raise GrammarError(f"path: {where!r} holds {len(pieces)} pieces, its trainer spec says {declared}")
    tokens: list[bytes | None] = []
    special: set[int] = set()
    eos: list[int] = []
    byte_ids: dict[int, int] = {}
    for i, (piece, ptype) in enumerate(pieces):
        if ptype == _SP_BYTE:
            m = _BYTE_PIECE.match(piece)
            if not m:
                raise GrammarError(f"path: byte piece {i} is {piece!r}, expected the form <0xHH>")
            if int(m.group(1), 16) in byte_ids:
                raise GrammarError(
                    f"path: byte piece {i} ({piece!r}) repeats byte piece {byte_ids[int(m.group(1), 16)]}"
                )
            byte_ids[int(m.group(1), 16)] = i
            tokens.append(bytes([int(m.group(1), 16)]))
        elif ptype in (_SP_NORMAL, _SP_USER_DEFINED):
            tokens.append(piece.replace("▁", " ").encode("utf-8"))
        else:
            tokens.append(piece.encode("utf-8"))
            special.add(i)
            if piece == "</s>":
                eos.append(i)
    if not eos:
        raise GrammarError(f"path: expected a '</s>' control piece in {os.fspath(path)!r}, got none")
    encoder = SentencePieceEncoder(path) if _have("sentencepiece") else None
    return _finish(tokens, special, eos, vocab_size, encoder)


# --------------------------------------------------------------------------
# The tokenizers in the mistral-common wheel
# --------------------------------------------------------------------------


def mistral_data_dir() -> Path:
    """The ``data`` folder of the installed ``mistral-common`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec("mistral_common")
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locs:
        d = Path(loc) / "data"
        if d.is_dir():
            return d
    raise GrammarError(
        "mistral-common: expected the mistral-common wheel for its tokenizer files, got none installed; "
        "install it with `pip install --no-deps mistral-common`"
    )


def _data_file(name: str) -> Path:
    p = mistral_data_dir() / name
    if not p.is_file():
        raise GrammarError(f"mistral-common: expected {name} in {p.parent}, got no such file (a different version?)")
    return p


@lru_cache(maxsize=2)
def mistral_tekken(name: str = "tekken_240911.json") -> Vocab:
    """The 131,072-token byte-level BPE of mistral-common (1,000 control ids in front, stop id 2)."""
    return load_tekken_json(_data_file(name))


@lru_cache(maxsize=2)
def mistral_sentencepiece(name: str = "tokenizer.model.v1") -> Vocab:
    """The 32,000-token SentencePiece model of mistral-common (unk/bos/eos = 0/1/2)."""
    return load_sentencepiece(_data_file(name))


@lru_cache(maxsize=2)
def mistral_tekken_encoding(name: str = "tekken_240911.json") -> Any:
    """A ``tiktoken.Encoding`` for the tekken file (needs ``tiktoken``), ids as in :func:`mistral_tekken`.

    tiktoken numbers tokens by rank; add ``num_special`` (returned as the
    encoding's attribute ``maskplug_offset``) to get model ids.
    """
    try:
        import tiktoken
    except ImportError as exc:
        raise GrammarError("tiktoken: expected the tiktoken package to encode with tekken, got none installed") from exc
    path = _data_file(name)
    mistral_tekken(name)  # the vocabulary's checks (cached): a bad file is refused by name, never half read
    data = _read_json(path, "name")
    cfg = data["config"]
    nspec = int(cfg["default_num_special_tokens"])
    inner = int(cfg["default_vocab_size"]) - nspec
    ranks = {base64.b64decode(e["token_bytes"]): int(e["rank"]) for e in data["vocab"][:inner]}
    enc = tiktoken.Encoding(name=f"maskplug-{name}", pat_str=cfg["pattern"], mergeable_ranks=ranks, special_tokens={})
    enc.maskplug_offset = nspec  # type: ignore[attr-defined]
    return enc


def _stop_ids(tokenizer: Any, eos_token_ids: Iterable[int] | None) -> list[int]:
    """The model's stop tokens when given, else the tokenizer's ``eos_token_id`` (an int or a list)."""
    if eos_token_ids is not None:
        ids = sorted(set(_id_list(eos_token_ids, "eos_token_ids")))
        if ids:
            return ids
    eos = getattr(tokenizer, "eos_token_id", None)
    if hasattr(eos, "__index__") and not isinstance(eos, bool):
        return [_int_id(eos, "tokenizer.eos_token_id")]
    if isinstance(eos, (list, tuple)) and eos:
        return sorted(set(_id_list(eos, "tokenizer.eos_token_id")))
    raise GrammarError("eos_token_ids: expected the model's stop tokens or a tokenizer with eos_token_id, got neither")


def _fit(base: Vocab, eos_ids: list[int], vocab_size: int | None) -> Vocab:
    """``base`` with the model's stop tokens and logits width (tokens past the width can never be produced)."""
    size = base.vocab_size if vocab_size is None else vocab_size
    if isinstance(size, bool) or not hasattr(size, "__index__"):
        raise GrammarError(f"vocab_size: expected an int logits width, got {size!r}")
    size = int(size)
    if size <= 0:
        raise GrammarError(f"vocab_size: expected a positive logits width, got {size}")
    tokens = base.tokens[:size]
    bad = [e for e in eos_ids if not 0 <= e < len(tokens)]
    if bad:
        raise GrammarError(f"eos_token_ids: expected ids in [0, {len(tokens)}) of the tokenizer, got {bad}")
    special = {s for s in base.special_ids if s < len(tokens)}
    return Vocab(tokens, eos_ids, special, size, encoder=base.encoder, encoder_name=base.encoder_name)


def vocab_from_hf_tokenizer(
    tokenizer: Any,
    vocab_size: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> Vocab:
    """The :class:`Vocab` of the tokenizer an engine holds, with the model's stop tokens and logits width.

    What the engine adapters use (vLLM and SGLang hand their backends a
    Hugging Face fast tokenizer). No network access: the tokenizer is
    serialised to its ``tokenizer.json`` text and read by
    :func:`load_tokenizer_json`, so the vocabulary carries that tokenizer's
    own encoder too.

    Args:
        tokenizer: a Hugging Face fast tokenizer (``backend_tokenizer.to_str()``),
            or any object with a ready ``maskplug_vocab`` attribute.
        vocab_size: the model's logits width; default: the tokenizer's number of ids.
        eos_token_ids: the model's stop tokens (authoritative); default: the
            tokenizer's ``eos_token_id``.

    Raises:
        GrammarError: the tokenizer is neither kind, or its ids do not fit.
    """
    given = getattr(tokenizer, "maskplug_vocab", None)
    if isinstance(given, Vocab):
        eos = list(given.eos_ids) if eos_token_ids is None else _stop_ids(tokenizer, eos_token_ids)
        if (vocab_size is None or int(vocab_size) == given.vocab_size) and tuple(eos) == given.eos_ids:
            return given
        return _fit(given, eos, vocab_size)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if not callable(to_str):
        raise GrammarError(
            "tokenizer: expected a Hugging Face fast tokenizer (with backend_tokenizer) or an object with a "
            f"maskplug_vocab attribute, got {type(tokenizer).__name__}"
        )
    eos = _stop_ids(tokenizer, eos_token_ids)
    with tempfile.TemporaryDirectory(prefix="maskplug-vocab-") as tmp:
        path = os.path.join(tmp, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(to_str())
        # The stop tokens are set from the model's ids below; the loader is
        # told one of them by its text only to satisfy its own check.
        texts = tokenizer.convert_ids_to_tokens(eos[:1])
        try:
            base = load_tokenizer_json(path, eos_tokens=texts)
        except GrammarError:
            base = load_tokenizer_json(path)
    return _fit(base, eos, vocab_size)
