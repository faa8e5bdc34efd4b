"""``torch.ops.maskplug_triton.apply_bitmask``: the kernel as a ``torch.library`` op.

The custom op lets ``torch.compile(fullgraph=True)`` trace a model step that
masks its logits: Dynamo records one opaque node instead of breaking the graph
on the Triton launch, and the fake implementation tells it that the op only
mutates ``logits`` in place and returns nothing. Arguments are the normalised
ones of ``maskplug.kernels.sdk.KernelBackend.apply``; the op is defined by
``maskplug.kernels.sdk.define_apply_op``.
"""

from __future__ import annotations

from maskplug.kernels.sdk import define_apply_op

from . import kernel

__all__ = ["apply_bitmask"]

apply_bitmask = define_apply_op("maskplug_triton", kernel.launch)
"""Mask ``logits`` in place with the Triton kernel (see :func:`maskplug_triton.kernel.launch`)."""
