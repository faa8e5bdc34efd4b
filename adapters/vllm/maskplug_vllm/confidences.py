"""The drafter's confidences, from the worker that drafts to the engine core that picks the budget.

A model drafter (vLLM's ``draft_model`` method, and the other proposers built
on vLLM's ``SpecDecodeBaseProposer``) picks each draft token as the argmax of
its own logits. maskplug records the draft model's probability of each token
it proposed (the softmax at the argmax, a conditional acceptance estimate per
position) while the drafter runs, and hands it back beside the draft token ids
vLLM already returns to the engine core after every step
(``GPUModelRunner.take_draft_token_ids``; the executor returns rank 0's reply,
so every rank's drafter may record, and one answers). The list travels as
plain floats (:data:`CONFIDENCES_ATTR`).

In the engine core, :class:`DraftConfidences` keeps them per request. A
step's budget reads the confidences recorded two steps earlier, as vLLM's
DSpark reads them on an engine that cannot wait for the device (see
:class:`maskplug.ConfidenceHistory`, whose rule this follows on the host); the
split of the budget among requests reads the live ones, the confidences of the
very drafts being verified.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from maskplug.engines.sdk import wraps

__all__ = ["CONFIDENCES_ATTR", "DraftConfidences", "make_greedy_sample", "make_propose", "make_take_draft_token_ids"]

CONFIDENCES_ATTR = "maskplug_confidences"
"""Attribute of vLLM's ``DraftTokenIds``: per request (its order), the drafter's probability of each draft."""

_RECORD_ATTR = "_maskplug_draft_conf"


class DraftConfidences:
    """Per-request draft confidences in the engine core: the live recording and the one before it.

    :meth:`record` is called once per engine step with the confidences of the
    drafts just proposed (the drafts the next step schedules). For the step
    that verifies them, :meth:`for_step` returns ``(stale, live)``: ``live``
    are those drafts' own confidences, ``stale`` the request's confidences as
    recorded one step before (two steps before the step that uses them). A
    request with no recording reads as confidence 1 (a new request is assumed
    to draft well; the live split corrects the guess at once), and a request
    whose drafts have no recorded confidence at all makes both ``None``.
    """

    def __init__(self) -> None:
        self._live: dict[str, list[float]] = {}
        self._stale: dict[str, list[float]] = {}
        self.recorded = 0

    def record(self, req_ids: Sequence[str], confidences: Sequence[Sequence[float]]) -> None:
        """Store one step's confidences (``confidences[i]`` for ``req_ids[i]``); the previous become stale."""
        self.recorded += 1
        for r in req_ids:
            if r in self._live:
                self._stale[r] = self._live[r]
        for r, c in zip(req_ids, confidences, strict=False):
            self._live[r] = [float(x) for x in c]

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop finished requests."""
        for r in req_ids:
            self._live.pop(r, None)
            self._stale.pop(r, None)

    def for_step(
        self, req_ids: Sequence[str], spec: Mapping[str, Sequence[int]]
    ) -> tuple[npt.NDArray[np.float64] | None, npt.NDArray[np.float64] | None]:
        """``(stale, live)`` confidence tables ``[n, max drafts]`` for a step, or ``(None, None)``."""
        if not self.recorded:
            return None, None
        k = max((len(spec.get(r, ())) for r in req_ids), default=0)
        if k == 0:
            return None, None
        n = len(req_ids)
        stale = np.ones((n, k), dtype=np.float64)
        live = np.ones((n, k), dtype=np.float64)
        for i, r in enumerate(req_ids):
            for table, src in ((stale, self._stale.get(r)), (live, self._live.get(r))):
                if src:
                    m = min(k, len(src))
                    table[i, :m] = src[:m]
        np.clip(stale, 0.0, 1.0, out=stale)
        np.clip(live, 0.0, 1.0, out=live)
        return stale, live


# -- the worker side: recording while the drafter runs ---------------------------------------------


def make_greedy_sample(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``SpecDecodeBaseProposer._greedy_sample`` to record the probability of each token it picks.

    The ids are those vLLM picks (the argmax of the same logits); only the
    plain path records (a drafter with local argmax reduction or a
    heterogeneous vocabulary keeps vLLM's own code and records nothing).
    """

    def _greedy_sample(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        record = getattr(self, _RECORD_ATTR, None)
        if record is None or self.use_local_argmax_reduction or self.use_heterogeneous_vocab:
            return orig(self, hidden_states)
        logits = self.model.compute_logits(hidden_states)
        ids = logits.argmax(dim=-1)
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        record.append(probs)
        return ids

    return wraps(orig)(_greedy_sample)


def make_propose(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``SpecDecodeBaseProposer.propose``: collect one probability per draft position, ``[batch, K]``."""

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        record: list[torch.Tensor] = []
        setattr(self, _RECORD_ATTR, record)
        try:
            out = orig(self, *args, **kwargs)
        finally:
            setattr(self, _RECORD_ATTR, None)
        k = out.shape[1] if out.dim() == 2 else 0
        if k and len(record) == k and all(p.shape[0] >= out.shape[0] for p in record):
            self._maskplug_confidences = torch.stack([p[: out.shape[0]] for p in record], dim=1).cpu()
        else:
            self._maskplug_confidences = None
        return out

    return wraps(orig)(propose)


def make_take_draft_token_ids(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``GPUModelRunner.take_draft_token_ids`` so the drafter's confidences travel with the draft ids."""

    def take_draft_token_ids(self: Any) -> Any:
        out = orig(self)
        drafter = getattr(self, "drafter", None)
        conf = getattr(drafter, "_maskplug_confidences", None) if drafter is not None else None
        if out is not None and conf is not None and conf.shape[0] >= len(out.req_ids):
            setattr(out, CONFIDENCES_ATTR, conf[: len(out.req_ids)].tolist())
        return out

    return wraps(orig)(take_draft_token_ids)
