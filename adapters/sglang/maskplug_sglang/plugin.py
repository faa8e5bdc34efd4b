"""The ``sglang.srt.plugins`` entry point.

SGLang calls :func:`register` early in each of its processes (before it parses
the command line). Registering changes nothing by itself: it adds the name
``maskplug`` to SGLang's grammar-backend registry and to the choices of
``--grammar-backend``, so the backend is used only when a server is started
with ``--grammar-backend maskplug``. It uses SGLang's public registry only
(``register_grammar_backend`` and ``add_grammar_backend_choices``); nothing in
SGLang is patched.
"""

from __future__ import annotations

import logging
from typing import Any

from maskplug import PluginError

__all__ = ["BACKEND_NAME", "TESTED_SGLANG", "create_backend", "register"]

BACKEND_NAME = "maskplug"
"""The value of ``--grammar-backend`` that selects maskplug."""

TESTED_SGLANG = ("0.5.23",)
"""SGLang versions this adapter is tested against."""

logger = logging.getLogger(__name__)


def create_backend(server_args: Any, tokenizer: Any, vocab_size: int, eos_token_ids: Any = None) -> Any:
    """The factory SGLang's registry calls (``init_func(server_args, tokenizer, vocab_size, eos_token_ids)``).

    The backend module (and the grammar provider behind it) is imported only
    here, when a server actually selects maskplug.
    """
    from .backend import create_backend as make

    return make(server_args, tokenizer, vocab_size, eos_token_ids)


def register() -> None:
    """Register ``maskplug`` as an SGLang grammar backend (idempotent).

    Raises:
        PluginError: SGLang lacks the grammar-backend registry (a version this
            adapter does not know), with the version found; or
            ``MASKPLUG_SGLANG_DSPARK`` asks for the DSpark patches and SGLang
            is not a tested release.
    """
    try:
        import sglang
        from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES, add_grammar_backend_choices
        from sglang.srt.constrained.base_grammar_backend import register_grammar_backend
    except ImportError as exc:
        import importlib.metadata as md

        try:
            version = md.version("sglang")
        except md.PackageNotFoundError:
            version = "not installed"
        raise PluginError(
            f"sglang: expected a version with the grammar-backend registry (tested: {', '.join(TESTED_SGLANG)}), "
            f"got {version}: {exc}"
        ) from exc
    version = getattr(sglang, "__version__", "unknown")
    if version not in TESTED_SGLANG:
        logger.warning(
            "maskplug-sglang is tested with SGLang %s, found %s; registering through the public registry anyway",
            ", ".join(TESTED_SGLANG),
            version,
        )
    register_grammar_backend(BACKEND_NAME, create_backend)
    if BACKEND_NAME not in GRAMMAR_BACKEND_CHOICES:
        add_grammar_backend_choices([BACKEND_NAME])
    from .patches import enabled_by_env, install

    if enabled_by_env():
        install()
