"""`ikcode bench --simulate`: the JSON report's shape and the chart, through the real CLI."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ikcode.cli import main
from tests.serving import free_port


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


def test_a_live_run_against_no_server_says_why_its_turns_failed(tmp_path):
    port = free_port()  # nothing listens there
    args = ["bench", "--base-url", f"http://127.0.0.1:{port}", "--agents", "1", "--context", "100",
            "--duration", "2", "--json", str(tmp_path / "out.json")]  # fmt: skip
    result = CliRunner().invoke(main, args)
    report = json.loads((tmp_path / "out.json").read_text())
    report = report["runs"][0] if "runs" in report else report
    assert report["failed"] > 0 and any("ConnectError" in error for error in report["errors"])
    assert "turn(s) failed: ConnectError" in result.output
