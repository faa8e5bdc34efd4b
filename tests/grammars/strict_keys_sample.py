"""Schemas that compile with ``strict_keys=False`` but not with ``strict_keys=True``, over a JSONSchemaBench file.

Run as a script for the figure over a whole sample (llguidance by default;
``--provider outlines-core`` is much slower)::

    .venv/bin/python tests/grammars/strict_keys_sample.py ../shared/jsonschemabench/maskbench-sample.jsonl

The test ``test_strict_keys_compose.py`` runs :func:`broken_by_strict` over
the subset maskplug ships.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec, Vocab


def schemas(path: Path) -> Iterator[tuple[str, Any]]:
    """``(id, schema)`` of every line of a JSONSchemaBench-format file."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield str(row["id"]), row["schema"]


def checker(provider: str, vocab: Vocab) -> Any:
    """A function ``spec -> None`` that compiles (or checks) ``spec`` and raises GrammarError when it cannot."""
    if provider == "llguidance":
        from maskplug_llguidance import LLGuidanceProvider

        lp = LLGuidanceProvider(vocab, compile_limit_s=None)
        return lp.check
    if provider == "outlines-core":
        from maskplug_outlines import OutlinesProvider

        op = OutlinesProvider(vocab, compile_limit_s=None)

        def regex_only(spec: GrammarSpec) -> None:
            # Which schemas the regex builder takes; the Index build is the slow part and not at issue.
            op.check_options(spec)
            op.regex_for(spec)

        return regex_only
    from maskplug_xgrammar import XGrammarProvider

    xp = XGrammarProvider(vocab, compile_limit_s=None)
    return xp.compile


def broken_by_strict(path: Path, provider: str, vocab: Vocab) -> tuple[int, int, list[tuple[str, str]]]:
    """``(schemas read, compiled with strict_keys=False, [(id, error) compiled with False but not True])``."""
    check = checker(provider, vocab)
    read = ok_open = 0
    broken: list[tuple[str, str]] = []
    for sid, schema in schemas(path):
        read += 1
        try:
            check(GrammarSpec("json_schema", schema, strict_keys=False))
        except GrammarError:
            continue
        ok_open += 1
        try:
            check(GrammarSpec("json_schema", schema, strict_keys=True))
        except GrammarError as exc:
            broken.append((sid, str(exc)[:200]))
    return read, ok_open, broken


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--provider", default="llguidance", choices=["llguidance", "outlines-core", "xgrammar"])
    args = ap.parse_args(argv)
    from maskplug.grammar.vocabs import mistral_sentencepiece

    t0 = time.perf_counter()
    read, ok_open, broken = broken_by_strict(args.data, args.provider, mistral_sentencepiece())
    print(
        f"{args.provider}: {read} schemas, {ok_open} compile with strict_keys=False, {len(broken)} of them fail with True"
    )
    for sid, err in broken:
        print(f"  {sid}: {err}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
