"""Reading a Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer files.

Names are already the Hugging Face ones the model expects; weights are converted to fp32. The
`safetensors` package is used when installed; otherwise a small reader of the (simple) format:
an 8-byte little-endian header length, a JSON header, then raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ikcode.model.config import ModelConfig
from ikcode.model.errors import ModelLoadError
from ikcode.model.tokenizer import Tokenizer

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def config_from_hf(config: dict, name: str) -> ModelConfig:
    model_type = config.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r}; supported: llama, qwen2, qwen3 (and mistral)"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelLoadError(f"unsupported RoPE scaling {rope_type!r} in config.json")
    if config.get("use_sliding_window"):  # Qwen2/Qwen3 configs carry it, normally false
        raise ModelLoadError("sliding-window attention (use_sliding_window: true) is not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    eos = config.get("eos_token_id")
    return ModelConfig(
        architecture=_MODEL_TYPES[model_type],
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        name=name,
    )


def _read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        return _read_safetensors_plain(path)
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _read_safetensors_plain(path: Path) -> dict[str, torch.Tensor]:
    data = path.read_bytes()
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
    except (struct.error, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a safetensors file: {exc}") from exc
    body = memoryview(data)[8 + header_len :]
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if spec["dtype"] not in _DTYPES:
            raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {spec['dtype']}")
        start, end = spec["data_offsets"]
        flat = torch.frombuffer(bytearray(body[start:end]), dtype=_DTYPES[spec["dtype"]])
        tensors[name] = flat.reshape(spec["shape"])
    return tensors


def load_hf_checkpoint(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    config_json = _read_json(directory / "config.json")
    if not config_json:
        raise ModelLoadError(f"{directory} has no config.json: not a Hugging Face checkpoint folder")
    quantized = config_json.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ModelLoadError(
            f"{directory} is a quantized checkpoint ({method}): its weights need their scales, which "
            "this engine does not apply; use the unquantized checkpoint or a GGUF of the model"
        )
    config = config_from_hf(config_json, name=directory.name)
    index = _read_json(directory / "model.safetensors.index.json").get("weight_map")
    if isinstance(index, dict) and index:  # the shards it names, not a consolidated copy beside them
        files = sorted({directory / str(shard) for shard in index.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{directory} has no *.safetensors weights (PyTorch .bin files are not supported)"
        )
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in _read_safetensors_file(file).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed by the model
            state_dict[name] = tensor.to(torch.float32).contiguous()
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)

    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{directory} has no tokenizer.json")
    generation = _read_json(directory / "generation_config.json")
    gen_eos = generation.get("eos_token_id")
    extra_eos = list(config.eos_token_ids)
    extra_eos += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    tokenizer = Tokenizer.from_tokenizer_json(
        tokenizer_file.read_text(encoding="utf-8"), _read_json(directory / "tokenizer_config.json"), extra_eos
    )
    template_file = directory / "chat_template.jinja"  # where newer checkpoints keep it
    if tokenizer.chat_template is None and template_file.is_file():
        tokenizer.chat_template = template_file.read_text(encoding="utf-8")
    return config, state_dict, tokenizer
