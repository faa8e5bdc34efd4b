"""``maskplug conformance`` on bad input: exit status 2 and one line for usage errors, one schema's error for a bad line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from maskplug import cli
from maskplug import conformance as conf
from maskplug.grammar.spec import MAX_SCHEMA_DEPTH


def _data(tmp_path: Path, *rows: str) -> str:
    good = {
        "id": "ok",
        "schema": {"type": "integer"},
        "tests": [{"valid": True, "data": 3}, {"valid": False, "data": "x"}],
    }
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join([json.dumps(good), *rows]) + "\n", encoding="utf-8")
    return str(p)


def _nested(depth: int) -> dict[str, object]:
    d: dict[str, object] = {"type": "integer"}
    for _ in range(depth):
        d = {"type": "object", "properties": {"a": d}}
    return d


USAGE_ERRORS = [
    (["--limit-s", "nan"], r"--limit-s: expected seconds > 0"),
    (["--limit-s", "-1"], r"--limit-s: expected seconds > 0"),
    (["--limit-s", "0"], r"--limit-s: expected seconds > 0"),
    (["--limit-s", "1e12"], r"--limit-s: expected seconds > 0 and at most 100000"),
    (["--limit-s=-inf"], r"--limit-s: expected seconds > 0"),
    (["--limit-s", "five"], r"--limit-s: expected a number of seconds, got 'five'"),
    (["--provider", "nope"], r"--provider: expected one of \['auto', .*got 'nope'"),
    (["--provider", "xgrammar", "--provider", ""], r"--provider: expected one of .*got ''"),
    (["--limit", "0"], r"limit: expected"),
    (["--shard", "3/2"], r"shard: expected I/N"),
    (["--data", "/nonexistent/file.jsonl"], r"data: could not read"),
]


@pytest.mark.parametrize("entry", ["cli", "module"])
@pytest.mark.parametrize(("args", "message"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_one_line(
    entry: str, args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*args] if "--data" in args else [*args, "--data", _data(tmp_path)]
    code = cli.main(["conformance", *argv]) if entry == "cli" else conf.main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("maskplug conformance: error: ")
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.parametrize("good", ["0.5", "30", "inf", "1e5"])
def test_every_holdable_limit_parses(good: str) -> None:
    assert conf.limit_arg(good) == float(good)


def test_a_line_nested_too_deep_is_one_schema_error_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = json.dumps({"id": "deep", "schema": _nested(MAX_SCHEMA_DEPTH + 10), "tests": [{"valid": False, "data": 1}]})
    # Deeper than Python's JSON parser goes: the line itself cannot be read.
    deeper = '{"id": "deeper", "schema": ' + "[" * 5000 + "]" * 5000 + ', "tests": []}'
    data = _data(tmp_path, deep, deeper)
    code = conf.main(["--provider", "xgrammar", "--data", data, "--json", "--details"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err
    got = json.loads(out)
    by_path = {d["path"]: d for d in got["details"]}
    assert set(by_path) == {"maskplug", "engine"}
    for d in by_path.values():
        assert d["schemas"] == 3 and d["compiled"] == 1
        assert set(d["errors"]) == {"deep", "line-3"}
        assert f"nested at most {MAX_SCHEMA_DEPTH} levels" in d["errors"]["deep"]
        assert "nested too deep to read" in d["errors"]["line-3"]
        assert d["valid_accepted"] == 1 and d["invalid_accepted"] == 0  # the good schema still ran
    summary = {r["path"]: r for r in got["reports"]}
    for r in summary.values():
        assert r["compile_errors"] == 2
        for key in ("compile_p50_s", "compile_p99_s", "compile_max_s", "compile_cpu_max_s"):
            assert r[key] >= 0
        assert r["compile_max_s"] >= r["compile_p99_s"] >= r["compile_p50_s"]


def test_the_table_has_compile_max_and_cpu_columns(tmp_path: Path) -> None:
    cases = conf.load_cases(_data(tmp_path))
    reports = conf.run(["llguidance"], cases, engine=False)
    (r,) = reports
    assert len(r.compile_s) == len(r.compile_cpu_s) == 1
    table = conf.format_table(reports)
    assert "compile p50 / p99 / max (s)" in table and "compile CPU p50 / p99 / max (s)" in table
    row = table.splitlines()[2]
    s = r.summary()
    assert f"{s['compile_max_s']:.3f}" in row and f"{s['compile_cpu_max_s']:.3f}" in row


def test_merge_reads_details_written_before_cpu_figures(tmp_path: Path) -> None:
    cases = conf.load_cases(_data(tmp_path))
    (r,) = conf.run(["llguidance"], cases, engine=False)
    old = r.detail()
    del old["compile_cpu_s"]
    back = conf.PathReport.from_detail(old)
    assert back.compile_cpu_s == [] and back.compile_s == r.compile_s
