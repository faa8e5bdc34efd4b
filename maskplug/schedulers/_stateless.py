"""The common part of the schedulers whose budget is a fixed function of the step."""

from __future__ import annotations

from typing import Any

from .protocol import StepOutcome, check_no_config


class StatelessScheduler:
    """A scheduler that takes no configuration and learns nothing: a subclass sets ``name`` and ``budget``."""

    name: str
    uses_grammar = False

    def __init__(self, **config: Any) -> None:
        check_no_config(self.name, config)

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn."""
