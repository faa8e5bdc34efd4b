"""Pretty-printed valid instances under the default whitespace bound, over a JSONSchemaBench file.

For every schema a provider compiles with the default options (strict keys,
``max_whitespace=DEFAULT_MAX_WHITESPACE``) and every valid instance whose
compact form (``json.dumps``) the grammar accepts, the instance written with
``json.dumps(..., indent=2)`` and ``indent=4`` must be accepted too, unless
its deepest indentation (the newline and the spaces after it, one run) is
past the bound. Run as a script for the figure over a whole sample::

    .venv/bin/python tests/grammars/pretty_sample.py ../shared/jsonschemabench/maskbench-sample.jsonl --provider xgrammar

The test ``test_max_whitespace.py`` checks the same over the subset maskplug ships.
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
from maskplug.grammar.spec import DEFAULT_MAX_WHITESPACE

PROVIDERS = ("llguidance", "outlines-core", "xgrammar")


def rows(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def make_provider(name: str, vocab: Vocab, limit_s: float) -> Any:
    if name == "llguidance":
        from maskplug_llguidance import LLGuidanceProvider

        return LLGuidanceProvider(vocab, compile_limit_s=limit_s)
    if name == "outlines-core":
        from maskplug_outlines import OutlinesProvider

        return OutlinesProvider(vocab, compile_limit_s=limit_s)
    from maskplug_xgrammar import XGrammarProvider

    return XGrammarProvider(vocab, compile_limit_s=limit_s)


def longest_run(text: str) -> int:
    """The longest whitespace run between items of ``json.dumps(indent=...)`` output (newline + indentation)."""
    lines = text.split("\n")
    return max((1 + len(r) - len(r.lstrip(" ")) for r in lines[1:]), default=0)


def run(path: Path, name: str, vocab: Vocab, limit_s: float) -> dict[str, Any]:
    prov = make_provider(name, vocab, limit_s)
    stop = vocab.eos_ids[0]

    def accepts(grammar: Any, text: str) -> bool:
        m = grammar.matcher()
        return all(m.accept(t) for t in vocab.encode(text)) and m.accept(stop)

    out: dict[str, Any] = {"provider": name, "schemas": 0, "compiled": 0, "instances": 0, "pretty": 0}
    out.update({"pretty_accepted": 0, "past_bound": 0, "refused": []})
    for row in rows(path):
        out["schemas"] += 1
        try:
            grammar = prov.compile(GrammarSpec("json_schema", row["schema"]))
        except GrammarError:
            continue
        out["compiled"] += 1
        for case in row.get("tests", []):
            if not case["valid"]:
                continue
            data = case["data"]
            if not accepts(grammar, json.dumps(data, ensure_ascii=False)):
                continue  # an engine gap unrelated to whitespace (counted by maskplug conformance)
            out["instances"] += 1
            for indent in (2, 4):
                pretty = json.dumps(data, indent=indent, ensure_ascii=False)
                if longest_run(pretty) > DEFAULT_MAX_WHITESPACE:
                    out["past_bound"] += 1
                    continue
                out["pretty"] += 1
                if accepts(grammar, pretty):
                    out["pretty_accepted"] += 1
                else:
                    out["refused"].append((str(row["id"]), indent))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--provider", action="append", choices=PROVIDERS, help="repeatable (default: all three)")
    ap.add_argument("--limit-s", type=float, default=600.0, help="compile limit in CPU seconds (default: %(default)s)")
    args = ap.parse_args(argv)
    from maskplug.grammar.vocabs import mistral_sentencepiece

    for name in args.provider or PROVIDERS:
        t0 = time.perf_counter()
        r = run(args.data, name, mistral_sentencepiece(), args.limit_s)
        print(
            f"{name}: {r['compiled']}/{r['schemas']} schemas compiled; {r['instances']} valid instances accepted"
            f" compact; pretty (indent 2 and 4) accepted {r['pretty_accepted']}/{r['pretty']}"
            f" ({r['past_bound']} past the bound of {DEFAULT_MAX_WHITESPACE}, not tried)"
            f" [{time.perf_counter() - t0:.0f} s]"
        )
        for sid, indent in r["refused"]:
            print(f"  refused: {sid} indent={indent}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
