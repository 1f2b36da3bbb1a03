"""The DeepInfer backend: DeepSeek's DeepInfer (deepinfer==0.1.0) behind the Engine protocol,
with ikcode's prefix cache committed when the engine frees a sequence. deepinfer itself is
imported lazily (only when an engine is built without an explicit backend)."""

from ikcode.engines.deepinfer.config import REQUIRED_ENVIRONMENT, DeepInferConfig
from ikcode.engines.deepinfer.engine import DeepInferEngine
from ikcode.engines.deepinfer.machine import MachineCheckError, check_machine

__all__ = ["REQUIRED_ENVIRONMENT", "DeepInferConfig", "DeepInferEngine", "MachineCheckError", "check_machine"]
