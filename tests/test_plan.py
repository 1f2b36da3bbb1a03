"""`ikcode plan`: the same per-card model as the simulator, and the same answer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ikcode.admission import AdmissionConfig
from ikcode.bench.hardware import HardwareModel, adapter_schedule
from ikcode.bench.simulate import run_simulation
from ikcode.bench.workload import AgentsWorkload
from ikcode.cli import main
from ikcode.plan import VERDICT, plan
from ikcode.profiles import load_profile


def hardware() -> HardwareModel:
    return HardwareModel.from_dict(load_profile("deepinfer-4xb200").hardware)


def test_published_sizes():
    hw = hardware()
    fits = plan(hw, 450_000, 100)
    assert fits["fits"] and fits["verdict"] == VERDICT
    big = plan(hw, 500_000, 200)
    assert not big["fits"]
    assert (
        big["max_agents_at_this_size"] < 200 and big["over_by_agents"] == 200 - big["max_agents_at_this_size"]
    )
    assert big["max_agents_resident"] < 120  # the published "about 120 conversations" at 475K each
    assert big["predicted_wait_s"] > 0


def test_plan_cli_says_it_does_not_fit():
    args = ["plan", "--profile", "deepinfer-4xb200", "--context", "500000", "--agents", "200", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["fits"] is False and data["agents"] == 200
    text = CliRunner().invoke(main, args[:-1])
    assert "do not fit" in text.output


def test_plan_and_simulator_agree_on_the_resident_limit():
    """Small cards: below plan's limit the baseline keeps its hits; twice past it, it recomputes."""
    hw = replace(hardware(), cards=2)
    hw = replace(
        hw, weights_bytes=2 * (hw.card_memory_bytes * hw.memory_utilization - 2e6 * hw.kv_bytes_per_token)
    )
    limit = plan(hw, 100_000, 1)["max_agents_resident"]
    assert 10 <= limit <= 30
    load = AgentsWorkload(agents=limit - 2, context_tokens=100_000, duration_s=300.0, ramp_s=20.0)
    under = run_simulation(hw, AdmissionConfig(policy="fifo"), load)
    over = run_simulation(hw, AdmissionConfig(policy="fifo"), replace(load, agents=2 * limit))
    assert under["cached_token_share"] > 0.85
    assert over["cached_token_share"] < 0.6


def test_plan_and_simulator_agree_on_the_compute_limit():
    """200 x 500K on 4x B200 with ikcode: every turn in flight fits in memory (held once), so
    reading is the limit; 10% under plan's limit turns start in seconds, 25% past it they queue
    (admission told to ignore the limit: with it, new sessions wait for a slot instead,
    tests/test_simulated.py)."""
    profile = load_profile("deepinfer-4xb200")
    hw, schedule = hardware(), adapter_schedule(profile)
    result = plan(hw, 500_000, 200, engine_schedule=schedule)
    limit = result["max_agents_at_this_size"]
    assert not result["fits"] and result["limit"] == "compute", result
    assert result["max_agents_memory"] > limit
    ikcode = AdmissionConfig.from_dict(profile.admission, policy="ikcode")
    load = AgentsWorkload(agents=int(limit * 0.9), context_tokens=500_000)
    under = run_simulation(hw, ikcode, load, engine_schedule=schedule)
    unlimited = replace(ikcode, max_active_sessions=0)
    over = run_simulation(hw, unlimited, replace(load, agents=int(limit * 1.25)), engine_schedule=schedule)
    assert under["ttft"]["p50"] < 3.0 and under["failed"] == 0, under["ttft"]
    assert over["ttft"]["p50"] > 3 * under["ttft"]["p50"], (under["ttft"], over["ttft"])


def test_plan_refuses_an_empty_conversation_instead_of_dividing_by_zero():
    with pytest.raises(ValueError, match="context_tokens"):
        plan(HardwareModel(), 0, 10)


def test_plan_prints_the_profiles_own_watermark(tmp_path):
    from ikcode.profiles import load_profile

    text = Path(load_profile("deepinfer-4xb200").source).read_text()
    assert "prefill_watermark = 0.9\n" in text
    profile = tmp_path / "cards.toml"
    profile.write_text(text.replace("prefill_watermark = 0.9\n", "prefill_watermark = 0.8\n"))
    out = CliRunner().invoke(
        main, ["plan", "--profile", str(profile), "--context", "500000", "--agents", "20"]
    )
    assert out.exit_code == 0, out.output
    assert "under the 80% watermark" in out.output
