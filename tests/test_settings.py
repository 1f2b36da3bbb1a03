import json
import os
import stat

from click.testing import CliRunner

from ikcode import auth
from ikcode.cli import main
from ikcode.launcher.claude import mapping_for
from ikcode.launcher.rolemap import MODEL_ROLE_VARS
from ikcode.launcher.settings import backups_dir, resolve, write_env_block
from ikcode.profiles import load_profile


def test_token_created_once_with_mode_0600():
    first = auth.load_or_create_token()
    assert first.startswith("ik-") and len(first) > 30
    assert auth.load_or_create_token() == first
    mode = stat.S_IMODE(os.stat(auth.token_path()).st_mode)
    assert mode == 0o600
    assert auth.tokens_equal(first, first) and not auth.tokens_equal(first, first + "x")


def test_settings_write_keeps_other_keys_backs_up_and_removes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / ".claude" / "settings.local.json"
    local.parent.mkdir()
    local.write_text(
        json.dumps({"permissions": {"allow": ["Bash(ls)"]}, "env": {"FOO": "1", "ANTHROPIC_API_KEY": "x"}})
    )
    runner = CliRunner()
    result = runner.invoke(main, ["settings", "--write"])
    assert result.exit_code == 0, result.output
    data = json.loads(local.read_text())
    assert data["permissions"] == {"allow": ["Bash(ls)"]}
    assert data["env"]["FOO"] == "1"
    assert "ANTHROPIC_API_KEY" not in data["env"]
    for name in MODEL_ROLE_VARS:
        assert data["env"][name] == "smollm2-135m-instruct"
    # A plain `claude` then knows the served model too (no unrecognized_model line).
    assert data["modelOverrides"] == {"claude-opus-4-8": "smollm2-135m-instruct"}
    assert stat.S_IMODE(os.stat(local).st_mode) == 0o600
    # Backups go to ikcode's state dir, not into the project (git would not ignore them there).
    assert not list(local.parent.glob("*.bak-*")) and not list(local.parent.glob("*.tmp"))
    backups = list(backups_dir().glob("*settings.local.json*.bak-*"))
    assert backups and json.loads(backups[0].read_text())["env"]["ANTHROPIC_API_KEY"] == "x"
    token = data["env"]["ANTHROPIC_AUTH_TOKEN"]
    assert token.startswith(auth.TOKEN_PREFIX)

    result = runner.invoke(main, ["settings", "--remove"])
    assert result.exit_code == 0, result.output
    data = json.loads(local.read_text())
    assert data == {"permissions": {"allow": ["Bash(ls)"]}, "env": {"FOO": "1"}}
    # Removing leaves no copy of the token behind (a project's backups are not git-ignored), and
    # the first backup, the user's own key in it, is still there (same second, another name).
    backups = sorted(backups_dir().glob("*settings.local.json*.bak-*"))
    assert len(backups) == 2 and all(token not in b.read_text() for b in backups)
    assert ['"x"' in b.read_text() for b in backups] == [True, False]
    assert json.loads(backups[1].read_text())["env"]["FOO"] == "1"
    assert all(stat.S_IMODE(os.stat(b).st_mode) == 0o600 for b in backups)


def test_settings_write_follows_no_link_and_leaves_no_readable_copy(tmp_path, monkeypatch):
    """A repository can ship .claude/ with anything in it: a link where the settings file's temp
    file would go must not be written through, nor a leftover temp file of another mode reused."""
    monkeypatch.chdir(tmp_path)
    local = tmp_path / ".claude" / "settings.local.json"
    local.parent.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (local.parent / "settings.local.json.tmp").symlink_to(victim)
    result = CliRunner().invoke(main, ["settings", "--write"])
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "keep me"
    assert not local.is_symlink() and stat.S_IMODE(os.stat(local).st_mode) == 0o600
    assert json.loads(local.read_text())["env"]["ANTHROPIC_AUTH_TOKEN"].startswith(auth.TOKEN_PREFIX)


def test_settings_refuses_to_clobber_invalid_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / ".claude" / "settings.local.json"
    local.parent.mkdir()
    local.write_text("{not json")
    result = CliRunner().invoke(main, ["settings", "--write"])
    assert result.exit_code != 0
    assert "not valid JSON" in result.output
    assert local.read_text() == "{not json"


def test_show_flags_a_settings_file_that_overrides_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "userclaude"))
    project = tmp_path / ".claude" / "settings.json"
    project.parent.mkdir()
    project.write_text(json.dumps({"env": {"ANTHROPIC_MODEL": "claude-opus-4-8"}}))
    mapping = mapping_for(load_profile(), discover=False)
    write_env_block(tmp_path / "userclaude" / "settings.json", mapping)
    reports = {r.name: r for r in resolve(mapping, tmp_path, {"ANTHROPIC_MODEL": "shell-model"})}
    model = reports["ANTHROPIC_MODEL"]
    assert model.winner == "project" and model.status == "conflict"
    assert model.values["shell"] == "shell-model" and model.values["user"] == "smollm2-135m-instruct"
    assert reports["ANTHROPIC_DEFAULT_HAIKU_MODEL"].winner == "user"
    assert reports["ANTHROPIC_DEFAULT_HAIKU_MODEL"].status == "ok"

    result = CliRunner().invoke(main, ["settings", "--show"], terminal_width=200)
    assert result.exit_code == 1
    assert "conflict: ANTHROPIC_MODEL comes from project" in result.output
