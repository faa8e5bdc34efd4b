"""maskplug.data: the bundled schemas, the override, the tokenizers; the library proper without the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import maskplug
from maskplug import GrammarError
from maskplug.data import SCHEMAS_ENV, load_schemas, schema_dir


def test_schemas_ship_inside_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCHEMAS_ENV, raising=False)
    folder = schema_dir()
    package = Path(maskplug.__file__).resolve().parent
    assert folder.is_dir() and folder.is_relative_to(package)
    schemas = load_schemas()
    names = [name for name, _ in schemas]
    assert names == sorted(f.stem for f in folder.glob("*.json")) and len(names) >= 10
    for name, schema in schemas:
        assert schema.get("type") == "object", name
        assert json.loads((folder / f"{name}.json").read_text(encoding="utf-8")) == schema


def test_the_environment_variable_overrides_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "only.json").write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    monkeypatch.setenv(SCHEMAS_ENV, str(tmp_path))
    assert schema_dir() == tmp_path
    assert load_schemas() == [("only", {"type": "object", "properties": {"a": {"type": "integer"}}})]
    # The simulator's workload reads the same folder.
    from maskplug.sim.workload import default_schema_dir

    assert default_schema_dir() == tmp_path


def test_an_explicit_folder_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCHEMAS_ENV, str(tmp_path / "missing"))
    (tmp_path / "x.json").write_text('{"type": "object"}')
    assert load_schemas(tmp_path) == [("x", {"type": "object"})]


def test_bad_schema_folders_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(GrammarError, match="schemas: expected JSON schema files in"):
        load_schemas(tmp_path)
    with pytest.raises(GrammarError, match="schemas: expected JSON schema files in"):
        load_schemas(tmp_path / "does-not-exist")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(GrammarError, match=r"schemas: expected valid JSON in .*broken\.json"):
        load_schemas(tmp_path)


def test_the_simulator_serves_the_bundled_schemas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCHEMAS_ENV, raising=False)
    from maskplug.data import load_tokenizer
    from maskplug.sim import SimConfig, Workload

    work = Workload(SimConfig(tokenizer="spm"), load_tokenizer("spm"), None)
    package = Path(maskplug.__file__).resolve().parent
    assert work.schemas == load_schemas(package / "data" / "schemas")


def test_unknown_tokenizer_is_a_clear_error() -> None:
    from maskplug.data import load_tokenizer

    with pytest.raises(GrammarError, match="tokenizer: expected one of"):
        load_tokenizer("no-such-tokenizer")


def test_the_simulator_keeps_no_re_export_modules() -> None:
    # The tokenizers and the progress display live in maskplug.data and maskplug.console;
    # the simulator's earlier re-export modules are gone, its workload still names load_schemas.
    import importlib

    from maskplug.sim import workload

    for gone in ("maskplug.sim.tokenizers", "maskplug.sim.progress", "maskplug.grammar.base"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
    assert workload.load_schemas is load_schemas


def test_the_library_proper_never_imports_the_simulator() -> None:
    code = (
        "import sys, maskplug, maskplug.cli, maskplug.selftest, maskplug.bench, maskplug.data, maskplug.console\n"
        "from maskplug.cli import main\n"
        "assert main(['selftest', '--cases', '2', '--json', '--no-progress']) == 0\n"
        "loaded = sorted(m for m in sys.modules if m == 'maskplug.sim' or m.startswith('maskplug.sim.'))\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
