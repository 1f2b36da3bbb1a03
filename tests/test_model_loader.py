"""Loading real files written in the test: a tiny GGUF (llama and qwen2) and a Hugging Face folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ikcode.model import weight_cache
from ikcode.model.errors import ModelLoadError
from ikcode.model.loader import expected_shapes, load_model
from ikcode.model.tokenizer import CHATML_TEMPLATE, Tokenizer

gguf = pytest.importorskip("gguf")

TINY = dict(vocab=3 + 256 + 2, hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, head_dim=16, ctx=256)
MERGES = [("h", "i"), ("Ġ", "t")]
GGUF_NAMES = {
    v: k
    for k, v in {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }.items()
}
LAYER_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, *rest = hf.split(".")
    part, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of llama checkpoints (interleaved RoPE)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    from ikcode.model.config import ModelConfig

    config = ModelConfig(
        architecture=arch, vocab_size=TINY["vocab"], hidden_size=TINY["hidden"],
        intermediate_size=TINY["ffn"],
        num_layers=TINY["layers"], num_heads=TINY["heads"], num_kv_heads=TINY["kv_heads"],
        head_dim=TINY["head_dim"], tie_word_embeddings=tied, attention_bias=arch == "qwen2",
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape).astype(np.float32) for name, shape in expected_shapes(config).items()
    }


def write_gguf(
    path: Path, arch: str, weights: dict[str, np.ndarray], quantize: bool = True, arch_name: str | None = None
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["ctx"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    tok = Tokenizer.from_vocab(merges=MERGES)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([tok.id_to_token(i) for i in range(tok.vocab_size)])
    writer.add_token_types([3, 3, 3] + [1] * (tok.vocab_size - 3))
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML_TEMPLATE)
    for name, w in weights.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = llama_cpp_permute(w, TINY["heads"] if ".q_proj." in name else TINY["kv_heads"])
        if quantize and w.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q8_round_trip(w: np.ndarray) -> np.ndarray:
    q8 = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_weights_come_back_under_hf_names_unpermuted(tmp_path: Path, arch: str) -> None:
    weights = random_weights(arch, tied=arch == "llama")
    loaded = load_model(write_gguf(tmp_path / f"{arch}.gguf", arch, weights))
    c = loaded.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        arch, 2, 64, 4, 2, 16,
    )  # fmt: skip
    assert (c.vocab_size, c.max_position_embeddings, c.rope_theta, c.rms_norm_eps) == (
        261,
        256,
        50000.0,
        1e-6,
    )
    assert c.tie_word_embeddings == (arch == "llama")
    assert c.attention_bias == (arch == "qwen2")
    assert c.eos_token_ids[0] == 2 and c.bos_token_id == 0
    assert set(loaded.state_dict) == set(weights)
    for name, w in weights.items():
        want = q8_round_trip(w) if w.ndim == 2 else w
        np.testing.assert_array_equal(loaded.state_dict[name].numpy(), want, err_msg=name)
    assert loaded.tokenizer.encode("hi there") == [
        loaded.tokenizer.token_to_id("hi"),
        *loaded.tokenizer.encode(" there"),
    ]
    assert loaded.chat_template == CHATML_TEMPLATE


def test_second_load_is_a_cache_hit_and_a_changed_file_is_not(tmp_path: Path) -> None:
    weights = random_weights("llama", tied=False)
    path = write_gguf(tmp_path / "m.gguf", "llama", weights, quantize=False)
    first, second = load_model(path), load_model(path)
    assert not first.from_cache and second.from_cache
    for name in weights:
        assert torch.equal(first.state_dict[name], second.state_dict[name])
    assert second.tokenizer.encode("hi 12") == first.tokenizer.encode("hi 12")
    assert second.config == first.config

    old_entry = weight_cache.entry_dir(path)
    write_gguf(path, "llama", random_weights("llama", tied=False, seed=1), quantize=False)
    os.utime(path, ns=(1, 1))  # a different mtime, whatever the clock resolution
    third = load_model(path)
    assert not third.from_cache
    assert not torch.equal(third.state_dict["model.norm.weight"], first.state_dict["model.norm.weight"])
    assert not old_entry.exists()  # the stale entry of the same path was dropped


def test_use_cache_false_writes_nothing(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", random_weights("llama", tied=True), quantize=False)
    load_model(path, use_cache=False)
    assert not weight_cache.entry_dir(path).exists()


def test_bad_paths_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(garbage)
    other = tmp_path / "model.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="unsupported model path"):
        load_model(other)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    weights = random_weights("llama", tied=True)
    path = write_gguf(tmp_path / "m.gguf", "llama", weights, quantize=False, arch_name="gptneox")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gptneox'"):
        load_model(path)


def test_truncated_gguf_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", random_weights("llama", tied=True), quantize=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError):
        load_model(cut)


def write_hf_folder(folder: Path, arch: str, weights: dict[str, np.ndarray], tied: bool) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    config = {
        "model_type": arch, "vocab_size": TINY["vocab"], "hidden_size": TINY["hidden"],
        "intermediate_size": TINY["ffn"], "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"], "num_key_value_heads": TINY["kv_heads"],
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "tie_word_embeddings": tied, "bos_token_id": 0, "eos_token_id": 2,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in weights.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text(Tokenizer.from_vocab(merges=MERGES).backend.to_str())
    tok_config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_folder(tmp_path: Path, arch: str) -> None:
    pytest.importorskip("safetensors")
    weights = random_weights(arch, tied=arch == "qwen2")
    loaded = load_model(write_hf_folder(tmp_path / "ckpt", arch, weights, tied=arch == "qwen2"))
    c = loaded.config
    assert (c.architecture, c.rope_theta, c.max_position_embeddings, c.head_dim) == (arch, 1e6, 512, 16)
    assert c.attention_bias == (arch == "qwen2") and c.tie_word_embeddings == (arch == "qwen2")
    assert set(loaded.state_dict) == set(weights)
    for name, w in weights.items():
        want = torch.from_numpy(w).to(torch.bfloat16).float()
        assert torch.equal(loaded.state_dict[name], want), name
    assert loaded.tokenizer.eos_token_ids[:2] == (2, 0)
    assert loaded.chat_template == CHATML_TEMPLATE
    assert loaded.tokenizer.encode("<|im_start|>hi") == [1, loaded.tokenizer.token_to_id("hi")]


def test_safetensors_plain_reader_matches_the_package(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from ikcode.model.safetensors_loader import _read_safetensors_file, _read_safetensors_plain

    folder = write_hf_folder(tmp_path / "ckpt", "llama", random_weights("llama", tied=False), tied=False)
    ours, theirs = (
        _read_safetensors_plain(folder / "model.safetensors"),
        _read_safetensors_file(folder / "model.safetensors"),
    )
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_hf_folder_with_wrong_shapes(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    weights = random_weights("llama", tied=False)
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:10]
    with pytest.raises(ModelLoadError, match=r"up_proj.weight has shape \(10, 64\), expected \(96, 64\)"):
        load_model(write_hf_folder(tmp_path / "ckpt", "llama", weights, tied=False))


def test_a_quantized_checkpoint_or_unused_weights_are_refused(tmp_path: Path) -> None:
    """An fp8 checkpoint loaded as raw codes, its scales ignored: a broken model without a word."""
    pytest.importorskip("safetensors")
    folder = write_hf_folder(tmp_path / "fp8", "llama", random_weights("llama", tied=False), tied=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ModelLoadError, match=r"quantized checkpoint \(fp8\)"):
        load_model(folder)
    weights = random_weights("llama", tied=False)
    weights["model.layers.0.self_attn.q_proj.weight_scale_inv"] = np.ones((1, 1), dtype=np.float32)
    with pytest.raises(ModelLoadError, match="1 weights this model does not use, e.g. .*weight_scale_inv"):
        load_model(write_hf_folder(tmp_path / "scales", "llama", weights, tied=False))


def test_the_weight_cache_knows_a_file_by_its_bytes_and_mends_a_damaged_entry(tmp_path: Path) -> None:
    """Same path, size and mtime (`cp -p`, `rsync -a`): the old weights were served. A damaged
    entry was never rebuilt (every start dequantized again)."""
    path = write_gguf(tmp_path / "m.gguf", "qwen2", random_weights("qwen2", tied=True), quantize=False)
    first = load_model(path)
    stamp = path.stat().st_mtime_ns
    write_gguf(path, "qwen2", random_weights("qwen2", tied=True, seed=1), quantize=False)
    os.utime(path, ns=(stamp, stamp))
    other = load_model(path)
    assert not other.from_cache
    assert not torch.equal(other.state_dict["model.norm.weight"], first.state_dict["model.norm.weight"])
    entry = weight_cache.entry_dir(path)
    (entry / "state_dict.pt").write_bytes(b"cut")
    assert not load_model(path).from_cache  # read back from the file, and stored again
    assert load_model(path).from_cache


def test_a_cache_hit_takes_the_name_asked_for(tmp_path: Path, monkeypatch) -> None:
    from ikcode.model import default_model

    path = write_gguf(tmp_path / "m.gguf", "qwen2", random_weights("qwen2", tied=True), quantize=False)
    by_path = load_model(path)  # named after the file's general.name (or its stem)
    monkeypatch.setattr(default_model, "default_model_path", lambda: path)
    as_default = load_model(None)
    assert (
        as_default.from_cache and as_default.config.name == default_model.SERVED_NAME != by_path.config.name
    )


def test_gguf_metadata_that_does_not_add_up_is_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(TINY, "heads", 0)
    path = write_gguf(tmp_path / "m.gguf", "qwen2", random_weights("qwen2", tied=True), quantize=False)
    with pytest.raises(ModelLoadError, match="m.gguf"):
        load_model(path)
