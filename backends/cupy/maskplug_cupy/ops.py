"""``torch.ops.maskplug_cupy.apply_bitmask``: the CUDA C kernel as a ``torch.library`` op.

With the op, ``torch.compile(fullgraph=True)`` traces a model step that masks
its logits as one opaque node instead of breaking the graph at the CuPy
launch; the fake implementation says the op mutates ``logits`` in place and
returns nothing. Arguments are the normalised ones of
``maskplug.kernels.sdk.KernelBackend.apply``; the op is defined by
``maskplug.kernels.sdk.define_apply_op`` and refuses tensors that are not on a
CUDA device.
"""

from __future__ import annotations

from maskplug.kernels.sdk import define_apply_op

from . import kernel

__all__ = ["apply_bitmask"]

apply_bitmask = define_apply_op("maskplug_cupy", kernel.launch, cuda_only=True)
"""Mask ``logits`` in place with the CUDA C kernel (see :func:`maskplug_cupy.kernel.launch`)."""
