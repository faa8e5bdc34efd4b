"""Conformance of grammar providers on real JSON schemas, through maskplug and through each engine directly.

Data: JSONSchemaBench-style JSON lines, one schema per line with its test
instances (``{"id", "split", "schema", "tests": [{"valid", "data"}]}``).
Every instance is serialised as ``json.dumps(data, ensure_ascii=False)``,
tokenised by the model's own tokenizer (tekken by default: the vocabulary's
encoder), fed token by token to a fresh matcher and then the stop token. A
valid instance should be accepted to the end; an invalid one refused
somewhere.

For each provider, two paths are measured in the same run:

* ``maskplug``: ``grammar_provider(name, vocab).compile(spec).matcher()``,
  a bitmask row filled before every token (timed: mask time per token), then
  ``accept``;
* ``engine``: the same engine driven through its own Python API the way its
  serving integrations drive it, with the real tokenizer: xgrammar's
  ``GrammarCompiler``/``GrammarMatcher`` over a ``TokenizerInfo`` built from
  the tiktoken encoding; llguidance's ``LLMatcher`` over
  ``LLTokenizer.from_tiktoken``, a token taken only when the engine's mask
  allows it (as masked sampling does); outlines-core's ``Guide``. Each
  provider distribution registers its engine's driver
  (:class:`EngineDriver`, through the ``maskplug_register_engine_drivers``
  hook); a provider with none has the maskplug path only.

Both paths get the same option mapping (:class:`~maskplug.grammar.GrammarSpec`
options to engine settings, documented in each provider distribution).

Documented normalisations (where maskplug's verdict may differ from the
engine's; each is tested in ``tests/grammars/test_conformance_real.py``):

* **outlines-core compiles once.** Building an outlines-core ``Index`` is the
  slow part (seconds to minutes over a 131k vocabulary), so the engine path
  walks the ``Index`` maskplug built (the same regex over the same
  vocabulary) with its own ``Guide``; its compile figures are maskplug's.
* **Compile limits.** maskplug stops a compile at its limit
  (``--limit-s``); the engine path then has no grammar for that schema and
  its instances are not counted on either path.

Run it: ``python -m maskplug.conformance [--provider NAME ...] [--data FILE]
[--limit N] [--json]`` (or ``maskplug conformance``). A long run can be split:
``--shard I/N`` takes every N-th schema from the I-th, ``--offset N`` skips the
first N; ``--json --details`` keeps every schema's figures, and ``--merge
FILE ...`` prints the table of such outputs combined.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch

from .errors import GrammarError, MaskplugError
from .grammar import GrammarSpec, Vocab, grammar_provider, grammar_providers
from .grammar.limits import MAX_COMPILE_LIMIT_S, check_limit
from .grammar.vocabs import mistral_tekken, mistral_tekken_encoding
from .plugins import get_registry

__all__ = [
    "DEFAULT_PROVIDERS",
    "Case",
    "EngineDriver",
    "PathReport",
    "check_providers",
    "default_data_path",
    "engine_path",
    "format_table",
    "limit_arg",
    "load_cases",
    "main",
    "merge",
    "parse_shard",
    "run",
]

DEFAULT_PROVIDERS = ("xgrammar", "llguidance", "outlines-core", "auto")
DATA_ENV = "MASKPLUG_JSONSCHEMABENCH"


@dataclass
class Case:
    """One schema and its instances (``tests``: (valid, data) pairs).

    ``error`` is set for a line that holds a schema maskplug cannot even read
    (nested too deep for the JSON parser): every provider reports it as that
    schema's compile error, and the run goes on.
    """

    id: str
    split: str
    schema: Any
    tests: list[tuple[bool, Any]]
    error: str | None = None


#: The JSONSchemaBench subset shipped as package data (see ``maskplug/data/jsonschemabench-subset.md``).
SUBSET_PATH = Path(__file__).resolve().parent / "data" / "jsonschemabench-subset.jsonl"


def default_data_path() -> Path:
    """``$MASKPLUG_JSONSCHEMABENCH``, else the subset shipped with maskplug (44 schemas, 112 instances).

    Nothing outside the installation is read unless asked for: the full sample
    is ``--data FILE`` (or the variable).
    """
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    return SUBSET_PATH


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` as ``(I, N)`` with ``1 <= I <= N``; :class:`GrammarError` naming ``shard`` otherwise."""
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        raise GrammarError(f"shard: expected I/N (for example 1/2), got {text!r}") from None
    if not 1 <= i <= n:
        raise GrammarError(f"shard: expected I/N with 1 <= I <= N, got {text!r}")
    return i, n


def load_cases(
    path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    *,
    offset: int = 0,
    shard: tuple[int, int] | None = None,
) -> list[Case]:
    """The schemas of a JSON-lines file.

    ``offset`` skips the first schemas; ``shard=(i, n)`` then keeps every
    ``n``-th schema from the ``i``-th (1-based), so the ``n`` shards of a file
    together hold each of its schemas exactly once; ``limit`` keeps the first
    ``limit`` of what is left.
    """
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise GrammarError(f"offset: expected an int >= 0, got {offset!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise GrammarError(f"limit: expected an int >= 1 or None, got {limit!r}")
    if shard is not None:
        ok = isinstance(shard, tuple) and len(shard) == 2 and all(type(x) is int for x in shard)
        if not ok or not 1 <= shard[0] <= shard[1]:
            raise GrammarError(f"shard: expected (i, n) with 1 <= i <= n, got {shard!r}")
    p = Path(path) if path is not None else default_data_path()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise GrammarError(f"data: could not read {os.fspath(p)!r}: {exc}") from exc
    out: list[Case] = []
    seen = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        k = seen
        seen += 1
        if k < offset or (shard is not None and (k - offset) % shard[1] != shard[0] - 1):
            continue
        try:
            row = json.loads(line)
            tests = [(bool(t["valid"]), t["data"]) for t in row["tests"]]
            out.append(Case(str(row["id"]), str(row.get("split", "")), row["schema"], tests))
        except RecursionError:
            # Nested deeper than Python's JSON parser goes: one schema that fails, not the end of the run.
            out.append(Case(f"line-{n}", "", None, [], error=f"data: line {n} is nested too deep to read"))
        except (ValueError, KeyError, TypeError) as exc:
            raise GrammarError(f"data: line {n} of {os.fspath(p)!r} is not a schema with tests: {exc}") from exc
        if limit is not None and len(out) >= limit:
            break
    return out


@dataclass
class PathReport:
    """Figures of one provider on one path (``maskplug`` or ``engine``)."""

    provider: str
    path: str
    schemas: int = 0
    compiled: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    compile_s: list[float] = field(default_factory=list)
    #: CPU seconds of each compile (the compile server's, or this process's for an in-process compile).
    compile_cpu_s: list[float] = field(default_factory=list)
    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    invalid_accepted: int = 0
    mask_s: float = 0.0
    mask_tokens: int = 0
    verdicts: dict[str, bool] = field(default_factory=dict)
    served_by: dict[str, str] = field(default_factory=dict)
    warned: int = 0

    def p(self, q: float, cpu: bool = False) -> float:
        """Percentile ``q`` of the compile times (wall-clock, or CPU with ``cpu``); NaN with none."""
        xs = self.compile_cpu_s if cpu else self.compile_s
        return float(np.percentile(xs, q)) if xs else float("nan")

    def summary(self) -> dict[str, Any]:
        """The table row (no per-instance detail)."""
        d = asdict(self)
        for k in ("verdicts", "compile_s", "compile_cpu_s", "errors"):
            d.pop(k)
        d["compile_errors"] = len(self.errors)
        d["compile_errors_past_limit"] = sum("within its limit" in e for e in self.errors.values())
        d["compile_p50_s"] = self.p(50)
        d["compile_p99_s"] = self.p(99)
        d["compile_max_s"] = self.p(100)
        d["compile_cpu_p50_s"] = self.p(50, cpu=True)
        d["compile_cpu_p99_s"] = self.p(99, cpu=True)
        d["compile_cpu_max_s"] = self.p(100, cpu=True)
        d["mask_us_per_token"] = 1e6 * self.mask_s / self.mask_tokens if self.mask_tokens else float("nan")
        d["served_by"] = _count(self.served_by.values())
        return d

    def detail(self) -> dict[str, Any]:
        """Every field (per-schema compile times, errors, per-instance verdicts): what :func:`merge` reads."""
        return asdict(self)

    @classmethod
    def from_detail(cls, d: dict[str, Any]) -> PathReport:
        """The report :meth:`detail` wrote (``compile_cpu_s`` may be absent: outputs of earlier versions)."""
        optional = {"compile_cpu_s"}
        try:
            return cls(**{f: d[f] for f in cls.__dataclass_fields__ if f in d or f not in optional})
        except (KeyError, TypeError) as exc:
            raise GrammarError(f"details: not a conformance report's detail: {exc}") from exc


def merge(parts: Iterable[Sequence[PathReport]]) -> list[PathReport]:
    """One report per (provider, path) from the reports of disjoint runs (shards of one sample).

    Counts add up, per-schema compile times and errors and per-instance
    verdicts are pooled (so percentiles are over every schema); a schema or
    instance reported by two parts is a :class:`GrammarError` naming ``parts``.
    """
    out: dict[tuple[str, str], PathReport] = {}
    for reports in parts:
        for r in reports:
            m = out.setdefault((r.provider, r.path), PathReport(r.provider, r.path))
            twice = (m.errors.keys() | m.served_by.keys()) & (r.errors.keys() | r.served_by.keys())
            twice |= m.verdicts.keys() & r.verdicts.keys()
            if twice:
                raise GrammarError(f"parts: {r.provider} ({r.path}) reports {sorted(twice)[:3]} more than once")
            for f in ("schemas", "compiled", "valid", "valid_accepted", "invalid", "invalid_accepted", "mask_tokens"):
                setattr(m, f, getattr(m, f) + getattr(r, f))
            m.warned += r.warned
            m.mask_s += r.mask_s
            m.compile_s += r.compile_s
            m.compile_cpu_s += r.compile_cpu_s
            m.errors.update(r.errors)
            m.verdicts.update(r.verdicts)
            m.served_by.update(r.served_by)
    return list(out.values())


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _text(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


# --------------------------------------------------------------------------
# maskplug's path
# --------------------------------------------------------------------------


def _feed_maskplug(grammar: Any, vocab: Vocab, ids: Sequence[int], bitmask: torch.Tensor) -> tuple[bool, float, int]:
    m = grammar.matcher()
    spent = 0.0
    n = 0
    for t in [*ids, vocab.eos_ids[0]]:
        t0 = time.perf_counter()
        m.fill(bitmask, 0)
        spent += time.perf_counter() - t0
        n += 1
        if not m.accept(int(t)):
            return False, spent, n
    return True, spent, n


# --------------------------------------------------------------------------
# The engines driven directly
# --------------------------------------------------------------------------


class EngineDriver(Protocol):
    """One engine driven through its own Python API, as its serving integrations drive it.

    Each provider distribution registers the driver of its engine through the
    ``maskplug_register_engine_drivers`` hook; the factory is called with the
    vocabulary and its ``tiktoken`` encoding (ranks numbered from
    ``encoding.maskplug_offset``, the control ids in front).
    """

    #: True when the engine path reuses the grammar maskplug compiled (its compile figures are then maskplug's).
    shares_compile: bool

    def compile(self, spec: GrammarSpec, grammar: Any) -> Any:
        """The engine's own grammar for ``spec`` (``grammar``: maskplug's, or None when that compile failed).

        Raises what the engine raises, or :class:`GrammarError` with the engine's reason.
        """
        ...

    def feed(self, compiled: Any, ids: Sequence[int]) -> bool:
        """Whether a fresh matcher of ``compiled`` takes every token of ``ids`` and then the stop token."""
        ...


def engine_path(name: str, vocab: Vocab, encoding: Any = None) -> EngineDriver | None:
    """The engine behind provider ``name`` driven directly (None for ``auto`` and providers with no driver).

    ``encoding``: the ``tiktoken`` encoding the driver builds the engine's
    tokenizer from (default: tekken's, :func:`~maskplug.grammar.vocabs.mistral_tekken_encoding`).
    """
    make = get_registry().engine_drivers.get(name)
    if make is None:
        return None
    return cast(EngineDriver, make(vocab, encoding if encoding is not None else mistral_tekken_encoding()))


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def run(
    providers: Sequence[str],
    cases: Sequence[Case],
    vocab: Vocab | None = None,
    *,
    options: dict[str, Any] | None = None,
    compile_limit_s: float | None = None,
    engine: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[PathReport]:
    """Feed every instance of ``cases`` through each provider (and its engine directly); return the reports."""
    v = vocab if vocab is not None else mistral_tekken()
    if not v.has_encoder:
        raise GrammarError("vocab: conformance needs the model's own tokenizer; got a vocabulary with no encoder")
    opts = dict(options or {})
    texts = {c.id: [v.encode(_text(d)) for _, d in c.tests] for c in cases}
    bitmask = v.new_bitmask(1)
    reports: list[PathReport] = []
    for name in providers:
        prov = grammar_provider(name, v)
        if name == "auto":
            for cand in getattr(prov, "candidates", []):
                cp = grammar_provider(cand, v)
                getattr(cp, "cache", {}).clear()  # auto's compile times are its own, not earlier cache hits
            getattr(prov, "cache", {}).clear()
        mine = PathReport(name, "maskplug")
        eng = engine_path(name, v) if engine else None
        theirs = PathReport(name, "engine") if eng is not None else None
        worker = getattr(prov, "worker", None)
        # Compile servers started before the clock runs: the figures are compiles, not start-ups.
        for w in [worker] + [getattr(grammar_provider(c, v), "worker", None) for c in getattr(prov, "candidates", [])]:
            if w is not None:
                try:
                    w.start()
                except GrammarError:
                    pass  # the first compile reports it as that schema's error
        for k, case in enumerate(cases):
            mine.schemas += 1
            if theirs is not None:
                theirs.schemas += 1
            try:
                if case.error is not None:
                    raise GrammarError(case.error)
                # The limit travels with each call: the shared provider instances keep their own.
                spec = GrammarSpec("json_schema", case.schema, compile_limit_s=compile_limit_s, **opts)
            except GrammarError as exc:  # a schema maskplug refuses to read: that schema's error on both paths
                mine.errors[case.id] = str(exc)
                if theirs is not None:
                    theirs.errors[case.id] = f"GrammarError: {exc}"
                continue
            seen = getattr(worker, "compiles", None)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                g = prov.compile(spec)
            except GrammarError as exc:
                g = None
                mine.errors[case.id] = str(exc)
            else:
                mine.compile_s.append(time.perf_counter() - t0)
                cpu = time.process_time() - c0
                if worker is not None and getattr(worker, "compiles", None) != seen:
                    cpu = float(getattr(worker, "last_cpu_s", None) or 0.0) + cpu  # the server's, and ours
                mine.compile_cpu_s.append(cpu)
                mine.compiled += 1
                mine.warned += bool(getattr(g, "warnings", None))
                if name == "auto":
                    mine.served_by[case.id] = str(getattr(g, "served_by", "?"))
            eg = None
            if eng is not None and theirs is not None:
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    eg = eng.compile(spec, g)
                except Exception as exc:  # the engine's own error, as it reports it
                    theirs.errors[case.id] = f"{type(exc).__name__}: {exc}"
                else:
                    if eng.shares_compile:  # maskplug's compile is the engine's (see the module notes)
                        theirs.compile_s.append(mine.compile_s[-1])
                        theirs.compile_cpu_s.append(mine.compile_cpu_s[-1])
                    else:
                        theirs.compile_s.append(time.perf_counter() - t0)
                        theirs.compile_cpu_s.append(time.process_time() - c0)
                    theirs.compiled += 1
            for i, (valid, _) in enumerate(case.tests):
                ids = texts[case.id][i]
                key = f"{case.id}#{i}"
                if g is not None:
                    ok, spent, n = _feed_maskplug(g, v, ids, bitmask)
                    mine.mask_s += spent
                    mine.mask_tokens += n
                    mine.verdicts[key] = ok
                    _tally(mine, valid, ok)
                if eg is not None and eng is not None and theirs is not None:
                    t0 = time.perf_counter()
                    ok = eng.feed(eg, ids)
                    theirs.mask_s += time.perf_counter() - t0
                    theirs.mask_tokens += len(ids) + 1
                    theirs.verdicts[key] = ok
                    _tally(theirs, valid, ok)
            if progress is not None and (k + 1) % 25 == 0:
                progress(f"{name}: {k + 1}/{len(cases)} schemas, {mine.compiled} compiled")
        reports.append(mine)
        if theirs is not None:
            reports.append(theirs)
    return reports


def _tally(r: PathReport, valid: bool, ok: bool) -> None:
    if valid:
        r.valid += 1
        r.valid_accepted += ok
    else:
        r.invalid += 1
        r.invalid_accepted += ok


def disagreements(reports: Sequence[PathReport]) -> dict[str, list[str]]:
    """Per provider, the instances where maskplug's verdict differs from the engine's (both compiled)."""
    by: dict[tuple[str, str], PathReport] = {(r.provider, r.path): r for r in reports}
    out: dict[str, list[str]] = {}
    for (name, path), r in by.items():
        if path != "maskplug" or (name, "engine") not in by:
            continue
        e = by[(name, "engine")]
        out[name] = sorted(k for k, ok in r.verdicts.items() if k in e.verdicts and e.verdicts[k] != ok)
    return out


def format_table(reports: Sequence[PathReport]) -> str:
    """A Markdown table of the reports."""
    head = (
        "| provider | path | compiled | compile errors | compile p50 / p99 / max (s) | "
        "compile CPU p50 / p99 / max (s) | valid accepted | invalid accepted | mask µs/token |"
    )
    rows = [head, "|" + "---|" * 9]
    for r in reports:
        s = r.summary()
        rows.append(
            f"| {r.provider} | {r.path} | {r.compiled} / {r.schemas} | {len(r.errors)} | "
            f"{s['compile_p50_s']:.3f} / {s['compile_p99_s']:.3f} / {s['compile_max_s']:.3f} | "
            f"{s['compile_cpu_p50_s']:.3f} / {s['compile_cpu_p99_s']:.3f} / {s['compile_cpu_max_s']:.3f} | "
            f"{r.valid_accepted} / {r.valid} | {r.invalid_accepted} / {r.invalid} | {s['mask_us_per_token']:.0f} |"
        )
    return "\n".join(rows)


def limit_arg(text: str) -> float:
    """An argparse ``type`` for ``--limit-s``: seconds > 0 up to the largest limit, or ``inf`` (no limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    try:
        check_limit(value, "--limit-s")
    except GrammarError:
        raise argparse.ArgumentTypeError(
            f"expected seconds > 0 and at most {MAX_COMPILE_LIMIT_S:g} (or inf: no limit), got {text!r}"
        ) from None
    return value


def check_providers(names: Sequence[str] | None) -> None:
    """:class:`GrammarError` naming ``--provider`` for a name that is not registered (``auto`` is built in)."""
    known = grammar_providers()
    bad = [n for n in names or () if n not in known]
    if bad:
        raise GrammarError(f"--provider: expected one of {known}, got {bad[0]!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """``maskplug conformance``: print the table (or JSON) for the chosen providers.

    Usage errors (a bad option value, an unknown provider, unreadable data)
    exit with status 2 and one line on stderr; a failure of the run itself
    with status 1 and one line.
    """
    from .cli import _Parser

    ap = _Parser(prog="maskplug conformance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", action="append", help="provider (repeatable; default: all three and auto)")
    ap.add_argument("--data", help="JSON-lines schemas with tests (default: the shared JSONSchemaBench sample)")
    ap.add_argument("--limit", type=int, help="only the first N schemas (after --offset and --shard)")
    ap.add_argument("--offset", type=int, default=0, help="skip the first N schemas of the file")
    ap.add_argument("--shard", help="I/N: every N-th schema from the I-th (1-based); N runs cover the file")
    ap.add_argument("--details", action="store_true", help="with --json: every schema's and instance's figures")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE",
        help="print the table of earlier --json --details outputs (shards) combined",
    )
    ap.add_argument(
        "--limit-s", type=limit_arg, default=None, help="compile limit in CPU seconds (default: the providers')"
    )
    ap.add_argument("--no-engine", action="store_true", help="skip driving the engines directly")
    ap.add_argument("--strict-keys", choices=("true", "false"), default="true")
    ap.add_argument("--unsupported", choices=("ignore", "refuse"), default="ignore")
    ap.add_argument("--whitespace", choices=("flexible", "compact"), default="flexible")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    try:
        a = ap.parse_args(argv)
    except SystemExit as exc:  # usage errors (2, one line) and --help (0): a status, not an exit
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if a.merge:
            return _print(merge(_read_details(f) for f in a.merge), a.json, a.details)
        check_providers(a.provider)
        shard = parse_shard(a.shard) if a.shard is not None else None
        cases = load_cases(a.data, a.limit, offset=a.offset, shard=shard)
    except GrammarError as exc:
        print(f"maskplug conformance: error: {exc}", file=sys.stderr)
        return 2
    opts = {"strict_keys": a.strict_keys == "true", "unsupported": a.unsupported, "whitespace": a.whitespace}

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        reports = run(
            a.provider or DEFAULT_PROVIDERS,
            cases,
            options=opts,
            compile_limit_s=a.limit_s,
            engine=not a.no_engine,
            progress=say,
        )
    except MaskplugError as exc:  # the run could not go on (no vocabulary, a provider that cannot start)
        print(f"maskplug conformance: error: {exc}", file=sys.stderr)
        return 1
    return _print(reports, a.json, a.details)


def _read_details(path: str) -> list[PathReport]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        details = data["details"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GrammarError(f"merge: {path!r} is not the output of --json --details: {exc}") from exc
    if not isinstance(details, list) or not all(isinstance(d, dict) for d in details):
        raise GrammarError(f"merge: {path!r} is not the output of --json --details")
    return [PathReport.from_detail(d) for d in details]


def _print(reports: Sequence[PathReport], as_json: bool, details: bool) -> int:
    diff = disagreements(reports)
    if as_json:
        out: dict[str, Any] = {"reports": [r.summary() for r in reports], "disagreements": diff}
        if details:
            out["details"] = [r.detail() for r in reports]
        print(json.dumps(out, indent=2))
    else:
        print(format_table(reports))
        for name, keys in diff.items():
            print(f"{name}: maskplug and the engine disagree on {len(keys)} instances {keys[:10]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
