"""What one scheduler's run produced: :class:`RunResult`, its counters and its ``--json`` record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunResult"]

#: Violations listed in full; past this many each further one is counted as ``"..."``.
_VIOLATIONS_LISTED = 50


@dataclass
class RunResult:
    """What one scheduler's run produced (all counts are exact; times are host measurements).

    Attributes:
        scheduler: the scheduler's spec.
        steps, tokens: engine steps run and tokens emitted.
        verified, accepted: drafts verified and accepted, over the decoding requests.
        verify_events: decoding requests verified, summed over steps.
        regimes: steps per budget regime (``full``, ``partial``, ``zero``).
        zero_trimmed: steps at budget 0 although drafts were scheduled (the budget trimmed them all).
        finished_tokens: tokens of the outputs that finished (valid, invalid or cut off).
        valid, invalid, cut_off: finished outputs by verdict.
        admitted: requests admitted into a slot.
        failed: requests that failed alone (their grammar did not compile); never admitted.
        in_flight: requests still running when the run ended.
        violations: the invariant checks that failed, ``"step N: what"``.
        invalid_samples: the first invalid outputs, for the report.
        budgets, max_budgets: per step, the chosen budget and the largest admissible one.
        tempted_rows: logits rows whose raw values preferred a token their mask forbids.
        sim_ms: the cost model's forward time (verify + draft), summed over steps.
        host_s, apply_s: maskplug's host time and the mask kernel's time, summed over steps.
        mask_ms: mask production time (host), summed over steps.
        serial_ms: step time from mask production's start to masks ready, without overlap
            (production + forward), summed over steps.
        overlap_ms: the same, measured with mask production overlapping the forward pass
            (equal to ``serial_ms`` without overlap).
        bound_ms: max(forward, mask production) per step, summed: what overlap can reach at best.
    """

    scheduler: str
    steps: int = 0
    tokens: int = 0
    verified: int = 0
    accepted: int = 0
    verify_events: int = 0
    zero_trimmed: int = 0
    tempted_rows: int = 0
    finished_tokens: int = 0
    valid: int = 0
    invalid: int = 0
    cut_off: int = 0
    admitted: int = 0
    failed: int = 0
    in_flight: int = 0
    regimes: dict[str, int] = field(default_factory=lambda: {"full": 0, "partial": 0, "zero": 0})
    budgets: list[int] = field(default_factory=list)
    max_budgets: list[int] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    invalid_samples: list[str] = field(default_factory=list)
    sim_ms: float = 0.0
    host_s: float = 0.0
    apply_s: float = 0.0
    mask_ms: float = 0.0
    serial_ms: float = 0.0
    overlap_ms: float = 0.0
    bound_ms: float = 0.0

    @property
    def forward_ms(self) -> float:
        """The cost model's forward time summed over steps: the run's simulated time, :attr:`sim_ms`."""
        return self.sim_ms

    @property
    def tokens_per_step(self) -> float:
        """Emitted tokens per engine step (all requests together)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def accepted_length(self) -> float:
        """Mean tokens emitted per decoding request per step: accepted drafts + 1."""
        return 1.0 + self.accepted / self.verify_events if self.verify_events else 0.0

    @property
    def goodput(self) -> float:
        """Emitted tokens per simulated second under the cost model."""
        return self.tokens / (self.sim_ms / 1000.0) if self.sim_ms > 0 else 0.0

    def violation(self, step: int, what: str) -> None:
        """Record a failed invariant check of ``step``."""
        if len(self.violations) < _VIOLATIONS_LISTED:
            self.violations.append(f"step {step}: {what}")
        else:
            self.violations.append("...")  # keep counting without growing the report

    def as_json(self, timing: bool) -> dict[str, Any]:
        """The ``--json`` record of ``docs/design.md`` §9; ``host_us_per_step`` is ``None`` unless ``timing``."""
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "tokens_per_step": round(self.tokens_per_step, 6),
            "accepted_length": round(self.accepted_length, 6),
            "regimes": dict(self.regimes),
            "goodput_tok_s": round(self.goodput, 3),
            "valid": self.valid,
            "invalid": self.invalid,
            "cut_off": self.cut_off,
            "host_us_per_step": round(1e6 * self.host_s / self.steps, 1) if timing and self.steps else None,
            # Present only when some request failed, so the record of a run without failures keeps its fields.
            **({"failed": self.failed} if self.failed else {}),
        }
