"""Developer tools that are also importable (e.g. `from tools.make_tiny_checkpoint import make_tiny_checkpoint`)."""
