"""Putting matchers back where they started after a fill or commit went wrong.

A producer that stops part-way has matchers advanced by what its walk had
accepted; these undo that, and say in the error (or on the exception, for a
call stopped as a whole) when the undo itself failed, so that the caller
knows to drop the matcher.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .checks import brief_error
from .protocols import Matcher

__all__ = ["logger", "restore_after_interrupt", "roll_back", "undo_after_interrupt"]

#: The producers' logger: batch calls walked again one request at a time, rollbacks that failed.
logger = logging.getLogger("maskplug.draft")
logger.addHandler(logging.NullHandler())


def roll_back(matcher: Matcher, k: int, what: str) -> str:
    """Roll a failed request's ``matcher`` back by ``k`` tokens; what its error should add about that.

    Returns ``""`` when there was nothing to undo or the rollback went
    through, else a clause for the request's error saying the rollback of the
    ``k`` ``what`` (``"drafts it had accepted"``) raised too and the matcher
    should be dropped.
    """
    if k <= 0:
        return ""
    try:
        matcher.rollback(k)
    except Exception as back:
        return (
            f"; rolling back the {k} {what} then raised {type(back).__name__} "
            f"({brief_error(back)}): the matcher is not where it started and should be dropped"
        )
    return ""


def undo_after_interrupt(matcher: Matcher, g: int, k: int, exc: BaseException, what: str = "drafts") -> None:
    """Roll ``matcher`` (request ``g``) back by the ``k`` tokens a walk stopped by ``exc`` left it advanced by.

    ``exc`` (an interrupt, or a bug) is about to be raised for the whole call,
    so a rollback that raises cannot fail its request in a result: it is
    logged as an error and added to ``exc`` as a note naming ``matchers[g]``
    (the matcher is not where it started and should be dropped), and ``exc``
    is still what the call raises.
    """
    if k <= 0:
        return
    try:
        matcher.rollback(k)
    except Exception as back:
        msg = (
            f"matchers[{g}]: rolling back the {k} {what} it had accepted, after the fill was stopped by "
            f"{type(exc).__name__}, raised {type(back).__name__} ({brief_error(back)}): the matcher is not "
            "where it started and should be dropped"
        )
        logger.error(msg)
        add_note = getattr(exc, "add_note", None)  # Python 3.11+
        if add_note is not None:
            add_note(msg)


def restore_after_interrupt(matchers: Sequence[Matcher], accepted: npt.NDArray[np.int64], exc: BaseException) -> None:
    """:func:`undo_after_interrupt` for every matcher a stopped walk left advanced (``accepted`` is zeroed)."""
    for g in np.flatnonzero(accepted).tolist():
        k = int(accepted[g])
        accepted[g] = 0
        undo_after_interrupt(matchers[g], g, k, exc)
