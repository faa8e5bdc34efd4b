"""Built-in kernel backends (registered through the same hooks as outside ones)."""
