"""The embedded engine: paged KV, continuous batching, chunked prefill, prefix cache, in PyTorch."""

from ikcode.engines.embedded.config import EmbeddedEngineConfig
from ikcode.engines.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine", "EmbeddedEngineConfig"]
