"""Adaptive verification through vLLM's OpenAI server, as users run it.

Every test starts the real server (``python -m vllm.entrypoints.openai.api_server``,
the process ``vllm serve`` starts: vLLM's engine core in a process of its own
and the model runner behind ``MultiprocExecutor``) on 127.0.0.1 with the tiny
dummy-weight model, sends a mixed batch of JSON-schema, regex and free-text
requests concurrently with the ``openai`` client, greedy, and compares:

* every output token for token with a server without speculation (maskplug
  serving the same grammars) at the same tensor-parallel size (TP changes float sums, so TP 2
  is compared with TP 2);
* every finished structured output against its schema or regex;
* maskplug's ``maskplug_*`` series on ``/metrics`` with vLLM's own
  spec-decode counters.

Configurations: TP 1 with ``goodput`` and with ``verify-all`` over n-gram drafts; TP 1 with the
``draft_model`` drafter and ``dspark`` on the draft model's confidences
(a one-layer draft of the two-layer target, so acceptance is partial); TP 2
with ``goodput`` and with ``no-spec``. The refusals at start-up: the server
exits before any engine process with a ``PluginError`` naming the setting.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import tiny_model
from openai_server import NGRAM, Server, free_port, metrics, serve, server_args, server_env

from maskplug.grammar.sdk import DEFAULT_MAX_WHITESPACE

REGEXES = [r"[a-z]{3,8}-[0-9]{2}", r"(yes|no|maybe)", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"[A-Z][a-z]{2,9}"]
NUM_REQUESTS = 16
MAX_TOKENS = 40


def workload() -> list[dict[str, Any]]:
    """A mixed batch: half JSON schemas, a quarter regexes, a quarter free text; prompts the drafter can copy."""
    schemas = [json.loads(t) for t in tiny_model.schema_texts()]
    reqs: list[dict[str, Any]] = []
    for i in range(NUM_REQUESTS):
        prompt = f'record {i}: {{"name": "alice", "id": {i}, "tags": ["a", "b"]}} alice-{i} -> '
        kind = ("json", "regex", "json", "free")[i % 4]
        if kind == "json":
            reqs.append({"prompt": prompt, "max_tokens": MAX_TOKENS, "json": schemas[i % len(schemas)]})
        elif kind == "regex":
            reqs.append({"prompt": prompt, "max_tokens": MAX_TOKENS, "regex": REGEXES[(i // 4) % len(REGEXES)]})
        else:
            reqs.append({"prompt": prompt, "max_tokens": MAX_TOKENS})
    return reqs


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("server-models")
    target = tiny_model.build(root / "target")
    return target, tiny_model.build_draft(root / "draft", target)


def run_server(
    tmp: Path,
    model: Path,
    name: str,
    *,
    scheduler: str | None,
    speculative: dict[str, Any] | None,
    tp: int = 1,
    cost: Path | None = None,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One server's outputs for :func:`workload` and its ``/metrics`` afterwards.

    maskplug serves the grammars in every server (the same grammars, whitespace bound included, with and
    without speculation); ``scheduler=None`` leaves verification to vLLM.
    """
    env = {"MASKPLUG_VLLM": "1"}
    if scheduler is not None:
        env["MASKPLUG_VLLM_SCHEDULER"] = scheduler
        if cost is not None:
            env["MASKPLUG_VLLM_COST"] = str(cost)
    port = free_port()
    args = server_args(model, port, speculative=speculative, tp=tp)
    with Server(args, server_env(env, tp=tp), tmp / f"{name}.log", port=port) as server:
        out = serve(server, workload())
        return out, metrics(server)


def assert_lossless_and_valid(got: list[dict[str, Any]], base: list[dict[str, Any]]) -> None:
    reqs = workload()
    diff = [i for i, (a, b) in enumerate(zip(got, base, strict=True)) if a["tokens"] != b["tokens"]]
    assert not diff, f"outputs differ from the server without speculation at requests {diff}: " + json.dumps(
        [(got[i]["text"], base[i]["text"]) for i in diff[:3]]
    )
    assert [a["finish_reason"] for a in got] == [b["finish_reason"] for b in base]
    finished = 0
    for req, out in zip(reqs, got, strict=True):
        assert out["tokens"], "every request produced tokens"
        if out["finish_reason"] != "stop":
            continue
        if "json" in req:
            jsonschema.validate(tiny_model.xgrammar_json(out["text"]), req["json"])
            finished += 1
        elif "regex" in req:
            assert re.fullmatch(req["regex"], out["text"]), (req["regex"], out["text"])
            finished += 1
    assert finished > 0, "some structured request finished"


def series(m: dict[str, float], metric: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in {"engine": "0", **labels}.items())
    return m[f"{metric}{{{want}}}"]


def vllm_series(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(name + "{"))


@pytest.fixture(scope="module")
def base_tp1(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out, _ = run_server(tmp_path_factory.mktemp("base1"), models[0], "base", scheduler=None, speculative=None)
    return out


@pytest.fixture(scope="module")
def base_tp2(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out, _ = run_server(tmp_path_factory.mktemp("base2"), models[0], "base", scheduler=None, speculative=None, tp=2)
    return out


def counted(m: dict[str, float], scheduler: str) -> dict[str, float]:
    """The server's ``maskplug_*`` counters after a run of ``scheduler``, checked against vLLM's own.

    Steps ran, drafts were accepted, no more verified than scheduled; vLLM
    counts every scheduled draft, and trimmed drafts as rejected, so its
    drafted and accepted tokens are maskplug's scheduled and accepted drafts.
    """
    assert series(m, "maskplug_scheduler_info", name=scheduler) == 1
    c = {key: series(m, f"maskplug_{key}_total") for key in ("steps", "structured_steps", "tokens_emitted")} | {
        key: series(m, f"maskplug_drafts_{key}_total") for key in ("scheduled", "verified", "accepted")
    }
    c |= {r: series(m, "maskplug_regime_steps_total", regime=r) for r in ("full", "partial", "zero")}
    c["structured"], c["emitted"] = c.pop("structured_steps"), c.pop("tokens_emitted")
    assert c["steps"] > 0 and 0 < c["accepted"] <= c["verified"] <= c["scheduled"]
    assert vllm_series(m, "vllm:spec_decode_num_draft_tokens_total") == c["scheduled"]
    assert vllm_series(m, "vllm:spec_decode_num_accepted_tokens_total") == c["accepted"]
    return c


@pytest.mark.parametrize("scheduler", ["grammar-aware:goodput", "verify-all"])
def test_ngram_drafts_through_the_server_are_lossless_and_counted(
    models: tuple[Path, Path], base_tp1: list[dict[str, Any]], tmp_path: Path, scheduler: str
) -> None:
    """``grammar-aware:goodput`` plans each step's budget; ``verify-all`` plans nothing.

    ``verify-all``'s steps are counted as vLLM's own ``update_from_output``
    goes: every scheduled draft verified, every step with drafts of a
    structured request in the ``full`` regime.
    """
    got, m = run_server(tmp_path, models[0], scheduler.split(":")[-1], scheduler=scheduler, speculative=NGRAM)
    assert_lossless_and_valid(got, base_tp1)
    c = counted(m, scheduler)
    assert sum(c[r] for r in ("full", "partial", "zero")) == c["structured"] > 0
    # Every sampled token: the outputs' tokens, and any a stopping request sampled past its stop.
    assert c["emitted"] >= sum(len(o["tokens"]) for o in got)
    assert c["emitted"] - c["accepted"] <= c["steps"] * NUM_REQUESTS
    if scheduler == "verify-all":
        assert c["verified"] == c["scheduled"] and c["full"] == c["structured"]


def test_draft_model_confidences_drive_dspark(
    models: tuple[Path, Path], base_tp1: list[dict[str, Any]], tmp_path: Path
) -> None:
    target, draft = models
    # A flat verify cost: a draft is worth verifying when its confidence beats the step's average yield,
    # so the budget moves with the draft model's confidences from step to step.
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"verify": [[1, 10.0], [64, 10.5], [512, 14.0]]}))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    got, m = run_server(tmp_path, target, "dspark", scheduler="grammar-aware:dspark", speculative=spec, cost=cost)
    assert_lossless_and_valid(got, base_tp1)
    scheduled = series(m, "maskplug_drafts_scheduled_total")
    verified = series(m, "maskplug_drafts_verified_total")
    accepted = series(m, "maskplug_drafts_accepted_total")
    # Confidence budgets kept some drafts and trimmed others (a scheduler without confidences would have
    # stopped the engine: dspark refuses a step without them); the draft model is right only some of the time.
    assert 0 < verified < scheduled, (verified, scheduled)
    assert 0 < accepted <= verified, (accepted, verified)
    assert vllm_series(m, "vllm:spec_decode_num_draft_tokens_total") == scheduled
    assert vllm_series(m, "vllm:spec_decode_num_accepted_tokens_total") == accepted


def test_tensor_parallel_goodput_is_lossless(
    models: tuple[Path, Path], base_tp2: list[dict[str, Any]], tmp_path: Path
) -> None:
    got, m = run_server(tmp_path, models[0], "goodput-tp2", scheduler="goodput", speculative=NGRAM, tp=2)
    assert_lossless_and_valid(got, base_tp2)
    assert 0 < series(m, "maskplug_drafts_accepted_total") <= series(m, "maskplug_drafts_verified_total")


def test_tensor_parallel_no_spec_verifies_nothing(
    models: tuple[Path, Path], base_tp2: list[dict[str, Any]], tmp_path: Path
) -> None:
    got, m = run_server(tmp_path, models[0], "nospec-tp2", scheduler="no-spec", speculative=NGRAM, tp=2)
    assert_lossless_and_valid(got, base_tp2)
    scheduled = series(m, "maskplug_drafts_scheduled_total")
    assert scheduled > 0
    assert series(m, "maskplug_drafts_verified_total") == 0
    assert series(m, "maskplug_drafts_accepted_total") == 0
    assert series(m, "maskplug_regime_steps_total", regime="zero") == series(m, "maskplug_structured_steps_total")
    # vLLM's own counters: every scheduled draft counted, none accepted.
    assert vllm_series(m, "vllm:spec_decode_num_draft_tokens_total") == scheduled
    assert vllm_series(m, "vllm:spec_decode_num_accepted_tokens_total") == 0


@pytest.mark.parametrize(
    ("scheduler", "speculative", "extra", "message"),
    [
        ("dspark", NGRAM, (), r"dspark.*reads the drafter's confidences.*'ngram'.*draft_model"),
        ("goodput", NGRAM, ("--pipeline-parallel-size", "2"), r"pipeline_parallel_size=2.*--tensor-parallel-size"),
    ],
)
def test_unsupported_configurations_are_refused_at_start(
    models: tuple[Path, Path],
    tmp_path: Path,
    scheduler: str,
    speculative: dict[str, Any] | None,
    extra: tuple[str, ...],
    message: str,
) -> None:
    """The server the user started stops with a PluginError naming the setting, before any engine process.

    (Every refusal's message is checked without a server in ``test_adaptive_parts.py``.)
    """
    env = server_env({"MASKPLUG_VLLM": "1", "MASKPLUG_VLLM_SCHEDULER": scheduler})
    args = server_args(models[0], free_port(), speculative=speculative, extra=extra)
    start = time.monotonic()
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=180)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "PluginError" in log and re.search(message, log), log[-3000:]
    assert "EngineCore" not in log, "refused before any engine process started"
    assert time.monotonic() - start < 180


def test_llm_with_vllm_defaults_is_lossless_and_counts(
    models: tuple[Path, Path], base_tp1: list[dict[str, Any]], tmp_path: Path
) -> None:
    """``LLM(...)`` as most scripts start it: the engine core in its own process, counters read from it."""
    got = tiny_model.run_script(
        "llm_default_run.py",
        models[0],
        tmp_path / "out.json",
        # The servers' grammars: maskplug's default whitespace bound (run_script turns it off otherwise).
        env={
            "MASKPLUG_VLLM": "1",
            "MASKPLUG_VLLM_SCHEDULER": "goodput",
            "MASKPLUG_VLLM_MAX_WHITESPACE": str(DEFAULT_MAX_WHITESPACE),
            "VLLM_CPU_KVCACHE_SPACE": "1",
        },
        timeout=400,
    )
    tokens = [o["tokens"] for o in got["outputs"]]
    assert tokens == [b["tokens"] for b in base_tp1]
    assert [o["finish_reason"] for o in got["outputs"]] == [b["finish_reason"] for b in base_tp1]
    st = got["stats"]
    assert st["scheduler"] == "goodput" and st["steps"] > 0
    assert 0 < st["drafts_accepted"] <= st["drafts_verified"] <= st["drafts_scheduled"]
