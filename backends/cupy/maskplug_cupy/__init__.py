"""maskplug-cupy: a CUDA C kernel backend for ``maskplug.apply_grammar_bitmask``, launched through CuPy.

Installing the distribution registers the backend ``"cupy"`` through the
``maskplug`` entry-point group. Importing this package imports neither CuPy nor
a CUDA library: a missing CuPy, device or NVRTC shows up as the backend's
unavailability reason. ``maskplug_cupy.kernel.cuda_source()`` returns the CUDA
source, for ahead-of-time builds; importing ``maskplug_cupy.ops`` registers
``torch.ops.maskplug_cupy.apply_bitmask`` (with a fake implementation, for
``torch.compile``).
"""

from __future__ import annotations

from .plugin import BACKEND, CupyBackend

__all__ = ["BACKEND", "CupyBackend"]
