"""Fixtures for the SGLang adapter tests: real tokenizers, SGLang's own xgrammar backend, ours.

Two real vocabularies, both offline:

* a byte-level BPE ``tokenizer.json`` trained here with ``tokenizers`` on the
  shared test schemas and JSON text, wrapped in a Hugging Face fast tokenizer:
  SGLang's xgrammar backend reads it with ``TokenizerInfo.from_huggingface``
  (its ordinary path) and ours with maskplug's tokenizer.json loader;
* the 32,000-token SentencePiece model shipped in the ``mistral-common`` wheel,
  read by maskplug's loader; SGLang gets it through its ``init_xgrammar`` hook
  for tokenizers xgrammar cannot read itself.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.machinery
import json
import random
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# transformers probes for torchvision when imported; import it before the stand-in below exists.
import transformers  # noqa: F401

from maskplug.data import schema_dir
from maskplug.testing import load_hypothesis_profile

# SGLang's speculative modules reach its multimodal stack (torchvision, whose PyPI wheel does
# not load beside the CPU torch here) and its tracing (opentelemetry, not installed). The
# verify code under test uses neither; these two packages, and only these, are replaced by
# empty stand-ins so that SGLang's real modules import.
STUBBED_PACKAGES = ("torchvision", "opentelemetry")


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyMeta(name, (_Any,), {})


class _Any(metaclass=_AnyMeta):
    """Whatever a stand-in module is asked for: a class that accepts anything."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __class_getitem__(cls, item: Any) -> Any:
        return cls

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyMeta(name, (_Any,), {})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyMeta(name, (_Any,), {})


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in STUBBED_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StandInFinder())

load_hypothesis_profile()  # the core suite's profiles: CI runs every property with 1,000 examples

SCHEMA_DIR = schema_dir()  # the schemas bundled with maskplug (MASKPLUG_SCHEMAS overrides)

BPE_VOCAB_SIZE = 832  # the model's logits width: padded past the tokenizer's ids

SPECIALS = ("<s>", "</s>", "<pad>")

REGEXES = (
    r"[a-z]{2,6}-\d{2,4}",
    r"(yes|no|maybe)( please)?",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[A-Z][a-z]+( [A-Z][a-z]+)*",
)

EBNFS = (
    'root ::= "yes" | "no" | "maybe " [0-9]+',
    'root ::= item ("," item)*\nitem ::= [a-z]+ | "\\"" [a-z ]* "\\""',
    'root ::= "{" ws "\\"k\\"" ws ":" ws num ws "}"\nnum ::= [0-9]+\nws ::= [ ]?',
)


def schema_texts() -> list[str]:
    """The shared JSON schemas, as text."""
    files = sorted(glob.glob(str(SCHEMA_DIR / "*.json")))
    if not files:
        raise FileNotFoundError(f"expected the shared test schemas in {SCHEMA_DIR}")
    return [Path(f).read_text() for f in files]


def grammar_keys() -> list[tuple[str, str]]:
    """SGLang grammar keys covering every kind the adapter dispatches."""
    keys = [("json", s) for s in schema_texts()]
    keys.append(("json", "$$ANY$$"))
    keys += [("regex", r) for r in REGEXES]
    keys += [("ebnf", e) for e in EBNFS]
    return keys


def _corpus() -> list[str]:
    rng = random.Random(1234)
    words = "alpha beta gamma delta street city name order item price true false null id type value".split()
    docs = [json.dumps(json.loads(t)) for t in schema_texts()] + schema_texts()
    for _ in range(400):
        obj = {rng.choice(words): rng.choice([rng.randint(0, 9999), rng.choice(words), None, True, [1, 2]])}
        docs.append(json.dumps(obj, indent=rng.choice([None, 2])))
    return docs


@pytest.fixture(scope="session")
def bpe_tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained here (deterministic, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def load_hf_tokenizer(path: Path | str) -> Any:
    """The Hugging Face fast tokenizer of a ``tokenizer.json`` made by :func:`bpe_tokenizer_file`."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="session")
def bpe_tokenizer(bpe_tokenizer_file: Path) -> Any:
    """The trained tokenizer as SGLang sees it: a Hugging Face fast tokenizer."""
    return load_hf_tokenizer(bpe_tokenizer_file)


@pytest.fixture(scope="session")
def bpe_backends(bpe_tokenizer: Any) -> tuple[Any, Any]:
    """(SGLang's own ``XGrammarGrammarBackend``, ours) on the trained tokenizer."""
    from maskplug_sglang.backend import MaskplugGrammarBackend
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    eos = [bpe_tokenizer.eos_token_id]
    theirs = XGrammarGrammarBackend(bpe_tokenizer, vocab_size=BPE_VOCAB_SIZE, model_eos_token_ids=eos)
    # SGLang's own xgrammar backend bounds no whitespace run: compared with it, neither does ours.
    ours = MaskplugGrammarBackend(bpe_tokenizer, BPE_VOCAB_SIZE, set(eos), provider="xgrammar", max_whitespace=None)
    return theirs, ours


class SentencePieceTokenizer:
    """SGLang's hook for special tokenizers (``init_xgrammar``) plus maskplug's vocabulary.

    SGLang's xgrammar backend calls ``init_xgrammar()`` for tokenizers
    ``TokenizerInfo.from_huggingface`` cannot read; here it returns a raw
    vocabulary built from the same decoded bytes maskplug reads, with control
    pieces as empty bytes (xgrammar's convention for special tokens).
    """

    def __init__(self) -> None:
        from maskplug.grammar.vocabs import mistral_sentencepiece

        self.maskplug_vocab = mistral_sentencepiece()
        self.eos_token_id = self.maskplug_vocab.eos_ids[0]

    def init_xgrammar(self) -> tuple[Any, None]:
        import xgrammar as xgr

        v = self.maskplug_vocab
        encoded = [b"" if i in v.special_ids else t for i, t in enumerate(v.tokens)]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=v.vocab_size, stop_token_ids=list(v.eos_ids))
        return info, None

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.maskplug_vocab.tokens[i] for i in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="session")
def sp_backends() -> tuple[Any, Any, SentencePieceTokenizer]:
    """(SGLang's xgrammar backend, ours, the tokenizer) on mistral-common's SentencePiece model."""
    from maskplug_sglang.backend import MaskplugGrammarBackend
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    tok = SentencePieceTokenizer()
    size = tok.maskplug_vocab.vocab_size
    theirs = XGrammarGrammarBackend(tok, vocab_size=size, model_eos_token_ids=[tok.eos_token_id])
    ours = MaskplugGrammarBackend(tok, size, {tok.eos_token_id}, provider="xgrammar", max_whitespace=None)
    return theirs, ours, tok


def control_columns(vocab: Any) -> torch.Tensor:
    """A one-row bitmask with the bits of the non-stop control tokens set."""
    words = np.zeros(vocab.mask_words, dtype=np.uint32)
    for t in sorted(vocab.special_ids - set(vocab.eos_ids)):
        words[t >> 5] |= np.uint32(1 << (t & 31))
    return torch.from_numpy(words.view(np.int32).copy())


def allowed_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows, below ``vocab_size``."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def compile_pair(backends: tuple[Any, ...], key: tuple[str, str]) -> tuple[Any, Any]:
    """The same key through SGLang's dispatch on both backends."""
    theirs, ours = backends[0], backends[1]
    return theirs._init_value_dispatch(key, False), ours._init_value_dispatch(key, False)
