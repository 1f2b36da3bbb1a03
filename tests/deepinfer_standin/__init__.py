"""A stand-in for the slice of deepinfer==0.1.0 that ikcode's adapter touches. Tests only.

DeepInfer builds only on SM100/Ascend machines with CUDA 13, so the adapter is tested against
this module, written from /work/shared/facts/deepinfer.md; each behaviour cites the DeepInfer
source line it mirrors (llm_engine.py, scheduler.py, memory.py, sequence.py).

Names the facts file does not give, assumed here and in the adapter (to check on the real
package first; each is one attribute access in ikcode/engines/deepinfer):
- `LLMEngine.abort_request(request_id)` (the facts only say "add/abort/step");
- `Sequence.status` readable, its name ending in WAITING while queued (to tell an aborted WAITING
  sequence, which never reaches finalize_seq, from a RUNNING one);
- `engine.scheduler` (Scheduler with try_allocate_seq, add_sequence, free_seq, pin_blocks,
  unpin_blocks, get_num_free_blocks) and `engine.cache_engine` (the worker's CacheEngine with
  `gpu_cache`, a list of per-layer page tensors indexed by block id, `gpu_states`, and the state
  hooks) reachable from the engine object;
- `Sequence.num_cached_tokens` advancing while the sequence runs (read for state snapshots);
- `EngineArgs.dist_init_addr` and `num_gpu_blocks` exist only here (rendezvous and memory size).
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
