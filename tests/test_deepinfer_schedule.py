"""The adapter's step settings reach DeepInfer's own scheduler, in each rank process.

The prefill vote intervals are read by DeepInfer's SchedulerConfig from the environment at import
(config.py:193-194, environ.py:174,177), the chunk from EngineArgs (arg_utils.py:107-113); the
C++ scheduler takes them from that config (scheduler.hpp:105-108). The `[deepinfer]` profile table
sets them, and the simulator's ikcode rows use the same values (ikcode/bench/server.py).
"""

from __future__ import annotations

import pytest

from ikcode.engines.deepinfer.config import DeepInferConfig
from ikcode.profiles import load_profile
from tests.deepinfer_build.harness import real_engine, wait_quiet


def test_the_profile_sets_the_adapters_step_settings():
    profile = load_profile("deepinfer-4xb200")
    config = DeepInferConfig.from_profile(profile, model_path="/nonexistent")
    assert config.schedule() == {key: int(value) for key, value in profile.deepinfer.items()}
    env = config.process_environment(0)
    assert env["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"] == str(config.prefill_attempt_interval)
    assert env["DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL"] == str(config.prefill_any_attempt_interval)


def test_unknown_or_bad_step_settings_are_refused():
    profile = load_profile("deepinfer-4xb200").model_copy(update={"deepinfer": {"prefill_every": 3}})
    with pytest.raises(ValueError, match="unknown \\[deepinfer\\] keys: prefill_every"):
        DeepInferConfig.from_profile(profile, model_path="/nonexistent")
    with pytest.raises(ValueError, match="prefill_attempt_interval must be >= 1"):
        DeepInferConfig(model="/nonexistent", prefill_attempt_interval=0).validate()


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"affinity_max_imbalance": -1}, "affinity_max_imbalance must be >= 0"),  # routing raised
        ({"prefill_watermark": 1.5, "gpu_tier_fraction": 0.5}, "prefill_watermark must be in"),
        ({"prime_min_tokens": -5}, "prime_min_tokens must be >= 0"),
        ({"host_tier_bytes_per_rank": -1}, "host_tier_bytes_per_rank must be >= 0"),
        ({"data_parallel_size": 4, "visible_devices": "0,1"}, "names 2 GPU"),  # ranks shared a card
        ({"environment": {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "off"}}, "may not set"),
    ],
)
def test_settings_that_break_the_engine_later_are_refused_at_once(setting, says):
    with pytest.raises(ValueError, match=says):
        DeepInferConfig(model="/nonexistent", **setting).validate()


@pytest.mark.deepinfer
def test_the_real_scheduler_runs_with_the_adapters_settings(tmp_path):
    engine = real_engine(
        tmp_path, max_num_batched_tokens=4096, prefill_attempt_interval=5, prefill_any_attempt_interval=9
    )
    try:
        (check,) = wait_quiet(engine)
        assert check["max_num_batched_tokens"] == 4096
        assert (check["prefill_attempt_interval"], check["prefill_any_attempt_interval"]) == (5, 9)
    finally:
        engine.shutdown(drain_timeout_s=5)


@pytest.mark.deepinfer
def test_none_keeps_deepinfers_own_defaults(tmp_path):
    engine = real_engine(tmp_path, prefill_attempt_interval=None, prefill_any_attempt_interval=None)
    try:
        (check,) = wait_quiet(engine)
        assert (check["prefill_attempt_interval"], check["prefill_any_attempt_interval"]) == (70, 100)
    finally:
        engine.shutdown(drain_timeout_s=5)


@pytest.mark.deepinfer
def test_the_profiles_cache_policy_runs_on_the_ranks(tmp_path):
    """[cache] policy was checked, then ignored: the ranks kept LRU while the simulator ran the
    policy the profile named."""
    profile = load_profile("deepinfer-4xb200")
    profile = profile.model_copy(update={"cache": {**profile.cache, "policy": "ikcode"}})
    assert DeepInferConfig.from_profile(profile, model_path="/nonexistent").cache_policy == "ikcode"
    with pytest.raises(ValueError, match="unknown cache policy 'lfu'"):
        DeepInferConfig(model="/nonexistent", cache_policy="lfu").validate()
    engine = real_engine(tmp_path, cache_policy="ikcode")
    try:
        assert [c["cache_policy"] for c in wait_quiet(engine)] == ["IkcodePolicy"]
    finally:
        engine.shutdown(drain_timeout_s=5)
