"""The simulated server: deterministic with a seed, real cache hits, fast."""

from __future__ import annotations

from ikcode.admission import AdmissionConfig
from ikcode.bench.simulate import run_simulation
from ikcode.bench.workload import AgentsWorkload
from ikcode.engines.simulated import HardwareModel
from ikcode.profiles import load_profile


def hardware() -> HardwareModel:
    return HardwareModel.from_dict(load_profile("deepinfer-4xb200").hardware)


def small(seed: int = 0) -> AgentsWorkload:
    return AgentsWorkload(agents=10, context_tokens=60_000, duration_s=120.0, ramp_s=10.0, seed=seed)


def strip(report: dict) -> dict:
    report = dict(report)
    report.pop("simulator")
    return report


def test_same_seed_same_report_other_seed_differs():
    a = run_simulation(hardware(), AdmissionConfig(policy="ikcode"), small(1))
    b = run_simulation(hardware(), AdmissionConfig(policy="ikcode"), small(1))
    c = run_simulation(hardware(), AdmissionConfig(policy="ikcode"), small(2))
    assert strip(a) == strip(b)
    assert strip(a)["ttft"] != strip(c)["ttft"]


def test_hardware_reproduces_the_published_rates():
    hw = hardware()
    assert abs(hw.cold_read_tokens_per_s(450_000) - 200_000) < 2_000
    assert hw.device_tier_tokens // 475_000 == 120
    assert hw.reload_seconds(450_000) < hw.prefill_seconds(0, 450_000) / 30


def test_warm_turns_hit_the_real_cache_and_nothing_fails():
    report = run_simulation(hardware(), AdmissionConfig(policy="fifo"), small())
    assert report["failed"] == 0
    assert report["cached_token_share"] > 0.8
    assert report["cache"]["prefix_cache_requests_total"] == report["requests"]
    assert report["ttft"]["warm"]["p50"] < report["ttft"]["cold"]["p50"]
