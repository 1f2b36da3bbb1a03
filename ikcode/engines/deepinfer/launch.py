"""The DeepInfer engine and its tokenizer from a profile (what `ikcode up --profile
deepinfer-4xb200` builds): the machine is checked first, with a message that says what is missing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ikcode.engines.deepinfer.config import DeepInferConfig
from ikcode.engines.deepinfer.machine import MachineCheckError, check_machine

# Names the module:function that provides the deepinfer names in each rank process.
BACKEND_SWITCH = "IKCODE_DEEPINFER_BACKEND"


def load_tokenizer(model_dir: str) -> Any:
    from ikcode.model.tokenizer import Tokenizer

    folder = Path(model_dir)
    try:
        text = (folder / "tokenizer.json").read_text(encoding="utf-8")
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except OSError as err:
        raise MachineCheckError(f"cannot read the tokenizer of {folder}: {err}") from None
    return Tokenizer.from_tokenizer_json(text, config)


def deepinfer_stack_parts(profile: Any, model_path: str | None = None) -> tuple[Any, Any, str]:
    """(engine, tokenizer, description). Raises MachineCheckError when this machine cannot run it."""
    from ikcode.engines.deepinfer.engine import DeepInferEngine

    config = DeepInferConfig.from_profile(profile, model_path)
    backend = os.environ.get(BACKEND_SWITCH, "").strip()
    if backend and backend != "deepinfer":
        # The CPU test harness (docs/deepinfer.md): DeepInfer's own engine core built on this
        # machine, with its GPU parts replaced. Not a way to serve: a way to test the adapter.
        config.backend = backend
    else:
        check_machine(config.data_parallel_size)
    if not config.model or not Path(config.model).is_dir():
        raise MachineCheckError(
            f"the deepinfer profile needs the model folder: set [model] path in {profile.source} or pass "
            f"--model (got {config.model!r})"
        )
    tokenizer = load_tokenizer(config.model)
    engine = DeepInferEngine(config)
    engine.start()  # spawns the ranks; each imports deepinfer with its environment set first
    what = (
        f"deepinfer engine, {config.data_parallel_size} data-parallel rank(s), {config.model}, "
        f"max_model_len {config.max_model_len}"
    )
    return engine, tokenizer, what
