"""A stand-in for the slice of deepinfer==0.1.0 that ikcode's adapter touches. Tests only.

DeepInfer builds only on SM100/Ascend machines with CUDA 13, so the adapter is tested against
this module, written from /work/shared/facts/deepinfer.md; each behaviour cites the DeepInfer
source line it mirrors (llm_engine.py, scheduler.py, memory.py, sequence.py).
"""

from .llm_engine import EOS_TOKEN_ID, VOCAB_SIZE, EngineArgs, LLMEngine, SamplingParams
from .memory import BLOCK_SIZE, YOCO_KEEP_TOKENS
from .scheduler import PREFILL_WATERMARK
from .sequence import RequestOutput, Sequence, SequenceStatus

__all__ = [
    "BLOCK_SIZE",
    "EOS_TOKEN_ID",
    "PREFILL_WATERMARK",
    "VOCAB_SIZE",
    "YOCO_KEEP_TOKENS",
    "EngineArgs",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
]
