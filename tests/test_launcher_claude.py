"""`ikcode claude` with a stand-in `claude` executable that records what it was given."""

import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ikcode import auth
from ikcode.launcher.rolemap import CONFLICTING_VARS, MODEL_ROLE_VARS

STAND_IN = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    args = sys.argv[1:]
    settings = json.load(open(args[args.index("--settings") + 1]))
    record = {{"argv": args, "env": dict(os.environ), "settings": settings}}
    json.dump(record, open(os.environ["RECORD_TO"], "w"))
    sys.exit(7)
    """
)


@pytest.fixture(scope="module")
def answering():
    """The URL of something that answers HTTP (404 to everything): `ikcode claude --base-url`
    checks that its endpoint answers before it starts claude."""

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def run_ikcode_claude(tmp_path, *args, extra_env=None):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "claude"
    fake.write_text(STAND_IN.format(python=sys.executable))
    fake.chmod(0o755)
    record = tmp_path / "record.json"
    env = dict(os.environ)
    env.pop("IKCODE_CLAUDE_BIN", None)
    env.update(
        {
            "PATH": f"{bindir}{os.pathsep}{env['PATH']}",
            "RECORD_TO": str(record),
            "ANTHROPIC_API_KEY": "sk-ant-must-not-leak",
            "CLAUDE_CODE_USE_BEDROCK": "1",
            "ANTHROPIC_CUSTOM_HEADERS": "Proxy-Authorization: Basic c2VjcmV0",
            "ANTHROPIC_MODEL": "claude-opus-4-8",
        }
    )
    env.update(extra_env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "ikcode", "claude", *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    return proc, (json.loads(record.read_text()) if record.exists() else None)


def test_claude_gets_full_mapping_in_env_and_settings_file(tmp_path, answering):
    proc, rec = run_ikcode_claude(
        tmp_path, "--base-url", answering + "/prefix", "--", "-p", "say hi", "--output-format", "json"
    )
    assert proc.returncode == 7, proc.stderr  # claude's own exit code
    token = auth.load_or_create_token()
    for source in (rec["env"], rec["settings"]["env"]):
        for name in MODEL_ROLE_VARS:
            assert source[name] == "smollm2-135m-instruct", name
        assert source["ANTHROPIC_BASE_URL"] == answering + "/prefix"
        assert source["ANTHROPIC_AUTH_TOKEN"] == token
        assert source["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    for name in CONFLICTING_VARS:
        assert name not in rec["env"], name
        # Blanked in the settings file too: it beats the shell, and so would a user's settings.json
        # holding the name (a real API key went to this server, a Bedrock flag took the session).
        assert rec["settings"]["env"][name] == "", name
    argv = rec["argv"]
    assert argv[0] == "--settings"
    assert argv[-4:] == ["-p", "say hi", "--output-format", "json"]
    # The local profile's small-window defaults are added and announced.
    assert "--tools=Bash,Read" in argv and any(a.startswith("--system-prompt=") for a in argv)
    assert "adds claude arguments" in proc.stderr
    assert token not in proc.stderr and token not in proc.stdout


def test_a_team_members_own_token_is_sent_to_a_server_elsewhere(tmp_path, answering):
    # --base-url to another machine's server: this machine's launcher token would be a 401 there.
    own = "ik-alice-own-token"
    proc, rec = run_ikcode_claude(
        tmp_path, "--base-url", answering, "--", "-p", "hi", extra_env={"IKCODE_TOKEN": own}
    )
    assert proc.returncode == 7, proc.stderr
    assert rec["env"]["ANTHROPIC_AUTH_TOKEN"] == rec["settings"]["env"]["ANTHROPIC_AUTH_TOKEN"] == own
    assert own not in proc.stderr and own not in proc.stdout


def test_this_machines_token_never_goes_to_a_server_elsewhere(monkeypatch):
    """Without IKCODE_TOKEN, a server on another machine gets no token at all: this machine's own
    token grants everything on this machine's server (it was put in claude's env, and sent to
    the server's /v1/models by discovery)."""
    from ikcode.launcher.claude import LauncherError, mapping_for
    from ikcode.profiles import load_profile

    monkeypatch.delenv("IKCODE_TOKEN", raising=False)
    elsewhere = "http://10.255.255.1:8741"  # never contacted: refused before discovery
    assert auth.client_token(elsewhere) is None
    assert auth.client_token("http://127.0.0.1:8741") == auth.load_or_create_token()
    with pytest.raises(LauncherError, match="IKCODE_TOKEN"):
        mapping_for(load_profile("local"), base_url=elsewhere)
    monkeypatch.setenv("IKCODE_TOKEN", "ik-alice-own-token")
    assert auth.client_token(elsewhere) == "ik-alice-own-token"
    mapping = mapping_for(load_profile("local"), base_url=elsewhere, discover=False)
    assert mapping.set["ANTHROPIC_AUTH_TOKEN"] == "ik-alice-own-token"


def test_user_flags_override_profile_defaults(tmp_path, answering):
    proc, rec = run_ikcode_claude(tmp_path, "--base-url", answering, "--", "--tools", "Bash", "-p", "x")
    assert proc.returncode == 7
    argv = rec["argv"]
    assert argv.count("--tools") == 1 and argv[argv.index("--tools") + 1] == "Bash"
    assert not any(a.startswith("--tools=") for a in argv)
    assert any(a.startswith("--system-prompt=") for a in argv)  # the other default still applies
    proc, rec = run_ikcode_claude(tmp_path, "--no-default-args", "--base-url", answering, "--", "-p", "x")
    assert not any(a.startswith(("--tools", "--system-prompt")) for a in rec["argv"])


def test_a_default_flag_with_values_cannot_take_the_users_prompt(tmp_path, answering):
    """Claude Code's --tools takes any number of values: with the user's own --system-prompt, the
    kept `--tools Bash,Read` stood right before the prompt, and Claude Code 2.1.332 read the
    prompt as a tool ("was read as a value of --tools, not as a prompt"). Each default is one
    `--flag=value` argument (checked with the real client: tools Bash and Read, prompt kept)."""
    args = ("--base-url", answering, "--", "fix the bug", "-p", "--system-prompt", "be brief")
    proc, rec = run_ikcode_claude(tmp_path, *args)
    assert proc.returncode == 7
    argv = rec["argv"]
    after_settings = argv[argv.index("--settings") + 2 :]
    assert after_settings == ["--tools=Bash,Read", "fix the bug", "-p", "--system-prompt", "be brief"]


def test_missing_claude_says_how_to_install(tmp_path, answering):
    env = {"PATH": "/nonexistent", "IKCODE_HOME": os.environ["IKCODE_HOME"]}
    proc = subprocess.run(
        [sys.executable, "-m", "ikcode", "claude", "--base-url", answering, "--", "-p", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "npm install -g @anthropic-ai/claude-code" in proc.stderr


def test_an_endpoint_that_does_not_answer_is_said_before_claude_starts(tmp_path):
    proc, rec = run_ikcode_claude(tmp_path, "--base-url", "http://127.0.0.1:9", "--", "-p", "x")
    assert proc.returncode == 1 and rec is None  # claude never ran
    assert "nothing answers at http://127.0.0.1:9" in proc.stderr and "ikcode up" in proc.stderr


def test_claudes_print_flag_before_the_separator_gets_a_hint(tmp_path):
    proc, rec = run_ikcode_claude(tmp_path, "-p", "say hi")
    assert proc.returncode == 1 and rec is None
    assert "unknown profile 'say hi'" in proc.stderr and 'ikcode claude -- -p "..."' in proc.stderr


def test_a_named_profile_is_not_served_by_another_profiles_server(monkeypatch):
    from ikcode import daemon
    from ikcode.cli.serve import ensure_stack
    from ikcode.profiles import load_profile

    wanted = load_profile("llamacpp")
    running = daemon.ServerState(1, "127.0.0.1", wanted.endpoint.port, wanted.base_url, "local", "log", 0.0)
    monkeypatch.setattr(daemon, "read_state", lambda: running)
    monkeypatch.setattr(daemon, "health", lambda url, timeout_s=2.0: {"status": "ok"})
    with pytest.raises(daemon.DaemonError, match="serving profile 'local'.*not 'llamacpp'"):
        ensure_stack(wanted, asked_for=True)
    assert ensure_stack(wanted) == wanted.base_url  # no profile named: whatever serves there
    monkeypatch.setattr(daemon, "read_state", lambda: None)  # not ours: not handed our token
    with pytest.raises(daemon.DaemonError, match="something other than this user's ikcode"):
        ensure_stack(wanted, asked_for=True)
    # The other profile's server at its own URL, nothing at the one asked for: not used either.
    elsewhere = "http://127.0.0.1:18930"
    running = daemon.ServerState(1, "127.0.0.1", 18930, elsewhere, "local", "log", 0.0)
    monkeypatch.setattr(daemon, "read_state", lambda: running)
    monkeypatch.setattr(
        daemon, "health", lambda url, timeout_s=2.0: {"status": "ok"} if url == elsewhere else None
    )
    with pytest.raises(daemon.DaemonError, match="serving profile 'local'.*not 'llamacpp'"):
        ensure_stack(wanted, asked_for=True)
    assert ensure_stack(wanted) == elsewhere


def test_a_refused_endpoint_is_one_line_from_env_and_settings(monkeypatch):
    from click.testing import CliRunner

    from ikcode.cli import main

    monkeypatch.delenv("IKCODE_TOKEN", raising=False)
    for command in (["env"], ["settings"]):
        result = CliRunner().invoke(main, [*command, "--base-url", "http://10.255.255.1:9999"])
        assert result.exit_code == 1 and "IKCODE_TOKEN" in result.output, result.output
        assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


def test_the_bench_signs_in_as_claude_and_doctor_do(monkeypatch):
    from ikcode.cli.bench import _profile_token
    from ikcode.profiles import load_profile

    monkeypatch.delenv("IKCODE_TOKEN", raising=False)
    local = load_profile("local")
    assert _profile_token(local, "http://10.255.255.1:8741") is None  # it grants everything here
    assert _profile_token(local, "http://127.0.0.1:8741") == auth.load_or_create_token()
    monkeypatch.setenv("IKCODE_TOKEN", "ik-alice-own-token")
    assert _profile_token(local, "http://10.255.255.1:8741") == "ik-alice-own-token"


def test_each_launch_has_a_settings_file_of_its_own(monkeypatch):
    from ikcode import paths
    from ikcode.launcher.claude import mapping_for, write_settings_file
    from ikcode.profiles import load_profile

    folder = paths.ensure(paths.state_dir() / "claude-settings")
    ended = folder / "999999999.json"  # a launch whose process is gone
    ended.write_text("{}")
    path = write_settings_file(mapping_for(load_profile("local"), discover=False))
    assert path == folder / f"{os.getpid()}.json" and not ended.exists()
    assert oct(path.stat().st_mode & 0o777) == "0o600" and not list(folder.glob("*.tmp"))


def test_status_fails_when_the_server_does_not_answer_as_it_should(monkeypatch, answering):
    """Running (its state file says so) but refusing this machine's token, or paused: it said
    `model: null` and exited 0."""
    from click.testing import CliRunner

    from ikcode import daemon
    from ikcode.cli import main

    port = int(answering.rsplit(":", 1)[1])
    state = daemon.ServerState(os.getpid(), "127.0.0.1", port, answering, "local", "log", 0.0)
    monkeypatch.setattr(daemon, "read_state", lambda: state)
    result = CliRunner().invoke(main, ["status", "--json"])
    assert result.exit_code == 1 and json.loads(result.output)["error"], result.output


def test_rotating_the_token_says_the_server_needs_a_restart():
    from click.testing import CliRunner

    from ikcode.cli import main

    result = CliRunner().invoke(main, ["token", "--rotate"])
    assert result.exit_code == 0 and "restart" in result.stderr
