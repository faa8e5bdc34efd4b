"""The ``maskplug`` command line.

``maskplug plugins``   what loaded, from which distribution, with which hooks
``maskplug backends``  kernel backends and, where one cannot run, why
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "main"]


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
    if args.json:
        print(json.dumps({"plugins": rows, "provides": provides}, indent=2))
    else:
        w = max([len(r["name"]) for r in rows] + [6])
        d = max([len(r["distribution"]) for r in rows] + [12])
        print(f"{'plugin':<{w}}  {'distribution':<{d}}  {'version':<9}  hooks")
        for r in rows:
            hooks = ", ".join(h.removeprefix("maskplug_") for h in r["hooks"]) or "-"
            line = f"{r['name']:<{w}}  {r['distribution']:<{d}}  {r['version']:<9}  {hooks}"
            if r["error"]:
                line += f"  FAILED: {r['error']}"
            print(line)
        print()
        for kind, names in provides.items():
            print(f"{kind}: {', '.join(names) or '(none)'}")
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
    for dev, info in out.items():
        print(f"device {dev}: auto -> {info['auto'] or 'none'}")
        backends = info["backends"]
        assert isinstance(backends, dict)
        for name, why in backends.items():
            if name == "auto":
                continue
            print(f"  {name:<10} {'available' if why is None else 'unavailable: ' + str(why)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``maskplug`` command."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="maskplug",
        description="Structured outputs with adaptive speculative verification, for any inference engine.",
    )
    parser.add_argument("--version", action="version", version=f"maskplug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list loaded plugins, their distributions and hooks")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("backends", help="list kernel backends and whether they can run here")
    p.add_argument("--device", default=None, help="device to check (default: cpu, and cuda when present)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_backends)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``maskplug`` and ``python -m maskplug``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
