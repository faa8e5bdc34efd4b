"""What the grammar producer learned about this step's drafts.

:class:`DraftMasks` is returned by :func:`maskplug.fill_draft_masks` and is the
``grammar=`` hint that grammar-aware budgets read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .errors import BudgetError, GrammarError
from .layout import ScheduledLayout

__all__ = ["DraftMasks", "check_draft_masks", "frozen", "host_field", "host_requests", "served"]


@dataclass(frozen=True)
class DraftMasks:
    """Per grammar request (in producer order):

    Attributes:
        request: batch index of each grammar request.
        acceptable: drafts the grammar accepts, a prefix length; the verifier
            must not accept beyond it and budgets should not spend on it.
        forced: ``forced[g, p]`` is True when mask row ``p`` of grammar
            request ``g`` allows exactly one token (shape: grammar requests ×
            max rows; rows past a request's own count are False).
        failed: the grammar requests this step could not serve, by batch
            index (the numbers of ``request``): each maps to the
            :class:`~maskplug.errors.GrammarError` saying what went wrong (a
            draft id outside the vocabulary, an exception inside the
            request's matcher, a matcher that could not be rolled back). A
            failed request's rows allow only its stop tokens, its
            ``acceptable`` is 0 and its ``forced`` row is all False; the
            other requests are served as if it were not in the batch. Empty
            (a read-only mapping) when every request was served.
    """

    request: npt.NDArray[np.int64]
    acceptable: npt.NDArray[np.int64]
    forced: npt.NDArray[np.bool_]
    failed: Mapping[int, GrammarError] = field(default_factory=lambda: _NO_FAILURES)


_NO_FAILURES: Mapping[int, GrammarError] = MappingProxyType({})


def served(
    request: npt.NDArray[np.int64], acceptable: npt.NDArray[np.int64], forced: npt.NDArray[np.bool_]
) -> DraftMasks:
    """``DraftMasks(request, acceptable, forced)`` with no failure, built without the generated ``__init__``.

    For the producers' hot path, which hands over arrays it made: the fields
    are set in one step (a frozen dataclass's ``__init__`` sets them one by
    one through ``object.__setattr__``).
    """
    out = object.__new__(DraftMasks)
    out.__dict__.update(request=request, acceptable=acceptable, forced=forced, failed=_NO_FAILURES)
    return out


def frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A read-only view of ``a`` (what checked grammar information hands out)."""
    v = a.view()
    v.flags.writeable = False
    return v


def host_field(name: str, value: Any, kinds: str, what: str) -> npt.NDArray[Any]:
    """A field of grammar information (:class:`DraftMasks`, tree masks) as a host numpy array of one of
    ``kinds`` (numpy dtype kinds); a :class:`~maskplug.errors.BudgetError` naming ``name`` otherwise."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise BudgetError(f"{name}: expected host values, got a tensor on {value.device}")
        value = value.detach().numpy()
    try:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (TypeError, ValueError, OverflowError) as err:
        raise BudgetError(f"{name}: expected {what}, got {type(value).__name__}") from err
    if arr.size and arr.dtype.kind not in kinds:
        raise BudgetError(f"{name}: expected {what}, got dtype {arr.dtype} of shape {arr.shape}")
    return arr


def host_requests(name: str, value: Any, n: int) -> npt.NDArray[np.int64]:
    """The ``request`` field of grammar information: unique batch indices in ``[0, n)`` as a 1-D int64 array.

    Anything else is a :class:`~maskplug.errors.BudgetError` naming ``name``.
    """
    req = host_field(name, value, "iu", "a 1-D array of batch indices")
    if req.ndim != 1:
        raise BudgetError(f"{name}: expected a 1-D array of batch indices, got shape {req.shape}")
    req = req.astype(np.int64, copy=False)
    g = req.shape[0]
    if g and (int(req.min()) < 0 or int(req.max()) >= n):
        bad = int(req[(req < 0) | (req >= n)][0])
        raise BudgetError(f"{name}: expected batch indices in [0, {n}), got {bad}")
    if g > 1 and np.unique(req).size != g:
        s = np.sort(req)
        raise BudgetError(f"{name}: expected unique batch indices, got {int(s[1:][s[1:] == s[:-1]][0])} twice")
    return req


def check_draft_masks(grammar: Any, layout: ScheduledLayout, arg: str = "grammar") -> DraftMasks:
    """``grammar`` checked against ``layout``: a read-only :class:`DraftMasks` of int64/bool arrays.

    The one check every entry point runs (:func:`~maskplug.choose_budget`,
    :class:`~maskplug.StepView`, hence :func:`~maskplug.allocate_step`):
    ``request`` unique batch indices of ``layout``, ``acceptable`` one count
    in ``[0, num_drafts]`` per grammar request, ``forced`` a 2-D bool array
    with one row per grammar request, ``failed`` a mapping keyed by batch
    indices of ``request``. Fields may be numpy arrays, sequences or
    host tensors. Anything else raises :class:`~maskplug.BudgetError` naming
    the field (``grammar.request`` and so on).
    """
    if not isinstance(grammar, DraftMasks):
        raise BudgetError(f"{arg}: expected DraftMasks or None, got {type(grammar).__name__}")
    req = host_requests(f"{arg}.request", grammar.request, layout.n)
    g = req.shape[0]
    acc = host_field(f"{arg}.acceptable", grammar.acceptable, "iu", f"{g} integer counts")
    if acc.shape != (g,):
        raise BudgetError(
            f"{arg}.acceptable: expected {g} integer counts (one per grammar request), got shape {acc.shape}"
        )
    acc = acc.astype(np.int64, copy=False)
    if g:
        nd = layout.num_drafts[req]
        bad_acc = (acc < 0) | (acc > nd)
        if bad_acc.any():
            i = int(np.argmax(bad_acc))
            raise BudgetError(
                f"{arg}.acceptable: expected counts in [0, num_drafts] per grammar request, got {int(acc[i])} "
                f"for request {int(req[i])} with {int(nd[i])} drafts"
            )
    forced = host_field(f"{arg}.forced", grammar.forced, "b", f"a bool array of shape ({g}, rows)")
    if forced.ndim != 2 or forced.shape[0] != g:
        raise BudgetError(f"{arg}.forced: expected a bool array of shape ({g}, rows), got shape {forced.shape}")
    failed = grammar.failed
    if not isinstance(failed, Mapping):
        raise BudgetError(
            f"{arg}.failed: expected a mapping of batch index to GrammarError, got {type(failed).__name__}"
        )
    if failed:
        known = set(req.tolist())
        for key in failed:
            if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or int(key) not in known:
                raise BudgetError(f"{arg}.failed: expected batch indices of {arg}.request as keys, got {key!r:.80}")
        failed = MappingProxyType({int(k): v for k, v in failed.items()})
    elif not isinstance(failed, MappingProxyType):
        failed = _NO_FAILURES
    return DraftMasks(
        request=frozen(req),
        acceptable=frozen(acc),
        forced=frozen(forced.astype(bool, copy=False)),
        failed=failed,
    )
