"""The default model's tokenizer, rebuilt from GGUF metadata, against transformers' own GGUF loading."""

from __future__ import annotations

import pytest

from ikcode.model.loader import LoadedModel

pytestmark = pytest.mark.model

CORPUS = [
    "Hello, world! How are you today?",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n-1) + fib(n-2)\n",
    "    4 spaces then 8        x, and tabs\t\t1\t2",
    "digits 1234567890, pi=3.14159, 2026-11-29T21:03:29Z, 0x1F, 1e-5, x² ½ ①②",
    "unicode: café naïve Ωmega 日本語 한국어 Привет мир 😀👍🏽 🇫🇷",
    "whitespace runs:   \n\n\n\t \r\n  \u00a0end   ",
    "I'm sure they'll say WE'RE fine; you've it's she'd",
    '{"key": [1, 2, {"nested": null}], "s": "a\\nb"}',
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n",
    "<|endoftext|><repo_name>ikcode<file_sep>README.md",
    "git diff --stat HEAD~3 | grep -E '^ [a-z]+/' && echo $((1+2))",
    "",
]


@pytest.fixture(scope="module")
def model(default_model: LoadedModel) -> LoadedModel:
    return default_model


def test_vocabulary_and_special_tokens(model: LoadedModel) -> None:
    tok = model.tokenizer
    assert tok.vocab_size == 49152
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.eos_token_ids[0] == 2 and 0 in tok.eos_token_ids
    assert tok.encode("<|im_start|>assistant\n")[0] == 1
    assert len(tok.special_token_ids) == 17


def test_round_trip(model: LoadedModel) -> None:
    for text in CORPUS:
        assert model.tokenizer.decode(model.tokenizer.encode(text)) == text


def test_every_digit_is_its_own_token(model: LoadedModel) -> None:
    # SmolLM2's tokenizer.json and llama.cpp's "smollm" pre-tokenizer isolate each numeric char.
    tok = model.tokenizer
    assert [tok.id_to_token(i) for i in tok.encode("year 2026")] == ["year", "Ġ", "2", "0", "2", "6"]
    assert [tok.id_to_token(i) for i in tok.encode("    4")] == ["ĠĠĠĠ", "4"]


def test_chat_template_renders_chatml(model: LoadedModel) -> None:
    import jinja2

    template = jinja2.Environment().from_string(model.chat_template or "")
    text = template.render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = model.tokenizer.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2


@pytest.fixture(scope="module")
def hf_tokenizer(model: LoadedModel):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model.source.parent), gguf_file=model.source.name)


def test_matches_transformers_on_text_without_numbers(model: LoadedModel, hf_tokenizer) -> None:
    for text in CORPUS:
        if any(c.isnumeric() for c in text):
            continue
        assert model.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text


def test_matches_transformers_with_smollm_pre_tokenizer(model: LoadedModel, hf_tokenizer) -> None:
    """transformers' GGUF table lacks the "smollm" pre-tokenizer and falls back to GPT-2's split,
    which differs only where whitespace precedes a digit ("    4"). Given the split SmolLM2's own
    tokenizer.json specifies, its vocabulary, merges and special tokens must agree with ours
    everywhere."""
    from tokenizers import pre_tokenizers

    backend = hf_tokenizer.backend_tokenizer
    original = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    try:
        for text in CORPUS:
            assert model.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
    finally:
        backend.pre_tokenizer = original
