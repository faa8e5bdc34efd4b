"""The exception hierarchy.

Every error maskplug raises on bad input is a :class:`MaskplugError`. Messages
name the argument, what was expected and what came, so a mismatch between two
layouts shows both sides. Validation always runs before anything is written:
on any error, logits and grammar matchers are left exactly as they were.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "BudgetError",
    "ConfigWarning",
    "GrammarError",
    "LayoutError",
    "MaskplugError",
    "MatcherInUse",
    "PluginError",
]


class MaskplugError(Exception):
    """Base class of every error raised by maskplug."""


class LayoutError(MaskplugError, ValueError):
    """Bad shapes, dtypes, devices, request ids or offsets."""


class BudgetError(MaskplugError, ValueError):
    """A budget, capacity, confidence or cost curve that cannot be used."""


class BackendUnavailable(MaskplugError, RuntimeError):
    """A kernel backend that was asked for cannot run here; the message says why."""


class GrammarError(MaskplugError, ValueError):
    """A grammar that cannot be compiled, or a token or buffer a matcher refuses."""


class MatcherInUse(MaskplugError, RuntimeError):
    """A matcher given to a call while another thread's call is using it (a matcher serves one call at a time)."""


class PluginError(MaskplugError, RuntimeError):
    """A plugin that failed to load or registered something invalid."""


class ConfigWarning(RuntimeWarning):
    """A ``MASKPLUG_*`` environment setting that names something that does not exist.

    Issued once, when the plugin registry loads, naming the variable and the
    unknown value. A warning rather than an error because one environment is
    often shared by deployments with different plugins installed; turn it into
    an error with ``-W error::maskplug.errors.ConfigWarning`` (or
    ``warnings.simplefilter("error", ConfigWarning)``).
    """
