"""What the grammar producer learned about this step's drafts.

:class:`DraftMasks` is returned by :func:`maskplug.fill_draft_masks` and is the
``grammar=`` hint that grammar-aware budgets read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["DraftMasks"]


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
    """

    request: npt.NDArray[np.int64]
    acceptable: npt.NDArray[np.int64]
    forced: npt.NDArray[np.bool_]
