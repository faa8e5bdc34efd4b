"""The ``maskplug`` command line.

``maskplug plugins``   what loaded, from which distribution, with which hooks
``maskplug backends``  kernel backends and, where one cannot run, why
``maskplug demo``      the end-to-end serving simulation (see :mod:`maskplug.sim`)
``maskplug selftest``  every backend and provider against the reference, in seconds
``maskplug bench``     host-path, draft-row and kernel timings against installed peers
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "main"]

_SEED_LIMIT = 2**32  # numpy's generators take seeds below this


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2), as the other commands report them."""

    def error(self, message: str) -> Any:  # argparse's own signature returns NoReturn
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(low: int, high: int | None = None) -> Any:
    """An argparse ``type``: a whole number in ``[low, high)``, refused by name otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value >= high):
            bound = f">= {low}" if high is None else f"in [{low}, {high})"
            raise argparse.ArgumentTypeError(f"expected a whole number {bound}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _whole(
    p: argparse.ArgumentParser, flag: str, low: int, default: int | None, text: str, high: int | None = None
) -> None:
    """Add option ``flag``: a whole number in ``[low, high)`` (:func:`_int_at_least`)."""
    p.add_argument(flag, type=_int_at_least(low, high), default=default, help=text)


def _switch(p: argparse.ArgumentParser, flag: str, text: str) -> None:
    """Add option ``flag``: on when given."""
    p.add_argument(flag, action="store_true", help=text)


def _limit_s(text: str) -> float:
    """An argparse ``type``: a compile limit in seconds (see :func:`maskplug.conformance.limit_arg`)."""
    from .conformance import limit_arg

    return limit_arg(text)


def _device(text: str) -> str:
    """An argparse ``type``: a torch device this machine has."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu or cuda:0, got {text!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or a cuda device, got {text!r}")
    return text


def _cmd_plugins(args: argparse.Namespace) -> int:
    from .plugins import get_registry

    reg = get_registry()
    rows: list[dict[str, Any]] = [
        {
            "name": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "hooks": p.hooks,
            "error": p.error,
        }
        for p in reg.plugins
    ]
    provides = {
        "kernels": sorted(reg.kernels),
        "grammar_providers": sorted(reg.grammar_providers),
        "schedulers": sorted(reg.schedulers),
    }
    from .kernels import cpu_numba

    # Which code masks wide rows on the CPU: same bits either way, about 3x apart in speed.
    cpu_kernel = cpu_numba.kernel_name()
    if args.json:
        print(json.dumps({"plugins": rows, "provides": provides, "cpu_kernel": cpu_kernel}, indent=2))
    else:
        from .console import Justify, render_table

        table = [
            [
                r["name"],
                r["distribution"],
                str(r["version"]),
                ", ".join(h.removeprefix("maskplug_") for h in r["hooks"]) or "-",
                f"FAILED: {r['error']}" if r["error"] else "loaded",
            ]
            for r in rows
        ]
        columns: list[tuple[str, Justify]] = [
            ("plugin", "left"),
            ("distribution", "left"),
            ("version", "left"),
            ("hooks", "left"),
            ("status", "left"),
        ]
        print(render_table(columns, table))
        print()
        for kind, names in provides.items():
            print(f"{kind}: {', '.join(names) or '(none)'}")
        hint = ""
        if cpu_kernel != "numba":
            hint = (
                f" ({cpu_numba.CPU_KERNEL_ENV}=numpy)"
                if cpu_numba.installed()
                else " (install maskplug[numba] for the one-pass kernel; same results)"
            )
        print(f"cpu_kernel: {cpu_kernel}{hint}")
    return 1 if any(r["error"] for r in rows) else 0


def _cmd_backends(args: argparse.Namespace) -> int:
    import torch

    from .dispatch import backend_status, resolve_backend
    from .errors import MaskplugError

    devices = [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out: dict[str, dict[str, object]] = {}
    for dev in devices:
        status = backend_status(dev)
        try:
            auto: str | None = resolve_backend("auto", torch.device(dev)).name
        except MaskplugError as exc:
            auto = None
            status["auto"] = str(exc)
        out[dev] = {"auto": auto, "backends": status}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from .console import render_table

    for i, (dev, info) in enumerate(out.items()):
        backends = info["backends"]
        assert isinstance(backends, dict)
        if i:
            print()
        print(f"device {dev}: auto -> {info['auto'] or 'none'}")
        table = [
            [name, "available" if why is None else f"unavailable: {why}"]
            for name, why in backends.items()
            if name != "auto"
        ]
        print(render_table([("backend", "left"), ("status", "left")], table))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .errors import MaskplugError
    from .sim.config import DEFAULT_SCHEDULERS, SimConfig
    from .sim.run import format_json, format_table, run_demo

    base = SimConfig()
    cfg = SimConfig(
        steps=args.steps if args.steps is not None else base.steps,
        concurrency=args.concurrency if args.concurrency is not None else base.concurrency,
        drafts=args.drafts if args.drafts is not None else base.drafts,
        tokenizer=args.tokenizer,
        provider=args.provider,
        backend=args.backend,
        seed=args.seed,
        squeeze_every=args.squeeze_every,
        max_batch_tokens=(args.max_batch_tokens or None)
        if args.max_batch_tokens is not None
        else base.max_batch_tokens,
        schema_dir=args.schemas,
        overlap=not args.no_overlap,
    )
    for name in ("steps", "concurrency"):
        if getattr(cfg, name) < 1:
            print(
                f"maskplug demo: error: --{name}: expected an integer >= 1, got {getattr(cfg, name)}", file=sys.stderr
            )
            return 2
    if cfg.drafts < 0:
        print(f"maskplug demo: error: --drafts: expected an integer >= 0, got {cfg.drafts}", file=sys.stderr)
        return 2
    scheds = [s for arg in (args.scheduler or []) for s in arg.split(",") if s] or list(DEFAULT_SCHEDULERS)
    for opt, low in (("tree_branch", 1), ("tree_width", 1), ("tree_depth", 0)):
        got = getattr(args, opt)
        if got is not None and got < low:
            flag = "--" + opt.replace("_", "-")
            print(f"maskplug demo: error: {flag}: expected an integer >= {low}, got {got}", file=sys.stderr)
            return 2
    show = not args.no_progress
    try:
        tree = None
        if args.tree or any(s.startswith("tree:") for s in scheds):
            from .sim.tree_drafter import TreeConfig
            from .sim.tree_engine import TREE_SCHEDULERS

            tree = TreeConfig(branch=args.tree_branch, depth=args.tree_depth, width=args.tree_width)
            if args.tree:
                scheds += [s for s in TREE_SCHEDULERS if s not in scheds]
        report = run_demo(cfg, scheds, progress=show, tree=tree)
        if args.plot:
            from .sim.plot import plot_demo, sweep

            goodput = sweep(cfg, scheds, steps=args.sweep_steps, progress=show)
            path = plot_demo(args.plot, report, goodput)
            print(f"plot written to {path}", file=sys.stderr)
    except MaskplugError as exc:
        print(f"maskplug demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(format_json(report, timing=not args.no_timing))
    else:
        print(format_table(report))
    return 1 if report.invalid or report.violations else 0


def _cmd_selftest(args: argparse.Namespace) -> int:
    from .selftest import run_selftest

    return run_selftest(seed=args.seed, cases=args.cases, as_json=args.json, progress=not args.no_progress)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(quick=args.quick, as_json=args.json, progress=not args.no_progress)


def _cmd_conformance(args: argparse.Namespace) -> int:
    from .conformance import main as conformance_main

    argv: list[str] = []
    for name in args.provider or ():
        argv += ["--provider", name]
    for flag, value in (
        ("--data", args.data),
        ("--limit", args.limit),
        ("--limit-s", args.limit_s),
        ("--offset", args.offset),
        ("--shard", args.shard),
    ):
        if value is not None:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    argv += ["--strict-keys", args.strict_keys, "--unsupported", args.unsupported, "--whitespace", args.whitespace]
    argv += ["--json"] * args.json + ["--no-engine"] * args.no_engine + ["--details"] * args.details
    if args.merge:
        argv += ["--merge", *args.merge]
    return conformance_main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``maskplug`` command."""
    from . import __version__

    parser = _Parser(
        prog="maskplug",
        description="Structured outputs with adaptive speculative verification, for any inference engine.",
    )
    parser.add_argument("--version", action="version", version=f"maskplug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list loaded plugins, their distributions and hooks")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("backends", help="list kernel backends and whether they can run here")
    p.add_argument("--device", type=_device, default=None, help="device to check (default: cpu, and cuda when present)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser(
        "demo",
        help="end-to-end structured-output serving simulation (the main job)",
        description="Simulate an engine serving JSON-schema, regex and unconstrained requests with speculative "
        "decoding and adaptive verification through maskplug's real code, once per budget scheduler, and "
        "report throughput, budget regimes, goodput and output validity. Exit status 1 when any output is "
        "invalid or any invariant check failed.",
    )
    _whole(p, "--steps", 1, None, "engine steps per scheduler (default 60)")
    _whole(p, "--concurrency", 1, None, "concurrent requests (default 16)")
    _whole(p, "--drafts", 0, None, "drafts per decoding request and step (default 4)")
    p.add_argument(
        "--provider",
        default="auto",
        help="grammar provider (default auto: each grammar compiled by the provider best suited to it); "
        "a grammar that does not compile fails that request alone",
    )
    p.add_argument("--backend", default="auto", help="kernel backend (default auto)")
    p.add_argument(
        "--scheduler",
        action="append",
        help="scheduler(s) to run, repeatable or comma-separated; grammar-aware:INNER wraps INNER "
        "(default: no-spec, verify-all, dspark, grammar-aware:dspark, goodput)",
    )
    _whole(p, "--seed", 0, 0, "seed of the requests, drafter and target (default 0)", high=_SEED_LIMIT)
    p.add_argument("--tokenizer", choices=("tekken", "spm"), default="tekken", help="vocabulary (default tekken)")
    p.add_argument(
        "--schemas",
        default=None,
        help="folder of JSON schemas (default: the schemas shipped with maskplug, or $MASKPLUG_SCHEMAS)",
    )
    _whole(p, "--max-batch-tokens", 0, None, "engine tokens per step, 0 = no limit (default 192)")
    _whole(p, "--squeeze-every", 0, 0, "every N-th step has room for bonus rows only")
    _switch(
        p,
        "--tree",
        "also run tree verification: rows tree:dspark and tree:grammar-aware:dspark (top-k draft trees, "
        "the budget over tree nodes, the same cost model and token limit); tree rows verify greedily, also the "
        "requests that chain rows verify by rejection sampling",
    )
    _whole(p, "--tree-branch", 1, 2, "tree drafter: candidates per node, top-k (default 2)")
    _whole(p, "--tree-depth", 1, None, "tree drafter: levels (default: --drafts)")
    _whole(p, "--tree-width", 1, 4, "tree drafter: nodes kept per level (default 4)")
    _switch(p, "--json", "print one JSON object (fields: docs/design.md, section 9)")
    _switch(
        p, "--no-timing", "with --json: report host_us_per_step as null, so the same seed gives byte-identical output"
    )
    p.add_argument("--plot", metavar="FILE.png", help="also sweep concurrency 1/8/64/256 and draw a PNG")
    _whole(p, "--sweep-steps", 1, 20, "steps per scheduler and level of the sweep")
    _switch(p, "--no-progress", "no progress display on stderr")
    _switch(
        p,
        "--no-overlap",
        "produce the draft masks before the simulated forward pass instead of during it (no waiting "
        "for the forward pass's simulated time)",
    )
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("selftest", help="check every kernel backend and grammar provider against the reference")
    p.add_argument("--seed", type=_int_at_least(0, _SEED_LIMIT), default=0, help="seed of the random cases")
    p.add_argument("--cases", type=_int_at_least(1), default=40, help="random cases per check")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.set_defaults(func=_cmd_selftest)

    p = sub.add_parser("bench", help="host-path, draft-row and kernel benchmarks against installed peers")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds, for smoke tests)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "conformance", help="grammar providers on real JSON schemas, through maskplug and each engine directly"
    )
    p.add_argument("--provider", action="append", help="provider (repeatable; default: all three and auto)")
    p.add_argument("--data", help="JSON-lines schemas with tests (default: the JSONSchemaBench sample)")
    p.add_argument("--limit", type=_int_at_least(1), help="only the first N schemas (after --offset and --shard)")
    p.add_argument("--limit-s", type=_limit_s, help="compile limit in CPU seconds (default: the providers')")
    p.add_argument("--offset", type=_int_at_least(0), help="skip the first N schemas of the file")
    p.add_argument("--shard", help="I/N: every N-th schema from the I-th (1-based); N runs cover the file")
    p.add_argument("--details", action="store_true", help="with --json: every schema's and instance's figures")
    p.add_argument("--merge", nargs="+", metavar="FILE", help="combine earlier --json --details outputs (shards)")
    p.add_argument("--strict-keys", choices=("true", "false"), default="true")
    p.add_argument("--unsupported", choices=("ignore", "refuse"), default="ignore")
    p.add_argument("--whitespace", choices=("flexible", "compact"), default="flexible")
    p.add_argument("--no-engine", action="store_true", help="skip driving the engines directly")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_conformance)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``maskplug`` and ``python -m maskplug``."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2), --help and --version (0): a status, like every command
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
