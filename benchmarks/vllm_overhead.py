"""maskplug's per-step cost inside vLLM's CPU engine, against vLLM's own fixed-K path, interleaved.

Runs in the vLLM environment from the repository root::

    adapters/.venv-vllm/bin/python benchmarks/vllm_overhead.py [--concurrency 1,16] [--rounds 7]

On a tiny Llama (hidden 128, 2 layers, vocabulary 640, dummy fp32 weights:
a step is mostly the engine's host work, which is what this measures) with
n-gram drafting of ``K`` tokens (default 3), three engines run the same
structured requests (JSON schema and regex, greedy):

* ``vllm``: vLLM's own xgrammar rows and mask apply, every draft verified;
* ``grammar``: ``MASKPLUG_VLLM=1``: maskplug's rows and mask apply, every draft verified;
* ``verify-all``: also ``MASKPLUG_VLLM_SCHEDULER=verify-all``: the budget
  planned and the outcome learnt in the engine core (the same drafts verified).

Every engine lives in its own process for the whole run (vLLM loads its
plugins once per process), compiles the workload's grammars and warms up at
every concurrency first, then waits on a pipe. A round runs every engine
once on the same requests, one after the other in a rotating order, each
timed run right after an untimed run of the same requests in the same mode
(``--no-prime`` skips those: the first run of new prompts in a process runs
its forward passes 10-25% slower than every later run, and with ``--switch``
a mode's code is cold right after a switch; both fell on some modes more than
others); the
figure is output tokens per second of the engine process's CPU time
(``--clock cpu``; one compute thread, so other work on the machine stretches
the wall clock but hardly the CPU time), and the summary is the median over
rounds of each round's ratio to ``vllm``. Every round checks that all
engines generated identical tokens (a digest of every request's token ids).

With ``--profile`` a last set of rounds times the engine's patched
functions with ``time.thread_time_ns`` (CPU time of the calling thread)
around each call: vLLM's ``Scheduler.schedule`` and ``update_from_output``,
the scheduler's ``get_grammar_bitmask`` (``grammar_output``: what the
engine core asks for after sending the step, the adapter's wrapper
included) and inside it the structured-output manager's ``grammar_bitmask``
(``rows``: the mask rows), each grammar's ``accept_tokens`` (``accept``: the
emitted tokens reaching the grammars, inside ``update_from_output``), the
scheduler's ``update_draft_token_ids`` (``drafts``: the next step's drafts,
each grammar request's checked by its grammar's ``validate_tokens``,
``validate``), the model runner's ``apply_grammar_bitmask`` (the apply), and a planning
scheduler's budget and outcome (``_Controller.plan`` / ``finish``), per step
that ran the model, and ``host``: the host work besides the forward pass
(``schedule``, ``update_from_output``, ``drafts``, ``grammar_output`` and the apply;
each timed call records whether another timed call was running, so a call
nested in another is counted once). These figures count the calls of steps
that scheduled something; the engine's idle steps (its loop spinning while a
request waits, mostly for its grammar: at one request in flight 50 to 70 per
request, about three per model step, each a ``schedule``, a
``get_grammar_bitmask`` and an ``update_from_output``) are timed apart and
shown on their own: their number is the wait's wall time over one idle
step's cost, so they measure the wait (the grammar compiling on another
thread, which gets the GIL between the loop's steps), not the work per
step, and differ between engines (before 2026-12-06 07:50 UTC they were in
every figure, divided by the model steps). These timed calls run
cold, between forward passes: each costs several times what the same call
costs repeated in a loop (``benchmarks/vllm_rows.py``, ``cpu_apply.py``).
``--restart N`` starts fresh engine processes every N rounds: one engine
process can run the same work about 30% slower than another for its whole
life (seen here with no maskplug code running at all), so the medians
should span several processes per engine. ``--switch`` removes that
spread instead: one engine process serves every mode, maskplug's patches
uninstalled and installed between runs (``_Switch``), so two modes differ
only in the code their steps run. With more than one profiled
round, ``host`` is also given as the median of each round's difference to
``vllm`` (profiled rounds restart engines too; ``--rounds 0`` runs only
profiled rounds and takes the rates from them). ``--log-stats`` has vLLM
keep its statistics every step, as its OpenAI server does (the ``LLM``
class, and so this benchmark by default, keeps none; maskplug's
``verify-all`` counts its steps either way). ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_tiny as tiny

#: maskplug's engines run vLLM's own grammar: unbounded flexible whitespace, as vLLM's xgrammar
#: backend compiles it (maskplug's default bound of whitespace runs is a different grammar, and on
#: a random-weight model that writes whitespace runs it gives different tokens).
SAME_GRAMMAR = {"MASKPLUG_VLLM_MAX_WHITESPACE": "none"}
MODES: dict[str, dict[str, str]] = {
    "vllm": {},
    "grammar": {"MASKPLUG_VLLM": "1", **SAME_GRAMMAR},
    "verify-all": {"MASKPLUG_VLLM": "1", "MASKPLUG_VLLM_SCHEDULER": "verify-all", **SAME_GRAMMAR},
}


# -- in the engine process ------------------------------------------------------------------------


#: Suffix of a timer's name for the calls made in idle steps (steps that scheduled nothing).
IDLE = " (idle)"


class _Timers:
    """CPU nanoseconds and calls per wrapped function; installed once, switched on and off.

    :meth:`unwrap` puts the wrapped attributes back and :meth:`rewrap` wraps
    whatever they hold then: the in-process switch of ``--switch`` changes
    maskplug's patches between runs, and the timers must wrap the patched
    methods, not hide them from maskplug's install and uninstall.
    """

    def __init__(self) -> None:
        self.on = False
        self.idle = False  # whether the step being timed scheduled nothing (set by the schedule timer)
        self.local = threading.local()  # .active: the timed function running on this thread, if any
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.wrapped: list[tuple[Any, str, str, Any, Any]] = []  # owner, attribute, name, original, wrapper

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        clock = time.thread_time_ns
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timers.on:
                return fn(*args, **kwargs)
            # Time spent in one timed function while another runs is also kept under
            # "<inner> in <outer>", so the host sum counts it once (maskplug may produce rows inside schedule).
            local = timers.local
            outer = getattr(local, "active", None)
            local.active = name
            out = None
            t0 = clock()
            try:
                out = fn(*args, **kwargs)
                return out
            finally:
                dt = clock() - t0
                local.active = outer
                if name == "schedule":
                    # Every timed call until the next schedule belongs to this step: an idle one
                    # when it scheduled nothing.
                    timers.idle = out is not None and not getattr(out, "total_num_scheduled_tokens", 1)
                tag = IDLE if timers.idle else ""
                key = name + tag
                timers.ns[key] = timers.ns.get(key, 0) + dt
                timers.calls[key] = timers.calls.get(key, 0) + 1
                if outer is not None:
                    key = f"{name} in {outer}{tag}"
                    timers.ns[key] = timers.ns.get(key, 0) + dt

        setattr(owner, attr, timed)
        self.wrapped.append((owner, attr, name, fn, timed))

    def unwrap(self) -> list[tuple[Any, str, str]]:
        """Put every wrapped attribute back (the last wrapped first); returns what was wrapped."""
        done = []
        while self.wrapped:
            owner, attr, name, fn, timed = self.wrapped.pop()
            if getattr(owner, attr) is timed:
                setattr(owner, attr, fn)
            done.append((owner, attr, name))
        return done[::-1]

    def rewrap(self, what: list[tuple[Any, str, str]]) -> None:
        for owner, attr, name in what:
            self.wrap(owner, attr, name)

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()


def _install_timers() -> _Timers:
    import vllm.v1.worker.gpu_model_runner as runner_mod
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    t = _Timers()
    t.wrap(Scheduler, "schedule", "schedule")
    t.wrap(Scheduler, "update_from_output", "update_from_output")
    # The drafts for the next step, checked against each grammar (vLLM's validate_tokens).
    t.wrap(Scheduler, "update_draft_token_ids", "drafts")
    # The rows as the engine core asks for them (the scheduler's wrapper included), and the
    # manager's producer inside that call.
    t.wrap(Scheduler, "get_grammar_bitmask", "grammar_output")
    t.wrap(StructuredOutputManager, "grammar_bitmask", "rows")
    t.wrap(runner_mod, "apply_grammar_bitmask", "apply")
    t.wrap(runner_mod.GPUModelRunner, "execute_model", "execute_model")
    # The emitted tokens reaching each request's grammar (inside update_from_output).
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    t.wrap(XgrammarGrammar, "accept_tokens", "accept")
    t.wrap(XgrammarGrammar, "validate_tokens", "validate")
    if os.environ.get("MASKPLUG_VLLM"):
        from maskplug_vllm.backend import MaskplugGrammar

        t.wrap(MaskplugGrammar, "accept_tokens", "accept")
        t.wrap(MaskplugGrammar, "validate_tokens", "validate")
    if os.environ.get("MASKPLUG_VLLM_SCHEDULER"):
        from maskplug_vllm import adaptive

        # A planned step's budget and outcome. A verify-all step's count (``finish_all``) is not timed
        # apart: a timer inside update_from_output costs a few microseconds itself, which only that
        # engine's figure would carry.
        t.wrap(adaptive._Controller, "plan", "plan")
        t.wrap(adaptive._Controller, "finish", "outcome")
    return t


class _Switch:
    """``--switch``: one engine process runs every mode, maskplug's patches changed between runs.

    The process starts as ``verify-all`` (maskplug's structured-output and
    adaptive patches installed by vLLM's plugin loader). A run in another
    mode first takes the timers off, uninstalls maskplug's patches
    (:func:`maskplug_vllm.uninstall`), installs what the mode needs and
    hands the structured-output manager that mode's grammar backend (vLLM's
    own xgrammar backend for ``vllm``, maskplug's for the others; each made
    by the first request that needs it, then kept), then puts the timers
    back on top. Between runs no request is in flight, so no grammar of one
    backend meets the other's rows. What differs between two modes is then
    only the code each step runs, in the same process, its memory and its
    caches: the process-to-process spread of the separate engines is gone.
    """

    def __init__(self, engine: Any, timers: _Timers) -> None:
        self.manager = engine.engine_core.engine_core.scheduler.structured_output_manager
        self.timers = timers
        self.mode = "verify-all"
        self.backends: dict[str, Any] = {}

    @staticmethod
    def _kind(mode: str) -> str:
        return "vllm" if mode == "vllm" else "maskplug"

    def to(self, mode: str) -> None:
        if mode == self.mode:
            return
        import maskplug_vllm

        wrapped = self.timers.unwrap()
        self.backends[self._kind(self.mode)] = self.manager.backend
        maskplug_vllm.uninstall()
        if mode != "vllm":
            maskplug_vllm.install()
            if mode == "verify-all":
                maskplug_vllm.install_adaptive("verify-all")
        self.manager.backend = self.backends.get(self._kind(mode))
        self.timers.rewrap(wrapped)
        self.mode = mode


def _answer(obj: Any) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(cfg: dict[str, Any]) -> None:
    """One engine; answers ``{"c", "n", "seed", "max_tokens", "profile"}`` commands with a run's figures.

    With ``cfg["switch"]`` (the modes it serves) a command's ``"mode"`` picks the mode of its run (:class:`_Switch`).
    """
    from vllm import LLM

    kwargs = tiny.engine_kwargs(cfg["model"], cfg["speculative"], max(cfg["concurrency"]))
    if cfg.get("log_stats"):
        # The OpenAI server's default: the scheduler builds its statistics (spec decoding's included) every step.
        kwargs["disable_log_stats"] = False
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    make = getattr(tiny, cfg.get("workload", "structured_workload"))
    timers = _install_timers()
    switch = _Switch(engine, timers) if cfg.get("switch") else None
    # Compile every grammar the runs will use (vLLM caches compiled grammars), then warm up at each
    # concurrency (shapes, caches), untimed; in every mode the process serves.
    for mode in cfg.get("switch") or [None]:
        if switch is not None:
            switch.to(mode)
        for seed in cfg["seeds"]:
            tiny.closed_loop(engine, make(cfg["requests"], seed), max(cfg["concurrency"]), 2, f"compile-{seed}")
        for c in cfg["concurrency"]:
            tiny.closed_loop(engine, make(c, 10_000 + c), c, 8, f"warm-{c}")
    import maskplug_vllm

    import maskplug

    _answer({"ready": True, "maskplug": maskplug.__file__, "maskplug_vllm": maskplug_vllm.__file__})
    for line in sys.stdin:
        cmd = json.loads(line)
        if switch is not None:
            switch.to(cmd["mode"])
        if cmd.get("warm"):
            # Untimed: the engine's first run at a concurrency after another one runs slower (shapes,
            # allocator, caches); one engine process serving every mode gives it to one mode only.
            tiny.closed_loop(engine, make(cmd["c"], 10_000 + cmd["c"]), cmd["c"], 8, f"warm-{cmd['round']}")
            _answer({})
            continue
        if cmd.get("prime"):
            # Untimed: the run's own requests once, in its own mode. The first run of a round's new
            # prompts runs its forward passes 10-25% slower than every later run of the same prompts
            # (new shapes in the CPU model's kernels), whichever mode it is, and right after a switch
            # of mode that mode's code and data are cold: in the rotating order the same mode always
            # follows the same one, so without this one mode pays more of it than another.
            engine.reset_prefix_cache()
            tiny.closed_loop(engine, make(cmd["n"], cmd["seed"]), cmd["c"], cmd["max_tokens"], f"p{cmd['round']}")
            _answer({})
            continue
        reqs = make(cmd["n"], cmd["seed"])
        # Every run starts without cached prompts: a round's first run would otherwise fill vLLM's
        # prefix cache for the others (one engine serving every mode shares it; separate engines
        # each hold what the warm-up left).
        engine.reset_prefix_cache()
        timers.reset()
        timers.on = bool(cmd.get("profile"))
        res = tiny.closed_loop(engine, reqs, cmd["c"], cmd["max_tokens"], f"r{cmd['round']}-{cmd['c']}")
        timers.on = False
        res["timers_ns"] = dict(timers.ns)
        res["timer_calls"] = dict(timers.calls)
        _answer(res)


# -- the driver -----------------------------------------------------------------------------------


def _mode_env(mode: str) -> dict[str, str]:
    """A mode's environment; ``<mode>@<tree>`` runs it on another source tree of maskplug (an A/B of two versions).

    The other tree's packages (``maskplug`` and ``maskplug_vllm``) come first
    on ``PYTHONPATH``, ahead of the environment's editable installs of this
    tree, and the other tree replaces this one in every ``PYTHONPATH`` entry.
    Each engine reports where it imported ``maskplug`` from.
    """
    name, _, tree = mode.partition("@")
    env = tiny.child_env(MODES[name])
    if tree:
        here = str(Path(__file__).resolve().parents[1])
        other = str(Path(tree).resolve())
        parts = [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q]
        front = [other, str(Path(other) / "adapters" / "vllm")]
        env["PYTHONPATH"] = os.pathsep.join(
            front + [other + q[len(here) :] if q.startswith(here) else q for q in parts]
        )
    return env


def _ratio_table(
    rows: list[dict[str, Any]], modes: list[str], conc: list[int], rate: str
) -> dict[int, dict[str, list[float]]]:
    out: dict[int, dict[str, list[float]]] = {c: {m: [] for m in modes} for c in conc}
    by = {(r["round"], r["c"], r["mode"]): r for r in rows}
    for (rnd, c, m), r in by.items():
        base = by.get((rnd, c, modes[0]))
        if base is not None:
            out[c][m].append(r[rate] / base[rate])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--requests", type=int, default=30, help="requests per run (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3, help="n-gram drafts per step (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="engines, the first is the reference; MODE@TREE runs MODE on another maskplug source tree",
    )
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--profile", type=int, default=2, help="rounds with per-function timers after the others")
    p.add_argument(
        "--restart",
        type=int,
        default=0,
        help="start fresh engine processes every this many rounds (0: never); the median then spans processes",
    )
    p.add_argument(
        "--switch",
        action="store_true",
        help="one engine process runs every mode, maskplug's patches switched between runs (no MODE@TREE)",
    )
    p.add_argument(
        "--prime",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each timed run follows an untimed run of the same requests in the same mode",
    )
    p.add_argument(
        "--log-stats",
        action="store_true",
        help="vLLM keeps its statistics every step, as its OpenAI server does (default: off, as the LLM class)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        serve(json.loads(args.serve))
        return 0
    conc = [int(x) for x in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    if args.switch and any("@" in m for m in modes):
        p.error("--switch: every mode runs on this tree in one process, got a MODE@TREE")
    rate = "tokens_per_cpu_s" if args.clock == "cpu" else "tokens_per_s"
    total_rounds = args.rounds + args.profile
    with tempfile.TemporaryDirectory(prefix="maskplug-overhead-") as tmp:
        model = str(tiny.build_model(Path(tmp) / "model"))
        cfg = {
            "model": model,
            "speculative": tiny.ngram(args.k),
            "concurrency": conc,
            "requests": args.requests,
            "seeds": list(range(total_rounds)),
        }
        if args.switch:
            cfg["switch"] = modes
        cfg["log_stats"] = args.log_stats
        print(
            f"model: Llama, hidden 128, 2 layers, vocab 640, dummy fp32 weights; n-gram K={args.k}; "
            f"vLLM's statistics {'on' if args.log_stats else 'off'}"
        )
        print(f"load average at the start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        t0 = time.perf_counter()

        def start() -> dict[str, tiny.EngineProcess]:
            if args.switch:
                # Started as verify-all: maskplug's patches loaded the way vLLM loads them, then switched.
                one = tiny.EngineProcess(__file__, "switch", cfg, _mode_env("verify-all"), Path(tmp) / "engine.log")
                return dict.fromkeys(modes, one)
            return {
                m: tiny.EngineProcess(__file__, m, cfg, _mode_env(m), Path(tmp) / f"engine-{i}.log")
                for i, m in enumerate(modes)
            }

        def close(engines: dict[str, tiny.EngineProcess]) -> None:
            for e in {id(e): e for e in engines.values()}.values():
                e.close()

        engines = start()
        print(f"engines ready in {time.perf_counter() - t0:.0f} s", flush=True)
        for m, e in engines.items():
            print(f"  {m}: maskplug from {e.ready.get('maskplug')}, maskplug_vllm from {e.ready.get('maskplug_vllm')}")
        rows: list[dict[str, Any]] = []
        mismatches: list[str] = []
        try:
            for rnd in range(total_rounds):
                if args.restart and rnd and rnd % args.restart == 0:
                    # Fresh engine processes: one process can run the same work ~30% slower than
                    # another for its whole life, a bias that more rounds on it never remove.
                    close(engines)
                    engines = start()
                profile = rnd >= args.rounds
                for c in conc:
                    order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
                    if args.switch and len(conc) > 1:
                        # Separate engines each meet the concurrency change in their own run; one
                        # engine serving every mode warms up at the new concurrency untimed first.
                        engines[order[0]].ask({"c": c, "round": rnd, "mode": order[0], "warm": True})
                    digests = {}
                    for m in order:
                        if args.prime:
                            engines[m].ask(
                                {
                                    "c": c,
                                    "n": args.requests,
                                    "seed": rnd,
                                    "max_tokens": args.max_tokens,
                                    "round": rnd,
                                    "mode": m,
                                    "prime": True,
                                }
                            )
                        res = engines[m].ask(
                            {
                                "c": c,
                                "n": args.requests,
                                "seed": rnd,
                                "max_tokens": args.max_tokens,
                                "round": rnd,
                                "profile": profile,
                                "mode": m,
                            }
                        )
                        res.update(mode=m, c=c, round=rnd, profile=profile)
                        rows.append(res)
                        digests[m] = res["digest"]
                    if len(set(digests.values())) != 1:
                        mismatches.append(f"round {rnd} c={c}: {digests}")
                    line = "  ".join(
                        f"{m} {r[rate]:7.1f}" for m in modes for r in rows[-len(modes) :] if r["mode"] == m
                    )
                    print(
                        f"round {rnd + 1}{' (profiled)' if profile else ''} c={c}: {line}  load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
        finally:
            close(engines)
    # With --rounds 0 the profiled rounds give the rates too (the timers themselves cost a little).
    timed = [r for r in rows if not r["profile"]] or rows
    ratios = _ratio_table(timed, modes, conc, rate)
    clock = "engine process CPU time" if args.clock == "cpu" else "wall-clock time"
    kind = "interleaved" if args.rounds else "profiled"
    print(f"\noutput tokens per second of {clock}: median over {len({r['round'] for r in timed})} {kind} rounds")
    print(f"{'engine':<12}" + "".join(f"{'c=' + str(c):>26}" for c in conc))
    summary: dict[str, Any] = {}
    for m in modes:
        cells = []
        for c in conc:
            vals = [r[rate] for r in timed if r["mode"] == m and r["c"] == c]
            rs = ratios[c][m]
            med, lo, hi = statistics.median(rs), min(rs), max(rs)
            summary[f"{m}@{c}"] = {
                "tokens_per_s_median": statistics.median(vals),
                "ratio_median": med,
                "ratio_min": lo,
                "ratio_max": hi,
            }
            cells.append(f"{statistics.median(vals):7.1f} ({med:.3f}x {lo:.2f}-{hi:.2f})")
        print(f"{m:<12}" + "".join(f"{x:>26}" for x in cells))
    print(f"(ratio to {modes[0]}: median of per-round ratios, min-max)")
    profiled = [r for r in rows if r["profile"]]
    if profiled:
        # Per step that ran the model (the same count in every engine: the tokens are identical); engine
        # steps that only wait differ in number between engines, and would dilute the busier one's figures.
        print("\nper model step, CPU µs of the calling thread (profiled rounds)")
        names = [
            "schedule",
            "grammar_output",
            "rows",
            "plan",
            "update_from_output",
            "accept",
            "drafts",
            "validate",
            "outcome",
            "execute_model",
            "apply",
            "host",
        ]
        print(f"{'engine':<12}{'c':>4}" + "".join(f"{n:>20}" for n in names))
        for m in modes:
            for c in conc:
                prs = [r for r in profiled if r["mode"] == m and r["c"] == c]
                steps = sum(r["model_steps"] for r in prs)
                per = {n: sum(r["timers_ns"].get(n, 0) for r in prs) / 1e3 / max(1, steps) for n in names}
                per["host"] = sum(_host_ns(r["timers_ns"]) for r in prs) / 1e3 / max(1, steps)
                cells = [
                    f"{per[n]:8.1f}" if n == "host" or any(n in r["timers_ns"] for r in prs) else "-" for n in names
                ]
                print(f"{m:<12}{c:>4}" + "".join(f"{x:>20}" for x in cells))
        print(
            "\nidle steps (the engine loop spinning on steps that schedule nothing while a request waits, e.g. for"
            "\nits grammar; not in the figures above): per model step, host CPU µs per idle step and per model step"
        )
        for m in modes:
            for c in conc:
                prs = [r for r in profiled if r["mode"] == m and r["c"] == c]
                steps = max(1, sum(r["model_steps"] for r in prs))
                idle = sum(r["timer_calls"].get("schedule" + IDLE, 0) for r in prs)
                ns = sum(_idle_ns(r["timers_ns"]) for r in prs)
                print(
                    f"{m:<12}{c:>4}  {idle / steps:6.2f} per model step, {ns / 1e3 / max(1, idle):6.1f} µs each,"
                    f" {ns / 1e3 / steps:6.1f} µs per model step"
                )
        # The sums above pool the profiled rounds; one engine process can run slower than another for its
        # whole life, so with several profiled rounds (and restarts) the per-round differences say more.
        rounds = sorted({r["round"] for r in profiled})
        if len(rounds) > 1:
            print(f"\nhost per model step, median of per-round differences to {modes[0]} (min-max), CPU µs")
            for m in modes[1:]:
                cells = []
                for c in conc:
                    diffs = [
                        _host(pr) - _host(base)
                        for rnd in rounds
                        for pr in profiled
                        if pr["mode"] == m and pr["c"] == c and pr["round"] == rnd
                        for base in profiled
                        if base["mode"] == modes[0] and base["c"] == c and base["round"] == rnd
                    ]
                    if diffs:
                        med = statistics.median(diffs)
                        cells.append(
                            f"c={c}: {med:+7.1f} ({min(diffs):+.1f} to {max(diffs):+.1f}, {len(diffs)} rounds)"
                        )
                print(f"{m:<12}  " + "   ".join(cells))
    loads = [x for r in rows for x in (r["load_before"], r["load_after"])]
    print(f"\nload average (1 min) around the runs: {min(loads):.1f} to {max(loads):.1f}")
    print("identical tokens in every round: " + ("yes" if not mismatches else "NO: " + "; ".join(mismatches)))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"rows": rows, "summary": summary, "mismatches": mismatches, "log_stats": args.log_stats}, indent=1
            )
        )
    return 1 if mismatches else 0


def _host_ns(t: dict[str, int]) -> int:
    """Host work besides the forward pass in one run's timers, CPU ns.

    The engine core's ``schedule``, ``update_from_output`` and
    ``update_draft_token_ids`` (``drafts``: the next step's drafts checked
    against each grammar), the grammar output it asks for
    (``get_grammar_bitmask``: the rows, where they were not produced inside
    ``schedule``, and any wrapper around them) and the apply. Figures
    recorded before ``get_grammar_bitmask`` was timed count the manager's
    rows outside ``schedule`` instead; before 2026-12-06 ``drafts`` was not
    timed (nor counted).
    """
    ns = t.get("schedule", 0) + t.get("update_from_output", 0) + t.get("apply", 0) + t.get("drafts", 0)
    if "grammar_output" in t:
        return ns + t["grammar_output"]
    return ns + t.get("rows", 0) - t.get("rows in schedule", 0)


def _idle_ns(t: dict[str, int]) -> int:
    """:func:`_host_ns` of the calls made in idle steps (steps that scheduled nothing), CPU ns."""
    return _host_ns({k[: -len(IDLE)]: v for k, v in t.items() if k.endswith(IDLE)})


def _host(r: dict[str, Any]) -> float:
    """One profiled round's host work per model step, CPU µs (as in the table)."""
    return float(_host_ns(r["timers_ns"])) / 1e3 / max(1, r["model_steps"])


if __name__ == "__main__":
    sys.exit(main())
