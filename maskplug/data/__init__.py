"""Data the maskplug commands use, shipped inside the package or read from installed wheels.

* :func:`schema_dir` / :func:`load_schemas`: the JSON schemas that
  ``maskplug demo``, ``maskplug bench`` and the tests serve (package data under
  ``maskplug/data/schemas``; the ``MASKPLUG_SCHEMAS`` environment variable
  points elsewhere);
* :func:`load_tokenizer`: the two real tokenizers (a
  :class:`maskplug.grammar.Vocab` plus an exact encoder) read from the
  ``mistral-common`` wheel's data files.

Nothing here downloads anything or reads files outside the installed packages
unless ``MASKPLUG_SCHEMAS`` (or an explicit folder) says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import GrammarError
from .tokenizers import TOKENIZERS, Tokenizer, load_tokenizer

__all__ = ["SCHEMAS_ENV", "TOKENIZERS", "Tokenizer", "load_schemas", "load_tokenizer", "schema_dir"]

#: The environment variable that replaces the bundled schema folder.
SCHEMAS_ENV = "MASKPLUG_SCHEMAS"


def schema_dir() -> Path:
    """The folder of JSON schemas: ``$MASKPLUG_SCHEMAS`` when set, else the one shipped with maskplug."""
    env = os.environ.get(SCHEMAS_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "schemas"


def load_schemas(folder: Path | str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Every ``*.json`` schema in ``folder`` (default :func:`schema_dir`) as ``(name, schema)``, by file name.

    Raises:
        GrammarError: the folder holds no ``*.json`` file, or one is not valid JSON.
    """
    path = Path(folder) if folder is not None else schema_dir()
    files = sorted(path.glob("*.json")) if path.is_dir() else []
    if not files:
        raise GrammarError(
            f"schemas: expected JSON schema files in {str(path)!r} (set {SCHEMAS_ENV} or --schemas), got none"
        )
    out = []
    for f in files:
        try:
            out.append((f.stem, json.loads(f.read_text(encoding="utf-8"))))
        except (OSError, ValueError) as exc:
            raise GrammarError(f"schemas: expected valid JSON in {str(f)!r}, got {exc}") from exc
    return out
