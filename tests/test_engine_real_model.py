"""The embedded engine on the real default model (SmolLM2-135M-Instruct): a correct answer, and a
long prompt repeated with a new tail served from the prefix cache."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from ikcode.engines.base import EngineRequest, FinishReason, SamplingParams
from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


@pytest.fixture(scope="module")
def engine(loaded):
    e = EmbeddedEngine(
        loaded.config, loaded.state_dict, EmbeddedEngineConfig(kv_memory_bytes=1 << 30, num_threads=2)
    )
    e.start()
    yield e
    e.shutdown(drain_timeout_s=5)


def _chat(loaded, text: str) -> list[int]:
    template = jinja2.Environment().from_string(loaded.chat_template)
    rendered = template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)
    return loaded.tokenizer.encode(rendered)


def test_capital_of_france(loaded, engine):
    ids = _chat(loaded, "What is the capital of France?")
    tokens, final = engine.submit(EngineRequest("france", ids, SamplingParams(max_tokens=30))).collect(120)
    assert "Paris" in loaded.tokenizer.decode(tokens)
    assert final.finish_reason is FinishReason.STOP


@pytest.mark.slow
def test_long_prompt_repeated_is_served_from_cache(loaded, engine):
    import ikcode.engines as engines_package

    # Real source text as a long prompt: the engine boundary modules.
    engines_dir = Path(engines_package.__file__).parent
    names = ("errors", "request", "events", "stream", "base")
    text = "".join((engines_dir / f"{name}.py").read_text() for name in names)
    prompt = loaded.tokenizer.encode(text * 4)[:6000]
    assert len(prompt) == 6000
    _, cold = engine.submit(EngineRequest("cold", prompt, SamplingParams(max_tokens=1))).collect(600)
    while not engine.idle():
        pass
    tail = loaded.tokenizer.encode(
        " And now a new question about the code above, please answer briefly." * 20
    )[:200]
    _, warm = engine.submit(EngineRequest("warm", prompt + tail, SamplingParams(max_tokens=1))).collect(600)
    assert warm.stats.cached_tokens >= 0.95 * len(prompt)
    assert warm.stats.computed_tokens <= len(tail) + engine.info.block_size
    assert warm.stats.ttft_s < cold.stats.ttft_s
