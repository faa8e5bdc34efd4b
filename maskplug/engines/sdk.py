"""The engine SDK: what maskplug's engine adapters (and outside ones) share.

Engines rarely have a registry for what an adapter must change (vLLM's mask
apply and its verify step, SGLang's DSpark planner), so adapters replace a
few named attributes of the engine, after checking its release.
:class:`PatchSet` keeps that bookkeeping in one place: each replacement is
made once per process, the engine's own attribute stays reachable
(:meth:`PatchSet.original`), a missing attribute (an engine build that does
not match the tested source) is a :class:`~maskplug.PluginError` naming it,
and :meth:`PatchSet.uninstall` puts everything back in reverse order.
:func:`wraps` marks a wrapper with the engine function it wraps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import PluginError

__all__ = ["PatchSet", "wraps"]

F = TypeVar("F", bound=Callable[..., Any])


def wraps(orig: Callable[..., Any]) -> Callable[[F], F]:
    """Give a wrapper the engine function's docstring and ``__wrapped__`` (its name stays its own)."""

    def mark(fn: F) -> F:
        fn.__doc__ = orig.__doc__
        fn.__wrapped__ = orig  # type: ignore[attr-defined]
        return fn

    return mark


class PatchSet:
    """The attributes one adapter replaced in one engine, in this process.

    Args:
        engine: the engine's name as errors show it (``"vllm"``, ``"sglang"``).
        tested: what the adapter was tested with, for the error on a missing
            attribute (e.g. ``"vLLM 0.32.0"``), or a function returning it
            (called only then).
    """

    def __init__(self, engine: str, tested: str | Callable[[], str]) -> None:
        self.engine = engine
        self._tested = tested
        self.lock = threading.RLock()
        self._originals: dict[tuple[int, str], tuple[Any, str, Any]] = {}

    def replace(self, owner: Any, attr: str, new: Any) -> None:
        """Set ``owner.attr = new`` unless this set already replaced it (then nothing changes)."""
        with self.lock:
            key = (id(owner), attr)
            if key in self._originals:
                return
            if not hasattr(owner, attr):
                tested = self._tested() if callable(self._tested) else self._tested
                raise PluginError(
                    f"{self.engine} internals: expected {getattr(owner, '__name__', owner)!r} to define {attr!r} "
                    f"(tested with {tested}), got nothing; this {self.engine} build does not match the tested source"
                )
            self._originals[key] = (owner, attr, getattr(owner, attr))
            setattr(owner, attr, new)

    def wrap(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.attr`` by ``make(original)``, where ``original`` is the engine's own attribute."""
        with self.lock:
            if (id(owner), attr) not in self._originals:
                self.replace(owner, attr, make(self.original(owner, attr)))

    def original(self, owner: Any, attr: str) -> Any:
        """The engine's own implementation of ``owner.attr`` (the current one when not replaced)."""
        entry = self._originals.get((id(owner), attr))
        return entry[2] if entry is not None else getattr(owner, attr)

    def replaced(self, owner: Any, attr: str) -> bool:
        """Whether this set replaced ``owner.attr``."""
        return (id(owner), attr) in self._originals

    def installed(self) -> bool:
        """Whether any replacement is in place."""
        return bool(self._originals)

    def uninstall(self) -> None:
        """Put every replaced attribute back, the last replaced first."""
        with self.lock:
            for owner, attr, value in list(self._originals.values())[::-1]:
                setattr(owner, attr, value)
            self._originals.clear()
