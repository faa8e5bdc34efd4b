"""The plugin registry: entry points, hooks, duplicates, failures and the environment switches.

Entry points are simulated by replacing ``importlib.metadata.entry_points`` as
:mod:`maskplug.plugins` sees it, so no distribution needs installing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import maskplug as mp
from maskplug import plugins


@dataclass
class FakeDist:
    name: str
    version: str = "9.9"


@dataclass
class FakeEntryPoint:
    """Just what the registry reads from an ``importlib.metadata.EntryPoint``."""

    name: str
    target: Callable[[], object]
    dist: FakeDist = field(default_factory=lambda: FakeDist("fake-dist"))

    def load(self) -> object:
        return self.target()


class RecordingKernel:
    """A kernel backend that only records what it was asked to do."""

    def __init__(self, name: str, priority: int = 100, reason: str | None = None) -> None:
        self.name = name
        self.priority = priority
        self.reason = reason
        self.calls: list[tuple[int, int]] = []

    def unavailable_reason(self, device: torch.device) -> str | None:
        return self.reason

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, *rest: Any) -> None:
        self.calls.append((int(logits.shape[0]), int(bitmask.shape[0])))


class Scheduler:
    def __init__(self, **config: Any) -> None:
        self.config = config


def make_plugin(kernels: list[Any] = (), schedulers: list[str] = (), seen: list[Any] | None = None) -> object:  # type: ignore[assignment]
    """A plugin object whose hooks register the given kernels and schedulers."""

    class Plugin:
        @mp.hookimpl
        def maskplug_register_kernels(self, register: Callable[[Any], None]) -> None:
            for k in kernels:
                register(k)

        @mp.hookimpl
        def maskplug_register_schedulers(self, register: Callable[[str, Any], None]) -> None:
            for s in schedulers:
                register(s, Scheduler)

        @mp.hookimpl
        def maskplug_step_end(self, stats: dict[str, Any]) -> None:
            if seen is not None:
                seen.append(stats)

    return Plugin()


@pytest.fixture
def entry_points(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeEntryPoint]]:
    """The entry points the registry will see; the registry is rebuilt before and after."""
    eps: list[FakeEntryPoint] = []

    real = plugins.md.entry_points

    def fake_entry_points(**kwargs: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__") != plugins.__name__:
            # Another package's lookup (numba's, when the CPU apply first imports it) sees the real ones.
            return real(**kwargs)
        assert kwargs == {"group": "maskplug"}
        return list(eps)

    for var in ("MASKPLUG_LOAD_PLUGINS", "MASKPLUG_DISABLE_PLUGINS", "MASKPLUG_KERNEL_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(plugins.md, "entry_points", fake_entry_points)
    mp.reset_registry()
    yield eps
    mp.reset_registry()


def _info(name: str) -> plugins.PluginInfo:
    return next(p for p in mp.get_registry().plugins if p.name == name)


def test_fake_plugin_registers_kernel_and_scheduler(entry_points: list[FakeEntryPoint]) -> None:
    kernel = RecordingKernel("fake-kernel")
    entry_points.append(FakeEntryPoint("fake", lambda: make_plugin([kernel], ["fake-sched"])))
    reg = mp.get_registry()
    assert reg.kernels["fake-kernel"] is kernel
    assert reg.schedulers["fake-sched"] is Scheduler
    assert "torch" in reg.kernels  # the built-in is registered through the same hooks
    info = _info("fake")
    assert (info.distribution, info.version, info.error) == ("fake-dist", "9.9", None)
    assert {"maskplug_register_kernels", "maskplug_register_schedulers", "maskplug_step_end"} <= set(info.hooks)
    builtin = _info("maskplug.kernels.torch_backend")
    assert builtin.distribution == "maskplug" and "maskplug_register_kernels" in builtin.hooks
    assert mp.backend_status("cpu")["fake-kernel"] is None


def test_step_end_reaches_plugins(entry_points: list[FakeEntryPoint]) -> None:
    seen: list[Any] = []
    entry_points.append(FakeEntryPoint("observer", lambda: make_plugin(seen=seen)))
    mp.get_registry().step_end({"budget": 3})
    assert seen == [{"budget": 3}]


def test_step_end_listened_follows_plugins_added_and_removed_after_the_first_question(
    entry_points: list[FakeEntryPoint],
) -> None:
    """The answer is read once from pluggy's own list and stays current as plugins come and go."""
    reg = mp.get_registry()
    assert reg.step_end_listened() is False
    assert reg.step_end_listened() is False  # asked again: the kept list
    hooks = reg.step_end_hooks()  # the same list, kept by an engine: truthy while anyone listens
    assert hooks is not None and not hooks
    seen: list[Any] = []
    observer = make_plugin(seen=seen)
    reg.add_plugin(observer, "late-observer")
    assert reg.step_end_listened() is True and len(hooks) == 1
    reg.step_end({"budget": 1})
    assert seen == [{"budget": 1}]
    reg.pm.unregister(observer)
    assert reg.step_end_listened() is False and not hooks
    # Registered with pluggy directly, not through add_plugin: it counts too.
    reg.pm.register(make_plugin(seen=seen), name="direct")
    assert reg.step_end_listened() is True and hooks and reg.step_end_hooks() is hooks


def test_duplicate_name_is_recorded_and_the_first_owner_kept(entry_points: list[FakeEntryPoint]) -> None:
    first = RecordingKernel("shared")
    entry_points.append(FakeEntryPoint("a-first", lambda: make_plugin([first])))
    # Registers a fresh scheduler, then a kernel name that is taken: all or nothing.
    entry_points.append(
        FakeEntryPoint("b-second", lambda: make_plugin([RecordingKernel("shared")], ["only-b"]), FakeDist("dist-b"))
    )
    with pytest.warns(RuntimeWarning, match="b-second"):
        reg = mp.get_registry()
    assert reg.kernels["shared"] is first
    assert "only-b" not in reg.schedulers
    err = _info("b-second").error
    assert err is not None and err.startswith("PluginError") and "'shared'" in err and "a-first" in err
    assert _info("a-first").error is None


def test_duplicate_of_a_builtin_is_refused(entry_points: list[FakeEntryPoint]) -> None:
    entry_points.append(FakeEntryPoint("impostor", lambda: make_plugin([RecordingKernel("torch")])))
    with pytest.warns(RuntimeWarning, match="impostor"):
        reg = mp.get_registry()
    assert type(reg.kernels["torch"]).__name__ == "TorchBackend"
    assert "PluginError" in (_info("impostor").error or "")


def test_claim_raises_plugin_error() -> None:
    reg = plugins.Registry()
    reg._claim("kernel", "k", "p1")
    with pytest.raises(mp.PluginError, match="already registered by p1"):
        reg._claim("kernel", "k", "p2")
    with pytest.raises(mp.PluginError, match="name"):
        reg._claim("kernel", "", "p3")


def test_invalid_kernel_object_is_recorded(entry_points: list[FakeEntryPoint]) -> None:
    class NoApply:
        name = "broken"
        priority = 1

        def unavailable_reason(self, device: torch.device) -> None:
            return None

    entry_points.append(FakeEntryPoint("broken-plugin", lambda: make_plugin([NoApply()])))
    with pytest.warns(RuntimeWarning):
        reg = mp.get_registry()
    assert "broken" not in reg.kernels
    assert "'apply'" in (_info("broken-plugin").error or "")


def test_import_failure_is_recorded_with_distribution_and_cause(entry_points: list[FakeEntryPoint]) -> None:
    def boom() -> object:
        raise ImportError("No module named 'cupy'")

    entry_points.append(FakeEntryPoint("cupy", boom, FakeDist("maskplug-cupy", "0.3")))
    entry_points.append(FakeEntryPoint("fine", lambda: make_plugin([RecordingKernel("fine-kernel")])))
    with pytest.warns(RuntimeWarning, match="maskplug-cupy"):
        reg = mp.get_registry()
    info = _info("cupy")
    assert (info.distribution, info.version) == ("maskplug-cupy", "0.3")
    assert info.error == "ImportError: No module named 'cupy'"
    assert "fine-kernel" in reg.kernels  # one broken plugin does not stop the rest


def _builtin_kernels() -> set[str]:
    """Kernels registered without any entry point."""
    reg = plugins.Registry()
    for modname in plugins.BUILTIN_PLUGINS:
        reg.add_plugin(__import__(modname, fromlist=["_"]), modname)
    assert "torch" in reg.kernels
    return set(reg.kernels)


def test_disable_plugins(entry_points: list[FakeEntryPoint], monkeypatch: pytest.MonkeyPatch) -> None:
    entry_points.append(FakeEntryPoint("p1", lambda: make_plugin([RecordingKernel("k1")])))
    entry_points.append(FakeEntryPoint("p2", lambda: make_plugin([RecordingKernel("k2")])))
    monkeypatch.setenv("MASKPLUG_DISABLE_PLUGINS", " p1 ,unrelated")
    mp.reset_registry()
    reg = mp.get_registry()
    assert set(reg.kernels) == _builtin_kernels() | {"k2"}
    assert [p.name for p in reg.plugins if p.name.startswith("p")] == ["p2"]


def test_load_plugins_allow_list(entry_points: list[FakeEntryPoint], monkeypatch: pytest.MonkeyPatch) -> None:
    entry_points.append(FakeEntryPoint("p1", lambda: make_plugin([RecordingKernel("k1")])))
    entry_points.append(FakeEntryPoint("p2", lambda: make_plugin([RecordingKernel("k2")])))
    monkeypatch.setenv("MASKPLUG_LOAD_PLUGINS", "p1")
    mp.reset_registry()
    assert set(mp.get_registry().kernels) == _builtin_kernels() | {"k1"}  # built-ins always load
    monkeypatch.setenv("MASKPLUG_LOAD_PLUGINS", "")
    mp.reset_registry()
    assert set(mp.get_registry().kernels) == _builtin_kernels()


def _apply(backend: str) -> None:
    layout = mp.ScheduledLayout([0], [1], [1])
    mapping = mp.GrammarRows([0]).mapping(layout)
    logits = torch.zeros(2, 32)
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)
    mp.apply_grammar_bitmask(logits, bitmask, mapping, np.array([0, 2]), backend=backend)


def test_auto_prefers_priority_and_honours_kernel_backend_env(
    entry_points: list[FakeEntryPoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = RecordingKernel("fast", priority=50)
    entry_points.append(FakeEntryPoint("fast", lambda: make_plugin([fast])))
    cpu = torch.device("cpu")
    assert mp.resolve_backend("auto", cpu) is fast
    _apply("auto")
    assert fast.calls == [(2, 2)]
    monkeypatch.setenv("MASKPLUG_KERNEL_BACKEND", "torch")
    assert mp.resolve_backend("auto", cpu).name == "torch"
    _apply("auto")
    assert fast.calls == [(2, 2)]  # the environment sent the call to torch
    monkeypatch.setenv("MASKPLUG_KERNEL_BACKEND", "missing")
    with pytest.raises(mp.BackendUnavailable, match="missing"):
        _apply("auto")


def test_unavailable_backends(entry_points: list[FakeEntryPoint]) -> None:
    gpu_only = RecordingKernel("gpu-only", priority=90, reason="needs a CUDA device")
    entry_points.append(FakeEntryPoint("gpu", lambda: make_plugin([gpu_only])))
    # "auto" skips it; naming it explicitly raises with its reason.
    assert mp.resolve_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(mp.BackendUnavailable, match="needs a CUDA device"):
        _apply("gpu-only")
    status = mp.backend_status("cpu")
    assert status["gpu-only"] == "needs a CUDA device" and status["torch"] is None
    assert gpu_only.calls == []


def test_each_registry_has_a_new_generation_and_providers_are_kept_per_generation(
    entry_points: list[FakeEntryPoint],
) -> None:
    from maskplug.grammar import Vocab, grammar_provider

    made: list[Any] = []

    class Provider:
        def __init__(self, vocab: Vocab) -> None:
            made.append(self)

    class Plugin:
        @mp.hookimpl
        def maskplug_register_grammar_providers(self, register: Callable[[str, Any], None]) -> None:
            register("counted", Provider)

    entry_points.append(FakeEntryPoint("counted", Plugin))
    vocab = Vocab([b"a", b"b", b"</s>"], eos_ids=[2])
    first = mp.get_registry()
    assert grammar_provider("counted", vocab) is grammar_provider("counted", vocab) is made[0]
    mp.reset_registry()
    second = mp.get_registry()
    assert second is not first and second.generation > first.generation
    assert grammar_provider("counted", vocab) is made[1]  # the old registry's instance is not served again
    assert plugins.Registry().generation > second.generation


class FakeDriver:
    """An engine driver that only keeps what it was made with."""

    shares_compile = False

    def __init__(self, vocab: Any, encoding: Any) -> None:
        self.vocab, self.encoding = vocab, encoding

    def compile(self, spec: Any, grammar: Any) -> Any:
        return grammar

    def feed(self, compiled: Any, ids: Any) -> bool:
        return True


def test_engine_drivers_register_through_their_hook(entry_points: list[FakeEntryPoint]) -> None:
    from maskplug.conformance import engine_path
    from maskplug.grammar import Vocab

    class Drivers:
        @mp.hookimpl
        def maskplug_register_engine_drivers(self, register: Callable[[str, Any], None]) -> None:
            register("fake-engine", FakeDriver)

    class Broken:
        @mp.hookimpl
        def maskplug_register_engine_drivers(self, register: Callable[[str, Any], None]) -> None:
            register("broken-engine", "not a factory")

    entry_points += [FakeEntryPoint("drivers", Drivers), FakeEntryPoint("zz-broken", Broken)]
    with pytest.warns(RuntimeWarning, match="zz-broken"):
        reg = mp.get_registry()
    assert reg.engine_drivers == {"fake-engine": FakeDriver}
    assert _info("drivers").hooks == ["maskplug_register_engine_drivers"]
    err = _info("zz-broken").error
    assert err is not None and "engine driver 'broken-engine': factory is not callable" in err
    vocab = Vocab([b"a", b"b", b"</s>"], eos_ids=[2])
    driver = engine_path("fake-engine", vocab, encoding="the encoding")
    assert isinstance(driver, FakeDriver) and (driver.vocab, driver.encoding) == (vocab, "the encoding")
    assert engine_path("auto", vocab) is None  # auto is no engine: it has the maskplug path only


def test_auto_is_a_builtin_grammar_provider(entry_points: list[FakeEntryPoint]) -> None:
    from maskplug.errors import GrammarError
    from maskplug.grammar import GrammarSpec, Vocab, grammar_provider
    from maskplug.grammar.auto import AutoProvider

    assert "maskplug.grammar.auto" in plugins.BUILTIN_PLUGINS
    reg = mp.get_registry()
    assert reg.grammar_providers == {"auto": AutoProvider}
    info = _info("maskplug.grammar.auto")
    assert (info.distribution, info.hooks, info.error) == ("maskplug", ["maskplug_register_grammar_providers"], None)
    assert mp.grammar_providers() == ["auto"]  # no provider distribution is loaded here
    # With nothing to choose from, auto supports no kind and a compile says what to install.
    auto = grammar_provider("auto", Vocab([b"a", b"b", b"</s>"], eos_ids=[2]))
    assert isinstance(auto, AutoProvider) and auto.candidates == [] and not auto.supports("regex")
    with pytest.raises(GrammarError, match=r"^spec.kind: no grammar provider besides auto .*maskplug-llguidance"):
        auto.compile(GrammarSpec("regex", "a"))


def test_a_plugin_cannot_shadow_auto(entry_points: list[FakeEntryPoint]) -> None:
    from maskplug.grammar.auto import AutoProvider

    class Shadow:
        @mp.hookimpl
        def maskplug_register_grammar_providers(self, register: Callable[[str, Any], None]) -> None:
            register("auto", Scheduler)

    entry_points.append(FakeEntryPoint("shadow", Shadow))
    with pytest.warns(RuntimeWarning, match="shadow"):
        reg = mp.get_registry()
    assert reg.grammar_providers["auto"] is AutoProvider
    err = _info("shadow").error
    assert err is not None and "'auto' is already registered by maskplug.grammar.auto" in err
