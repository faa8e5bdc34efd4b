"""The plugin boundary, read from the source with ``ast``.

Plugin distributions (``grammars/*/``, ``backends/*/``) and engine adapters
(``adapters/*/maskplug_*/``) import from maskplug only its public SDK: the
top-level package, ``maskplug.grammar.sdk``, ``maskplug.kernels.sdk``,
``maskplug.engines.sdk`` and, in their tests, ``maskplug.testing``. The core
(``maskplug/``) imports no grammar engine at module level and no plugin module
anywhere, so its tests run with none of them installed.

``KNOWN_CROSSINGS`` lists the imports that still cross the boundary, file by
file. It is data that only shrinks: a file that stops crossing must be taken
off it (the test says so), and a new crossing fails the test.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SDK_MODULES = frozenset({"maskplug", "maskplug.grammar.sdk", "maskplug.kernels.sdk", "maskplug.engines.sdk"})
TEST_ONLY_MODULES = frozenset({"maskplug.testing"})
GRAMMAR_ENGINES = frozenset({"xgrammar", "llguidance", "outlines_core"})

#: Imports of maskplug internals that plugins and adapters still make, to be moved
#: behind the SDK; each entry is (file relative to the repository, module imported).
KNOWN_CROSSINGS: frozenset[tuple[str, str]] = frozenset()

#: Core modules that still import a plugin module (inside a function); each entry is
#: (file, module). None does: the core reaches plugins only through the registry.
KNOWN_CORE_CROSSINGS: frozenset[tuple[str, str]] = frozenset()


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _sources(patterns: tuple[str, ...]) -> list[Path]:
    found = {p for pattern in patterns for p in ROOT.glob(pattern)}
    # Virtual environments live beside the adapters; only the project's own files count.
    return sorted(p for p in found if not any(part.startswith(".venv") for part in p.relative_to(ROOT).parts))


def _imports(path: Path) -> Iterator[tuple[str, bool]]:
    """Every absolute module ``path`` imports, with whether the import runs at module level."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def visit(node: ast.AST, top: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, top
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.module, top
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, inner)

    yield from visit(tree, True)


def _is_maskplug(module: str) -> bool:
    return module == "maskplug" or module.startswith("maskplug.")


def _plugin_files() -> list[Path]:
    return _sources(("grammars/*/**/*.py", "backends/*/**/*.py", "adapters/*/maskplug_*/**/*.py"))


def test_the_scan_sees_the_plugins_and_the_core() -> None:
    plugins = {_rel(p) for p in _plugin_files()}
    assert "grammars/xgrammar/maskplug_xgrammar/provider.py" in plugins
    assert any(p.startswith("backends/") for p in plugins)
    assert any(p.startswith("adapters/vllm/maskplug_vllm/") for p in plugins)
    assert not any(".venv" in p for p in plugins)
    assert (ROOT / "maskplug" / "dispatch.py") in _sources(("maskplug/**/*.py",))


def test_plugins_and_adapters_import_only_the_sdk() -> None:
    crossings: set[tuple[str, str]] = set()
    for path in _plugin_files():
        rel = _rel(path)
        in_tests = "tests" in path.relative_to(ROOT).parts
        for module, _top in _imports(path):
            if not _is_maskplug(module) or module in SDK_MODULES:
                continue
            if in_tests and module in TEST_ONLY_MODULES:
                continue
            crossings.add((rel, module))
    new = sorted(crossings - KNOWN_CROSSINGS)
    assert not new, f"imports of maskplug internals outside the SDK: {new}"
    gone = sorted(KNOWN_CROSSINGS - crossings)
    assert not gone, f"these no longer cross the boundary; take them off KNOWN_CROSSINGS: {gone}"


def test_the_core_imports_no_engine_at_module_level_and_no_plugin() -> None:
    engines_at_top: list[tuple[str, str]] = []
    plugins: set[tuple[str, str]] = set()
    for path in _sources(("maskplug/**/*.py",)):
        rel = _rel(path)
        for module, top in _imports(path):
            head = module.split(".")[0]
            if head in GRAMMAR_ENGINES and top:
                engines_at_top.append((rel, module))
            if head.startswith("maskplug_"):
                plugins.add((rel, module))
    assert not engines_at_top, f"grammar engines imported at module level by the core: {engines_at_top}"
    new = sorted(plugins - KNOWN_CORE_CROSSINGS)
    assert not new, f"plugin modules imported by the core: {new}"
    gone = sorted(KNOWN_CORE_CROSSINGS - plugins)
    assert not gone, f"these no longer import a plugin; take them off KNOWN_CORE_CROSSINGS: {gone}"


def test_the_visitor_tells_module_level_from_function_level() -> None:
    # The checks above rely on it; a file of both kinds, parsed the same way.
    import tempfile

    source = "import xgrammar\ntry:\n    import llguidance\nexcept ImportError:\n    pass\ndef f():\n    import outlines_core\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.py"
        path.write_text(source, encoding="utf-8")
        assert sorted(_imports(path)) == [("llguidance", True), ("outlines_core", False), ("xgrammar", True)]
