"""Shared helpers of the simulator tests."""

from __future__ import annotations

from typing import Any

import torch

from maskplug import hookimpl
from maskplug.data import load_tokenizer
from maskplug.grammar import grammar_provider
from maskplug.kernels.torch_backend import TorchBackend
from maskplug.sim import SimConfig, Simulation, Workload, default_cost_model
from maskplug.sim.models import TargetModel


def simulation(cfg: SimConfig, scheduler: str) -> Simulation:
    """One scheduler's simulation of ``cfg``, set up as ``run_demo`` does."""
    tok = load_tokenizer(cfg.tokenizer)
    work = Workload(cfg, tok, grammar_provider(cfg.provider, tok.vocab))
    target = TargetModel(cfg.seed, tok.vocab.vocab_size, noise=cfg.noise, margin=cfg.margin)
    return Simulation(cfg, scheduler, work, target, default_cost_model())


class SkipsEveryOtherRow:
    """A broken kernel: applies only even mask rows (as a mapping bug would)."""

    name = "broken-for-test"
    priority = -100

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def apply(self, logits, bitmask, request, position, cu_logits, vocab_size, mask_tail) -> None:  # type: ignore[no-untyped-def]
        keep = torch.arange(bitmask.shape[0]) % 2 == 0
        req = torch.where(keep, request, torch.full_like(request, -1))
        TorchBackend().apply(logits, bitmask, req, position, cu_logits, vocab_size, mask_tail)


class BrokenPlugin:
    """Registers :class:`SkipsEveryOtherRow` (priority below torch, so ``auto`` never picks it)."""

    @hookimpl
    def maskplug_register_kernels(self, register: Any) -> None:
        register(SkipsEveryOtherRow())
