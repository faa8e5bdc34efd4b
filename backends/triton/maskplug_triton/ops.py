"""``torch.ops.maskplug_triton.apply_bitmask``: the kernel as a ``torch.library`` op.

The custom op lets ``torch.compile(fullgraph=True)`` trace a model step that
masks its logits: Dynamo records one opaque node instead of breaking the graph
on the Triton launch, and the fake implementation tells it that the op only
mutates ``logits`` in place and returns nothing. Arguments are the normalised
ones of ``maskplug.KernelBackend.apply``.
"""

from __future__ import annotations

import torch

from . import kernel

__all__ = ["apply_bitmask"]


@torch.library.custom_op("maskplug_triton::apply_bitmask", mutates_args=("logits",))
def apply_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    request: torch.Tensor,
    position: torch.Tensor,
    cu_logits: torch.Tensor,
    vocab_size: int,
    mask_tail: bool,
) -> None:
    """Mask ``logits`` in place with the Triton kernel (see :func:`maskplug_triton.kernel.launch`)."""
    kernel.launch(logits, bitmask, request, position, cu_logits, vocab_size, mask_tail)


@apply_bitmask.register_fake
def _apply_bitmask_fake(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    request: torch.Tensor,
    position: torch.Tensor,
    cu_logits: torch.Tensor,
    vocab_size: int,
    mask_tail: bool,
) -> None:
    # Shapes never change and nothing is returned: tracing needs no more.
    return None
