"""`ikcode up --profile deepinfer-4xb200`: refused within seconds, saying why, on a machine without
GPUs; with the CPU test switch (IKCODE_DEEPINFER_BACKEND, docs/deepinfer.md) it starts two rank
processes of DeepInfer's real engine core, reaches healthy, and serves the official SDK."""

from __future__ import annotations

import os
import time

import anthropic
import httpx
import pytest

from ikcode import auth
from ikcode.profiles import shipped_profiles_dir
from tests.deepinfer_build import cpu_backend, cpu_runtime
from tests.deepinfer_build.harness import built_core
from tests.serving import free_port, ikcode

pytestmark = [pytest.mark.deepinfer, pytest.mark.slow]


def test_up_without_gpus_refuses_within_seconds(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "IKCODE_DEEPINFER_BACKEND"}
    env["PATH"] = "/usr/bin:/bin"  # no nvidia-smi here
    started = time.monotonic()
    result = ikcode("up", "--profile", "deepinfer-4xb200", "--port", str(free_port()), env=env, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "no NVIDIA GPU found" in result.stderr, result.stderr
    assert elapsed < 60, elapsed  # python start-up on a loaded machine; nothing is loaded


def two_rank_profile(tmp_path, port: int):
    text = (shipped_profiles_dir() / "deepinfer-4xb200.toml").read_text()
    for old, new in (
        ("port = 8741", f"port = {port}"),
        ("cards = 4", "cards = 2"),
        ("context_window = 1048576", "context_window = 16384"),
        ("host_cache_mb = 262144", "host_cache_mb = 16"),
        ("max_output_tokens = 32000", "max_output_tokens = 64"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "deepinfer-2-cpu.toml"
    path.write_text(text)
    return path


def test_up_with_the_cpu_harness_serves_two_ranks(tmp_path):
    built_core()
    port = free_port()
    model = cpu_backend.write_model_dir(tmp_path / "model")
    env = dict(os.environ)
    env.update({
        "IKCODE_DEEPINFER_BACKEND": cpu_backend.SWITCH, cpu_runtime.ENV_BLOCKS: "256",
        "PYTHONPATH": os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]),
    })  # fmt: skip
    started = ikcode("up", "--profile", str(two_rank_profile(tmp_path, port)), "--model", str(model),
                     env=env, timeout=600)  # fmt: skip
    assert started.returncode == 0, started.stderr[-3000:]
    url = f"http://127.0.0.1:{port}"
    try:
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "ok" and health["engine"] == "deepinfer"
        client = anthropic.Anthropic(base_url=url, auth_token=auth.load_or_create_token(), max_retries=0,
                                     timeout=120)  # fmt: skip
        ask = {"model": "deepseek-v4.1-flash", "max_tokens": 8,
               "messages": [{"role": "user", "content": "hello from the CPU harness"}]}  # fmt: skip
        message = client.messages.create(**ask)
        assert message.usage.output_tokens >= 1 and message.content[0].type == "text"
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        assert final.usage.output_tokens >= 1
        logs = ikcode("logs", env=env)
        assert "2 data-parallel rank(s)" in (logs.stdout + logs.stderr)
    finally:
        stopped = ikcode("down", env=env)
    assert stopped.returncode == 0, stopped.stderr
