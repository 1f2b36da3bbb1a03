"""Bad input at the command line: one clear line naming what was wrong (exit 1 or 2), no
traceback, nothing started or half written. Each case once crashed, hung or did the wrong thing."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ikcode import auth, daemon
from ikcode.cli import main
from ikcode.profiles import shipped_profiles_dir
from tests.serving import free_port


def run(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.output
    )  # an exception click did not turn into a message is a traceback for the user
    return result


@pytest.mark.parametrize(
    "args,says",
    [
        (["up", "--port", "0"], "0 is not in the range 1<=x<=65535"),  # hung 600 s on port 0
        (["up", "--port", "70000"], "70000 is not in the range"),  # OverflowError traceback
        (["down", "--timeout", "nan"], "not a finite number"),  # SIGKILL at once
        (["down", "--timeout", "-1"], "-1.0 is not in the range"),
        (["logs", "-n", "-2"], "-2 is not in the range x>=0"),
        (["bench", "--duration", "nan"], "not a finite number"),  # never ended
        (["bench", "--agents", "-1"], "-1 is not in the range x>=1"),  # empty tables, exit 0
        (["bench", "--chart", "c.txt"], "the chart is a PNG"),  # traceback after the run
        (["bench", "--json", "no/such/folder/x.json"], "no folder"),
        (["plan", "--agents", "0"], "0 is not in the range x>=1"),
        (["token", "--add", "bob", "--revoke", "alice"], "one of --rotate, --add, --revoke, --list"),
    ],
    ids=lambda case: "_".join(case).replace("-", "") if isinstance(case, list) else "",
)
def test_a_bad_option_is_one_clear_line(args, says):
    result = run(*args)
    assert result.exit_code == 2 and says in result.output, result.output


def test_a_profile_that_cannot_be_read_is_named(tmp_path):
    folder = tmp_path / "mine.toml"
    folder.mkdir()
    result = run("env", "--profile", str(folder))  # IsADirectoryError traceback
    assert result.exit_code == 1 and f"cannot read profile {folder}" in result.output
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"description = '\xe9'\n")
    result = run("env", "--profile", str(latin))  # UnicodeDecodeError traceback
    assert result.exit_code == 1 and "is not UTF-8 text" in result.output


@pytest.mark.parametrize(
    "figure,says",
    [
        ('cards = "4"', "[hardware] cards must be a whole number, got '4'"),  # TypeError traceback
        ("cards = 0", "[hardware] cards must be > 0, got 0"),  # ZeroDivisionError
        ("cards = -1", "[hardware] cards must be > 0, got -1"),  # "at most -2302 agents"
    ],
    ids=["text", "zero", "negative"],
)
def test_a_hardware_figure_of_the_wrong_kind_is_named(tmp_path, figure, says):
    text = (shipped_profiles_dir() / "deepinfer-4xb200.toml").read_text().replace("cards = 4", figure, 1)
    profile = tmp_path / "bad.toml"
    profile.write_text(text)
    for command in (["plan"], ["bench", "--simulate"]):
        result = run(*command, "--profile", str(profile))
        assert result.exit_code == 1 and says in result.output, (command, result.output)


def test_plan_refuses_a_conversation_past_the_window():
    result = run("plan", "--profile", "deepinfer-4xb200", "--context", "20000000")  # "median 0.0 s"
    assert result.exit_code == 1 and "past the profile's 1,048,576-token window" in result.output


def test_simulating_a_profile_without_hardware_is_refused():
    # It simulated the B200 defaults and labelled them "local".
    result = run("bench", "--simulate", "--profile", "local")
    assert result.exit_code == 1 and "has no [hardware] table" in result.output


def test_an_unusable_ikcode_home_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.setenv("IKCODE_HOME", str(home))
    for command in (["status"], ["token"], ["down"]):
        result = run(*command)
        assert result.exit_code == 1 and "cannot use" in result.output, (command, result.output)


def test_logs_with_no_lines_prints_none():
    daemon.log_file().write_text("one\ntwo\n")
    assert run("logs", "-n", "0").output == ""  # printed every line
    assert run("logs", "-n", "1").output == "two\n"


def test_a_damaged_token_file_is_named():
    auth.team_tokens_path().parent.mkdir(parents=True, exist_ok=True)
    auth.team_tokens_path().write_text("{not json")
    for args in (["token", "--list"], ["token", "--revoke", "bob"], ["token", "--add", "bob"]):
        result = run(*args)
        assert result.exit_code == 1 and f"{auth.team_tokens_path()} is not a token file" in result.output


@pytest.mark.parametrize("mode", [["--trace", "trace.jsonl"], ["--simulate", "--sensitivity"]])
def test_a_chart_where_none_is_drawn_is_refused(tmp_path, mode):
    (tmp_path / "trace.jsonl").write_text("")
    args = [str(tmp_path / a) if a.endswith(".jsonl") else a for a in mode]
    result = run("bench", *args, "--chart", str(tmp_path / "c.png"))  # was silently ignored
    assert result.exit_code == 2 and "--chart draws a run's TTFT" in result.output


def test_a_claude_binary_that_is_a_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("IKCODE_CLAUDE_BIN", str(tmp_path))  # PermissionError traceback from exec
    from ikcode.launcher.claude import LauncherError, find_claude

    with pytest.raises(LauncherError, match="is not an executable file"):
        find_claude()


def test_plan_and_bench_take_p_for_the_profile():
    assert run("plan", "-p", "deepinfer-4xb200", "--context", "100000", "--agents", "10").exit_code == 0
    result = run("bench", "-p", "local", "--simulate")
    assert result.exit_code == 1 and "has no [hardware] table" in result.output


@pytest.mark.parametrize(
    "table,says",
    [
        ('[cache]\npolicy = "mru"', "unknown cache policy 'mru'"),  # failed after the model loaded
        ('[cache]\nhost_cache_mb = "lots"', "[cache] host_cache_mb must be a whole number"),
        ('[admission]\nttft_bound_s = "x"', "[admission] ttft_bound_s must be a number, got 'x'"),  # taken
        ("[cache]\nsnapshot_cache_mb = 0", "[cache] snapshot_cache_mb must be a whole number of MB >= 1"),
    ],
    ids=["policy", "host_cache_mb", "ttft_bound_s", "snapshot_cache_mb"],
)
def test_a_bad_cache_or_admission_value_is_refused_before_the_model_loads(tmp_path, table, says):
    text = (shipped_profiles_dir() / "local.toml").read_text()
    section, line = table.split("\n")
    key = line.split(" = ")[0]
    kept = [row for row in text.splitlines() if not row.startswith(f"{key} =")]
    text = "\n".join(kept).replace(section, table, 1)
    profile = tmp_path / "bad.toml"
    profile.write_text(text)
    result = run("up", "--foreground", "--profile", str(profile), "--port", str(free_port()))
    assert result.exit_code == 1 and says in result.output, result.output
    assert "loading model" not in daemon.log_file().read_text() if daemon.log_file().exists() else True
