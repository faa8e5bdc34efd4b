"""The plugin manager and the registries it fills.

Plugins are found only through the ``maskplug`` entry-point group (plus the
built-ins, registered through the very same hooks). Environment switches:

``MASKPLUG_LOAD_PLUGINS``
    comma-separated allow-list of entry-point names; when set, nothing else
    loads (the built-ins always do).
``MASKPLUG_DISABLE_PLUGINS``
    comma-separated entry-point names that must not load.
``MASKPLUG_KERNEL_BACKEND``
    the backend ``backend="auto"`` resolves to (see :mod:`maskplug.dispatch`).

A name in any of them that matches nothing installed is reported when the
registry loads: a :class:`~maskplug.errors.ConfigWarning` naming the variable,
the unknown value and what is installed (also kept in
:attr:`Registry.config_problems`). Loading goes on, as it would without the
unknown name; an unknown ``MASKPLUG_KERNEL_BACKEND`` also makes every
``backend="auto"`` call raise :class:`~maskplug.BackendUnavailable` naming the
variable, since falling back to another backend would ignore the setting.
"""

from __future__ import annotations

import importlib.metadata as md
import itertools
import os
import threading
import warnings
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import ConfigWarning, PluginError

__all__ = ["PluginInfo", "Registry", "get_registry", "reset_registry"]

ENTRY_POINT_GROUP = "maskplug"
LOAD_PLUGINS_ENV = "MASKPLUG_LOAD_PLUGINS"
DISABLE_PLUGINS_ENV = "MASKPLUG_DISABLE_PLUGINS"
KERNEL_BACKEND_ENV = "MASKPLUG_KERNEL_BACKEND"
BUILTIN_PLUGINS = ("maskplug.kernels.torch_backend", "maskplug.schedulers.registry", "maskplug.grammar.auto")

# Numbers the registries of this process, in the order they are made.
_generations = itertools.count(1)


@dataclass
class PluginInfo:
    """What ``maskplug plugins`` shows about one plugin."""

    name: str
    distribution: str
    version: str
    hooks: list[str] = field(default_factory=list)
    error: str | None = None


def _split_env(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


class Registry:
    """Kernel backends, grammar providers, schedulers and engine drivers registered by plugins."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("maskplug")
        self.pm.add_hookspecs(hookspecs)
        self.kernels: dict[str, Any] = {}
        self.grammar_providers: dict[str, Callable[..., Any]] = {}
        self.schedulers: dict[str, Callable[..., Any]] = {}
        #: Per grammar provider name: the factory of its engine driven directly (see :mod:`maskplug.conformance`).
        self.engine_drivers: dict[str, Callable[..., Any]] = {}
        self.plugins: list[PluginInfo] = []
        #: Environment settings naming something that does not exist (one line each, as warned at load).
        self.config_problems: list[str] = []
        self._owner: dict[tuple[str, str], str] = {}
        #: This registry's number in the process (a fresh registry, after :func:`reset_registry`, has a
        #: larger one): what was built from an earlier registry's factories is keyed on its number.
        self.generation = next(_generations)
        #: pluggy's own list of ``maskplug_step_end`` implementations, once read (see :meth:`step_end_listened`).
        self._step_end_impls: list[Any] | None = None

    # -- registration callbacks ------------------------------------------------
    def _claim(self, kind: str, name: str, plugin: str) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"{plugin}: {kind} name: expected a non-empty str, got {name!r}")
        prev = self._owner.get((kind, name))
        if prev is not None:
            raise PluginError(
                f"{plugin}: {kind} {name!r} is already registered by {prev}; "
                "disable one of them with MASKPLUG_DISABLE_PLUGINS"
            )
        self._owner[(kind, name)] = plugin

    def _register_all(self, plugin_obj: object, info: PluginInfo) -> None:
        """Call the registration hooks of one plugin; all-or-nothing."""
        kernels: dict[str, Any] = {}
        providers: dict[str, Callable[..., Any]] = {}
        scheds: dict[str, Callable[..., Any]] = {}
        drivers: dict[str, Callable[..., Any]] = {}
        claimed: list[tuple[str, str]] = []

        def claim(kind: str, name: str) -> None:
            self._claim(kind, name, info.name)
            claimed.append((kind, name))

        def reg_kernel(backend: Any) -> None:
            name = getattr(backend, "name", None)
            for attr in ("unavailable_reason", "apply"):
                if not callable(getattr(backend, attr, None)):
                    raise PluginError(
                        f"{info.name}: kernel backend {name!r}: expected a callable "
                        f"{attr!r}, got {type(backend).__name__} without it"
                    )
            if not isinstance(getattr(backend, "priority", None), int):
                raise PluginError(f"{info.name}: kernel backend {name!r}: priority must be an int")
            claim("kernel", name)  # type: ignore[arg-type]
            kernels[name] = backend  # type: ignore[index]

        def by_name(kind: str, into: dict[str, Callable[..., Any]]) -> Callable[[str, Callable[..., Any]], None]:
            def reg(name: str, factory: Callable[..., Any]) -> None:
                if not callable(factory):
                    raise PluginError(f"{info.name}: {kind} {name!r}: factory is not callable")
                claim(kind, name)
                into[name] = factory

            return reg

        hooks = {
            "maskplug_register_kernels": reg_kernel,
            "maskplug_register_grammar_providers": by_name("grammar provider", providers),
            "maskplug_register_schedulers": by_name("scheduler", scheds),
            "maskplug_register_engine_drivers": by_name("engine driver", drivers),
        }
        try:
            for hook_name, cb in hooks.items():
                fn = getattr(plugin_obj, hook_name, None)
                if fn is not None:
                    fn(register=cb)
        except Exception:
            for key in claimed:
                self._owner.pop(key, None)
            raise
        self.kernels.update(kernels)
        self.grammar_providers.update(providers)
        self.schedulers.update(scheds)
        self.engine_drivers.update(drivers)

    def add_plugin(self, plugin_obj: object, name: str, distribution: str = "", version: str = "") -> None:
        """Register one plugin object (module or instance) and its contributions."""
        info = PluginInfo(name=name, distribution=distribution, version=version)
        try:
            self.pm.register(plugin_obj, name=name)
            info.hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin_obj) or [])
            self._register_all(plugin_obj, info)
        except Exception as exc:  # reported, never silently swallowed
            if self.pm.is_registered(plugin_obj):
                self.pm.unregister(plugin_obj)
            info.error = f"{type(exc).__name__}: {exc}"
            self.plugins.append(info)
            warnings.warn(
                f"maskplug plugin {name!r} from {distribution or 'unknown distribution'} "
                f"failed to register: {info.error}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.plugins.append(info)

    def load(self) -> None:
        """Load the built-ins, then every allowed entry point of the ``maskplug`` group."""
        import importlib

        from . import __version__

        for modname in BUILTIN_PLUGINS:
            self.add_plugin(importlib.import_module(modname), modname, "maskplug", __version__)

        allow = _split_env(LOAD_PLUGINS_ENV)
        deny = _split_env(DISABLE_PLUGINS_ENV) or set()
        eps = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        installed = sorted({ep.name for ep in eps})
        for var, names in ((LOAD_PLUGINS_ENV, allow or set()), (DISABLE_PLUGINS_ENV, deny)):
            for unknown in sorted(names - set(installed)):
                self._config_problem(
                    f"{var}: expected names of installed maskplug plugins {installed}, got {unknown!r}, "
                    "which no installed distribution provides"
                )
        for ep in eps:
            if (allow is not None and ep.name not in allow) or ep.name in deny:
                continue
            dist = ep.dist.name if ep.dist is not None else "unknown"
            ver = ep.dist.version if ep.dist is not None else ""
            try:
                obj = ep.load()
            except Exception as exc:
                info = PluginInfo(ep.name, dist, ver, error=f"{type(exc).__name__}: {exc}")
                self.plugins.append(info)
                warnings.warn(
                    f"maskplug plugin {ep.name!r} from distribution {dist} failed to import: {info.error}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            self.add_plugin(obj, ep.name, dist, ver)

        backend = os.environ.get(KERNEL_BACKEND_ENV, "").strip()
        if backend and backend != "auto" and backend not in self.kernels:
            self._config_problem(
                f"{KERNEL_BACKEND_ENV}: expected one of {sorted(self.kernels)} or 'auto', got {backend!r}; "
                'every backend="auto" call will raise BackendUnavailable'
            )

    def _config_problem(self, message: str) -> None:
        self.config_problems.append(message)
        warnings.warn(message, ConfigWarning, stacklevel=4)

    def step_end(self, stats: dict[str, Any]) -> None:
        """Call every ``maskplug_step_end`` hook."""
        self.pm.hook.maskplug_step_end(stats=stats)

    def step_end_listened(self) -> bool:
        """Whether any ``maskplug_step_end`` hook is registered (an engine builds the record only then).

        Asked every engine step: pluggy's own list of implementations is read
        where it has one (``get_hookimpls`` copies it), so a plugin registered
        at any time, through :meth:`add_plugin` or ``pm.register``, counts.
        """
        impls = self._step_end_impls
        if impls is None:
            caller = self.pm.hook.maskplug_step_end
            found = getattr(caller, "_hookimpls", None)
            if type(found) is not list:
                return bool(caller.get_hookimpls())
            # pluggy changes this list in place when a plugin is registered or removed, and the
            # hook's caller is made once with the hook specifications: kept, it stays current.
            impls = self._step_end_impls = found
        return bool(impls)

    def step_end_hooks(self) -> Sized | None:
        """pluggy's own list of ``maskplug_step_end`` implementations, or ``None`` where pluggy keeps none.

        The list stays current as plugins come and go (see
        :meth:`step_end_listened`): an engine that keeps it asks whether
        anyone listens with one truth test instead of two calls per step.
        """
        self.step_end_listened()
        return self._step_end_impls


_registry: Registry | None = None
_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                reg = Registry()
                reg.load()
                _registry = reg
    return _registry


def reset_registry() -> None:
    """Forget the loaded plugins; the next :func:`get_registry` loads them again.

    Useful after changing the environment switches (tests do). What was built
    from the old registry's factories is not reused: it is keyed on
    :attr:`Registry.generation`.
    """
    global _registry
    with _lock:
        _registry = None
