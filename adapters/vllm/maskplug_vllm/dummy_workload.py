"""The dummy-weight model and the bundled-schema workload of the engine benchmark.

``benchmarks/vllm_engine.py`` measures vLLM's engine on these (through the
names :mod:`maskplug_vllm.demo` re-exports, as before the demo moved to a
trained model): :func:`build_model` writes a tiny Llama folder whose weights
vLLM fills at random (``load_format="dummy"``), :func:`workload` mixes JSON
schemas bundled with maskplug, regexes and free text, :func:`sampling_params`
makes vLLM's greedy parameters for one request, and :func:`validity` with
:class:`PrefixChecker` judges an output (a cut-off output by replaying its
tokens through xgrammar).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MAX_TOKENS", "REGEXES", "PrefixChecker", "build_model", "sampling_params", "validity", "workload"]

REGEXES = [
    r"[a-z]{3,10}-[0-9]{2,4}",
    r"(yes|no|maybe)",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(alice|bob)@[a-z]{2,8}\.(com|org)",
]
MAX_TOKENS = {"json": 120, "regex": 48, "free": 32}
_RAW_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _corpus(schemas: list[tuple[str, dict[str, Any]]], lines: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words: set[str] = set()
    for _, schema in schemas:
        words.update(w for w in json.dumps(schema).replace('"', " ").split() if w.isascii())
    vocab = [*sorted(words), "true", "false", "null", "alice", "bob", "yes", "no", "maybe"]
    out = []
    for _ in range(lines):
        keys = rng.sample(vocab, k=3)
        vals = [rng.choice([str(rng.randint(0, 999)), f'"{rng.choice(vocab)}"', "true", "[1, 2]", "{}"]) for _ in keys]
        out.append("{" + ", ".join(f'"{k}": {v}' for k, v in zip(keys, vals, strict=True)) + "}")
    return out


def build_model(
    folder: Path | str,
    *,
    vocab_size: int = 512,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
) -> Path:
    """Write a Llama model folder (tokenizer and config, no weights) for ``load_format="dummy"``.

    The tokenizer is a byte-level BPE trained deterministically on JSON-like
    text from maskplug's bundled schemas; ``</s>`` (id 0) is its only special
    token and the EOS. The head dimension is ``hidden_size / num_heads`` (vLLM's
    CPU attention needs at least 32, 64 is safe).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from maskplug.data import load_schemas

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(load_schemas()), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "model_max_length": 4096})
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def workload(num_requests: int, seed: int = 0) -> list[dict[str, Any]]:
    """A mixed batch: half JSON schema, a quarter regex, a quarter unconstrained (``kind``, constraint, prompt)."""
    from maskplug.data import load_schemas

    schemas = load_schemas()
    rng = random.Random(seed)
    reqs: list[dict[str, Any]] = []
    for i in range(num_requests):
        kind = ("json", "json", "regex", "free")[i % 4]
        if kind == "json":
            name, schema = schemas[rng.randrange(len(schemas))]
            prompt = f'{name} {i}: {{"name": "alice", "id": {i}, "tags": ["a", "b"]}} -> '
            reqs.append({"kind": kind, "name": name, "schema": schema, "prompt": prompt})
        elif kind == "regex":
            pattern = REGEXES[rng.randrange(len(REGEXES))]
            prompt = f"pattern {i}: alice-{i} bob-{i + 1} alice-{i} -> "
            reqs.append({"kind": kind, "name": pattern, "regex": pattern, "prompt": prompt})
        else:
            prompt = f'free {i}: {{"name": "bob", "id": {i}}} {{"name": "bob", "id": {i}}} -> '
            reqs.append({"kind": kind, "name": "unconstrained", "prompt": prompt})
    return reqs


def sampling_params(req: dict[str, Any], max_tokens: int | None = None) -> Any:
    """Greedy ``SamplingParams`` with the request's structured-output constraint."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = None
    if req["kind"] == "json":
        so = StructuredOutputsParams(json=req["schema"])
    elif req["kind"] == "regex":
        so = StructuredOutputsParams(regex=req["regex"])
    limit = MAX_TOKENS[req["kind"]] if max_tokens is None else max_tokens
    return SamplingParams(temperature=0.0, max_tokens=limit, structured_outputs=so)


class PrefixChecker:
    """Whether a cut-off output is still a prefix its grammar accepts, checked with xgrammar directly.

    Independent of the engine's grammar backend: the output's token ids are
    replayed through a fresh ``xgrammar.GrammarMatcher`` compiled from the
    request's schema or regex.
    """

    def __init__(self, model_dir: Path | str, vocab_size: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        folder = Path(model_dir)
        eos = json.loads((folder / "tokenizer_config.json").read_text())["eos_token"]
        tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token=eos)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size))

    def accepts(self, req: dict[str, Any], token_ids: Sequence[int]) -> bool:
        if req["kind"] == "json":
            grammar = self._compiler.compile_json_schema(json.dumps(req["schema"]))
        else:
            grammar = self._compiler.compile_regex(req["regex"])
        matcher = self._xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(int(t)) for t in token_ids)


def validity(
    req: dict[str, Any],
    text: str,
    finish_reason: str | None,
    token_ids: Sequence[int] = (),
    prefixes: PrefixChecker | None = None,
) -> str:
    """``valid``, ``INVALID (...)``, ``cut off`` (stopped by ``max_tokens``; with ``prefixes``,
    ``cut off, valid prefix`` or ``INVALID (...)``) or ``unconstrained``."""
    if req["kind"] == "free":
        return "unconstrained"
    if finish_reason != "stop":
        if prefixes is None:
            return "cut off"
        return "cut off, valid prefix" if prefixes.accepts(req, token_ids) else "INVALID (not a prefix)"
    if req["kind"] == "regex":
        return "valid" if re.fullmatch(req["regex"], text) else "INVALID (no full match)"
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if not _RAW_CONTROL.search(text):
            return f"INVALID (not JSON: {exc})"
        # xgrammar's length-bounded JSON strings admit raw control characters; the value is still checked.
        value = json.loads(text, strict=False)
    try:
        jsonschema.validate(value, req["schema"])
    except jsonschema.ValidationError as exc:
        return f"INVALID (schema: {exc.message})"
    return "valid"
