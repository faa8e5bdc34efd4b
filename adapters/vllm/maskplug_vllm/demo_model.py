"""The vLLM demo's model: a tiny Llama trained here, in about a minute, on the demo's own tasks.

The demo's tasks are a few JSON schemas (:data:`SCHEMAS`), regexes
(:data:`REGEXES`) and one free-text task. :func:`instance` draws a random
valid answer for any of them (JSON written compact or with a space after
``,`` and ``:``); :func:`example` is one training text: a prompt naming the
task with one example answer, then a fresh answer and the EOS::

    weather example: {"city":"oslo","temperature":3,...}
    weather:
    {"city": "lima", "temperature": 21, ...}</s>

:func:`build_model` trains a byte-level BPE tokenizer on such texts (offline,
deterministic), then a ``LlamaForCausalLM`` (hidden 128, two heads of
head_dim 64, the smallest head vLLM's CPU attention takes, two layers) with
torch and transformers for a bounded number of steps and seconds, and saves
it with ``save_pretrained`` (safetensors) into a cache folder named by a hash
of the recipe (:class:`Recipe`): a second run loads it. Nothing is
downloaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FREE_TASK",
    "REGEXES",
    "SCHEMAS",
    "Recipe",
    "build_model",
    "default_cache_dir",
    "example",
    "instance",
    "prompt",
    "tasks",
]

_CITIES = ["oslo", "lima", "paris", "tokyo", "cairo", "quito", "rome", "delhi", "seoul", "accra"]
_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
_WORDS = ["red", "blue", "fast", "cheap", "new", "old", "big", "tiny", "home", "work", "tea", "map"]


def _record(**properties: dict[str, Any]) -> dict[str, Any]:
    """A JSON object schema with exactly ``properties``, every one required (every object of the demo is one)."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


#: The demo's JSON schemas: every value bounded (enums, integer ranges, string and array lengths), so
#: the grammar itself ends each answer within a known length unless the model writes whitespace runs.
SCHEMAS: dict[str, dict[str, Any]] = {
    "weather": _record(
        city={"enum": _CITIES},
        temperature={"type": "integer", "minimum": -30, "maximum": 45},
        unit={"enum": ["celsius", "fahrenheit"]},
        conditions={
            "type": "array",
            "items": {"enum": ["sunny", "rain", "wind", "snow", "fog", "cloudy"]},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    "tool_call": _record(
        tool={"enum": ["search", "calculator", "calendar", "maps"]},
        arguments=_record(
            query={"type": "string", "minLength": 1, "maxLength": 24},
            limit={"type": "integer", "minimum": 1, "maximum": 20},
        ),
    ),
    "person": _record(
        name={"type": "string", "minLength": 1, "maxLength": 16},
        age={"type": "integer", "minimum": 0, "maximum": 99},
        active={"type": "boolean"},
        tags={"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    ),
    "order": _record(
        order_id={"type": "integer", "minimum": 1000, "maximum": 9999},
        items={
            "type": "array",
            "items": _record(
                sku={"type": "string", "minLength": 3, "maxLength": 8},
                qty={"type": "integer", "minimum": 1, "maximum": 9},
            ),
            "minItems": 1,
            "maxItems": 3,
        },
        express={"type": "boolean"},
    ),
}


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


#: The demo's regex tasks: (pattern, a generator of random full matches).
REGEXES: dict[str, tuple[str, Callable[[random.Random], str]]] = {
    "date": (
        r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])",
        lambda r: f"20{_digits(r, 2)}-{r.randint(1, 12):02d}-{r.randint(1, 29):02d}",
    ),
    "answer": (r"(yes|no|maybe)", lambda r: r.choice(["yes", "no", "maybe"])),
    "code": (
        r"[A-Z]{3}-[0-9]{3}",
        lambda r: "".join(r.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(3)) + "-" + _digits(r, 3),
    ),
    "email": (
        r"[a-z]{3,8}@(mail|post|inbox)\.(com|org)",
        lambda r: f"{r.choice(_NAMES)}@{r.choice(['mail', 'post', 'inbox'])}.{r.choice(['com', 'org'])}",
    ),
}

#: The free-text task's name: a short sentence ending with a full stop.
FREE_TASK = "note"


def tasks() -> list[tuple[str, str]]:
    """Every task as ``(kind, name)``: kind ``json``, ``regex`` or ``free``."""
    return [("json", n) for n in SCHEMAS] + [("regex", n) for n in REGEXES] + [("free", FREE_TASK)]


def _string(rng: random.Random, schema: dict[str, Any]) -> str:
    lo, hi = int(schema.get("minLength", 0)), int(schema.get("maxLength", 12))
    pool = [w for w in (_NAMES + _WORDS) if lo <= len(w) <= hi]
    text = rng.choice(pool)
    if hi >= len(text) + 4 and rng.random() < 0.4:
        more = rng.choice(_WORDS)
        if len(text) + 1 + len(more) <= hi:
            text = f"{text} {more}"
    return text


def _value(rng: random.Random, schema: dict[str, Any]) -> Any:
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        return {k: _value(rng, s) for k, s in schema["properties"].items()}
    if kind == "array":
        n = rng.randint(int(schema.get("minItems", 0)), int(schema.get("maxItems", 3)))
        return [_value(rng, schema["items"]) for _ in range(n)]
    if kind == "integer":
        return rng.randint(int(schema["minimum"]), int(schema["maximum"]))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return _string(rng, schema)
    raise ValueError(f"schema: the demo's generator has no case for type {kind!r}")


def instance(kind: str, name: str, rng: random.Random) -> str:
    """A random valid answer for task ``(kind, name)`` of :func:`tasks`, as text."""
    if kind == "json":
        value = _value(rng, SCHEMAS[name])
        # Compact or with one space after "," and ":": the whitespace the model learns is bounded.
        return json.dumps(value, separators=(",", ":") if rng.random() < 0.5 else (", ", ": "))
    if kind == "regex":
        return REGEXES[name][1](rng)
    if kind == "free":
        words = [rng.choice(_NAMES), rng.choice(["likes", "has", "sees", "wants"]), "the"]
        words += [rng.choice(_WORDS) for _ in range(rng.randint(1, 2))] + [rng.choice(["map", "tea", "city", "car"])]
        return " ".join(words) + "."
    raise ValueError(f"kind: expected 'json', 'regex' or 'free', got {kind!r}")


def prompt(kind: str, name: str, rng: random.Random) -> str:
    """The prompt of a request for task ``(kind, name)``: the task's name, one example answer, the task again."""
    # The prompt ends with a newline, a token of its own, so the answer's first token is the one it is in
    # training (a prompt ending in a space would split " {" apart and the model would start mid-answer).
    return f"{name} example: {instance(kind, name, rng)}\n{name}:\n"


def example(kind: str, name: str, rng: random.Random) -> tuple[str, str]:
    """One training text as ``(prompt, answer)``; the model learns to write the answer and then stop."""
    return prompt(kind, name, rng), instance(kind, name, rng)


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained model; its :meth:`key` names the cache folder.

    Training stops after ``steps`` steps or ``seconds`` seconds, whichever
    comes first (``seconds`` bounds the set-up time on a slow machine; the
    steps reached are recorded in ``maskplug_demo.json`` beside the weights).
    ``steps=0`` saves the initial random weights (an untrained model).
    """

    steps: int = 1500
    seconds: float = 60.0
    batch: int = 24
    lr: float = 3e-3
    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 2

    def key(self) -> str:
        """A hash of the recipe, the tasks and their generators' version."""
        blob = json.dumps(
            {"recipe": asdict(self), "schemas": SCHEMAS, "regexes": {k: v[0] for k, v in REGEXES.items()}, "v": 1},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$MASKPLUG_CACHE`` or ``~/.cache/maskplug``, then ``demo-vllm``."""
    root = os.environ.get("MASKPLUG_CACHE", "").strip()
    return (Path(root) if root else Path.home() / ".cache" / "maskplug") / "demo-vllm"


def _texts(rng: random.Random) -> Iterator[str]:
    all_tasks = tasks()
    while True:
        kind, name = rng.choice(all_tasks)
        p, a = example(kind, name, rng)
        yield p + a


def _train_tokenizer(folder: Path, recipe: Recipe) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _texts(random.Random(recipe.seed + 1))
    tok.train_from_iterator((next(texts) for _ in range(4000)), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "model_max_length": 512})
    )
    return tok


Progress = Callable[[int, int, float, float], None]
"""Called during training with (step, steps, seconds so far, loss)."""


def _train(folder: Path, recipe: Recipe, tok: Any, progress: Progress | None) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(recipe.seed)
    eos = tok.token_to_id("</s>")
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        head_dim=recipe.hidden_size // recipe.num_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    texts = _texts(random.Random(recipe.seed))
    t0 = time.monotonic()
    step, loss_value = 0, math.nan
    model.train()
    while step < recipe.steps and time.monotonic() - t0 < recipe.seconds:
        rows = [[*tok.encode(next(texts)).ids, eos] for _ in range(recipe.batch)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), eos, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            labels[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        # Linear warm-up over the first 50 steps, then cosine decay over the step budget.
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = recipe.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / recipe.steps)))
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_value = float(out.loss.item())
        if progress is not None:
            progress(step, recipe.steps, time.monotonic() - t0, loss_value)
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return {"steps": step, "seconds": round(time.monotonic() - t0, 1), "loss": loss_value}


def build_model(
    recipe: Recipe | None = None,
    cache_dir: Path | str | None = None,
    *,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The trained model's folder for ``recipe`` (trained now unless cached) and its training record.

    The folder is ``<cache_dir>/<recipe key>`` (:func:`default_cache_dir` by
    default), written whole into a temporary sibling first and renamed, so an
    interrupted training leaves no half model behind. The record holds the
    steps and seconds trained, the last loss and whether it came from the cache.
    """
    recipe = recipe or Recipe()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / recipe.key()
    meta = folder / "maskplug_demo.json"
    if meta.is_file():
        return folder, {**json.loads(meta.read_text()), "cached": True}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{recipe.key()}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if log is not None:
            log("training the tokenizer (byte-level BPE on the demo's tasks)")
        tok = _train_tokenizer(tmp, recipe)
        record = _train(tmp, recipe, tok, progress)
        record["recipe"] = asdict(recipe)
        (tmp / "maskplug_demo.json").write_text(json.dumps(record, indent=1))
        try:
            tmp.rename(folder)
        except OSError:
            # Another run saved the same recipe first: theirs is as good as ours.
            if not meta.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, {**json.loads(meta.read_text()), "cached": False}
