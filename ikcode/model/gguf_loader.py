"""Reading a GGUF file: ModelConfig from its metadata, fp32 weights under Hugging Face names.

Weights are dequantized with ggml's own `gguf` package. GGUF stores shapes innermost-first; the
numpy arrays it gives are already [out, in] like PyTorch. For `llama` files llama.cpp's converter
permuted the q/k projection rows so that its interleaved RoPE works; we undo that so the model can
use the standard rotate-half RoPE (Qwen2 and Qwen3 files are not permuted).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from ikcode.engines.base import ModelLoadError
from ikcode.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face state-dict name of a GGUF tensor name; ModelLoadError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    raise ModelLoadError(
        f"unsupported tensor {gguf_name!r} in GGUF file (not a plain Llama/Qwen2/Qwen3 model)"
    )


def open_reader(path: Path):  # -> gguf.GGUFReader
    import gguf  # imported here: only GGUF loading needs it

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_metadata(reader) -> dict[str, object]:
    """All key/value metadata as Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def config_from_metadata(meta: dict[str, object], tensor_names: set[str], name: str) -> ModelConfig:
    arch = str(meta.get("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"unsupported RoPE scaling {scaling!r} in this GGUF file")

    def value(key: str, default: object = None) -> object:
        full = f"{arch}.{key}"
        if full not in meta and default is None:
            raise ModelLoadError(f"GGUF metadata lacks {full!r}")
        return meta.get(full, default)

    hidden = int(value("embedding_length"))  # type: ignore[call-overload]
    heads = int(value("attention.head_count"))  # type: ignore[call-overload]
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(value("vocab_size", len(tokens) if isinstance(tokens, list) else 0))  # type: ignore[call-overload]
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(value("feed_forward_length")),  # type: ignore[call-overload]
        num_layers=int(value("block_count")),  # type: ignore[call-overload]
        num_heads=heads,
        num_kv_heads=int(value("attention.head_count_kv", heads)),  # type: ignore[call-overload]
        head_dim=int(value("attention.key_length", hidden // heads)),  # type: ignore[call-overload]
        rope_theta=float(value("rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        # Stored as float32 (9.99999974e-06): its shortest repr gives back the intended 1e-05.
        rms_norm_eps=float(str(np.float32(value("attention.layer_norm_rms_epsilon", 1e-5)))),  # type: ignore[arg-type]
        max_position_embeddings=int(value("context_length", 4096)),  # type: ignore[call-overload]
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        name=name,
    )


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert `permute`: interleaved-pair rows back to rotate-half order."""
    rows = weight.shape[0]
    pairs = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def read_state_dict(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors, dequantized to fp32 and renamed; q/k unpermuted for llama files."""
    from gguf.quants import dequantize

    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(f"tensor {tensor.name}: unsupported type {tensor.tensor_type.name}") from exc
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if config.architecture == "llama" and re.search(r"attn_[qk]\.", tensor.name):
            heads = config.num_heads if "attn_q" in tensor.name else config.num_kv_heads
            array = unpermute_qk(array, heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # F32 tensors are views of the read-only memory map
            array = array.copy()
        state_dict[name] = torch.from_numpy(array)
    return state_dict
