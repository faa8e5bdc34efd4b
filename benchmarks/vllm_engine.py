"""vLLM's CPU engine end to end: no speculation, vLLM's fixed K, and maskplug's adaptive verification.

Runs in the vLLM environment (``adapters/.venv-vllm``, made by
``make -C adapters test-vllm``)::

    adapters/.venv-vllm/bin/python benchmarks/vllm_engine.py [--concurrency 1,8,32,64] [--requests-per-slot 2]

One run measures, on one structured workload (greedy; JSON-schema and regex
requests from maskplug's bundled schemas, ``--max-tokens`` each), output
tokens per second and the mean engine-step time at each concurrency, for:

* ``no-spec``: vLLM without speculative decoding;
* ``K=1``, ``K=3``, ``K=5``: vLLM's n-gram speculative decoding verifying
  every draft (vLLM's own xgrammar backend, as users run it today);
* ``goodput`` and ``grammar-aware:goodput``: one engine with n-gram drafting
  of up to 5 tokens and ``MASKPLUG_VLLM=1``, the verify budget chosen every
  step by the maskplug scheduler (switched in place), with the cost curve
  measured first by ``python -m maskplug_vllm.calibrate`` on the same model
  (with the same clock as the summary, see below). The engine runs every
  scheduler at one concurrency before the next concurrency, and each round
  starts with another scheduler: one engine process runs the same work a
  few percent faster in one stretch of its life than in another (two
  schedulers that made identical decisions differed by 4% when each ran all
  its concurrencies in one block). Each of those runs starts with a fresh
  scheduler (``set_scheduler``), so what one learnt at one concurrency does
  not carry over to the next.

Options beyond that: ``--workload mixed`` (half requests whose n-gram
drafts are mostly accepted, half whose drafts mostly fail; see
``benchmarks/vllm_tiny.py``), ``--drafter draft_model`` (vLLM's draft-model
drafter on a 1-layer copy of the target's config with its tokenizer; fixed K
against ``dspark`` and ``grammar-aware:dspark``, which read the drafter's
confidences), and ``--tp 2`` (``tensor_parallel_size=2`` with
``VLLM_CPU_OMP_THREADS_BIND="0|1"``: tensor parallelism needs vLLM's
multiprocess engine, so every engine core runs in its own process, each
scheduler gets its own engine, and the summary uses the wall clock).
The model, workloads and closed loop come from ``benchmarks/vllm_tiny.py``.

Every engine compiles the workload's grammars once before anything is
timed. Concurrency ``c`` is a closed loop: ``c`` requests in flight, the next one
added as soon as one finishes, ``requests-per-slot × c`` requests in all
(at least ``--min-requests``). Every engine runs in its own process (vLLM loads its plugins
once per process) and warms up at each concurrency with short requests
before it is timed. The model is a Llama with random weights
(``load_format="dummy"``, fp32, vocabulary 512), by default hidden size 1024
and 8 layers (``--hidden``/``--layers``): large enough that the forward pass,
not the engine's fixed per-step work, is most of a step, and that verifying
more tokens costs measurably more from a few tokens on. Its cost curve is
measured first at powers of two and at every step size the configurations
run at full batch (``c * (1 + k)`` tokens), and printed with the results.
The mean step time counts the steps that ran the model.

Every engine computes on one thread (``OMP_NUM_THREADS=1`` unless set:
vLLM's CPU worker would otherwise bind one OpenMP thread per core, and skips
its own reduction to one), idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``)
and the n-gram drafter's numba pool has one thread (``NUMBA_NUM_THREADS=1``;
vLLM drafts on one anyway). Without the last two, on the 2-core machine here
shared with other work, threads spinning after the drafter's numba region
made every operator of a speculative step wait for a time slice (a 48-token
K=1 generation took 24 s instead of 0.3 s). Two clocks are recorded for every run: wall-clock
time, and the engine process's CPU time (``time.process_time``; with one
compute thread, on an idle machine the two agree, while on a machine shared
with other work only the wall clock stretches). ``--clock`` picks the one the
summary compares (default ``cpu``). With
``--rounds R`` every engine runs R times, round after round, and each cell
keeps its fastest round (other work on the machine only ever slows a run).
Besides the whole run, the summary gives the rate while the batch ran
full (``vllm_tiny.closed_loop``'s ``steady_*`` figures: the steps that
began with requests waiting for a slot), which leaves out the tail where
the last requests run with slots standing empty: on the mixed workload the
letter requests set the tail's length whatever the budget, so a
configuration that finishes the copying requests sooner gains only while
waiting requests take their slots. The summary compares each adaptive scheduler with the best of every
baseline (no speculation included) and with the best fixed K >= 1 alone;
with more than one round it also gives the median of its per-round ratios
to that round's best.
``--schedulers`` replaces the adaptive engine's schedulers (``no-spec`` there
runs the speculative engine at budget zero: what the machinery costs when
nothing is verified; its row is ``no-spec (maskplug)``).
``--json`` writes everything measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_tiny as tiny

BASELINES = {"no-spec": 0, "K=1": 1, "K=3": 3, "K=5": 5}
ADAPTIVE = ["goodput", "grammar-aware:goodput"]
#: The schedulers with the draft-model drafter: they read its confidences.
ADAPTIVE_DRAFT_MODEL = ["dspark", "grammar-aware:dspark"]
MAX_SPEC = 5


def _speculative(cfg: dict[str, Any], spec: int) -> dict[str, Any] | None:
    """The speculative config of a run: n-gram, or the draft model (same tokenizer, fewer layers)."""
    if not spec:
        return None
    if cfg.get("drafter") == "draft_model":
        return {"method": "draft_model", "model": cfg["draft"], "num_speculative_tokens": spec}
    return tiny.ngram(spec)


def _engine_kwargs(cfg: dict[str, Any], spec: int, max_num_seqs: int) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if cfg.get("tp", 1) > 1:
        extra["tensor_parallel_size"] = cfg["tp"]
    return tiny.engine_kwargs(cfg["model"], _speculative(cfg, spec), max_num_seqs, **extra)


def _config_label(scheduler: str) -> str:
    """A maskplug scheduler's row: its name, marked when it is also a baseline's (``no-spec``)."""
    return f"{scheduler} (maskplug)" if scheduler in BASELINES else scheduler


def _structured_workload(n: int, seed: int, kind: str = "structured") -> list[dict[str, Any]]:
    """The run's requests: ``structured`` (JSON schema and regex) or ``mixed`` (see ``vllm_tiny.mixed_workload``)."""
    if kind == "mixed":
        return tiny.mixed_workload(n, seed)
    return tiny.structured_workload(n, seed)


def child(spec_json: str) -> None:
    """One engine configuration in this process; prints one JSON line of results."""
    cfg = json.loads(spec_json)
    tp = int(cfg.get("tp", 1))
    # Tensor parallelism needs vLLM's multiprocess engine (its workers are processes): then the
    # scheduler runs in the engine-core process, set once by the environment, and only the wall
    # clock sees the whole engine.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if tp > 1 else "0"
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    for k in [k for k in os.environ if k.startswith("MASKPLUG_VLLM")]:
        del os.environ[k]
    if cfg["schedulers"]:
        os.environ["MASKPLUG_VLLM"] = "1"
        os.environ["MASKPLUG_VLLM_SCHEDULER"] = cfg["schedulers"][0]
        os.environ["MASKPLUG_VLLM_COST"] = cfg["cost"]
        # vLLM's own grammar (unbounded flexible whitespace, as its xgrammar backend compiles it), so
        # every configuration constrains the same way and produces the same tokens.
        os.environ["MASKPLUG_VLLM_MAX_WHITESPACE"] = "none"
    from vllm import LLM

    llm = LLM(**_engine_kwargs(cfg, cfg["spec"], max(cfg["concurrency"])))
    engine = llm.llm_engine
    kind = cfg.get("workload", "structured")
    # Compile every grammar of the workload once (vLLM caches compiled grammars), so no timed
    # run waits for a compilation.
    tiny.closed_loop(engine, _structured_workload(64, 0, kind), 64, 2, "compile")
    results: list[dict[str, Any]] = []
    names = cfg["schedulers"] or [None]
    if cfg["schedulers"]:
        import maskplug_vllm
    # Concurrency by concurrency, every scheduler in turn: one engine process runs the same work a few
    # percent faster in one stretch of its life than in another, so two schedulers compare best when
    # their runs at a concurrency follow each other.
    for c in cfg["concurrency"]:
        for name in names:
            if name is not None and tp == 1:
                maskplug_vllm.set_scheduler(name)
            n = max(cfg["min_requests"], cfg["requests_per_slot"] * c)
            # Warm-up at this batch size (shapes, grammar caches), not timed.
            tiny.closed_loop(engine, _structured_workload(c, 1000 + c, kind), c, 6, f"warm-{name}-{c}")
            if name is not None:
                maskplug_vllm.reset_step_stats()
            res = tiny.closed_loop(engine, _structured_workload(n, c, kind), c, cfg["max_tokens"], f"run-{name}-{c}")
            res.update(config=_config_label(name) if name else cfg["label"], concurrency=c)
            if name is not None:
                res["stats"] = maskplug_vllm.step_stats()
            results.append(res)
            print(
                f"# {res['config']:<22} c={c:<3} {res['tokens_per_s']:8.1f} tok/s {res['mean_step_ms']:8.1f} ms/step"
                f" (CPU time: {res['tokens_per_cpu_s']:8.1f} tok/s {res['mean_step_cpu_ms']:8.1f} ms/step)",
                file=sys.stderr,
                flush=True,
            )
    print(_RESULTS + json.dumps(results), flush=True)


#: Prefix of the child's results line: engine worker processes may write to the same stdout after it.
_RESULTS = "maskplug-engine-results: "


def _run_child(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    for line in proc.stderr.splitlines():
        if line.startswith("# "):
            print(line[2:], flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"engine {cfg['label']} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULTS)]
    if not lines:
        raise SystemExit(f"engine {cfg['label']} printed no results:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len(_RESULTS) :])  # type: ignore[no-any-return]


def _round_ratios(
    results: list[dict[str, Any]],
    rate: str,
    adaptive: list[str],
    conc: list[int],
    rounds: int,
    baselines: list[str] | None = None,
) -> dict[tuple[str, int], list[float]]:
    """Each round's ratio of every adaptive configuration to that round's best of ``baselines`` (default all).

    ``results`` holds every configuration once per round, in round order.
    """
    among = list(BASELINES) if baselines is None else baselines
    out: dict[tuple[str, int], list[float]] = {}
    for c in conc:
        seen: dict[str, list[float]] = {}
        for r in results:
            if r["concurrency"] == c:
                seen.setdefault(r["config"], []).append(r[rate])
        for a in adaptive:
            ratios = []
            for i in range(rounds):
                best = max(seen[b][i] for b in among)
                ratios.append(seen[a][i] / best)
            out[a, c] = ratios
    return out


def _print_medians(ratios: dict[tuple[str, int], list[float]], adaptive: list[str], conc: list[int]) -> None:
    for c in conc:
        cells = []
        for a in adaptive:
            rs = ratios[a, c]
            cells.append(f"  {a}: {statistics.median(rs):.3f} [{', '.join(f'{x:.3f}' for x in rs)}]")
        print(f"c={c:<3}" + "".join(cells))


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _token_counts(conc: list[int]) -> list[int]:
    """Verify sizes to calibrate: powers of two, and every step size a configuration runs at full batch.

    A step of ``c`` requests verifying ``k`` drafts each has ``c * (1 + k)``
    tokens; measuring those sizes themselves keeps the cost curve exact where
    the schedulers compare budgets, instead of interpolated between powers of two.
    """
    top = max(conc) * (1 + MAX_SPEC)
    sizes = {1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top}
    sizes |= {c * (1 + k) for c in conc for k in range(MAX_SPEC + 1)}
    return sorted(sizes)


def _calibrate(model: str, out: Path, conc: list[int], clock: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASKPLUG_VLLM")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    cmd = [
        sys.executable,
        "-m",
        "maskplug_vllm.calibrate",
        "--model",
        model,
        "--out",
        str(out),
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--max-num-seqs",
        str(max(conc)),
        "--token-counts",
        ",".join(str(n) for n in _token_counts(conc)),
        "--max-model-len",
        "512",
        "--num-speculative-tokens",
        str(MAX_SPEC),
        "--repeats",
        "7",
        "--clock",
        clock,
        "--engine-arg",
        "gpu_memory_utilization=0.3",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"calibration failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=32, help="requests per run at least (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="run every engine this many times; keep each cell's best")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="what the summary divides by: the engine process's CPU time (default; steady on a machine "
        "shared with other work, the engine computing on one thread) or wall-clock time",
    )
    p.add_argument(
        "--workload",
        choices=("structured", "mixed"),
        default="structured",
        help="structured: JSON schema and regex requests; mixed: half whose drafts are mostly accepted "
        "(a copied answer), half whose drafts mostly fail (letters the drafter cannot predict)",
    )
    p.add_argument(
        "--drafter",
        choices=("ngram", "draft_model"),
        default="ngram",
        help="ngram (schedulers goodput, grammar-aware:goodput) or draft_model: a 1-layer draft of the target "
        "with the same tokenizer (schedulers dspark, grammar-aware:dspark)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor_parallel_size (>1: vLLM's multiprocess engine, VLLM_CPU_OMP_THREADS_BIND one core per "
        "rank, one scheduler per engine, wall clock)",
    )
    p.add_argument(
        "--schedulers",
        default=None,
        help="comma-separated maskplug schedulers for the adaptive engine (default: goodput,grammar-aware:goodput, "
        "or dspark,grammar-aware:dspark with the draft model); e.g. no-spec,goodput measures what the speculative "
        "machinery costs when nothing is verified",
    )
    p.add_argument("--model-dir", default=None, help="build the model here (default: a temporary folder)")
    p.add_argument("--cost", default=None, help="use this cost file instead of calibrating")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        child(args.child)
        return 0
    conc = [int(x) for x in args.concurrency.split(",")]
    if args.tp > 1 and args.clock == "cpu":
        # The engine core and workers run in other processes: this process's CPU time is not the engine's.
        print("--tp > 1: the summary uses the wall clock (the engine runs in other processes)")
        args.clock = "wall"
    adaptive = ADAPTIVE_DRAFT_MODEL if args.drafter == "draft_model" else ADAPTIVE
    if args.schedulers:
        adaptive = [x.strip() for x in args.schedulers.split(",") if x.strip()]
    # One compute thread per engine (inherited by the calibration and every engine process): vLLM's
    # CPU worker otherwise binds one OpenMP thread per core, and on a machine shared with other work
    # those threads wait on each other at every barrier.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Idle OpenMP threads sleep rather than spin, and the n-gram drafter's numba pool has one thread
    # (vLLM uses one anyway): spinning pool threads take the engine's core away from it at every step.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="maskplug-vllm-bench-") as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "model"
        model = str(
            tiny.build_model(
                model_dir,
                vocab_size=512,
                hidden_size=args.hidden,
                intermediate_size=3 * args.hidden,
                num_layers=args.layers,
            )
        )
        draft = str(tiny.build_draft(Path(tmp) / "draft", model, num_layers=1))
        t0 = time.perf_counter()
        if args.cost:
            cost_path = Path(args.cost)
            cost = json.loads(cost_path.read_text())
        else:
            cost_path = Path(tmp) / "cost.json"
            cost = _calibrate(model, cost_path, conc, args.clock)
        print(
            f"model: Llama, hidden {args.hidden}, {args.layers} layers, vocab 512, dummy weights (fp32); "
            f"drafter {args.drafter}; workload {args.workload}; tensor_parallel_size {args.tp}; clock {args.clock}"
        )
        print(f"load average at the start: {_load()}", flush=True)
        print("verify cost (ms) by tokens per step: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in cost["verify"]))
        if "step_overhead_ms" in cost:
            print(
                f"whole steps beyond the forward: {cost['step_overhead_ms']:.2f} ms per step + "
                f"{cost.get('token_overhead_ms', 0.0):.3f} ms per token ({cost.get('whole_steps', {})})"
            )
        common = {
            "model": model,
            "concurrency": conc,
            "requests_per_slot": args.requests_per_slot,
            "min_requests": args.min_requests,
            "max_tokens": args.max_tokens,
            "cost": str(cost_path),
            "workload": args.workload,
            "drafter": args.drafter,
            "draft": draft,
            "tp": args.tp,
        }
        results: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            print(f"round {rnd + 1} of {args.rounds}", flush=True)
            for label, spec in BASELINES.items():
                results += _run_child({**common, "label": label, "spec": spec, "schedulers": []})
            # Each round starts with another scheduler, so none always runs in the same place.
            turn = adaptive[rnd % len(adaptive) :] + adaptive[: rnd % len(adaptive)]
            if args.tp > 1:
                # The engine core is another process: one engine per scheduler, set by its environment.
                for a in turn:
                    results += _run_child({**common, "label": a, "spec": MAX_SPEC, "schedulers": [a]})
            else:
                results += _run_child({**common, "label": "adaptive", "spec": MAX_SPEC, "schedulers": turn})
        elapsed = time.perf_counter() - t0
    adaptive = [_config_label(a) for a in adaptive]
    configs = [*BASELINES, *adaptive]
    rate, step = ("tokens_per_cpu_s", "mean_step_cpu_ms") if args.clock == "cpu" else ("tokens_per_s", "mean_step_ms")
    # Interference from other work on the machine only ever slows a run: keep each cell's fastest round.
    table: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        key = (r["config"], r["concurrency"])
        if key not in table or r[rate] > table[key][rate]:
            table[key] = r
    clock = "process CPU time" if args.clock == "cpu" else "wall-clock time"
    print(
        f"\noutput tokens/s (mean step ms) by concurrency, in {clock}; {args.max_tokens} tokens max per request, "
        f"best of {args.rounds} rounds"
    )
    print(f"{'config':<24}" + "".join(f"{'c=' + str(c):>20}" for c in conc))
    for cfg in configs:
        cells = [f"{table[cfg, c][rate]:9.1f} ({table[cfg, c][step]:6.1f})" for c in conc]
        print(f"{cfg:<24}" + "".join(f"{x:>20}" for x in cells))
    print(f"\nadaptive against the best of no-spec and fixed K (ratio of tokens/s, {clock}; best rounds)")
    summary = []
    fixed = [b for b in BASELINES if BASELINES[b] > 0]
    # Sustained load: only the steps that ran with requests waiting for a slot (vllm_tiny.closed_loop).
    steady = "steady_tokens_per_cpu_s" if args.clock == "cpu" else "steady_tokens_per_s"
    # Per-round ratios, (whole run | while full) x (every baseline | fixed K >= 1 only).
    ratios = {
        (rate_key, k_only): _round_ratios(results, rate_key, adaptive, conc, args.rounds, fixed if k_only else None)
        for rate_key in (rate, steady)
        for k_only in (False, True)
    }
    for c in conc:
        best = max(BASELINES, key=lambda b: table[b, c][rate])
        best_k = max(fixed, key=lambda b: table[b, c][rate])
        row = {
            "concurrency": c,
            "clock": args.clock,
            "best_baseline": best,
            "best_tokens_per_s": table[best, c][rate],
            "best_fixed_k": best_k,
        }
        for a in adaptive:
            row[a] = table[a, c][rate] / table[best, c][rate]
            row[f"{a} vs fixed K"] = table[a, c][rate] / table[best_k, c][rate]
            for (rate_key, k_only), by_cell in ratios.items():
                label = f"{a}{' steady' if rate_key == steady else ''}{' vs fixed K' if k_only else ''} per round"
                row[label] = by_cell[a, c]
        summary.append(row)
        print(f"c={c:<3} best {best:<8}" + "".join(f"  {a}: {row[a]:.3f}" for a in adaptive))
    print(f"\nadaptive against the best fixed K >= 1 alone (ratio of tokens/s, {clock}; best rounds)")
    for row in summary:
        print(
            f"c={row['concurrency']:<3} best {row['best_fixed_k']:<8}"
            + "".join(f"  {a}: {row[a + ' vs fixed K']:.3f}" for a in adaptive)
        )
    if args.rounds > 1:
        # Rounds run one after the other, every configuration once per round: a ratio within a round
        # compares engines that ran minutes apart, not hours, so the median of those is the steadier figure.
        for k_only in (False, True):
            title = "best fixed K >= 1" if k_only else "best baseline"
            print(f"\nround by round, each round's adaptive engine against that round's {title}: median [all]")
            _print_medians(ratios[rate, k_only], adaptive, conc)
    print(f"\nwhile the batch ran full (requests waiting for a slot): output tokens/s in {clock}, median of rounds")
    print(f"{'config':<24}" + "".join(f"{'c=' + str(c):>12}" for c in conc))
    for cfg in configs:
        cells = [
            statistics.median(r[steady] for r in results if r["config"] == cfg and r["concurrency"] == c) for c in conc
        ]
        print(f"{cfg:<24}" + "".join(f"{x:12.1f}" for x in cells))
    for k_only in (False, True):
        title = "best fixed K >= 1" if k_only else "best baseline"
        print(f"while full, each round's adaptive engine against that round's {title}: median [all]")
        _print_medians(ratios[steady, k_only], adaptive, conc)
    for cfg in adaptive:
        for c in conc:
            s = table[cfg, c]["stats"]
            print(
                f"{cfg:<22} c={c:<3} regimes {s['regimes']}, drafts scheduled {s['drafts_scheduled']}, "
                f"verified {s['drafts_verified']}, accepted {s['drafts_accepted']}"
            )
    # Greedy and lossless: every configuration, every round, the same tokens at each concurrency.
    mismatches = []
    for c in conc:
        digests = {r["config"]: r["digest"] for r in results if r["concurrency"] == c}
        if len({r["digest"] for r in results if r["concurrency"] == c}) > 1:
            mismatches.append(f"c={c}: {digests}")
    print("identical tokens in every configuration: " + ("yes" if not mismatches else "NO: " + "; ".join(mismatches)))
    loads = [x for r in results for x in (r["load_before"], r["load_after"])]
    print(f"\nload average (1 min) around the timed runs: {min(loads):.1f} to {max(loads):.1f}")
    print(f"total {elapsed:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"cost": cost, "results": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
