"""Kernel backends: the built-in ``torch`` backend and the public SDK every backend builds on.

:mod:`maskplug.kernels.sdk` is what a backend distribution imports (the
:class:`~maskplug.kernels.sdk.KernelBackend` protocol, the cached-availability
base, bit-pattern tables, device helpers, the custom-op factory);
:mod:`maskplug.kernels.torch_backend` is the built-in backend, registered
through the same hook as outside ones.
"""
