import json
import shutil
import subprocess

import pytest

from ikcode.launcher.rolemap import CONFLICTING_VARS, MODEL_ROLE_VARS, claude_env
from ikcode.launcher.shells import render

ROLE_AND_ENDPOINT_VARS = (
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_AUTH_TOKEN",
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_FABLE_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
)


def make(model="served-model", url="http://127.0.0.1:8741", token="ik-secret", window=8192, out=1024):
    return claude_env(
        served_model=model, base_url=url, token=token, context_window=window, max_output_tokens=out
    )


def test_all_nine_role_and_endpoint_variables_are_set():
    mapping = make()
    for name in ROLE_AND_ENDPOINT_VARS:
        assert name in mapping.set, name
    for name in MODEL_ROLE_VARS:
        assert mapping.set[name] == "served-model"
    assert mapping.set["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8741"
    assert mapping.set["ANTHROPIC_AUTH_TOKEN"] == "ik-secret"


def test_cache_friendly_and_quiet_settings():
    mapping = make(window=32768, out=4096)
    assert mapping.set["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert mapping.set["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert mapping.set["DISABLE_TELEMETRY"] == "1"
    assert mapping.set["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    assert "DISABLE_PROMPT_CACHING" not in mapping.set


def test_compaction_before_the_served_window_without_client_warnings():
    mapping = make(window=8192, out=1024)
    # The client believes the served window and compacts at 3/4 of it (measured behaviour:
    # bench/compaction_probe.py); values under 100K in AUTO_COMPACT_WINDOW make it warn.
    assert mapping.set["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192"
    assert mapping.set["CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE"] == "6144"
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in mapping.set
    child = mapping.apply({"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "8192", "PATH": "/bin"})
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in child
    assert make(window=131072).set["CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE"] == "98304"


def test_conflicts_removed_from_child_environment():
    mapping = make()
    assert set(CONFLICTING_VARS) <= set(mapping.unset)
    parent = {
        "ANTHROPIC_API_KEY": "sk-ant-other",
        "CLAUDE_CODE_USE_BEDROCK": "1",
        "CLAUDE_CODE_USE_VERTEX": "1",
        "ANTHROPIC_MODEL": "claude-opus-4-8",
        "PATH": "/bin",
    }
    child = mapping.apply(parent)
    assert "ANTHROPIC_API_KEY" not in child
    assert "CLAUDE_CODE_USE_BEDROCK" not in child and "CLAUDE_CODE_USE_VERTEX" not in child
    assert child["ANTHROPIC_MODEL"] == "served-model"
    assert child["PATH"] == "/bin"


def test_api_key_kept_when_no_token():
    mapping = make(token=None)
    assert "ANTHROPIC_AUTH_TOKEN" not in mapping.set
    assert "ANTHROPIC_API_KEY" not in mapping.unset


def test_empty_model_name_refused():
    with pytest.raises(ValueError):
        make(model="")


NASTY_MODEL = 'my model\'s "v2" $HOME `id` \\ end'
NASTY_URL = "http://127.0.0.1:8741/a path/it's $x"


def _eval_and_dump(shell: str, script: str, names) -> dict:
    dump = {
        "bash": "; ".join(f'printf "%s\\0" "${n}"' for n in names),
        "zsh": "; ".join(f'printf "%s\\0" "${n}"' for n in names),
        "fish": "; ".join(f'printf "%s\\0" "${n}"' for n in names),
    }[shell]
    env = {"PATH": "/usr/bin:/bin", "ANTHROPIC_API_KEY": "leak", "HOME": "/tmp"}
    if shell == "fish":
        program = f"{script}\n{dump}"
        out = subprocess.run([shell, "-c", program], capture_output=True, env=env, check=True).stdout
    else:
        program = f'eval "$IKCODE_SCRIPT"\n{dump}\nprintf "%s\\0" "${{ANTHROPIC_API_KEY-UNSET}}"'
        env["IKCODE_SCRIPT"] = script
        out = subprocess.run([shell, "-c", program], capture_output=True, env=env, check=True).stdout
    values = out.decode().split("\0")
    return dict(zip(list(names) + ["__api_key"], values, strict=False))


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_quoting_survives_eval(shell):
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    mapping = make(model=NASTY_MODEL, url=NASTY_URL, token="tok'en\"$x")
    names = list(mapping.set)
    got = _eval_and_dump(shell, render(mapping, shell), names)
    for name in names:
        assert got[name] == mapping.set[name], name
    if shell != "fish":
        assert got["__api_key"] == "UNSET"


def test_powershell_and_json_rendering():
    mapping = make(model="it's")
    ps = render(mapping, "powershell")
    assert "$env:ANTHROPIC_MODEL = 'it''s'" in ps
    assert "Remove-Item Env:ANTHROPIC_API_KEY" in ps
    data = json.loads(render(mapping, "json"))
    assert data["set"]["ANTHROPIC_MODEL"] == "it's"
    assert "ANTHROPIC_API_KEY" in data["unset"]
    with pytest.raises(ValueError):
        render(mapping, "tcsh")
