"""Random apply_grammar_bitmask cases built through maskplug's own layout code.

Each case is a real step: a scheduled layout, a producer layout (ragged or
fixed, grammar order shuffled), a budget in one of the three regimes, the
capacities ``maskplug.allocate`` picks for it and the device-style
``cu_logits`` from ``maskplug.active_cu_logits``. On top of that it adds what
the kernels must also handle: duplicated mask rows (applied as an AND), mask
words of all ones and all zeros, bitmasks wider or narrower than the logits,
a vocabulary tail, and logits rows with a stride larger than their width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import maskplug

Regime = Literal["full", "partial", "zero"]


@dataclass
class Case:
    """Everything one call needs; ``logits`` is ``base[:rows, :width]``, a strided view."""

    base: torch.Tensor
    logits: torch.Tensor
    bitmask: torch.Tensor
    request: np.ndarray
    position: np.ndarray
    cu_logits: np.ndarray
    vocab_size: int | None
    tail: Literal["mask", "keep"]
    regime: Regime
    mode: str

    def describe(self) -> str:
        return (
            f"regime={self.regime} mode={self.mode} logits={tuple(self.logits.shape)} stride={self.logits.stride()} "
            f"dtype={self.logits.dtype} words={self.bitmask.shape[1]} vocab_size={self.vocab_size} tail={self.tail} "
            f"rows={self.bitmask.shape[0]}"
        )


def _random_words(rng: np.random.Generator, rows: int, words: int) -> np.ndarray:
    """Mask words mixing random bits, all-ones and all-zeros, in runs as well as singly."""
    w = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64)
    kind = rng.integers(0, 4, size=(rows, words))
    w[kind == 1] = -1
    w[kind == 2] = 0
    # Whole rows of one kind exercise the tile-level shortcuts.
    for r in range(rows):
        pick = rng.integers(0, 6)
        if pick == 0:
            w[r] = -1
        elif pick == 1:
            w[r] = 0
        elif pick == 2 and words > 1:
            a = int(rng.integers(0, words))
            w[r, a:] = -1 if rng.integers(0, 2) else 0
    return w.astype(np.int32)


def make_case(
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    regime: Regime | None = None,
    mode: str | None = None,
    width: int | None = None,
    max_requests: int = 5,
    max_drafts: int = 4,
    max_width: int = 3000,
    duplicates: bool = True,
) -> Case:
    """A random case; ``None`` arguments are drawn from ``seed`` too."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, max_requests + 1))
    num_bonus = int(rng.choice([1, 1, 1, 2]))
    nd = rng.integers(0, max_drafts + 1, size=n)
    layout = maskplug.ScheduledLayout(list(range(100, 100 + n)), nd, np.ones(n, dtype=np.int64), num_bonus)
    total = int(nd.sum())
    if regime is None:
        regimes: tuple[Regime, ...] = ("full", "partial", "zero")
        regime = regimes[int(rng.integers(0, 3))]
    if regime == "full" or total == 0:
        budget = total
    elif regime == "zero":
        budget = 0
    else:
        budget = int(rng.integers(1, total)) if total > 1 else 0
    conf = torch.from_numpy(rng.uniform(0.05, 1.0, size=(n, max(max_drafts, 1))))
    capacity = maskplug.allocate(conf, nd, budget)
    cu = maskplug.active_cu_logits(capacity, num_bonus).numpy().astype(np.int64)

    g = int(rng.integers(1, n + 1))
    gids = rng.permutation(np.arange(100, 100 + n))[:g]
    if mode is None:
        mode = "ragged" if rng.integers(0, 2) else "fixed"
    stride = int(max_drafts + num_bonus + rng.integers(0, 2)) if mode == "fixed" else None
    rows = maskplug.GrammarRows(gids, mode=mode, stride=stride)  # type: ignore[arg-type]
    mp = rows.mapping(layout)
    req, pos = mp.request.astype(np.int64), mp.position.astype(np.int64)
    if duplicates and req.size and rng.integers(0, 2):
        k = int(rng.integers(1, min(4, req.size) + 1))
        pick = rng.integers(0, req.size, size=k)
        req = np.concatenate([req, req[pick]])
        pos = np.concatenate([pos, pos[pick]])
        perm = rng.permutation(req.size)
        req, pos = req[perm], pos[perm]

    if width is None:
        width = int(rng.integers(1, max_width + 1))
    shape_kind = int(rng.integers(0, 4))
    vocab_size: int | None
    if shape_kind == 0:  # exact cover
        words, vocab_size = -(-width // 32), None
    elif shape_kind == 1:  # bitmask wider than the logits
        words, vocab_size = -(-width // 32) + int(rng.integers(1, 4)), None
    elif shape_kind == 2:  # grammar vocabulary smaller than the logits (padding tail)
        vocab_size = int(rng.integers(1, width + 1))
        words = -(-vocab_size // 32) + int(rng.integers(0, 2))
    else:  # bitmask narrower than the logits, vocab_size says so
        vocab_size = int(rng.integers(1, width + 1))
        words = max(1, -(-vocab_size // 32))
    tail: Literal["mask", "keep"] = "mask" if rng.integers(0, 2) else "keep"

    nrows = int(cu[-1]) + int(rng.integers(0, 3))
    pad = int(rng.choice([0, 0, 1, 3, 8, 33]))
    base = torch.from_numpy(rng.standard_normal((max(nrows, 1), width + pad), dtype=np.float32)).to(dtype)
    logits = base[:nrows, :width]
    bm = torch.from_numpy(_random_words(rng, req.size, words))
    return Case(base, logits, bm, req.astype(np.int32), pos.astype(np.int32), cu, vocab_size, tail, regime, mode)


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Bit-pattern view, so comparisons are exact (NaN and -0.0 included)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def expected(case: Case) -> torch.Tensor:
    """The oracle's answer for ``case`` (a fresh tensor)."""
    out = case.logits.clone()
    maskplug.reference.apply_grammar_bitmask(
        out, case.bitmask, (case.request, case.position), case.cu_logits, vocab_size=case.vocab_size, tail=case.tail
    )
    return out


def run_backend(case: Case, backend: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked logits, whole buffer)`` after ``backend`` ran on a copy of the case on ``device``."""
    base = case.base.clone().to(device)
    rows, width = case.logits.shape
    view = base[:rows, :width]
    maskplug.apply_grammar_bitmask(
        view,
        case.bitmask.to(device),
        (case.request, case.position),
        case.cu_logits,
        vocab_size=case.vocab_size,
        tail=case.tail,
        backend=backend,
    )
    return view.cpu(), base.cpu()


def check(case: Case, backend: str, device: torch.device | str = "cpu") -> None:
    """Assert ``backend`` matches the oracle bit for bit and writes nothing outside the view."""
    want = expected(case)
    got, base = run_backend(case, backend, device)
    assert torch.equal(int_view(got), int_view(want)), case.describe()
    rows, width = case.logits.shape
    outside = torch.ones(base.shape, dtype=torch.bool)
    outside[:rows, :width] = False
    assert torch.equal(int_view(base)[outside], int_view(case.base)[outside]), "wrote outside the logits view"


def compile_one_graph(step: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """Run ``torch.compile(step, fullgraph=True)`` on ``args``; its output and the call targets of its one graph.

    On meta tensors the custom ops run their fake implementation, so this traces
    a kernel op on any machine.
    """
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(step, backend=record, fullgraph=True)(*args)
    assert len(graphs) == 1
    return out, [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
