"""One validation path per kind of argument, shared by every public entry point.

Each checker takes the argument in any of the forms maskplug accepts (a Python
scalar or list, a numpy scalar or array, a host tensor, a 0-d tensor) and turns
it into one normalised host value before checking it, so the same mistake gets
the same :class:`~maskplug.MaskplugError` whatever form it came in. Checks are
vectorised: one or two numpy reductions per array, never a Python loop over
its elements.

Device tensors are the exception: reading their values would synchronise with
the device, so callers that accept them check only what is known without a
read (dtype, shape, device) and document that the values are trusted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .errors import MaskplugError

__all__ = ["INT32_MAX", "check_unit_interval", "host_int", "host_ints"]

#: The largest count or offset maskplug accepts: offsets and row indices are int32 on the device.
INT32_MAX = 2**31 - 1

IntArray = npt.NDArray[np.int64]


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    return f"{type(value).__name__} {value!r}"[:120]


def _range_text(lo: int, hi: int, v: int) -> str:
    if hi != INT32_MAX:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if v < lo else f">= {lo} and <= 2**31 - 1"


def _want(expected: str | None, what: str, lo: int, hi: int, v: int) -> str:
    return expected.format(lo=lo, hi=hi) if expected else f"{what} {_range_text(lo, hi, v)}"


def host_int(
    name: str,
    value: Any,
    exc: type[MaskplugError],
    *,
    lo: int = 0,
    hi: int = INT32_MAX,
    expected: str | None = None,
) -> int:
    """``value`` as a Python int in ``[lo, hi]``: an int, a numpy integer, or a 0-d integer host tensor or array.

    ``bool`` is refused (it is an int only by accident of Python's history), as
    are floats, even integral ones: a budget or a size is a count.
    ``expected`` replaces the default description of the range in the
    message; it is formatted with ``lo`` and ``hi`` (only when the check fails).
    """
    if type(value) is int and lo <= value <= hi:  # the common case, in one comparison
        return value
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise exc(f"{name}: expected an int or a 0-d integer tensor, got {_kind(value)}")
        if value.device.type != "cpu":
            raise exc(f"{name}: expected a host value here, got a tensor on {value.device}")
        value = value.item()
    elif isinstance(value, np.ndarray):
        if value.ndim != 0 or value.dtype.kind not in "iu":
            raise exc(f"{name}: expected an int, got {_kind(value)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise exc(f"{name}: expected an int, got {_kind(value)}")
    v = int(value)
    if not lo <= v <= hi:
        want = expected.format(lo=lo, hi=hi) if expected else "an int " + _range_text(lo, hi, v)
        raise exc(f"{name}: expected {want}, got {v}")
    return v


def host_ints(
    name: str,
    value: Any,
    exc: type[MaskplugError],
    *,
    n: int | None = None,
    lo: int = 0,
    hi: int = INT32_MAX,
    integral_floats: bool = False,
    what: str = "counts",
    expected: str | None = None,
) -> IntArray:
    """``value`` as a 1-D int64 host array of ``n`` entries (when given), each in ``[lo, hi]``.

    Accepts a sequence, a numpy array or a host tensor of an integer dtype
    (``integral_floats`` also lets floats that hold whole numbers through, as
    layouts always have). Refused with ``exc`` naming ``name``: a device
    tensor, anything not 1-D, bool, complex or fractional values, a wrong
    length, and values out of range (the first offender is named; ``expected``
    replaces the default description of the range, formatted with ``lo`` and
    ``hi``). The range check is one reduction over the array.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise exc(f"{name}: expected host (CPU) values, got a tensor on {value.device}")
        if value.dtype == torch.bfloat16:
            value = value.float()
        value = value.detach().resolve_conj().resolve_neg().numpy()
    try:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (TypeError, ValueError, OverflowError) as err:
        raise exc(f"{name}: expected a 1-D sequence of integer {what}, got {_kind(value)}") from err
    if arr.ndim != 1:
        raise exc(f"{name}: expected a 1-D sequence of integer {what}, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        ok = integral_floats and arr.dtype.kind == "f" and bool(np.all(np.isfinite(arr) & (np.mod(arr, 1) == 0)))
        if not ok:
            raise exc(f"{name}: expected integer {what}, got dtype {arr.dtype}")
        if np.any(np.abs(arr) > 2.0**62):
            big = float(arr[np.argmax(np.abs(arr))])
            raise exc(f"{name}: expected {_want(expected, what, lo, hi, int(big))}, got {big}")
    if n is not None and arr.shape[0] != n:
        raise exc(f"{name}: expected {n} entries (one per request), got {arr.shape[0]}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > hi:
        bad = int(np.argmax(arr > hi))
        v = int(arr[bad])
        raise exc(f"{name}: expected {_want(expected, what, lo, hi, v)}, got {v} at index {bad}")
    out = arr.astype(np.int64, copy=False)
    if out.size:
        # One reduction: shifted by lo and read unsigned, a value below lo wraps to a huge one.
        span = (out - lo).view(np.uint64) if lo else out.view(np.uint64)
        if int(span.max()) > hi - lo:
            bad = int(np.argmax((out < lo) | (out > hi)))
            v = int(out[bad])
            raise exc(f"{name}: expected {_want(expected, what, lo, hi, v)}, got {v} at index {bad}")
    return out


def check_unit_interval(
    name: str,
    values: npt.NDArray[np.float64],
    exc: type[MaskplugError],
    num_drafts: npt.NDArray[np.int64] | None = None,
) -> None:
    """Refuse NaN or values outside ``[0, 1]`` in 2-D ``values``, per row only the first ``num_drafts[r]`` columns.

    Without ``num_drafts`` every entry counts. One pass over ``values`` (NaN
    fails both comparisons); only when it fails is the live part worked out,
    since dead entries (stale columns past a request's drafts) may hold
    anything.
    """
    ok = (values >= 0.0) & (values <= 1.0)
    if ok.all():
        return
    bad = ~ok
    if num_drafts is not None:
        bad &= np.arange(values.shape[1])[None, :] < num_drafts[:, None]
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise exc(f"{name}: expected probabilities in [0, 1] (no NaN), got {float(values[where])} at index {where}")
