"""Repetition penalties in the embedded engine's sampler: llama.cpp's arithmetic, only the last
`repeat_last_n` tokens, stop tokens exempt, and the same tokens whether the prompt's prefix came
from the cache or was computed."""

from __future__ import annotations

import random

import pytest
import torch

from ikcode.engines.base import EngineRequest, InvalidSampling, SamplingParams
from ikcode.engines.embedded.sampler import penalize, sample
from tests.tiny_model import assert_pool_clean, tiny_engine

PENALTY = SamplingParams(max_tokens=24, ignore_eos=True, repeat_penalty=1.3, repeat_last_n=64)


def test_penalty_arithmetic_is_llama_cpp_s():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5, repeat_last_n=8)
    out = penalize(logits, params, [0, 1, 1, 1, 3])
    # Positive logits are divided, negative ones multiplied; then count * freq + presence off.
    expected = torch.tensor(
        [2.0 / 2 - 0.25 - 0.5, -1.0 * 2 - 3 * 0.25 - 0.5, 0.5, 3.0 / 2 - 0.25 - 0.5, -2.0]
    )
    assert torch.allclose(out, expected)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # input untouched


def test_only_the_last_n_tokens_count_and_stop_tokens_are_exempt():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=2, stop_token_ids=(3,))
    out = penalize(logits, params, [0, 1, 2, 3])
    assert out.tolist() == [1.0, 1.0, 0.5, 1.0]  # token 0 and 1 left the window; 3 stops
    off = SamplingParams(repeat_penalty=1.0)
    assert penalize(logits, off, [0, 1]) is logits


def test_greedy_choice_moves_off_a_repeated_token():
    logits = torch.tensor([0.0, 5.0, 4.8])
    assert sample(logits, SamplingParams(), None, [1, 1]) == 1
    assert sample(logits, SamplingParams(repeat_penalty=1.1), None, [1, 1]) == 2


def test_bad_penalty_values_are_rejected():
    with pytest.raises(InvalidSampling, match="repeat_penalty"):
        SamplingParams(repeat_penalty=0.0).validate()
    with pytest.raises(InvalidSampling, match="repeat_last_n"):
        SamplingParams(repeat_last_n=-1).validate()


def test_cached_prefix_gives_the_same_tokens_as_cold_with_penalties():
    torch.set_num_threads(1)
    rng = random.Random(17)
    engine = tiny_engine(kv_memory_bytes=1024 * 1024, max_num_seqs=4, start=False)
    engine.start()
    changed = 0
    for trial in range(8):
        # Repetitive prompts, so the penalty has tokens to act on inside its window.
        motif = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))]
        prompt = (motif * 40)[: rng.randrange(60, 200)]
        cold, _ = engine.submit(
            EngineRequest(f"cold{trial}", prompt, PENALTY, cache_salt=f"s{trial}")
        ).collect(30)
        warm, final = engine.submit(EngineRequest(f"warm{trial}", prompt, PENALTY)).collect(30)
        again, final_again = engine.submit(EngineRequest(f"again{trial}", prompt, PENALTY)).collect(30)
        plain, _ = engine.submit(
            EngineRequest(f"plain{trial}", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        ).collect(30)
        assert final_again.stats.cached_tokens_device >= 16, "the prompt was not served from the cache"
        assert warm == cold == again, f"trial {trial}"
        changed += plain != cold
    assert changed >= 4, "the penalty changed almost no answer: is it applied?"
    assert_pool_clean(engine)
    engine.shutdown()


@pytest.mark.model
def test_default_model_hello_py_same_cold_and_warm_at_the_local_profile_settings(default_model):
    """The loop case on the real default model: the local profile's penalties, greedy and seeded
    at its temperature; a cold read (salted) and a read served from the cache answer alike."""
    import jinja2

    from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from ikcode.profiles import load_profile

    model = load_profile("local").model
    hello = 'def main():\n    print("Hello, world!")\n\n\nmain()\n'
    messages = [{"role": "user", "content": f"hello.py:\n```python\n{hello}```\nWhat does hello.py print?"}]
    template = jinja2.Environment().from_string(default_model.chat_template)
    prompt = default_model.tokenizer.encode(template.render(messages=messages, add_generation_prompt=True))
    engine = EmbeddedEngine(
        default_model.config,
        default_model.state_dict,
        EmbeddedEngineConfig(
            kv_memory_bytes=1 << 28, num_threads=2, weights=model.weights, float_weights=model.float_weights
        ),
    )
    engine.start()
    try:
        for temperature, seed in ((0.0, None), (model.default_temperature, 7)):
            params = SamplingParams(
                temperature=temperature,
                seed=seed,
                max_tokens=48,
                repeat_penalty=model.repeat_penalty,
                repeat_last_n=model.repeat_last_n,
                frequency_penalty=model.frequency_penalty,
                presence_penalty=model.presence_penalty,
            )
            cold, _ = engine.submit(
                EngineRequest(f"cold{temperature}", prompt, params, cache_salt="x")
            ).collect(300)
            engine.submit(EngineRequest(f"seed{temperature}", prompt, params)).collect(300)
            warm, final = engine.submit(EngineRequest(f"warm{temperature}", prompt, params)).collect(300)
            assert final.stats.cached_tokens >= len(prompt) - 16, "the prompt was not served from the cache"
            assert warm == cold, (
                default_model.tokenizer.decode(cold) + " | " + default_model.tokenizer.decode(warm)
            )
    finally:
        engine.shutdown(drain_timeout_s=5)
