"""`ikcode bench --simulate`: the JSON report's shape and the chart, through the real CLI."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ikcode.cli import main


def test_bench_simulate_writes_json_and_chart(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = [
        "bench",
        "--simulate",
        "--profile",
        "deepinfer-4xb200",
        "--agents",
        "8",
        "--context",
        "50000",
        "--duration",
        "90",
        "--ramp",
        "5",
        "--policy",
        "fifo",
        "--policy",
        "ikcode",
        "--seed",
        "3",
        "--json",
        str(out),
        "--chart",
        str(png),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [r["config"]["policy"] for r in data["runs"]] == ["fifo", "ikcode"]
    for run in data["runs"]:
        for key in ("p50", "p95", "p99"):
            assert run["ttft"][key] >= 0
            assert key in run["ttft"]["warm"] and key in run["ttft"]["cold"]
        assert 0 <= run["cached_token_share"] <= 1
        assert run["failed"] == 0
        assert run["read_tokens_per_s"] > 0
        assert run["config"]["workload"]["agents"] == 8
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_single_policy_report_is_flat(tmp_path):
    out = tmp_path / "r.json"
    args = [
        "bench",
        "--simulate",
        "--agents",
        "4",
        "--context",
        "20000",
        "--duration",
        "30",
        "--ramp",
        "2",
        "--policy",
        "ikcode",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["config"]["policy"] == "ikcode" and "ttft" in data


def test_bench_sensitivity_table_has_every_row_for_both_policies(tmp_path):
    out = tmp_path / "s.json"
    args = ["bench", "--simulate", "--sensitivity", "--agents", "4", "--context", "20000",
            "--duration", "30", "--ramp", "2", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    labels = [r["row"] for r in rows]
    assert labels[:4] == ["base", "ramp 300 s", "run 375 s", "run 1500 s"]
    assert "kv_bytes_per_token x0.8" in labels and "pcie_bytes_per_s x1.2" in labels
    for row in rows:
        assert set(row["policies"]) == {"fifo", "ikcode"}
        assert row["startup_floor_s"] > 0
        for summary in row["policies"].values():
            assert {"p95", "steady_p95", "cold_p95"} <= set(summary)
    assert "| base | fifo |" in result.output
    refused = CliRunner().invoke(main, ["bench", "--sensitivity"])
    assert refused.exit_code != 0 and "--simulate" in refused.output
