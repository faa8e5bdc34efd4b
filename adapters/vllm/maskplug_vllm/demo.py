"""A short real-engine demo: vLLM's CPU engine with maskplug's adaptive verification.

``python -m maskplug_vllm.demo`` (or ``make demo-vllm`` from the repository root)
builds a tiny Llama model (a byte-level BPE tokenizer trained here on text
made from maskplug's bundled JSON schemas, a config whose weights vLLM fills
at random: ``load_format="dummy"``), starts vLLM's engine in this process with
n-gram drafting and ``MASKPLUG_VLLM=1``, and generates one mixed batch of
JSON-schema, regex and unconstrained requests under each of a few maskplug
schedulers, switched in place. For each it prints the budget regimes of the
steps, tokens per step and the drafts scheduled, verified and accepted; then
every output with whether it is valid (finished: JSON parsed and validated
against its schema, regex fully matched; cut off by ``max_tokens``: its tokens
replayed through xgrammar, a prefix the grammar accepts). The exit status is
1 if any structured output is invalid.

The outputs of a model with random weights are not meaningful text; the
point is the engine's machinery: rows for every scheduled draft, budgets
chosen by maskplug, trimmed steps, masks applied correctly in every regime.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_model", "main", "workload"]

REGEXES = [
    r"[a-z]{3,10}-[0-9]{2,4}",
    r"(yes|no|maybe)",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(alice|bob)@[a-z]{2,8}\.(com|org)",
]
MAX_TOKENS = {"json": 120, "regex": 48, "free": 32}

#: One compute thread whose idle OpenMP peers sleep, and a one-thread numba pool for the n-gram
#: drafter (unless already set): on a small machine shared with other work, spinning pool threads
#: stall every speculative step of vLLM's CPU engine.
_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "NUMBA_NUM_THREADS": "1"}
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m maskplug_vllm.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None, help="where to build the tiny model (default: a temporary folder)")
    p.add_argument("--requests", type=int, default=32, help="requests in the batch (default: %(default)s)")
    p.add_argument("--spec", type=int, default=5, help="n-gram drafts per request per step (default: %(default)s)")
    p.add_argument(
        "--schedulers",
        default="grammar-aware:goodput,goodput,no-spec",
        help="maskplug schedulers to run the batch under, in turn (default: %(default)s)",
    )
    p.add_argument("--cost", default=None, help="a cost file from python -m maskplug_vllm.calibrate")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    args = _parser().parse_args(argv)
    threads = {k: v for k, v in _THREAD_ENV.items() if k not in os.environ}
    if threads and argv is None:
        # The OpenMP runtime reads these when it loads (importing maskplug loaded torch already):
        # start again with them set.
        os.environ.update(threads)
        os.execv(sys.executable, [sys.executable, "-m", "maskplug_vllm.demo", *sys.argv[1:]])
    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    if not schedulers:
        print("--schedulers: expected at least one scheduler name", file=sys.stderr)
        return 2
    # The adapter and its schedulers are chosen through the environment, before vLLM loads its plugins.
    os.environ["MASKPLUG_VLLM"] = "1"
    os.environ["MASKPLUG_VLLM_SCHEDULER"] = schedulers[0]
    if args.cost:
        os.environ["MASKPLUG_VLLM_COST"] = args.cost
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    with tempfile.TemporaryDirectory(prefix="maskplug-vllm-demo-") as tmp:
        model = build_model(Path(args.model_dir) if args.model_dir else Path(tmp) / "model")
        print(f"tiny Llama model (dummy weights) in {model}; starting vLLM's CPU engine ...", flush=True)
        from vllm import LLM

        import maskplug_vllm

        t0 = time.perf_counter()
        llm = LLM(
            model=str(model),
            tokenizer=str(model),
            load_format="dummy",
            dtype="float32",
            enforce_eager=True,
            gpu_memory_utilization=0.3,
            max_model_len=512,
            max_num_seqs=max(8, args.requests),
            seed=0,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": args.spec,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 3,
            },
            structured_outputs_config={"backend": "xgrammar"},
        )
        if not maskplug_vllm.adaptive_installed():
            print("maskplug's adaptive verification is not installed in this engine", file=sys.stderr)
            return 1
        print(f"engine up in {time.perf_counter() - t0:.0f} s: n-gram drafting, {args.spec} tokens per request\n")
        prefixes = PrefixChecker(model, llm.llm_engine.model_config.get_vocab_size())
        reqs = workload(args.requests)
        params = [sampling_params(r) for r in reqs]
        # Compile the batch's grammars once (vLLM caches them), so no scheduler's run waits for that.
        llm.generate([r["prompt"] for r in reqs], [sampling_params(r, 1) for r in reqs], use_tqdm=False)
        invalid = 0
        last: list[tuple[dict[str, Any], Any]] = []
        header = f"{'scheduler':<24}{'steps':>6}{'full':>6}{'partial':>8}{'zero':>6}{'tokens/step':>13}"
        header += f"{'scheduled':>11}{'verified':>10}{'accepted':>10}{'seconds':>9}"
        rows = []
        for name in schedulers:
            maskplug_vllm.set_scheduler(name)
            maskplug_vllm.reset_step_stats()
            t1 = time.perf_counter()
            outputs = llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False)
            took = time.perf_counter() - t1
            s = maskplug_vllm.step_stats()
            reg = s["regimes"]
            per_step = s["tokens_emitted"] / max(1, s["steps"])
            rows.append(
                f"{name:<24}{s['steps']:>6}{reg['full']:>6}{reg['partial']:>8}{reg['zero']:>6}{per_step:>13.2f}"
                f"{s['drafts_scheduled']:>11}{s['drafts_verified']:>10}{s['drafts_accepted']:>10}{took:>9.1f}"
            )
            print(f"  {name}: {s['steps']} steps, {per_step:.2f} tokens per step", flush=True)
            for r, o in zip(reqs, outputs, strict=True):
                c = o.outputs[0]
                invalid += validity(r, c.text, c.finish_reason, c.token_ids, prefixes).startswith("INVALID")
            last = [(r, o) for r, o in zip(reqs, outputs, strict=True)]
        print("\nSteps by budget regime (steps with drafts for structured requests), per scheduler:")
        print(header)
        print("\n".join(rows))
        print(f"\nOutputs under {schedulers[-1]} (greedy; every scheduler's outputs were checked):")
        for r, o in last:
            c = o.outputs[0]
            text = c.text if len(c.text) <= 60 else c.text[:57] + "..."
            verdict = validity(r, c.text, c.finish_reason, c.token_ids, prefixes)
            print(f"  {r['kind']:<6}{r['name'][:22]:<24}{c.finish_reason or '':<8}{verdict:<23}{text!r}")
        total = len(reqs) * len(schedulers)
        print(
            f"\n{total - invalid} of {total} outputs valid (finished: parsed and validated or fully matched; "
            f"cut off: a prefix the grammar accepts) or unconstrained; {invalid} invalid"
        )
        return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
