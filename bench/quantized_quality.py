"""Quantized decode weights (int8, int4) vs fp32 on the default model: greedy agreement and a
perplexity delta.

    .venv/bin/python bench/quantized_quality.py [--prompts 20] [--tokens 256] [--threads 2]
        [--weights int8,int4]

Greedy agreement: 20 fixed chat prompts, each answered greedily for --tokens tokens (EOS ignored)
by two engines over the same weights, both with batch_invariance="off" (so greedy requests take
the shared decode path): weights="fp32" and each of --weights. Printed: the share of positions with
the same token, and the tokens before the first difference (mean, and how many prompts agree all
the way). Once two answers differ they continue from different text, so the first difference is
the strict measure.

Perplexity: a fixed English text through the model in 8-row groups (as 8 concurrent decode rows
share a matmul), fp32 vs quantized weights, same prompt attention; exp(mean NLL of each next token).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import uuid
from pathlib import Path

import jinja2
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ikcode.engines.base import EngineRequest, SamplingParams  # noqa: E402
from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from ikcode.model.llama import ForwardBatch, RowGroup  # noqa: E402
from ikcode.model.loader import LoadedModel, load_model  # noqa: E402

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a hash table is in two sentences.",
    "How do I list all files in a directory with bash?",
    "What is the capital of France?",
    "Give three tips for writing clean code.",
    "Write a haiku about the ocean.",
    "What does the git rebase command do?",
    "Explain recursion to a ten year old.",
    "Write a SQL query that counts rows per customer.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I read a JSON file in Python?",
    "What causes the seasons on Earth?",
    "Write a short email asking for a meeting next week.",
    "What is a binary search and when should I use it?",
    "Name five fruits that are red.",
    "How does HTTP caching work?",
    "Write a bash loop that prints numbers 1 to 10.",
    "What is the boiling point of water at sea level?",
    "Explain the difference between TCP and UDP.",
]

TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the "
    "political bands which have connected them with another, and to assume among the powers of "
    "the earth, the separate and equal station to which the Laws of Nature and of Nature's God "
    "entitle them, a decent respect to the opinions of mankind requires that they should declare "
    "the causes which impel them to the separation. We hold these truths to be self-evident, that "
    "all men are created equal, that they are endowed by their Creator with certain unalienable "
    "Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure these "
    "rights, Governments are instituted among Men, deriving their just powers from the consent of "
    "the governed, That whenever any Form of Government becomes destructive of these ends, it is "
    "the Right of the People to alter or to abolish it, and to institute new Government, laying "
    "its foundation on such principles and organizing its powers in such form, as to them shall "
    "seem most likely to effect their Safety and Happiness. Prudence, indeed, will dictate that "
    "Governments long established should not be changed for light and transient causes; and "
    "accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils "
    "are sufferable, than to right themselves by abolishing the forms to which they are accustomed."
)


def chat_tokens(model: LoadedModel, text: str) -> list[int]:
    template = jinja2.Environment().from_string(model.chat_template)
    rendered = template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)
    return model.tokenizer.encode(rendered)


def make_engine(model: LoadedModel, threads: int, weights: str) -> EmbeddedEngine:
    """weights: fp32, int8, int4, or bf16 (every matmul in bf16: EmbeddedEngineConfig.float_weights)."""
    float_weights = "bf16" if weights == "bf16" else "fp32"
    weights = "fp32" if weights == "bf16" else weights
    config = EmbeddedEngineConfig(
        kv_memory_bytes=64 * 1024 * 1024,
        num_threads=threads,
        device="cpu",
        batch_invariance="off",
        weights=weights,
        float_weights=float_weights,
    )
    engine = EmbeddedEngine(model.config, model.state_dict, config)
    engine.start()
    return engine


def greedy(engine: EmbeddedEngine, prompt: list[int], tokens: int) -> list[int]:
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out, final = engine.submit(EngineRequest(uuid.uuid4().hex, prompt, sampling)).collect(900)
    if final.error is not None:
        raise RuntimeError(str(final.error))
    return out


@torch.inference_mode()
def perplexity(engine: EmbeddedEngine, tokens: list[int], quantized: bool) -> float:
    """exp(mean NLL) of tokens[1:], the rows in 8-row matmul groups, written to blocks 0.. ."""
    runner = engine.runner
    n, block_size = len(tokens), runner.block_size
    blocks = list(range(-(-n // block_size)))
    attention = runner._prompt_attention(blocks, 0, 0, n)
    padded = n + (-n % 4)
    groups = [RowGroup(s, min(s + 8, padded), quantized) for s in range(0, padded, 8)]
    ids = torch.tensor(tokens + [0] * (padded - n))
    positions = torch.tensor(list(range(n)) + [0] * (padded - n))
    batch = ForwardBatch(ids, positions, torch.arange(n), torch.arange(n), [attention], groups)
    hidden = runner.model(batch, runner.k_pool, runner.v_pool)[:n]
    logits = torch.cat(
        [
            runner.model.logits(hidden[s : s + 8], [not quantized] * len(hidden[s : s + 8]))
            for s in range(0, n, 8)
        ]
    )
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(tokens[1:]))
    return math.exp(nll.item())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--weights", default="int8,int4,bf16", help="int8, int4 (decode rows), bf16 (all rows): each vs fp32"
    )
    args = parser.parse_args(argv)

    model = load_model(None)
    torch.set_num_threads(args.threads)
    print(f"model {model.config.name}; {args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    fp32 = make_engine(model, args.threads, "fp32")
    try:
        text = model.tokenizer.encode(TEXT)
        ppl_fp32 = perplexity(fp32, text, quantized=False)
        prompts = [chat_tokens(model, p) for p in PROMPTS[: args.prompts]]
        reference = [greedy(fp32, prompt, args.tokens) for prompt in prompts]
        for kind in args.weights.split(","):
            compare(model, args, kind, text, ppl_fp32, prompts, reference)
    finally:
        fp32.shutdown(drain_timeout_s=5)
    return 0


def compare(model, args, kind, text, ppl_fp32, prompts, reference) -> None:
    engine = make_engine(model, args.threads, kind)
    try:
        ppl = perplexity(engine, text, quantized=kind != "bf16")
        print(f"perplexity over {len(text)} tokens: fp32 {ppl_fp32:.3f}, {kind} {ppl:.3f} "
              f"({100 * (ppl / ppl_fp32 - 1):+.2f}%)")  # fmt: skip
        same = total = 0
        firsts = []
        started = time.monotonic()
        for text_prompt, prompt, a in zip(PROMPTS, prompts, reference, strict=False):
            b = greedy(engine, prompt, args.tokens)
            same += sum(x == y for x, y in zip(a, b, strict=False))
            total += len(a)
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
            firsts.append(first)
            print(f"  {first:>4} tokens before the first difference: {text_prompt}", flush=True)
        full = sum(f == args.tokens for f in firsts)
        print(f"{kind}: greedy agreement with fp32 over {args.tokens} tokens on {len(firsts)} prompts: "
              f"{100 * same / total:.1f}% of positions the same; first difference after "
              f"{sum(firsts) / len(firsts):.1f} tokens on average; {full}/{len(firsts)} prompts identical "
              f"all the way ({time.monotonic() - started:.0f} s; "
              f"load average {os.getloadavg()[0]:.2f})")  # fmt: skip
    finally:
        engine.shutdown(drain_timeout_s=5)


if __name__ == "__main__":
    raise SystemExit(main())
