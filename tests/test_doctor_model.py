"""`ikcode doctor --quick` passes against `ikcode up` on the default model, in under a minute."""

import json
import os
import time

import pytest

from tests.serving import free_port, ikcode, local_profile

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_doctor_quick_passes_on_the_default_model(tmp_path):
    port = free_port()
    profile = local_profile(tmp_path, port)
    started = ikcode("up", "--profile", str(profile), "--port", str(port))
    assert started.returncode == 0, started.stderr
    project = tmp_path / "project"
    project.mkdir()
    # no settings file of this machine's user or of the repository takes part
    env = {**os.environ, "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config")}
    try:
        began = time.monotonic()
        checked = ikcode("doctor", "--profile", str(profile), "--quick", "--json", env=env, cwd=project)
        elapsed = time.monotonic() - began
    finally:
        stopped = ikcode("down")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    document = json.loads(checked.stdout)
    checks = {c["name"]: c for c in document["checks"]}
    assert document["ok"] is True
    assert checks["endpoint"]["data"]["model"] == "smollm2-135m-instruct"
    gate = checks["quality_gate"]
    assert gate["status"] == "pass", gate["detail"]
    assert gate["data"]["documents"][0]["warm_hit_rate"] >= 0.95
    assert checks["silent_miss"]["status"] == "pass", checks["silent_miss"]["detail"]
    # Not a speed target (the machine may be shared; the time is printed below): a bound far
    # above the ~30 s it takes alone, which only a quick mode that ran the full checks would pass.
    assert elapsed < 300, f"quick mode took {elapsed:.1f} s"
    split = ", ".join(f"{name} {c['data'].get('seconds', 0):.1f} s" for name, c in checks.items())
    print(f"doctor --quick on the default model: {elapsed:.1f} s ({split}); {gate['detail']}")
    assert stopped.returncode == 0, stopped.stderr
