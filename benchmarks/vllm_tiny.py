"""What the vLLM engine benchmarks share: a tiny model folder, the workloads, a closed loop, one engine per process.

Imported by ``benchmarks/vllm_overhead.py`` and ``benchmarks/vllm_engine.py``
(run from the repository root, in the vLLM environment). Self-contained on
purpose: the benchmarks must not change when the demo's model or workload does.

* :func:`build_model`: a Llama folder (byte-level BPE tokenizer trained here,
  deterministically, on JSON-like text from maskplug's bundled schemas; a
  config whose weights vLLM fills at random, ``load_format="dummy"``), and
  :func:`build_draft`, the same config with fewer layers (same tokenizer) for
  vLLM's ``draft_model`` drafter.
* :func:`structured_workload`: JSON-schema and regex requests (two to one)
  whose prompts hold text the n-gram drafter can copy.
* :func:`mixed_workload`: half requests whose drafts are mostly accepted
  (a regex whose only answer is spelled out in the prompt, so the drafter
  copies it), half whose drafts mostly fail (letters under a regex, after a
  prompt that holds every three-letter string once: the drafter proposes
  what followed in the prompt, which the random model rarely picks).
* :func:`closed_loop`: ``c`` requests in flight on an ``LLMEngine``, output
  tokens, CPU and wall time (in all and per model step), and a digest of
  every request's tokens.
* :class:`EngineProcess`: one engine configuration in its own process (vLLM
  loads its plugins once per process), driven round by round over a pipe so
  that configurations can be measured interleaved without restarting engines.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REGEXES = [
    r"[a-z]{3,10}-[0-9]{2,4}",
    r"(yes|no|maybe)",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(alice|bob)@[a-z]{2,8}\.(com|org)",
]

#: One compute thread whose idle OpenMP peers sleep, and a one-thread numba pool for the n-gram
#: drafter: on a small machine shared with other work, spinning pool threads stall every step.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "NUMBA_NUM_THREADS": "1"}


def _corpus(lines: int = 3000, seed: int = 0) -> list[str]:
    from maskplug.data import load_schemas

    rng = random.Random(seed)
    words: set[str] = set()
    for _, schema in load_schemas():
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
    vocab_size: int = 640,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    head_dim: int = 64,
) -> Path:
    """Write a Llama model folder (tokenizer and config, no weights) for ``load_format="dummy"``.

    ``</s>`` (id 0) is the tokenizer's only special token and the EOS; vLLM's
    CPU attention needs a head dimension of at least 32 (64 by default).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "model_max_length": 4096})
    )
    heads = max(1, hidden_size // head_dim)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden_size // heads,
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


def build_draft(folder: Path | str, target: Path | str, *, num_layers: int = 1) -> Path:
    """A draft model for ``target``: its tokenizer, its config with ``num_layers`` layers.

    With dummy weights from the same seed the draft shares the target's
    embeddings, head and first layers, so it agrees with the target on some
    tokens and not on others.
    """
    out, tgt = Path(folder), Path(target)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tgt / name).read_bytes())
    config = json.loads((tgt / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config))
    return out


def structured_workload(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` structured requests, JSON schema and regex two to one, prompts with text to copy."""
    from maskplug.data import load_schemas

    schemas = load_schemas()
    rng = random.Random(seed)
    reqs: list[dict[str, Any]] = []
    for i in range(n):
        if i % 3 != 2:
            name, schema = schemas[rng.randrange(len(schemas))]
            prompt = f'{name} {i}: {{"name": "alice", "id": {i}, "tags": ["a", "b"]}} -> '
            reqs.append({"kind": "json", "schema": schema, "prompt": prompt})
        else:
            pattern = REGEXES[rng.randrange(len(REGEXES))]
            prompt = f"pattern {i}: alice-{i} bob-{i + 1} alice-{i} -> "
            reqs.append({"kind": "regex", "regex": pattern, "prompt": prompt})
    return reqs


MIXED_ANSWERS = 8
"""Distinct answers of the mixed workload's ``copy`` requests (so a warm-up compiles every grammar)."""


def mixed_workload(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` requests in turn: drafts mostly accepted, drafts mostly rejected.

    * ``copy``: a regex whose only match is a fixed string of words (one of
      :data:`MIXED_ANSWERS`) that the prompt spells out three times: the
      n-gram drafter proposes its continuation from the prompt. The grammar
      admits other spellings of the same text in tokens, which the random
      model sometimes picks, so about 70% of the drafts are accepted (8 in
      flight, measured per kind in the engine).
    * letters: ``[QXZK]{64}`` (four letters that are single tokens and never
      merge, so the model's tokens and the prompt's are the same ids) after
      a prompt holding a de Bruijn sequence of them: every string of three
      letters appears in it exactly once, before any the model writes, so the
      drafter (longest match of 1-3 tokens, earliest first) always proposes
      what followed in the prompt. The random model rarely picks it: under
      1% of the drafts are accepted.

    Free text does not fail: a random-weight model soon repeats itself, and
    the drafter copies the loop (85-100% of its drafts accepted).
    """
    words = ["alice", "bob", "name", "true", "false", "null", "yes", "no", "maybe", "id", "tags"]
    fixed = random.Random(0)
    answers = [" ".join(fixed.choice(words) for _ in range(12)) + f" {j}" for j in range(MIXED_ANSWERS)]
    rng = random.Random(seed)
    reqs: list[dict[str, Any]] = []
    for i in range(n):
        if i % 2 == 0:
            answer = answers[rng.randrange(MIXED_ANSWERS)]
            prompt = f"copy {i}: {answer}. again: {answer}. again: {answer}. once more: "
            reqs.append({"kind": "regex", "regex": _literal(answer), "prompt": prompt})
        else:
            shift = rng.randrange(len(_DE_BRUIJN))
            cycle = _DE_BRUIJN[shift:] + _DE_BRUIJN[:shift]
            letters = "".join(cycle + cycle[:2])
            reqs.append({"kind": "regex", "regex": LETTERS, "prompt": f"letters {i}: {letters} -> "})
    return reqs


#: The mixed workload's failing half: four letters that are single tokens and never merge, more of them than a
#: request's tokens.
FAILING_ALPHABET = "QXZK"
LETTERS = f"[{FAILING_ALPHABET}]{{64}}"


def _de_bruijn(k: int, n: int) -> list[str]:
    """A cyclic sequence of the digits ``0..k-1`` holding every ``n``-digit string exactly once."""
    a = [0] * k * n
    out: list[int] = []

    def db(t: int, p: int) -> None:
        if t > n:
            if n % p == 0:
                out.extend(a[1 : p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, k):
                a[t] = j
                db(t + 1, t)

    db(1, 1)
    return [FAILING_ALPHABET[d] for d in out]


_DE_BRUIJN = _de_bruijn(4, 3)


def _literal(text: str) -> str:
    """A regex matching exactly ``text``."""
    import re

    return re.escape(text)


def sampling_params(req: dict[str, Any], max_tokens: int) -> Any:
    """Greedy ``SamplingParams`` with the request's structured-output constraint."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = None
    if req["kind"] == "json":
        so = StructuredOutputsParams(json=req["schema"])
    elif req["kind"] == "regex":
        so = StructuredOutputsParams(regex=req["regex"])
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)


def engine_kwargs(model: str, speculative: dict[str, Any] | None, max_num_seqs: int, **extra: Any) -> dict[str, Any]:
    """``vllm.LLM`` arguments as every benchmark engine runs: dummy fp32 weights, eager, xgrammar backend name."""
    kw: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "load_format": "dummy",
        "dtype": "float32",
        "enforce_eager": True,
        "gpu_memory_utilization": 0.3,
        "max_model_len": 512,
        "max_num_seqs": max_num_seqs,
        "seed": 0,
        "structured_outputs_config": {"backend": "xgrammar"},
    }
    if speculative:
        kw["speculative_config"] = dict(speculative)
    kw.update(extra)
    return kw


def ngram(k: int) -> dict[str, Any]:
    """vLLM's n-gram drafter proposing up to ``k`` tokens (prompt lookups of 1 to 3 tokens)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def closed_loop(
    engine: Any, reqs: list[dict[str, Any]], c: int, max_tokens: int, tag: str, *, on_step: Any = None
) -> dict[str, Any]:
    """Run ``reqs`` with ``c`` in flight (the next added as one finishes); tokens, times and a token digest.

    Every step is timed on both clocks; the ``mean_step_*`` figures count only
    the steps that ran the model (a step that only waits for grammar
    compilation returns no output), ``mean_step_ms_all`` every step. The
    ``steady_*`` figures count only the steps that began while requests were
    still waiting for a slot (the batch ran full) and the tokens those steps
    emitted: the rate under sustained load, without the tail in which the last
    requests run with slots standing empty (a configuration that finishes
    some requests sooner only gains where a waiting request takes the slot).
    """
    pending = list(enumerate(reqs))
    in_flight = tokens = steps = model_steps = 0
    step_s = model_step_s = model_step_cpu = 0.0
    steady_tokens, steady_s, steady_cpu = 0, 0.0, 0.0
    lengths: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    finish: dict[str, int] = {}

    def submit() -> None:
        nonlocal in_flight
        while pending and in_flight < c:
            i, r = pending.pop(0)
            engine.add_request(f"{tag}-{i}", r["prompt"], sampling_params(r, max_tokens))
            in_flight += 1

    load_before = os.getloadavg()[0]
    t0, cpu0 = time.perf_counter(), time.process_time()
    submit()
    while in_flight or pending:
        full = bool(pending)
        s0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        dt, dc = time.perf_counter() - s0, time.process_time() - c0
        step_s += dt
        steps += 1
        if outs:
            model_steps += 1
            model_step_s += dt
            model_step_cpu += dc
        if on_step is not None:
            on_step()
        if full:
            steady_s += dt
            steady_cpu += dc
        for o in outs:
            # Outputs are cumulative: what this step added is the growth of each request's tokens.
            n = len(o.outputs[0].token_ids)
            if full:
                steady_tokens += n - lengths.get(o.request_id, 0)
            lengths[o.request_id] = n
            if o.finished:
                in_flight -= 1
                ids = list(o.outputs[0].token_ids)
                tokens += len(ids)
                outputs[int(o.request_id.rsplit("-", 1)[1])] = ids
                reason = str(o.outputs[0].finish_reason)
                finish[reason] = finish.get(reason, 0) + 1
        submit()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    digest = hashlib.sha256(json.dumps([outputs[i] for i in sorted(outputs)]).encode()).hexdigest()[:16]
    return {
        "requests": len(reqs),
        "output_tokens": tokens,
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu,
        "steps": steps,
        "model_steps": model_steps,
        "mean_step_ms": 1e3 * model_step_s / max(1, model_steps),
        "mean_step_cpu_ms": 1e3 * model_step_cpu / max(1, model_steps),
        "mean_step_ms_all": 1e3 * step_s / max(1, steps),
        "steady_tokens": steady_tokens,
        "steady_seconds": steady_s,
        "steady_cpu_seconds": steady_cpu,
        "steady_tokens_per_s": steady_tokens / steady_s if steady_s else 0.0,
        "steady_tokens_per_cpu_s": steady_tokens / steady_cpu if steady_cpu else 0.0,
        "digest": digest,
        "finish_reasons": finish,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def child_env(mode_env: dict[str, str], *, in_process: bool = True) -> dict[str, str]:
    """The environment of one engine process: no inherited ``MASKPLUG_VLLM*``, one compute thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASKPLUG_VLLM")}
    for k, v in THREAD_ENV.items():
        env.setdefault(k, v)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    env.update(mode_env)
    return env


class EngineProcess:
    """One engine configuration in a child process, answering one JSON command per line.

    The child is ``python <script> --serve <config json>``; the script's serve
    loop (see ``vllm_overhead.serve``) reads a command per line and writes one
    JSON line back. Children wait on their pipe between commands, so
    configurations take turns on the machine round by round.
    """

    def __init__(self, script: str, label: str, config: dict[str, Any], env: dict[str, str], log: Path) -> None:
        self.label = label
        self.log = log
        # vLLM logs a lot: to a file, so a full pipe never blocks the child.
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, script, "--serve", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                err = self.log.read_text()
                raise SystemExit(f"engine {self.label} ended (rc {self.proc.wait()}):\n{err[-4000:]}")
            if line.startswith("@@"):
                return json.loads(line[2:])  # type: ignore[no-any-return]

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send one command; its JSON answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """End the child (it leaves when its pipe closes)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
