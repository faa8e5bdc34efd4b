"""The engine SDK's patch bookkeeping (maskplug.engines.sdk): once per process, originals kept, all put back."""

from __future__ import annotations

import types

import pytest

from maskplug import PluginError
from maskplug.engines.sdk import PatchSet, wraps


def _engine() -> types.SimpleNamespace:
    def step(x: int) -> int:
        """The engine's step."""
        return x + 1

    return types.SimpleNamespace(step=step, other=lambda: "engine")


def test_replace_once_keep_the_original_and_put_everything_back() -> None:
    eng = _engine()
    own_step, own_other = eng.step, eng.other
    ps = PatchSet("toy", "toy 1.0")
    assert not ps.installed()

    def make(orig: types.FunctionType) -> types.FunctionType:
        @wraps(orig)
        def step(x: int) -> int:
            return 10 * orig(x)

        return step  # type: ignore[return-value]

    ps.wrap(eng, "step", make)
    assert eng.step(1) == 20 and eng.step.__doc__ == "The engine's step." and eng.step.__wrapped__ is own_step
    # A second wrap (a plugin loaded twice in one process) changes nothing: no wrapper around the wrapper.
    ps.wrap(eng, "step", make)
    assert eng.step(1) == 20
    ps.replace(eng, "step", lambda x: -1)
    assert eng.step(1) == 20
    assert ps.original(eng, "step") is own_step and ps.replaced(eng, "step")
    assert ps.original(eng, "other") is own_other and not ps.replaced(eng, "other")
    ps.replace(eng, "other", lambda: "maskplug")
    assert ps.installed() and eng.other() == "maskplug"
    ps.uninstall()
    assert eng.step is own_step and eng.other is own_other and not ps.installed()


def test_a_missing_attribute_names_it_and_what_was_tested() -> None:
    eng = _engine()
    ps = PatchSet("toy", lambda: "toy 1.0")
    with pytest.raises(PluginError, match=r"toy internals: expected .*'gone'.*tested with toy 1\.0"):
        ps.replace(eng, "gone", lambda: None)
    assert not ps.installed() and not hasattr(eng, "gone")
