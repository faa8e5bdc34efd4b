"""Real tokenizers, read from the ``mistral-common`` wheel's data files.

The demo, the benchmarks and the tests need two things from a tokenizer: the decoded bytes of every
token id (a :class:`maskplug.grammar.Vocab`, which fixes the mask width) and an
encoder that turns a reference document into token ids. Both come from files
shipped inside the ``mistral-common`` wheel; the package itself is never
imported (it only has to be installed, ``--no-deps`` is enough) and nothing is
downloaded.

* ``"tekken"``: the 131,072-token byte-level BPE (``tekken_240911.json``),
  1,000 control tokens in front, stop token id 2, encoded with tiktoken.
* ``"spm"``: the 32,000-token SentencePiece model of Mistral-7B v0.1
  (``tokenizer.model.v1``), ids 0/1/2 = unk/bos/eos, encoded with sentencepiece.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from ..errors import GrammarError
from ..grammar import Vocab

__all__ = ["TOKENIZERS", "Tokenizer", "load_tokenizer"]

#: Names accepted by :func:`load_tokenizer`.
TOKENIZERS = ("tekken", "spm")

_SPM_FILE = "tokenizer.model.v1"


@dataclass(frozen=True)
class Tokenizer:
    """A vocabulary plus an exact encoder.

    Attributes:
        name: ``"tekken"`` or ``"spm"``.
        vocab: the decoded bytes of every id, the stop and control tokens.
        encode: text → token ids whose decoded bytes concatenate to exactly
            the UTF-8 text (no BOS, no stop token, no added prefix space).
    """

    name: str
    vocab: Vocab
    encode: Callable[[str], list[int]]

    @property
    def eos(self) -> int:
        """The stop token (the first of the vocabulary's stop tokens)."""
        return self.vocab.eos_ids[0]

    def decode(self, ids: list[int]) -> bytes:
        """The bytes the ids stand for (control tokens included verbatim)."""
        toks = self.vocab.tokens
        return b"".join(toks[i] for i in ids)


def _tekken() -> Tokenizer:
    from ..grammar.vocabs import mistral_tekken, mistral_tekken_encoding

    vocab = mistral_tekken()
    enc = mistral_tekken_encoding()
    offset = int(enc.maskplug_offset)
    # The encoder and the vocabulary must be one tokenizer: every rank lands on its own id.
    if offset + enc.n_vocab != vocab.vocab_size:
        raise GrammarError(
            f"tokenizer: tekken's encoder spans {offset} + {enc.n_vocab} ids, its vocabulary {vocab.vocab_size}"
        )

    def encode(text: str) -> list[int]:
        return [r + offset for r in enc.encode(text, disallowed_special=())]

    return Tokenizer("tekken", vocab, encode)


def _spm() -> Tokenizer:
    import sentencepiece as spm

    from ..grammar.vocabs import mistral_data_dir, mistral_sentencepiece

    vocab = mistral_sentencepiece()
    try:
        sp = spm.SentencePieceProcessor(model_file=str(mistral_data_dir() / _SPM_FILE))
    except (OSError, RuntimeError) as exc:
        raise GrammarError(f"tokenizer: sentencepiece could not read {_SPM_FILE}: {exc}") from exc
    tokens = vocab.tokens
    if sp.get_piece_size() != len(tokens):
        raise GrammarError(
            f"tokenizer: sentencepiece reads {sp.get_piece_size()} pieces from {_SPM_FILE}, maskplug {len(tokens)}"
        )
    # Byte-fallback pieces spell any text one byte at a time.
    single = {tokens[i]: i for i in range(len(tokens)) if i not in vocab.special_ids and len(tokens[i]) == 1}
    if len(single) < 256:
        missing = sorted(set(range(256)) - {t[0] for t in single})
        raise GrammarError(f"tokenizer: {_SPM_FILE} has no single-byte piece for bytes {missing[:8]}")

    def encode(text: str) -> list[int]:
        ids = [int(t) for t in sp.encode(text)]
        # SentencePiece adds a dummy prefix space to the first piece; remove it
        # so the ids decode to exactly ``text``.
        if ids and tokens[ids[0]].startswith(b" ") and not text.startswith(" "):
            rest = tokens[ids[0]][1:]
            ids = [single[bytes([c])] for c in rest] + ids[1:]
        return ids

    return Tokenizer("spm", vocab, encode)


def load_tokenizer(name: str) -> Tokenizer:
    """Load ``"tekken"`` (131,072 tokens) or ``"spm"`` (32,000 tokens); cached per process."""
    # Checked before the cache, which would raise TypeError for an unhashable name.
    if not isinstance(name, str) or name not in TOKENIZERS:
        raise GrammarError(f"tokenizer: expected one of {TOKENIZERS}, got {name!r}")
    return _load(name)


@cache
def _load(name: str) -> Tokenizer:
    return _tekken() if name == "tekken" else _spm()
