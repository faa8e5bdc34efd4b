"""Build the API reference (HTML) from the docstrings with pdoc: ``make docs``.

The reference covers the core package and the plugin distributions of this tree
that import without a GPU, every public module of each (a module whose name has
no leading underscore), so importing a module is part of the build: a module
that fails to import, or a docstring pdoc cannot process, fails the build.

pdoc reports a submodule that fails to import, an annotation it cannot resolve
or an include it cannot read as a warning and carries on; here every warning is
an error, except pdoc's own limits (``_known``: a NamedTuple's generated constructor).

Docstrings are written in the Google style with Sphinx cross-reference roles
(``:class:`~maskplug.CostModel```); pdoc reads the sections but not the roles'
``~`` (short-name) marker, so roles are rewritten to plain code spans, which
pdoc links by name.

Run: ``python docs/build_api.py [OUTPUT_DIR]`` (default ``build/docs``). Needs
no network and no GPU.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pdoc.doc
import pdoc.docstrings
import pdoc.render

# The packages documented: the core and the plugin distributions installed beside it in .venv.
PACKAGES = (
    "maskplug",
    "maskplug_xgrammar",
    "maskplug_llguidance",
    "maskplug_outlines",
    "maskplug_triton",
    "maskplug_cupy",
)

# pdoc resolves a typing.NamedTuple's generated constructor annotations in the collections
# namespace, where the postponed (string) annotations of a module with ``from __future__ import
# annotations`` cannot be found; the fields themselves are documented with their types.
_NAMEDTUPLE_INIT = re.compile(r"Error parsing type annotation .* for ([\w.]+)\.__init__\. Import of ")


def _known(text: str) -> bool:
    """Whether a pdoc warning is one of pdoc's limits rather than a fault of the docstrings."""
    m = _NAMEDTUPLE_INIT.match(text)
    if m is None:
        return False
    module, _, qualname = m.group(1).rpartition(".")
    cls = getattr(sys.modules.get(module), qualname, None)
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


# :class:`~a.b.C`, :func:`a.f`, :meth:, :attr:, :mod:, :data:, :exc:, :obj: -> `a.b.C`
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`~?([^`]+)`")

_convert = pdoc.docstrings.convert


def _convert_roles(docstring: str, docformat: str, source_file: Path | None) -> str:
    """pdoc's docstring conversion, after turning Sphinx roles into code spans."""
    return _convert(_ROLE.sub(r"`\1`", docstring), docformat, source_file)


def public_modules(package: str) -> Iterator[str]:
    """``package`` and every submodule of it whose dotted name has no part starting with ``_``."""
    yield package
    root = importlib.import_module(package)
    paths = getattr(root, "__path__", None)
    if paths is None:
        return

    def onerror(name: str) -> None:
        # walk_packages imports subpackages to find their children; a failure there is a build error.
        raise ImportError(f"cannot import {name} while listing {package}'s modules")

    for info in pkgutil.walk_packages(paths, prefix=package + ".", onerror=onerror):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield info.name


def write(modules: list[str], output: Path) -> None:
    """Render ``modules`` (each named on its own: pdoc's walk stops at a package's ``__all__``)."""
    all_modules = {name: pdoc.doc.Module.from_name(name) for name in modules}
    for name, module in all_modules.items():
        page = output / f"{name.replace('.', '/')}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(pdoc.render.html_module(module, all_modules), encoding="utf-8")
    (output / "index.html").write_text(pdoc.render.html_index(all_modules), encoding="utf-8")
    (output / "search.js").write_text(pdoc.render.search_index(all_modules), encoding="utf-8")


def build(output: Path) -> int:
    """Write the reference under ``output``; the number of unexpected warnings (0 on success)."""
    pdoc.docstrings.convert = _convert_roles  # type: ignore[assignment]
    pdoc.render.configure(docformat="google", show_source=False, footer_text="maskplug API reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modules = [name for package in PACKAGES for name in public_modules(package)]
        write(modules, output)
    bad = 0
    for w in caught:
        text = str(w.message)
        if _known(text):
            continue
        bad += 1
        print(f"docs: {w.category.__name__}: {text}", file=sys.stderr)
    print(f"docs: {len(modules)} modules -> {output}/index.html", file=sys.stderr)
    return bad


def main(argv: list[str]) -> int:
    """Entry point: build into ``argv[0]`` (default ``build/docs``); 1 on any unexpected warning."""
    output = Path(argv[0] if argv else "build/docs")
    start = time.perf_counter()
    bad = build(output)
    print(f"docs: built in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if bad:
        print(f"docs: {bad} warning(s) treated as errors", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
