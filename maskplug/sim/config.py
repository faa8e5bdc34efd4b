"""What defines a simulated run: :class:`SimConfig`, the request mix, the simulated GPU and the demo's schedulers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..budget import CostModel
from ..errors import GrammarError
from ..schedulers import get_scheduler

__all__ = ["DEFAULT_SCHEDULERS", "SimConfig", "WorkloadMix", "default_cost_model", "make_scheduler"]

#: The schedulers ``maskplug demo`` compares, in table order. ``grammar-aware:X`` wraps ``X``.
DEFAULT_SCHEDULERS = ("no-spec", "verify-all", "dspark", "grammar-aware:dspark", "goodput")


def default_cost_model() -> CostModel:
    """The simulated GPU: flat verify cost up to 64 tokens, then about 0.11 ms per token.

    Shaped like a mid-size target on one accelerator: a forward pass costs
    the same until the batch fills the compute units, then grows linearly.
    The drafter costs a little per request.
    """
    return CostModel.from_curves(
        draft_curve=[(1, 1.0), (16, 1.3), (64, 2.2), (256, 5.5)],
        verify_curve=[(1, 9.0), (64, 9.5), (128, 16.0), (256, 30.0), (512, 58.0), (1024, 114.0)],
        max_reqs=4096,
        max_tokens=1 << 16,
    )


def make_scheduler(spec: str) -> Any:
    """A scheduler from a spec: a registered name, or ``grammar-aware:INNER`` (:func:`maskplug.get_scheduler`)."""
    return get_scheduler(spec)


@dataclass(frozen=True)
class WorkloadMix:
    """Shares of request kinds, and how often a request gets a token limit below its document length."""

    json: float = 0.5
    regex: float = 0.25
    free: float = 0.25
    #: share of requests whose ``max_tokens`` cuts the document short (they end "cut off")
    short_limit: float = 0.05

    def __post_init__(self) -> None:
        vals = (self.json, self.regex, self.free, self.short_limit)
        if any(not np.isfinite(v) or v < 0 for v in vals) or self.json + self.regex + self.free <= 0:
            raise GrammarError(f"mix: expected non-negative shares with a positive sum, got {vals}")


#: The fields ``--json`` reports under ``config`` (``docs/design.md`` §9), in order; ``mix`` follows them.
_JSON_FIELDS = (
    "steps",
    "concurrency",
    "drafts",
    "tokenizer",
    "provider",
    "backend",
    "noise",
    "margin",
    "tempt_rate",
    "max_batch_tokens",
    "squeeze_every",
)


@dataclass(frozen=True)
class SimConfig:
    """Everything that defines a run (the seed included); see ``maskplug demo --help``.

    Attributes:
        steps: engine steps per scheduler.
        concurrency: request slots (continuous batching keeps them full).
        drafts: ``K``, drafts per decoding request and step.
        tokenizer: ``"tekken"`` (131,072 tokens) or ``"spm"`` (32,000).
        provider: grammar provider name (default ``"auto"``: each grammar compiled by the
            provider best suited to it). A grammar that does not compile (a
            compile stopped at its limit included) fails that request alone:
            it is counted in ``RunResult.failed`` and listed in
            ``Workload.failures``; the run goes on.
        backend: kernel backend name or ``"auto"``.
        seed: the seed of the request stream, drafter and target.
        noise: scale of the target's logit noise.
        margin: the target's preference for the reference token, in logits.
        tempt_rate: how often a grammar row's raw logits prefer a forbidden token.
        max_batch_tokens: the engine's tokens-per-step limit (prefill chunks
            plus decode tokens plus verified drafts); ``None`` for no limit.
        squeeze_every: every ``N``-th step the engine has room for bonus
            rows only (budget 0 forced through ``max_logits``); 0 = never.
        check_rows: rows per step whose masking is checked column by column.
        mix: request kinds.
        schema_dir: the folder of JSON schemas (default :func:`maskplug.data.schema_dir`).
        overlap: produce the mask rows during the simulated forward pass
            (which then takes real time: the cost model's, per step).
    """

    steps: int = 60
    concurrency: int = 16
    drafts: int = 4
    tokenizer: str = "tekken"
    provider: str = "auto"
    backend: str = "auto"
    seed: int = 0
    noise: float = 2.0
    margin: float = 30.0
    tempt_rate: float = 0.1
    max_batch_tokens: int | None = 192
    squeeze_every: int = 0
    check_rows: int = 2
    mix: WorkloadMix = field(default_factory=WorkloadMix)
    schema_dir: str | None = None
    overlap: bool = False

    def as_json(self) -> dict[str, Any]:
        """The configuration as plain JSON values."""
        mix = {"json": self.mix.json, "regex": self.mix.regex, "free": self.mix.free}
        return {**{name: getattr(self, name) for name in _JSON_FIELDS}, "mix": mix}
