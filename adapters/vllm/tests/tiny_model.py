"""A tiny Llama model folder, built offline for the engine tests.

A byte-level BPE tokenizer is trained here on text generated from the test
schemas (deterministic: a fixed corpus, one thread-independent trainer), and a
``LlamaForCausalLM`` config with head_dim 64 (the smallest vLLM's CPU attention
takes) is written beside it; vLLM fills the weights itself (``load_format="dummy"``).

Around the model, what the tests on it share: the engine as they start it
(:func:`ngram_engine`), the test schemas (:func:`schema_paths`,
:func:`schema_texts`), random grammar-accepted histories and producer steps
(:func:`walk`, :func:`random_requests`), a mask row's allowed tokens
(:func:`allowed`) and JSON outputs read as xgrammar admits them
(:func:`xgrammar_json`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from maskplug.data import schema_dir

# The schemas bundled with maskplug (``MASKPLUG_SCHEMAS`` overrides, as everywhere).
SCHEMA_DIR = schema_dir()
VOCAB_SIZE = 512


def schema_paths() -> list[Path]:
    """The shared test schemas; a missing folder is an error, not a skip."""
    paths = sorted(SCHEMA_DIR.glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"expected JSON schemas in {SCHEMA_DIR}, found none")
    return paths


def schema_texts() -> list[str]:
    """The shared test schemas' JSON texts, in :func:`schema_paths` order."""
    return [p.read_text() for p in schema_paths()]


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words: set[str] = set()
    for p in schema_paths():
        text = p.read_text()
        words.update(w for w in json.dumps(json.loads(text)).replace('"', " ").split() if w.isascii())
    vocab = [*sorted(words), "true", "false", "null", "positive", "negative", "neutral", "alice", "bob"]
    lines = []
    for _ in range(3000):
        keys = rng.sample(vocab, k=3)
        vals = [rng.choice([str(rng.randint(0, 999)), f'"{rng.choice(vocab)}"', "true", "[1, 2]", "{}"]) for _ in keys]
        lines.append("{" + ", ".join(f'"{k}": {v}' for k, v in zip(keys, vals, strict=True)) + "}")
    return lines


def build(folder: Path, specials: tuple[str, ...] = ("</s>",)) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``config.json`` into ``folder``.

    ``specials`` are the added special tokens, ids ``0..``; the last is the
    EOS. By default it is the only one: vLLM's xgrammar path treats other
    special tokens (``<s>``, ``<unk>``) as literal text, which maskplug does
    not (see ``test_difference_special_tokens_are_not_text``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": specials[-1],
                "model_max_length": 4096,
            }
        )
    )
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": VOCAB_SIZE,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 64,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "bos_token_id": len(specials) - 1,
                "eos_token_id": len(specials) - 1,
                "tie_word_embeddings": False,
                "torch_dtype": "float32",
            }
        )
    )
    return folder


def build_draft(folder: Path, target: Path, *, num_layers: int = 1) -> Path:
    """A draft model for ``target``: its tokenizer and config with ``num_layers`` layers instead of its own.

    With dummy weights drawn from the same seed, the draft shares the
    target's first layers, embeddings and head, so it agrees with the target
    on some tokens and not on others: acceptance is partial and confidence
    budgets vary.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((target / name).read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def ngram_engine(
    folder: Path | str, num_spec: int, *, max_model_len: int, max_num_seqs: int, backend: str = "xgrammar"
) -> Any:
    """vLLM's engine (``vllm.LLM``) on the tiny model, as the engine tests run it.

    Dummy weights fixed by seed 0, float32, eager mode, n-gram drafting of
    ``num_spec`` tokens (prompt lookups of 1 to 3 tokens), structured outputs
    through the ``backend`` name (``xgrammar`` by default: the engine tests
    compare against vLLM's own xgrammar path; served by maskplug when the
    adapter is enabled).
    """
    from vllm import LLM

    return LLM(
        model=str(folder),
        tokenizer=str(folder),
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        seed=0,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": num_spec,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        structured_outputs_config={"backend": backend},
    )


def load_tokenizer(folder: Path) -> Any:
    """The model's tokenizer as vLLM's structured-output code sees it (a Hugging Face fast tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    eos = json.loads((folder / "tokenizer_config.json").read_text())["eos_token"]
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token=eos)


def allowed(row: np.ndarray, limit: int) -> np.ndarray:
    """The token ids below ``limit`` that a mask row (int32 words, little-endian bit order) allows."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")[:limit]
    return np.flatnonzero(bits)


def walk(
    grammar: Any, rng: np.random.Generator, steps: int, limit: int, avoid: frozenset[int] = frozenset()
) -> list[int]:
    """A random token history ``grammar`` accepts (sampled from its own masks, never from ``avoid``).

    ``grammar`` is a vLLM-side grammar of the adapter (``maskplug_vllm.backend.MaskplugGrammar``):
    it fills its mask row, takes the sampled token, and is left after the history.
    """
    out: list[int] = []
    row = torch.zeros(1, grammar.matcher.vocab.mask_words, dtype=torch.int32)
    for _ in range(steps):
        if grammar.is_terminated():
            break
        grammar.fill_bitmask(row, 0)
        choices = np.setdiff1d(allowed(row[0].numpy(), limit), list(avoid))
        if choices.size == 0:
            break
        t = int(rng.choice(choices))
        assert grammar.accept_tokens("walk", [t])
        out.append(t)
    return out


def random_requests(
    rng: np.random.Generator,
    step: int,
    tokenizer: Any,
    theirs_backend: Any,
    ours_backend: Any,
    schemas: list[str],
    request: Any,
    num_spec: int,
) -> tuple[list[str], dict[str, Any], dict[str, Any], dict[str, list[int]]]:
    """One random step's requests on two structured-output backends, and their drafts.

    Between one and five requests, each with a random schema of ``schemas`` compiled by both
    ``theirs_backend`` (vLLM's) and ``ours_backend`` (the adapter's ``MaskplugBackend``), the
    same random history accepted by both, and up to ``num_spec`` grammar-valid drafts, some
    padded with ``-1`` as vLLM pads missing drafts (the list keeps its length). ``request``
    wraps a grammar as vLLM's scheduler holds it. Returns the request ids, the requests of
    each side by id, and the drafts by id (requests without drafts left out).
    """
    from maskplug_vllm.backend import MaskplugGrammar
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    eos = {int(tokenizer.eos_token_id)}
    n = int(rng.integers(1, 6))
    ids = [f"s{step}-{i}" for i in range(n)]
    theirs: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    spec: dict[str, list[int]] = {}
    for rid in ids:
        schema = schemas[int(rng.integers(0, len(schemas)))]
        g_ours = ours_backend.compile_grammar(StructuredOutputOptions.JSON, schema, stop_token_ids=eos)
        g_theirs = theirs_backend.compile_grammar(StructuredOutputOptions.JSON, schema, stop_token_ids=eos)
        # Histories never end the grammar (finished requests are not scheduled); drafts may.
        history = walk(g_ours, rng, int(rng.integers(0, 40)), len(tokenizer), frozenset(eos))
        assert g_theirs.accept_tokens(rid, history)
        probe = MaskplugGrammar(g_ours.matcher.fork(), g_ours.spec)
        drafts = walk(probe, rng, int(rng.integers(0, num_spec + 1)), VOCAB_SIZE)
        if drafts and rng.random() < 0.2:
            cut = int(rng.integers(0, len(drafts)))
            drafts[cut:] = [-1] * (len(drafts) - cut)
        if drafts:
            spec[rid] = drafts
        theirs[rid], ours[rid] = request(g_theirs), request(g_ours)
    return ids, theirs, ours, spec


#: The characters xgrammar's length-bounded strings admit raw although JSON forbids them: every control
#: character but CR and LF (TAB included; pinned by
#: test_engine.py's test_xgrammar_length_bounded_strings_admit_raw_control_characters).
BOUNDED_RAW = frozenset(chr(c) for c in range(0x20)) - {"\r", "\n"}


def escape_raw_in_strings(text: str) -> tuple[str, set[str]]:
    """``text`` with each raw control character inside a JSON string written as a ``\\u00XX`` escape.

    Returns the escaped text and the set of characters escaped. Outside strings nothing changes:
    there, TAB, CR and LF are JSON whitespace and any other control character stays an error.
    """
    out: list[str] = []
    escaped: set[str] = set()
    in_string = after_backslash = False
    for ch in text:
        if in_string and not after_backslash and ch < " ":
            out.append(f"\\u{ord(ch):04x}")
            escaped.add(ch)
            continue
        out.append(ch)
        if after_backslash:
            after_backslash = False
        elif in_string and ch == "\\":
            after_backslash = True
        elif ch == '"':
            in_string = not in_string
    return "".join(out), escaped


def xgrammar_json(text: str) -> Any:
    """The value of a JSON output xgrammar's grammar admitted, with the one departure from RFC 8259 it has.

    xgrammar's length-bounded strings admit raw control characters (every one but CR and LF,
    :data:`BOUNDED_RAW`) where JSON forbids them. Text that strict JSON refuses is parsed again
    with those characters escaped, strictly: any other departure, or a CR or LF in a string,
    still fails (``AssertionError`` or ``json.JSONDecodeError``).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        escaped, raw = escape_raw_in_strings(text)
        assert raw and raw <= BOUNDED_RAW, text
        return json.loads(escaped)


def run_script(
    script: str, model: Path, out: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> dict[str, Any]:
    """Run one of this folder's engine scripts in a fresh process and return the JSON it wrote to ``out``.

    The process gets this environment without any ``MASKPLUG_VLLM*`` variable, with
    ``MASKPLUG_VLLM_MAX_WHITESPACE=none`` (vLLM's own JSON grammars bound no whitespace run, and the
    runs are compared with them), plus ``env`` (so each run says for itself whether maskplug is on);
    a failed run raises with the end of its stderr.
    """
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MASKPLUG_VLLM")}
    # The engine runs compare maskplug's grammars with vLLM's own, which bound no whitespace run.
    run_env["MASKPLUG_VLLM_MAX_WHITESPACE"] = "none"
    run_env.update(env or {})
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, str(here / script), str(model), str(out), *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def count_producer_steps(counts: dict[str, int]) -> None:
    """Count maskplug's producer steps into ``counts["fill_calls"]`` and their drafts into ``counts["draft_rows"]``.

    Every path: a step is served by the few-request walk (``_fill_few``, from
    the wrapped manager's one-pass path or from ``fill_step_rows``) or by the
    general path (``_fill_general``), exactly one of them; ``_fill_few``
    declining (``None``) sends the step on to the other.
    """
    import maskplug_vllm.scheduler as mp_sched

    real_few, real_general = mp_sched._fill_few, mp_sched._fill_general

    def count(grammar_req_ids: list[str], spec_tokens: dict[str, list[int]]) -> None:
        counts["fill_calls"] += 1
        counts["draft_rows"] += sum(len(spec_tokens.get(r, ())) for r in grammar_req_ids)

    def few(
        bitmask: Any,
        matchers: list[Any],
        grammar_req_ids: list[str],
        spec_tokens: dict[str, list[int]],
        *args: Any,
    ) -> Any:
        out = real_few(bitmask, matchers, grammar_req_ids, spec_tokens, *args)
        if out is not None:
            count(grammar_req_ids, spec_tokens)
        return out

    def general(
        bitmask: Any, matchers: list[Any], grammar_req_ids: list[str], spec_tokens: dict[str, list[int]]
    ) -> Any:
        count(grammar_req_ids, spec_tokens)
        return real_general(bitmask, matchers, grammar_req_ids, spec_tokens)

    mp_sched._fill_few = few  # type: ignore[assignment]
    mp_sched._fill_general = general
