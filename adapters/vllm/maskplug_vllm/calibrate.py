"""The engine's own step cost, measured: maskplug's cost file for vLLM.

maskplug's schedulers choose the verify budget by expected tokens per
millisecond, so they need what a step costs on *this* engine, model and
machine: ``verify_ms(num_tokens)`` for the target forward (plus its logits)
over a step of ``num_tokens`` tokens, and ``draft_ms(num_reqs)`` for the
drafter over ``num_reqs`` requests. This module measures both inside a running
vLLM engine with a short profile and writes them as a JSON cost file::

    python -m maskplug_vllm.calibrate --model MODEL --out cost.json

The file holds ``{"verify": [[num_tokens, ms], ...], "draft": [[num_reqs, ms], ...],
"model": ..., "device": ..., "max_reqs": ..., "max_tokens": ...,
"step_overhead_ms": ..., "token_overhead_ms": ..., ...}``; the
engine reads it through ``MASKPLUG_VLLM_COST=cost.json``, and
:meth:`CostProfile.cost_model` turns it into the :class:`maskplug.CostModel`
the schedulers take (:meth:`maskplug.CostModel.from_curves`).

For start-up profiling inside an engine process, :func:`profile_runner`
measures a model runner directly, and :func:`profile_llm` measures an
``LLM`` through its workers (``collective_rpc``).

How it measures: the target forward is vLLM's own dummy batch
(``_dummy_run(num_tokens, force_attention=True)``: the model with attention
metadata, no sampling) followed by the LM head over every token, which is what
a speculative step computes (each scheduled draft and each bonus position has
a logits row). Every size is warmed up first, then timed ``repeats`` times in
round-robin order (so a slow moment of the machine spreads over all sizes) and
the fastest kept (``statistic="min"``: on a shared machine interference only
ever adds time, so the fastest run is the closest to the engine's own cost;
``"median"`` is the alternative). A size measured slower than a larger one
is then capped by it (:func:`lower_envelope`); the raw figures are kept in
the file. The n-gram drafter is timed on synthetic token histories with
vLLM's own proposer; other drafters are not measured (their draft curve is
zero and ``draft_measured`` says so).

Whole steps (on by default with a drafter, ``--no-whole-steps`` to skip):
the forward pass is not all a speculative step costs. The engine also
schedules, samples, runs the rejection sampler, fills and applies grammar
rows and updates its requests, and on a small model or a CPU that is
milliseconds per step, growing with the tokens verified. So after the
forward profile the command runs real decode steps of the same engine
(closed loops of n-gram-friendly prompts at several batch sizes, every
draft verified), times every step on the same clock, subtracts the profiled
forward and draft costs, and fits what is left as ``step_overhead_ms +
token_overhead_ms * num_tokens`` (least squares, both terms kept ``>= 0``).
:meth:`CostProfile.cost_model` adds the two to its curves, so the schedulers
price a budget by what the whole step costs. The fit and the residual spread
are in the file (``whole_steps``). This needs the engine core in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the command sets).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from maskplug import BudgetError, CostModel

__all__ = [
    "COST_FILE_FORMAT",
    "CostProfile",
    "StepSample",
    "check_overhead",
    "default_request_counts",
    "default_token_counts",
    "fit_step_overhead",
    "lower_envelope",
    "main",
    "measure_whole_steps",
    "profile_llm",
    "profile_runner",
    "read_cost_file",
    "with_overheads",
]

COST_FILE_FORMAT = "maskplug-cost/1"
"""The ``format`` field of a cost file this module writes and reads."""


def _pairs(name: str, value: Any) -> list[tuple[int, float]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise BudgetError(f"{name}: expected a non-empty list of [size, ms] pairs, got {value!r}")
    out: list[tuple[int, float]] = []
    for item in value:
        ok = isinstance(item, (list, tuple)) and len(item) == 2
        size, ms = (item[0], item[1]) if ok else (None, None)
        if (
            not ok
            or isinstance(size, bool)
            or not isinstance(size, int)
            or size < 0
            or isinstance(ms, bool)
            or not isinstance(ms, (int, float))
            or not math.isfinite(ms)
            or ms < 0
        ):
            raise BudgetError(f"{name}: expected [int size >= 0, finite ms >= 0] pairs, got {item!r}")
        out.append((int(size), float(ms)))
    sizes = [s for s, _ in out]
    if len(set(sizes)) != len(sizes):
        raise BudgetError(f"{name}: expected distinct sizes, got {sizes}")
    return sorted(out)


def check_overhead(name: str, value: Any) -> float:
    """A whole-step overhead of a cost file: a finite number of ms ``>= 0``, else :class:`maskplug.BudgetError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise BudgetError(f"{name}: expected a finite number of ms >= 0, got {value!r}")
    return float(value)


def with_overheads(
    draft: Sequence[tuple[float, float]], verify: Sequence[tuple[float, float]], step_ms: float, token_ms: float
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The cost curves of a whole step: ``step_ms`` added to every drafter sample, ``token_ms * n`` to every verify sample."""
    return [(n, ms + step_ms) for n, ms in draft], [(n, ms + token_ms * n) for n, ms in verify]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BudgetError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class CostProfile:
    """A measured step-cost profile of one engine (what a cost file holds).

    Attributes:
        verify: ``(num_tokens, ms)``: the target forward and its logits over
            a step of ``num_tokens`` tokens.
        draft: ``(num_reqs, ms)``: proposing drafts for ``num_reqs`` requests.
        model: the model the engine served.
        device: where it ran (e.g. ``cpu``, ``cuda:0 (NVIDIA H100)``).
        max_reqs: the engine's most requests per step (``max_num_seqs``).
        max_tokens: the engine's most tokens per step (``max_num_batched_tokens``).
        graph_limit: the largest captured graph size (0: eager, no padding).
        step_overhead_ms: what every step costs beyond the forward and the
            drafter (scheduling, sampling, bookkeeping), from whole steps.
        token_overhead_ms: what each token of a step costs beyond the
            forward (its logits row's sampling, rejection and grammar work).
        meta: anything else recorded (vLLM version, dtype, drafter, repeats, date).
    """

    verify: tuple[tuple[int, float], ...]
    draft: tuple[tuple[int, float], ...]
    model: str
    device: str
    max_reqs: int
    max_tokens: int
    graph_limit: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    step_overhead_ms: float = 0.0
    token_overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify", tuple(_pairs("verify", [list(p) for p in self.verify])))
        object.__setattr__(self, "draft", tuple(_pairs("draft", [list(p) for p in self.draft])))
        _positive_int("max_reqs", self.max_reqs)
        _positive_int("max_tokens", self.max_tokens)
        if isinstance(self.graph_limit, bool) or not isinstance(self.graph_limit, int) or self.graph_limit < 0:
            raise BudgetError(f"graph_limit: expected an int >= 0, got {self.graph_limit!r}")
        if not all(ms > 0 for _, ms in self.verify):
            raise BudgetError(f"verify: expected positive times (a forward never costs nothing), got {self.verify}")
        for name in ("step_overhead_ms", "token_overhead_ms"):
            object.__setattr__(self, name, check_overhead(name, getattr(self, name)))

    def cost_model(self, max_reqs: int | None = None, max_tokens: int | None = None) -> CostModel:
        """The :class:`maskplug.CostModel` of this profile (tabulated up to the engine's limits by default).

        The whole-step overheads are added to the curves: ``step_overhead_ms``
        to every drafter sample (it is paid once per step, like the drafter),
        ``token_overhead_ms * num_tokens`` to every verify sample (the curve is
        linear between samples and past the last, so the added line is exact).
        """
        draft, verify = with_overheads(self.draft, self.verify, self.step_overhead_ms, self.token_overhead_ms)
        return CostModel.from_curves(
            draft,
            verify,
            max_reqs=self.max_reqs if max_reqs is None else max_reqs,
            max_tokens=self.max_tokens if max_tokens is None else max_tokens,
            graph_limit=self.graph_limit,
        )

    def to_json(self) -> dict[str, Any]:
        """The cost file's content."""
        return {
            "format": COST_FILE_FORMAT,
            "verify": [[n, round(ms, 6)] for n, ms in self.verify],
            "draft": [[n, round(ms, 6)] for n, ms in self.draft],
            "model": self.model,
            "device": self.device,
            "max_reqs": self.max_reqs,
            "max_tokens": self.max_tokens,
            "graph_limit": self.graph_limit,
            "step_overhead_ms": round(self.step_overhead_ms, 6),
            "token_overhead_ms": round(self.token_overhead_ms, 6),
            **self.meta,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "cost file") -> CostProfile:
        """Parse a cost file's content; :class:`maskplug.BudgetError` names what is wrong."""
        if not isinstance(data, dict):
            raise BudgetError(f"{source}: expected a JSON object, got {type(data).__name__}")
        fmt = data.get("format", COST_FILE_FORMAT)
        if fmt != COST_FILE_FORMAT:
            raise BudgetError(f"{source}: expected format {COST_FILE_FORMAT!r}, got {fmt!r}")
        missing = [k for k in ("verify", "draft", "max_reqs", "max_tokens") if k not in data]
        if missing:
            raise BudgetError(f"{source}: expected the keys verify, draft, max_reqs, max_tokens; missing {missing}")
        known = {
            "format",
            "verify",
            "draft",
            "model",
            "device",
            "max_reqs",
            "max_tokens",
            "graph_limit",
            "step_overhead_ms",
            "token_overhead_ms",
        }
        try:
            return cls(
                verify=tuple(_pairs(f"{source}: verify", data["verify"])),
                draft=tuple(_pairs(f"{source}: draft", data["draft"])),
                model=str(data.get("model", "")),
                device=str(data.get("device", "")),
                max_reqs=data["max_reqs"],
                max_tokens=data["max_tokens"],
                graph_limit=data.get("graph_limit", 0),
                meta={k: v for k, v in data.items() if k not in known},
                # Files written before whole-step calibration price the forward alone.
                step_overhead_ms=data.get("step_overhead_ms", 0.0),
                token_overhead_ms=data.get("token_overhead_ms", 0.0),
            )
        except BudgetError as exc:
            msg = str(exc)
            raise BudgetError(msg if msg.startswith(source) else f"{source}: {msg}") from None

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the cost file (atomically: a reader never sees half a file)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        data = self.to_json()
        # One key per line, each curve on one line: small diffs, easy to read.
        body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items())
        tmp.write_text("{\n" + body + "\n}\n")
        tmp.replace(out)
        return out


def read_cost_file(path: str | os.PathLike[str]) -> CostProfile:
    """Read a cost file written by :meth:`CostProfile.write`; :class:`maskplug.BudgetError` if unusable."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise BudgetError(f"path: expected a readable cost file, got {str(p)!r} ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BudgetError(f"path: expected JSON in {str(p)!r}, got a parse error ({exc})") from None
    return CostProfile.from_json(data, source=f"cost file {str(p)!r}")


def _powers_of_two_to(limit: int) -> list[int]:
    sizes, s = [], 1
    while s < limit:
        sizes.append(s)
        s *= 2
    sizes.append(limit)
    return sizes


def default_token_counts(max_reqs: int, num_spec: int, max_tokens: int) -> list[int]:
    """Powers of two up to the largest decode step (``max_reqs * (1 + num_spec)``, capped at ``max_tokens``)."""
    return _powers_of_two_to(max(1, min(max_tokens, max_reqs * (1 + num_spec))))


def default_request_counts(max_reqs: int) -> list[int]:
    """Powers of two up to ``max_reqs``."""
    return _powers_of_two_to(max(1, max_reqs))


def _time_ms(
    fns: dict[int, Callable[[], object]], repeats: int, warmup: int, statistic: str, clock: str = "wall"
) -> list[tuple[int, float]]:
    now = time.process_time if clock == "cpu" else time.perf_counter
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[int, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for n, fn in fns.items():
            t0 = now()
            fn()
            samples[n].append((now() - t0) * 1e3)
    pick = min if statistic == "min" else statistics.median
    return [(n, float(pick(v))) for n, v in samples.items()]


def lower_envelope(samples: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """Each size's time capped by every larger size's: ``t(n) = min(t(m) for m >= n)``.

    A bigger step never costs less, so a small size measured slower than a
    larger one was slowed by something else (the machine's other work, a
    first-time allocation); the larger size's time bounds it. The raw
    figures stay in the file (``verify_measured``, ``draft_measured_ms``).
    """
    pairs = sorted(samples)
    out: list[tuple[int, float]] = []
    cap = float("inf")
    for n, ms in reversed(pairs):
        cap = min(cap, ms)
        out.append((n, cap))
    return out[::-1]


def _device_name(device: Any) -> str:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return str(dev)


def _check_counts(name: str, counts: Sequence[int], limit: int) -> list[int]:
    out = sorted(set(counts))
    if not out or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in out):
        raise BudgetError(f"{name}: expected positive ints, got {list(counts)!r}")
    if out[-1] > limit:
        raise BudgetError(f"{name}: expected sizes <= {limit} (the engine's limit), got {out[-1]}")
    return out


def profile_runner(
    runner: Any,
    token_counts: Sequence[int] | None = None,
    request_counts: Sequence[int] | None = None,
    *,
    repeats: int = 5,
    warmup: int = 2,
    statistic: str = "min",
    clock: str = "wall",
) -> CostProfile:
    """Measure a vLLM model runner in its own process (the engine must be idle).

    Args:
        runner: vLLM's ``GPUModelRunner`` (or the CPU build's ``CPUModelRunner``).
        token_counts: verify sizes; default :func:`default_token_counts`.
        request_counts: drafter sizes; default :func:`default_request_counts`.
        repeats: timed runs per size.
        warmup: untimed runs per size first.
        statistic: ``"min"`` (default) or ``"median"`` of the timed runs.
        clock: ``"wall"`` (default) or ``"cpu"``: the process's CPU time, for a
            CPU engine computing on one thread on a machine shared with other
            work (there only the wall clock stretches); never for a GPU, whose
            work the host's CPU time does not see.
    """
    import torch

    _positive_int("repeats", repeats)
    if statistic not in ("min", "median"):
        raise BudgetError(f"statistic: expected 'min' or 'median', got {statistic!r}")
    if clock not in ("wall", "cpu"):
        raise BudgetError(f"clock: expected 'wall' or 'cpu', got {clock!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise BudgetError(f"warmup: expected an int >= 0, got {warmup!r}")
    cfg = runner.vllm_config
    spec = cfg.speculative_config
    num_spec = int(spec.num_speculative_tokens) if spec is not None else 0
    max_reqs = int(cfg.scheduler_config.max_num_seqs)
    max_tokens = int(cfg.scheduler_config.max_num_batched_tokens)
    tokens = _check_counts(
        "token_counts",
        default_token_counts(max_reqs, num_spec, max_tokens) if token_counts is None else token_counts,
        max_tokens,
    )
    reqs = _check_counts(
        "request_counts", default_request_counts(max_reqs) if request_counts is None else request_counts, max_reqs
    )
    sync: Callable[[], None] = getattr(runner, "_sync_device", lambda: None)

    def forward(n: int) -> Callable[[], object]:
        def run() -> object:
            with torch.inference_mode():
                hidden, _ = runner._dummy_run(n, force_attention=True)
                logits = runner.model.compute_logits(hidden[:n])
            sync()
            return logits

        return run

    verify = _time_ms({n: forward(n) for n in tokens}, repeats, warmup, statistic, clock)

    drafter: Any = getattr(runner, "drafter", None)
    method = getattr(spec, "method", None) if spec is not None else None
    draft_measured = method == "ngram" and drafter is not None and hasattr(drafter, "propose")
    if draft_measured:
        rng = np.random.default_rng(0)
        max_len = int(cfg.model_config.max_model_len)
        vocab = int(cfg.model_config.get_vocab_size())
        # Histories like a decode's: a prompt plus some output, with repeats for the n-grams to find.
        hist = min(max_len - num_spec - 1, 256)
        base = rng.integers(0, vocab, size=(max(reqs), max_len), dtype=np.int32)
        base[:, hist // 2 : hist] = base[:, : hist - hist // 2]

        def propose(n: int) -> Callable[[], object]:
            lengths = np.full(n, hist, dtype=np.int32)
            sampled = [[int(base[i, hist - 1])] for i in range(n)]
            ids = base[:n]
            return lambda: drafter.propose(num_spec, sampled, lengths, ids)

        draft = _time_ms({n: propose(n) for n in reqs}, repeats, warmup, statistic, clock)
    else:
        draft = [(0, 0.0)]
    return CostProfile(
        verify=tuple(lower_envelope(verify)),
        draft=tuple(lower_envelope(draft)),
        model=str(cfg.model_config.model),
        device=_device_name(runner.device),
        max_reqs=max_reqs,
        max_tokens=max_tokens,
        graph_limit=0,
        meta={
            "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
            "num_speculative_tokens": num_spec,
            "draft_method": method,
            "draft_measured": bool(draft_measured),
            "repeats": repeats,
            "statistic": statistic,
            "clock": clock,
            "verify_measured": [[n, round(ms, 6)] for n, ms in verify],
            "draft_measured_ms": [[n, round(ms, 6)] for n, ms in draft],
            "vllm_version": _vllm_version(),
            "measured_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    )


@dataclass(frozen=True)
class StepSample:
    """One timed decode step of a running engine (:func:`measure_whole_steps`)."""

    ms: float
    num_reqs: int
    num_tokens: int
    num_drafts: int


def _engine_scheduler(llm: Any) -> Any:
    """The engine core's scheduler, when the engine core runs in this process."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    sched = getattr(getattr(core, "engine_core", None), "scheduler", None)
    if sched is None or not hasattr(sched, "schedule"):
        raise BudgetError(
            "whole steps: expected the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), "
            f"got an engine core client of type {type(core).__name__}"
        )
    return sched


def measure_whole_steps(
    llm: Any,
    batch_sizes: Sequence[int],
    *,
    max_tokens: int = 24,
    prompt_len: int = 48,
    clock: str = "wall",
    seed: int = 0,
) -> list[StepSample]:
    """Time real decode steps of ``llm``'s engine, batch by batch; the engine must be idle.

    For each batch size ``c``, ``c`` greedy requests (prompts of random token
    ids that repeat, so an n-gram drafter finds continuations) run to
    ``max_tokens`` output tokens, and every engine step is timed on
    ``clock``. The scheduler's output of each step says how many requests,
    tokens and drafts it held; only pure decode steps (every request one
    sampled token plus its drafts, no prompt tokens) are kept.
    """
    from vllm import SamplingParams

    if clock not in ("wall", "cpu"):
        raise BudgetError(f"clock: expected 'wall' or 'cpu', got {clock!r}")
    sizes = _check_counts("batch_sizes", batch_sizes, 1 << 20)
    engine = llm.llm_engine
    sched = _engine_scheduler(llm)
    now = time.process_time if clock == "cpu" else time.perf_counter
    seen: list[tuple[int, int, int]] = []
    original = sched.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        drafts = sum(len(v) for v in getattr(out, "scheduled_spec_decode_tokens", {}).values())
        seen.append((len(out.num_scheduled_tokens), int(out.total_num_scheduled_tokens), drafts))
        return out

    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    samples: list[StepSample] = []
    sched.schedule = schedule
    try:
        for rnd, c in enumerate(sizes):
            for i in range(c):
                unit = rng.integers(0, vocab, size=max(2, prompt_len // 4)).tolist()
                ids = (unit * 4)[:prompt_len]
                engine.add_request(f"maskplug-whole-{rnd}-{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                seen.clear()
                t0 = now()
                engine.step()
                ms = (now() - t0) * 1e3
                if len(seen) == 1:
                    n, t, d = seen[0]
                    if n and t == n + d:
                        samples.append(StepSample(ms, n, t, d))
    finally:
        sched.schedule = original
    return samples


def fit_step_overhead(samples: Sequence[StepSample], cost: CostModel) -> dict[str, Any]:
    """What the steps cost beyond ``cost``: ``step_ms + token_ms * num_tokens``, least squares, both ``>= 0``.

    Returns ``{"step_overhead_ms", "token_overhead_ms", "steps", "residual_ms"}``
    (``residual_ms``: the median absolute difference between a step's time and
    the fitted whole-step cost). Needs at least two steps of different sizes
    for the slope; with one size the slope is 0 and the constant is the mean.
    """
    if not samples:
        raise BudgetError("samples: expected timed decode steps, got none")
    t = np.array([s.num_tokens for s in samples], dtype=np.float64)
    n = np.array([s.num_reqs for s in samples], dtype=np.int64)
    ms = np.array([s.ms for s in samples], dtype=np.float64)
    extra = (
        ms
        - np.asarray(cost.verify_ms(t.astype(np.int64)), dtype=np.float64)
        - np.asarray(cost.draft_ms(n), dtype=np.float64)
    )
    a, c = float(np.mean(extra)), 0.0
    if np.unique(t).size >= 2:
        design = np.stack([np.ones_like(t), t], axis=1)
        (a, c), *_ = np.linalg.lstsq(design, extra, rcond=None)
        a, c = float(a), float(c)
        # Keep both terms non-negative (the cost never falls with more tokens, and a
        # step never costs less than its forward): refit the other term alone.
        if c < 0:
            a, c = float(np.mean(extra)), 0.0
        elif a < 0:
            a, c = 0.0, float(np.dot(t, extra) / np.dot(t, t))
    a, c = max(a, 0.0), max(c, 0.0)
    residual = float(np.median(np.abs(extra - (a + c * t))))
    return {"step_overhead_ms": a, "token_overhead_ms": c, "steps": len(samples), "residual_ms": residual}


def _vllm_version() -> str:
    from .patches import vllm_version

    try:
        return vllm_version()
    except Exception:  # pragma: no cover - the profile still stands without it
        return "unknown"


def _profile_worker(worker: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Runs in each worker process (``collective_rpc``); returns the profile as JSON data."""
    return profile_runner(worker.model_runner, **kwargs).to_json()


def profile_llm(llm: Any, **kwargs: Any) -> CostProfile:
    """Measure an idle ``vllm.LLM`` through its first worker (``kwargs`` as for :func:`profile_runner`)."""
    results = llm.collective_rpc(_profile_worker, args=(kwargs,))
    return CostProfile.from_json(results[0], source="worker profile")


def _engine_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m maskplug_vllm.calibrate",
        description="Measure a vLLM engine's verify and draft cost and write maskplug's cost file.",
    )
    p.add_argument("--model", required=True, help="model name or folder, as for vllm.LLM")
    p.add_argument("--out", default="maskplug-cost.json", help="cost file to write (default: %(default)s)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--load-format", default="auto", help="e.g. dummy: random weights, same cost")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=5,
        help="n-gram drafts per request the engine will schedule (0: no drafter); sets the verify sizes",
    )
    p.add_argument("--token-counts", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--request-counts", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--statistic", choices=("min", "median"), default="min")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall-clock time (default) or the process's CPU time (a CPU engine on a shared machine)",
    )
    p.add_argument(
        "--whole-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time real decode steps and fit what they cost beyond the forward (default: on with a drafter)",
    )
    p.add_argument(
        "--step-batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="batch sizes of the whole-step runs (default: 1, 4, 16 and the most requests, up to --max-num-seqs)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other vllm.LLM argument (VALUE parsed as JSON when it is JSON), repeatable",
    )
    return p


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a parsed command line."""
    kw: dict[str, Any] = {
        "model": args.model,
        "tokenizer": args.tokenizer or args.model,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "enforce_eager": True,
        "seed": 0,
    }
    if args.num_speculative_tokens > 0:
        kw["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BudgetError(f"--engine-arg: expected KEY=VALUE, got {item!r}")
        kw[key.replace("-", "_")] = _engine_value(value)
    return kw


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    args = _parser().parse_args(argv)
    # The engine profiled here must not read a cost file (possibly the one being written).
    os.environ.pop("MASKPLUG_VLLM_COST", None)
    whole = args.num_speculative_tokens > 0 if args.whole_steps is None else args.whole_steps
    if whole:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") not in ("0", "false", "False"):
            raise SystemExit(
                "--whole-steps: expected VLLM_ENABLE_V1_MULTIPROCESSING=0 (the steps are timed in this process), "
                f"got {os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}; unset it or pass --no-whole-steps"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(**llm_kwargs(args))
    profile = profile_llm(
        llm,
        token_counts=args.token_counts,
        request_counts=args.request_counts,
        repeats=args.repeats,
        warmup=args.warmup,
        statistic=args.statistic,
        clock=args.clock,
    )
    if whole:
        sizes = args.step_batch_sizes or sorted({min(c, args.max_num_seqs) for c in (1, 4, 16, args.max_num_seqs)})
        print(f"timing whole decode steps at batch sizes {sizes} ...", flush=True)
        samples = measure_whole_steps(llm, sizes, clock=args.clock)
        fit = fit_step_overhead(samples, profile.cost_model())
        profile = dataclasses.replace(
            profile,
            step_overhead_ms=fit["step_overhead_ms"],
            token_overhead_ms=fit["token_overhead_ms"],
            meta={
                **profile.meta,
                "whole_steps": {
                    "batch_sizes": sizes,
                    "steps": fit["steps"],
                    "residual_ms": round(fit["residual_ms"], 6),
                    "drafts_per_step": round(sum(s.num_drafts for s in samples) / len(samples), 3),
                },
            },
        )
    out = profile.write(args.out)
    print(f"wrote {out}: {profile.model} on {profile.device}")
    if whole:
        print(
            f"  whole steps: {profile.step_overhead_ms:.3f} ms per step + {profile.token_overhead_ms:.4f} ms per token "
            f"beyond the forward ({profile.meta['whole_steps']['steps']} decode steps, median residual "
            f"{profile.meta['whole_steps']['residual_ms']:.3f} ms)"
        )
    for n, ms in profile.verify:
        print(f"  verify {n:6d} tokens  {ms:9.3f} ms")
    for n, ms in profile.draft:
        print(f"  draft  {n:6d} requests {ms:9.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
