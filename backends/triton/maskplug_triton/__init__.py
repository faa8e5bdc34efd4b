"""maskplug-triton: a Triton kernel backend for ``maskplug.apply_grammar_bitmask``.

Installing the distribution registers the backend ``"triton"`` through the
``maskplug`` entry-point group; ``backend="auto"`` then uses it on CUDA devices
when no backend of higher priority is available. Importing this package does
not import Triton: the kernel module loads on first use, so a missing or broken
Triton shows up as the backend's unavailability reason, not as an import error.
Importing ``maskplug_triton.ops`` registers ``torch.ops.maskplug_triton.apply_bitmask``
(with a fake implementation, for ``torch.compile``).
"""

from __future__ import annotations

from .plugin import BACKEND, TritonBackend

__all__ = ["BACKEND", "TritonBackend"]
