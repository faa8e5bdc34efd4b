"""What engine adapters share: :mod:`maskplug.engines.sdk`."""
