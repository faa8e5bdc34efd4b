"""``torch.ops.maskplug_cupy.apply_bitmask``: the CUDA C kernel as a ``torch.library`` op.

With the op, ``torch.compile(fullgraph=True)`` traces a model step that masks
its logits as one opaque node instead of breaking the graph at the CuPy
launch; the fake implementation says the op mutates ``logits`` in place and
returns nothing. Arguments are the normalised ones of
``maskplug.KernelBackend.apply``.
"""

from __future__ import annotations

import torch

from . import kernel

__all__ = ["apply_bitmask"]


@torch.library.custom_op("maskplug_cupy::apply_bitmask", mutates_args=("logits",))
def apply_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    request: torch.Tensor,
    position: torch.Tensor,
    cu_logits: torch.Tensor,
    vocab_size: int,
    mask_tail: bool,
) -> None:
    """Mask ``logits`` in place with the CUDA C kernel (see :func:`maskplug_cupy.kernel.launch`)."""
    if logits.device.type != "cuda":
        import maskplug

        raise maskplug.BackendUnavailable(
            f"logits: maskplug_cupy::apply_bitmask runs on CUDA tensors, got a tensor on {logits.device}"
        )
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
