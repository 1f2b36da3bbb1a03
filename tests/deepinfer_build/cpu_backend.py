"""The CPU test switch of the DeepInfer backend:
`IKCODE_DEEPINFER_BACKEND=tests.deepinfer_build.cpu_backend:load` makes every rank process load
DeepInfer from the sdist built here (build.py) with its GPU parts replaced (cpu_runtime.py),
instead of the installed package; the machine check is skipped.

    python -m tests.deepinfer_build.cpu_backend model-dir PATH   # write the tiny model folder
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.deepinfer_build import build, cpu_runtime

SWITCH = "tests.deepinfer_build.cpu_backend:load"


def load() -> SimpleNamespace:
    """The names the adapter uses, from DeepInfer's own modules."""
    cpu_runtime.install(build.build(quiet=True))
    from deepinfer._C.engine import RequestOutput
    from deepinfer.engine.arg_utils import EngineArgs
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.sampling_params import SamplingParams

    return SimpleNamespace(LLMEngine=LLMEngine, EngineArgs=EngineArgs, SamplingParams=SamplingParams,
                           RequestOutput=RequestOutput)  # fmt: skip


def write_model_dir(path: Path, vocab: int = cpu_runtime.VOCAB, eos: int = cpu_runtime.EOS) -> Path:
    """The tiny DeepSeek-V4.1 config plus a word-level tokenizer over its 1,024 ids, so the gateway
    can render and tokenize (ikcode reads tokenizer.json; DeepInfer reads config.json)."""
    cpu_runtime.write_model_dir(path, vocab=vocab, eos=eos)
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = vocab  # what ikcode's DeepInferConfig.model_facts reads
    (path / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {"<s>": cpu_runtime.BOS, "</s>": cpu_runtime.EOS, "<unk>": 2}
    for i in range(3, cpu_runtime.VOCAB - 256):
        vocab[f"w{i}"] = i
    for b in range(256):  # bytes, so any text tokenizes
        vocab[f"<0x{b:02X}>"] = cpu_runtime.VOCAB - 256 + b
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t, i in (("<s>", 0), ("</s>", 1))],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "ByteFallback"},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }  # fmt: skip
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "model-dir":
        print(write_model_dir(Path(sys.argv[2])))
    else:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
