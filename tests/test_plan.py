"""`ikcode plan`: tier capacities and the verdict for the 4x B200 profile."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ikcode.cli import main
from ikcode.engines.simulated import HardwareModel
from ikcode.plan import VERDICT, plan
from ikcode.profiles import load_profile


def test_plan_numbers_for_the_published_sizes():
    hw = HardwareModel.from_dict(load_profile("deepinfer-4xb200").hardware)
    p = plan(hw, 450_000, 100)
    assert p["kv_bytes_per_token"] == 6386
    assert p["conversations_on_gpu"] == 57_000_000 // (450_000 + 200)
    assert p["conversations_in_host"] == 617_000_000 // (450_000 + 200)
    assert p["fits_gpu_all"] and p["verdict"] == VERDICT
    big = plan(hw, 500_000, 200)
    assert not big["fits_gpu_all"]  # 200 x 500K = 100M tokens > 57M
    assert big["conversations_on_gpu"] < 200 < big["conversations_on_gpu"] + big["conversations_in_host"]
    assert 0 < big["active_at_once"] < 200


def test_plan_cli_json():
    result = CliRunner().invoke(
        main, ["plan", "--profile", "deepinfer-4xb200", "--context", "500000", "--agents", "200", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["verdict"] == "size the GPU tier for sessions active at once"
    assert data["agents"] == 200


def test_plan_refuses_an_empty_conversation_instead_of_dividing_by_zero():
    import pytest

    hw = HardwareModel()
    with pytest.raises(ValueError, match="context_tokens"):
        plan(hw, 0, 10)
    assert hw.cold_read_tokens_per_s(0) == 0.0
