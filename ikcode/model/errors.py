"""Errors the model layer raises (the layers above map them: stack.py to its own start error)."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model file is missing, corrupt or of an unsupported architecture (raised at start)."""
