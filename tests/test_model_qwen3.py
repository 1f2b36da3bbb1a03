"""Qwen3 (per-head q/k RMSNorm, head_dim != hidden / heads, no q/k/v bias) against transformers.

The test writes a random Qwen3 checkpoint folder (config.json with `model_type: qwen3`,
model.safetensors, tokenizer files), loads it with ikcode's loader, and compares with
`transformers.Qwen3ForCausalLM` loaded from the same folder: the logits of one forward, and the
greedy tokens the embedded engine generates. The prefix cache check (warm == cold, bit for bit)
runs the engine determinism test on the tiny Qwen3 model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import tests.test_engine_determinism as determinism
from ikcode.engines.base import EngineRequest, SamplingParams
from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from ikcode.model.config import ModelConfig
from ikcode.model.llama import ForwardBatch, LlamaModel, RowGroup
from ikcode.model.loader import LoadedModel, expected_shapes, load_model
from ikcode.model.paged_attention import QueryGroup, SeqAttention
from ikcode.model.tokenizer import CHATML_TEMPLATE, Tokenizer

# head_dim 48 while hidden / heads = 16: the two must not be confused anywhere.
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 48, "hidden_act": "silu", "attention_bias": False,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "use_sliding_window": False, "bos_token_id": 0, "eos_token_id": 2,
    "torch_dtype": "float32",
}  # fmt: skip
PROMPT = [5, 17, 42, 99, 7, 250, 31, 8, 64, 128, 3, 77, 200, 11, 19, 23, 160, 45, 90, 12]


def write_qwen3_folder(folder: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    from ikcode.model.safetensors_loader import config_from_hf

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(config_from_hf(CONFIG, "qwen3")).items():
        if len(shape) == 1:  # norms: around 1, so that a missing norm shows
            tensors[name] = 1 + 0.3 * torch.randn(shape, generator=generator)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
    save_file(tensors, str(folder / "model.safetensors"))
    tokenizer = Tokenizer.from_vocab()
    (folder / "tokenizer.json").write_text(tokenizer.backend.to_str())
    tok_config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("safetensors")
    return write_qwen3_folder(tmp_path_factory.mktemp("qwen3") / "ckpt")


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> LoadedModel:
    return load_model(checkpoint, use_cache=False)


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3ForCausalLM")
    return transformers.Qwen3ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def model_logits(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Every position's logits from one prompt forward of ikcode's model (one block, causal mask)."""
    n = len(ids)
    model = LlamaModel(cfg)
    model.load_hf_state_dict(state_dict)
    group = cfg.num_heads // cfg.num_kv_heads
    pool_shape = (cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim)
    k_pools, v_pools = torch.zeros(pool_shape), torch.zeros(pool_shape)
    causal = torch.full((n, n), float("-inf")).triu(1).repeat(group, 1)
    rows = torch.arange(n)
    seq = SeqAttention(torch.tensor([0]), [QueryGroup(0, n, n, n, causal)], first_block=0)
    batch = ForwardBatch(torch.tensor(ids), rows, rows, rows, [seq], [RowGroup(0, n)])
    with torch.inference_mode():
        return model.logits(model(batch, k_pools, v_pools), [True] * n)


def test_config_is_read_as_qwen3(loaded: LoadedModel) -> None:
    c = loaded.config
    assert (c.architecture, c.qk_norm, c.attention_bias, c.head_dim, c.hidden_size) == (
        "qwen3",
        True,
        False,
        48,
        64,
    )
    assert "model.layers.1.self_attn.k_norm.weight" in loaded.state_dict


def test_logits_match_transformers(loaded: LoadedModel, reference) -> None:
    with torch.inference_mode():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    ours = model_logits(loaded.config, loaded.state_dict, PROMPT)
    diff = (theirs - ours).abs().max().item()
    scale = theirs.abs().max().item()
    print(f"qwen3 logits max |diff| vs transformers: {diff:.3e} (largest |logit| {scale:.2f})")
    assert diff < 1e-4
    # The comparison can fail: the same weights without the q/k norms give other logits.
    without_norms = model_logits(dataclasses.replace(loaded.config, qk_norm=False), loaded.state_dict, PROMPT)
    assert (theirs - without_norms).abs().max().item() > 1e-2


def test_engine_greedy_tokens_match_transformers(loaded: LoadedModel, reference) -> None:
    torch.set_num_threads(1)
    engine = EmbeddedEngine(
        loaded.config,
        loaded.state_dict,
        EmbeddedEngineConfig(kv_memory_bytes=1 << 20, num_threads=1, device="cpu"),
    )
    engine.start()
    try:
        ours, _ = engine.submit(
            EngineRequest("q3", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
        ).collect(30)
    finally:
        engine.shutdown()
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(8):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(PROMPT) :]


@pytest.mark.parametrize("float_weights", ["fp32", "bf16"])
def test_cached_prefix_equals_cold(float_weights: str) -> None:
    determinism.test_cached_prefix_equals_cold("qwen3", float_weights)


def write_qwen3_gguf(path: Path, state_dict: dict[str, torch.Tensor]) -> Path:
    """The same weights as a llama.cpp-style Qwen3 GGUF (F32; names from gguf's own Qwen3 map)."""
    gguf = pytest.importorskip("gguf")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, CONFIG["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(CONFIG["num_hidden_layers"])
    writer.add_vocab_size(CONFIG["vocab_size"])  # the embedding has rows past the tokenizer
    writer.add_context_length(CONFIG["max_position_embeddings"])
    writer.add_embedding_length(CONFIG["hidden_size"])
    writer.add_feed_forward_length(CONFIG["intermediate_size"])
    writer.add_head_count(CONFIG["num_attention_heads"])
    writer.add_head_count_kv(CONFIG["num_key_value_heads"])
    writer.add_key_length(CONFIG["head_dim"])
    writer.add_value_length(CONFIG["head_dim"])
    writer.add_rope_freq_base(CONFIG["rope_theta"])
    writer.add_layer_norm_rms_eps(CONFIG["rms_norm_eps"])
    tokenizer = Tokenizer.from_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)])
    writer.add_token_types([3, 3, 3] + [1] * (tokenizer.vocab_size - 3))
    writer.add_token_merges([])
    writer.add_eos_token_id(2)
    for name, tensor in state_dict.items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_qwen3_loads_the_same_model(loaded: LoadedModel, tmp_path: Path) -> None:
    from_gguf = load_model(write_qwen3_gguf(tmp_path / "qwen3.gguf", loaded.state_dict), use_cache=False)
    c = from_gguf.config
    assert (c.architecture, c.qk_norm, c.head_dim, c.attention_bias) == ("qwen3", True, 48, False)
    assert set(from_gguf.state_dict) == set(loaded.state_dict)
    for name, tensor in loaded.state_dict.items():  # not permuted: llama.cpp permutes llama q/k only
        assert torch.equal(from_gguf.state_dict[name], tensor), name
    ours = model_logits(c, from_gguf.state_dict, PROMPT)
    assert torch.equal(ours, model_logits(loaded.config, loaded.state_dict, PROMPT))
