"""A tiny random-initialised Llama/Qwen2/Qwen3 model for fast tests: ModelConfig + seeded state dict.

2 layers, d_model 64, 4 heads / 2 KV heads (GQA), vocab 300, Hugging Face tensor names, fp32.
Qwen3 gets q/k norms and a head_dim of 32 (not 64 / 4), as its real configs decouple the two.
Weights are scaled up a little so greedy decoding is not a flat, tie-ridden distribution.
"""

from __future__ import annotations

import torch

from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from ikcode.engines.embedded.sequence import Sequence
from ikcode.model.config import ModelConfig

TINY_VOCAB = 300
TINY_EOS = 2


def tiny_config(architecture: str = "llama", tie: bool = False, **overrides) -> ModelConfig:
    fields = dict(
        architecture=architecture,
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32 if architecture == "qwen3" else 16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        attention_bias=architecture == "qwen2",
        qk_norm=architecture == "qwen3",
        bos_token_id=1,
        eos_token_ids=(TINY_EOS,),
        name=f"tiny-{architecture}",
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float | None = None) -> torch.Tensor:
        s = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * s

    d, inter = cfg.hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd = {
        "model.embed_tokens.weight": w(cfg.vocab_size, d, scale=1.0),
        "model.norm.weight": 1 + 0.1 * w(d, scale=1),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(q_out, d)
        sd[p + "self_attn.k_proj.weight"] = w(kv_out, d)
        sd[p + "self_attn.v_proj.weight"] = w(kv_out, d)
        sd[p + "self_attn.o_proj.weight"] = w(d, q_out)
        if cfg.attention_bias:
            for n, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                sd[p + f"self_attn.{n}_proj.bias"] = 0.1 * w(size, scale=1)
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = 1 + 0.1 * w(cfg.head_dim, scale=1)
            sd[p + "self_attn.k_norm.weight"] = 1 + 0.1 * w(cfg.head_dim, scale=1)
        sd[p + "mlp.gate_proj.weight"] = w(inter, d)
        sd[p + "mlp.up_proj.weight"] = w(inter, d)
        sd[p + "mlp.down_proj.weight"] = w(d, inter)
        sd[p + "input_layernorm.weight"] = 1 + 0.1 * w(d, scale=1)
        sd[p + "post_attention_layernorm.weight"] = 1 + 0.1 * w(d, scale=1)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = w(cfg.vocab_size, d, scale=1.0)
    return sd


class InstrumentedEngine(EmbeddedEngine):
    """The production engine with what only tests need:
    - release_lag_steps: release a finished sequence that many steps after its final token, as
      engines that close a sequence on a later step do (the commit still happens at release);
    - final_token_bug: the published adapter bug, the cache entry dropped when the final token
      came out, so when the engine releases the sequence there is nothing left to commit;
    - batch_sizes: how many sequences each forward ran (proof that requests shared a batch)."""

    def __init__(self, *args, release_lag_steps: int = 0, final_token_bug: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.release_lag_steps = release_lag_steps
        self.final_token_bug = final_token_bug
        self.batch_sizes: list[int] = []
        run = self.runner.run

        def recording_run(scheduled):
            self.batch_sizes.append(len(scheduled))
            return run(scheduled)

        self.runner.run = recording_run

    def release_step(self, seq: Sequence) -> int:
        return self.steps + self.release_lag_steps

    def blocks_to_commit(self, seq: Sequence) -> list:
        return [] if self.final_token_bug else super().blocks_to_commit(seq)


def tiny_engine(
    architecture: str = "llama",
    tie: bool = False,
    seed: int = 0,
    *,
    start: bool = True,
    release_lag_steps: int = 0,
    final_token_bug: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
    **config,
) -> InstrumentedEngine:
    """A InstrumentedEngine over the tiny model, one torch thread, on CPU; start=False leaves the engine
    thread off, so requests submitted before start() share the first steps. state_dict: other
    weights for the same tiny architecture."""
    cfg = tiny_config(architecture, tie)
    defaults = dict(kv_memory_bytes=256 * 1024, num_threads=1, device="cpu", max_prefill_tokens_per_step=64)
    defaults.update(config)
    engine = InstrumentedEngine(
        cfg,
        tiny_state_dict(cfg, seed) if state_dict is None else state_dict,
        EmbeddedEngineConfig(**defaults),
        release_lag_steps=release_lag_steps,
        final_token_bug=final_token_bug,
    )
    if start:
        engine.start()
    return engine


def block_bytes(engine: EmbeddedEngine, block: int) -> bytes:
    """Raw K and V bytes of one device block, all layers (compared bit for bit)."""
    k = engine.runner.k_pool[:, block].contiguous().cpu()
    v = engine.runner.v_pool[:, block].contiguous().cpu()
    return k.numpy().tobytes() + v.numpy().tobytes()


def wait_idle(engine: EmbeddedEngine, timeout_s: float = 10.0) -> None:
    """Wait until every request has been released (release lag included)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not engine.idle():
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not become idle")
        time.sleep(0.002)


def assert_pool_clean(engine: EmbeddedEngine) -> None:
    """Every device block is free or evictable again, and the cache's books agree."""
    wait_idle(engine)
    engine.cache.check_invariants()
    assert engine.cache.num_free_blocks() == engine.num_blocks
    load = engine.load()
    assert load.kv_blocks_used == 0
    assert load.kv_blocks_cached == len(engine.cache.pool.index)  # every cached block unreferenced
