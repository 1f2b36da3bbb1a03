"""DeepInfer's own engine on a CPU: the sdist's `LLMEngine`, `Worker` step loop, C++ scheduler,
block manager, sequences and outputs (built by build.py), with only the GPU parts replaced.

What is replaced, and why it cannot run here:
- GPU kernel libraries and DeepInfer's kernel package (deep_ep, deep_gemm, flash_mla, tile_kernels,
  tilelang, deepinfer.model_executor.layers.tilelang_ops): CUDA/SM100 kernels. They are imported by
  the model and cache modules (e.g. worker/cache_engine.py:22-25, worker/worker.py:22-23) and become
  import stubs; nothing on the engine's control path calls them.
- `torch.cuda.Event` (llm_engine.py:91, worker/worker.py:165, ve/schema.py:50): a CPU event;
  `torch.cuda.current_device` (a log line, parallel_state.py:229): 0.
- `deepinfer.PLATFORM` (platform.py): the GPU platform's process groups are NCCL
  (parallel_state.py:75-76); here every group is gloo, as the CPU groups already are.
- The worker's GPU setup (worker/base.py:56-123: ModelRunner on cuda:N, CUDA device pinning,
  NUMA/CPU binding), model load (:183-190), memory profiling (:192-259), cache allocation (:261-263)
  and graph capture (:265-279): CpuWorker below. Its distributed init is DeepInfer's own
  (`_init_distributed_environment`, base.py:320-345: gloo init_process_group + init_parallel_groups).
- The forward and the sampler (model_runner.py:308-368): CpuModelRunner, a deterministic model whose
  next token is a function of the KV pages it reads through the sequence's block table and of the
  sliding-window ring in its state slot, so a wrong page or a wrong window after a resume changes
  the tokens.
- The state-slice kernels of `GPUCacheInterface` (cache_engine.py:762-848 call tilelang's
  select_state_slice / load_state_to_cache): CpuCacheInterface, same signatures, same contract
  (the slice ending at `last_hit_position`, read without checking that it is still held).
- The tokenizer and the model class lookup (llm_engine.py:197-206): no weights exist here.
Everything else, including `LLMEngine.__init__`, `step`, `add_request`, `abort_request`,
`has_unfinished_requests`, `pre_sampler_sync`, `finalize_seq`, `flush_inflight_reqs`,
`Worker.execute_model_step` and `_post_process_step`, runs as shipped.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

GPU_MODULES = (
    "deep_ep", "deep_gemm", "flash_mla", "tile_kernels", "tilelang",
    "deepinfer.model_executor.layers.tilelang_ops",
)  # fmt: skip
# Settings of the deterministic CPU engine. The ranks read them from the environment.
ENV_BLOCKS = "IKCODE_DEEPINFER_CPU_BLOCKS"  # KV blocks of 128 tokens per rank
ENV_WINDOW = "IKCODE_DEEPINFER_CPU_WINDOW"  # sliding window, tokens
ENV_EOS_AFTER = "IKCODE_DEEPINFER_CPU_EOS_AFTER"  # emit EOS after this many output tokens (0 = never)
ENV_FAIL_STATE_READ = "IKCODE_DEEPINFER_CPU_FAIL_STATE_READ"  # "1": the state-slice read raises (fault test)
ENV_STEP_SECONDS = "IKCODE_DEEPINFER_CPU_STEP_SECONDS"  # each forward with real rows takes at least this long
BLOCK_TOKENS = 128
EXTRA_STATE_TOKENS = 128  # DEEPINFER_PREFILL_STORE_EXTRA_SIZE's default (environ.py:164)
VOCAB = 1024
BOS, EOS = 0, 1
ENGINE_ENV = {
    "CUDA_VISIBLE_DEVICES": "0",
    "DEEPINFER_USE_NEXTN_DECODE": "0",  # multi-token prediction drafts come from a GPU model
    "DEEPINFER_ENABLE_MTP_VARLEN": "0",
    "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1",  # the NORMAL engine's default (arg_utils.py:50-54)
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "140",
    "DEEPINFER_PREFILL_STORE_EXTRA_STATE": "1",
    "DEEPINFER_BATCH_INVARIANT": "1",
    "DEEPINFER_CPP_LOG_LEVEL": "warn",
}


class _Anything:
    """Stands for any attribute of a GPU kernel module at import time."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *a: Any, **k: Any) -> Any:
        if len(a) == 1 and not k and callable(a[0]) and not isinstance(a[0], _Anything):
            return a[0]  # used as a decorator
        return _Anything()

    def __getitem__(self, key: Any) -> Any:
        return _Anything()

    def __iter__(self) -> Any:
        return iter(())

    def __mro_entries__(self, bases: Any) -> tuple[type, ...]:
        return (object,)

    def _op(self, *a: Any) -> Any:
        return _Anything()

    __or__ = __ror__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _op
    __floordiv__ = __mod__ = __neg__ = __lshift__ = __rshift__ = _op


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything()


class _GpuStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if any(fullname == m or fullname.startswith(m + ".") for m in GPU_MODULES):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: Any) -> None:
        pass


class CpuEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: CpuEvent) -> float:
        return (end.t - self.t) * 1000.0


_installed = False


def install(pkg_dir: Path) -> None:
    """Make the built sdist importable with the GPU parts replaced. Idempotent, per process."""
    global _installed
    if _installed:
        return
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    sys.path.insert(0, str(pkg_dir))
    sys.meta_path.insert(0, _GpuStubFinder())
    torch.cuda.Event = CpuEvent  # type: ignore[misc, assignment]
    torch.cuda.current_device = lambda: 0  # each rank's engine is on "cuda:0" of its process
    import deepinfer
    from deepinfer.platform import Platform, PlatformEnum

    class CpuPlatform(Platform):
        enum = PlatformEnum.GPU
        tilelang_ops_backend = "cuda"
        distributed_backend = "gloo"
        fp8_sf_type = torch.int32

        def get_distributed_options(self) -> object:
            return None

    deepinfer.PLATFORM = CpuPlatform()  # type: ignore[attr-defined]
    from deepinfer.engine import llm_engine
    from deepinfer.worker import worker as worker_module

    from . import cpu_worker

    worker_module.Worker = cpu_worker.make_worker_class(worker_module.Worker)  # type: ignore[misc]
    llm_engine.get_hf_tokenizer = lambda path, *a, **k: types.SimpleNamespace(**special_tokens(path))
    llm_engine._get_model_architecture = lambda model_config: cpu_worker.CpuModel
    llm_engine.get_bf16_tflops_limit = lambda: 1.0  # a GPU spec-sheet figure, for the stats line
    _installed = True


def special_tokens(model_dir: str) -> dict[str, int]:
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return {"eos_token_id": hf["eos_token_id"], "bos_token_id": hf["bos_token_id"]}


def write_model_dir(path: Path, window: int = 128, vocab: int = VOCAB, eos: int = EOS) -> Path:
    """A DeepSeek-V4.1 config.json that DeepInfer's own parser accepts (hugging_face/config.py:237-328),
    tiny: 3 layers, two sliding-window layers and a compressed last layer, which makes YoCo truncation
    possible (model_metadata_utils.py:89-93: the first ratio-1 layer ends the prefill side)."""
    text = {
        "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": vocab,
        "max_position_embeddings": 65536, "hidden_act": "silu", "attention_dropout": 0.0,
        "attention_bias": False, "rms_norm_eps": 1e-6, "swiglu_limit": 10.0, "tie_word_embeddings": False,
        "sliding_window": window, "rope_theta": 10000.0, "q_lora_rank": 64, "head_dim": 512,
        "qk_rope_head_dim": 64, "num_key_value_heads": 1, "o_lora_rank": 64, "o_groups": 1, "hc_mult": 1,
        "hc_eps": 1e-6, "hc_sinkhorn_iters": 1, "compress_ratios": [0, 0, 1],
        "candidate_source_layer_id": None, "index_source_layer_ids": [2], "kv_source_layer_ids": [2],
        "compress_rope_theta": 10000.0, "index_topk": 64, "index_n_heads": 4, "index_head_dim": 64,
        "moe_intermediate_size": 64, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "norm_topk_prob": True,
        "topk_method": "noaux_tc", "dspark_block_size": 4, "dspark_target_layer_ids": [0],
        "dspark_markov_rank": 1, "dspark_noise_token_id": 2, "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2, "num_nextn_predict_layers": 0,
    }  # fmt: skip
    hf = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0"},
        "pad_token_id": BOS, "bos_token_id": BOS, "eos_token_id": eos, "text_config": text,
        "vision_config": {"hidden_size": 64, "downsample_ratio": 2},
    }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    return path


def kv_value(token: np.ndarray | int, position: np.ndarray | int) -> Any:
    """What the CPU model stores for a token at a position (never 0: 0 is an unwritten slot)."""
    return ((np.int64(token) * 1_000_003) ^ (np.int64(position) * 7_919)) % 2_147_483_647 + 1
