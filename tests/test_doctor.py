"""`ikcode doctor` against real servers on 127.0.0.1 (the tiny model behind the real gateway): a
healthy one passes; a cache that never hits, a settings file that overrides the model and an
unreachable endpoint each fail the right check with the right reason."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ikcode import auth
from ikcode.cli import main
from ikcode.doctor import FAIL, FULL, PASS, QUICK, SKIP, WARN, DoctorContext, report, run_checks
from ikcode.doctor.quality_gate import document_sizes
from ikcode.doctor.silent_miss import analyse
from ikcode.profiles import load_profile
from tests.serving import free_port
from tests.test_doctor_log import log_record as _record
from tests.test_gateway_api import serve
from tests.test_gateway_support import tiny_tokenizer, wait_idle
from tests.tiny_model import tiny_engine

NETWORK_CHECKS = ["endpoint", "contract", "quality_gate", "silent_miss", "tail", "capacity"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def start_server(tokenizer, tmp_path, **engine_config):
    engine = tiny_engine(kv_memory_bytes=4 * 1024 * 1024, **engine_config)  # a 2048-token window
    engine.start()
    token = auth.load_or_create_token()
    log = tmp_path / "requests.jsonl"
    server = serve(engine, tokenizer, tmp_path, auth_tokens={"launcher": token}, request_log_path=log)
    return engine, server, token, log


def doctor(url, token, project, log=None, only=None, environ=None):
    ctx = DoctorContext(
        profile=load_profile("local"),
        base_url=url,
        token=token,
        project_dir=project,
        environ=environ if environ is not None else {"PATH": os.environ.get("PATH", "")},
        request_log=log,
    )
    return {r.name: r for r in run_checks(ctx, only)}


def test_healthy_tiny_server_passes(tokenizer, tmp_path, project):
    engine, server, token, log = start_server(tokenizer, tmp_path)
    try:
        started = time.monotonic()
        results = doctor(server.url, token, project, log, only=NETWORK_CHECKS + ["mapping"])
        elapsed = time.monotonic() - started
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    for name, result in results.items():
        assert result.status == PASS, (name, result.detail)
    gate = results["quality_gate"].data["documents"][0]
    assert gate["match"] and gate["warm_hit_rate"] >= 0.95 and gate["cold_hit_rate"] < 0.5
    assert gate["prompt_tokens"] > 500 and gate["cold_ttft_s"] > 0 and gate["warm_ttft_s"] > 0
    assert results["endpoint"].data["model"] == "tiny" and results["endpoint"].data["context_window"] == 2048
    assert results["silent_miss"].data["repeat_hit_rate"] >= 0.95
    assert results["capacity"].data["engine"]["kv_blocks_total"] == 512
    document = report(list(results.values()))
    assert document["ok"] is True and set(document["checks"][0]) == {
        "name",
        "status",
        "detail",
        "fix",
        "data",
    }
    json.dumps(document)  # plain JSON
    assert elapsed < 30


def test_cache_that_never_hits_fails_gate_and_silent_miss(tokenizer, tmp_path, project):
    # The published bug: the cache entry is finalised at the final token, nothing left to commit.
    engine, server, token, log = start_server(tokenizer, tmp_path, final_token_bug=True)
    try:
        results = doctor(server.url, token, project, log, only=NETWORK_CHECKS)
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    gate, miss = results["quality_gate"], results["silent_miss"]
    assert gate.status == FAIL, gate.detail
    assert "read only 0.0% from cache" in gate.detail and "silent cache miss" in gate.detail
    assert "released" in gate.fix or "releases" in gate.fix
    assert gate.data["documents"][0]["match"]  # the answers still agree: only the cache is broken
    assert miss.status == FAIL, miss.detail
    assert "missed the cache although they repeated the previous prompt" in miss.detail
    assert "the cache never hit" in miss.detail and "final token" in miss.detail
    assert miss.data["miss_count"] >= 1 and miss.data["any_hit"] is False
    # the other checks still pass: the endpoint works, it only forgets
    assert results["endpoint"].status == PASS and results["contract"].status == PASS


def test_project_settings_overriding_the_model_fail_mapping(project):
    settings = project / ".claude" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"env": {"ANTHROPIC_MODEL": "claude-opus-4-8"}}))
    result = doctor("http://127.0.0.1:1", "tok", project, only=["mapping"])["mapping"]
    assert result.status == FAIL
    assert "ANTHROPIC_MODEL=claude-opus-4-8 from project settings" in result.detail
    assert str(settings) in result.detail and "smollm2-135m-instruct" in result.detail
    assert "remove ANTHROPIC_MODEL" in result.fix
    # a stale shell variable alone only warns: `ikcode claude` replaces it in the child
    settings.unlink()
    env = {"PATH": os.environ.get("PATH", ""), "ANTHROPIC_MODEL": "claude-opus-4-8"}
    shell = doctor("http://127.0.0.1:1", "tok", project, only=["mapping"], environ=env)["mapping"]
    assert shell.status == WARN and "from the shell" in shell.detail


def test_unreachable_endpoint_fails_fast(project):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    runner = CliRunner()
    outcome = runner.invoke(main, ["doctor", "--base-url", url, "--json"], catch_exceptions=False)
    assert time.monotonic() - started < 5
    assert outcome.exit_code == 1
    document = json.loads(outcome.output)
    assert document["ok"] is False
    checks = {c["name"]: c for c in document["checks"]}
    assert checks["endpoint"]["status"] == FAIL
    assert f"cannot connect to {url}: connection refused" in checks["endpoint"]["detail"]
    assert "ikcode up" in checks["endpoint"]["fix"]
    # The request log is found through the running server: with none, its checks are not run
    # (a warning to run doctor elsewhere would send the user looking for the wrong thing).
    for name in ("contract", "quality_gate", "capacity", "silent_miss", "tail"):
        assert checks[name]["status"] == SKIP, name


def test_table_output_and_exit_code(project):
    outcome = CliRunner().invoke(main, ["doctor", "--base-url", "http://127.0.0.1:1", "--only", "endpoint"])
    assert outcome.exit_code == 1
    assert "endpoint" in outcome.output and "fail" in outcome.output


def test_claude_version(claude_bin, tmp_path, project):
    env = {"PATH": os.environ.get("PATH", ""), "IKCODE_CLAUDE_BIN": claude_bin, "HOME": str(tmp_path)}
    real = doctor("http://127.0.0.1:1", "tok", project, only=["claude"], environ=env)["claude"]
    assert real.status == PASS and real.data["version"] >= "2.1.181", real.detail
    old = tmp_path / "claude"
    old.write_text("#!/bin/sh\necho '2.1.100 (Claude Code)'\n")
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    env["IKCODE_CLAUDE_BIN"] = str(old)
    outdated = doctor("http://127.0.0.1:1", "tok", project, only=["claude"], environ=env)["claude"]
    assert outdated.status == WARN and "before 2.1.181" in outdated.detail
    # What npm installs on Node 20 when asked without a version: it works, but is not the newest.
    old.write_text("#!/bin/sh\necho '2.1.197 (Claude Code)'\n")
    behind = doctor("http://127.0.0.1:1", "tok", project, only=["claude"], environ=env)["claude"]
    assert behind.status == WARN and "older than 2.1.332" in behind.detail
    assert "@anthropic-ai/claude-code@$(npm view" in behind.fix
    missing = doctor("http://127.0.0.1:1", "tok", project, only=["claude"], environ={"PATH": str(project)})
    assert missing["claude"].status == WARN and "not on PATH" in missing["claude"].detail


def test_log_tells_a_changed_system_line_from_a_miss(tokenizer, tmp_path):
    """The gateway logs how much of a prompt repeats the session's previous one."""
    import httpx

    engine, server, token, log = start_server(tokenizer, tmp_path)
    headers = {"Authorization": f"Bearer {token}", "X-Claude-Code-Session-Id": "s1"}
    long_text = "notes " * 200
    try:
        for system in ("system line one", "system line one", "system line TWO"):
            body = {
                "model": "tiny",
                "max_tokens": 2,
                "system": system,
                "messages": [{"role": "user", "content": long_text}],
            }
            assert (
                httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=30).status_code
                == 200
            )
            wait_idle(engine)
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    first, same, changed = records
    assert "prefix_shared_tokens" not in first
    assert same["prefix_shared_tokens"] == same["previous_prompt_tokens"] == first["prompt_tokens"]
    assert "prefix_break" not in same
    assert changed["prefix_break"] == "system" and changed["prefix_shared_tokens"] < 20
    result = analyse(records)
    assert (
        result["miss_count"] == 0 and result["break_count"] == 1 and result["breaks"][0]["where"] == "system"
    )


def test_document_sizes_follow_the_window():
    assert document_sizes(8192, QUICK) == [2500]
    assert document_sizes(2048, QUICK) == [921]
    # Engines with large blocks (DeepInfer: 128) get a document long enough for the 95% bar.
    assert document_sizes(1_000_000, QUICK, block_size=128) == [6400]
    full = document_sizes(8192, FULL)
    assert len(full) == 3 and max(full) <= 8192 - 512
    big = document_sizes(1_000_000, FULL)
    assert len(big) == 5 and max(big) == 200_000


def test_full_mode_asks_several_documents(tokenizer, tmp_path, project):
    engine, server, token, log = start_server(tokenizer, tmp_path)
    try:
        ctx = DoctorContext(profile=load_profile("local"), base_url=server.url, token=token, mode=FULL,
                            project_dir=project, request_log=log)  # fmt: skip
        gate = {r.name: r for r in run_checks(ctx, ["quality_gate"])}["quality_gate"]
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    assert gate.status == PASS, gate.detail
    sizes = [d["prompt_tokens"] for d in gate.data["documents"]]
    assert len(sizes) == 3 and sizes == sorted(sizes) and sizes[-1] > 1500
    assert all(d["match"] and d["warm_hit_rate"] >= 0.95 for d in gate.data["documents"])


def test_the_tested_claude_version_is_the_one_ci_pins():
    from ikcode.launcher.claude import TESTED_CLAUDE_VERSION

    test_sh = (Path(__file__).resolve().parent.parent / "scripts" / "test.sh").read_text()
    pinned = re.search(r"IKCODE_CLAUDE_VERSION:-([0-9.]+)", test_sh).group(1)
    assert pinned == ".".join(map(str, TESTED_CLAUDE_VERSION))


def test_a_cache_that_serves_other_prompts_blocks_fails_the_gate(tokenizer, tmp_path, project, monkeypatch):
    """Cache keys that ignore the tokens (here: position only) serve a new document another
    prompt's KV. The salted cold ask then hits too, so cold = warm compares one wrong answer with
    itself: the gate must fail on the cold ask's hit."""
    from hashlib import blake2b

    import ikcode.cache.hashing as hashing
    import ikcode.engines.embedded.engine as embedded_engine
    import ikcode.engines.embedded.sequence as embedded_sequence
    import ikcode.gateway.block_hashes as gateway_hashes
    from ikcode.doctor.client import EndpointClient
    from ikcode.doctor.needle import needle_document, request_body

    def position_only(token_ids, block_size, salt="", shared_prefix_tokens=0, parent=None):
        keys, previous = [], (hashing._ROOT if parent is None else parent)
        for _ in range(len(token_ids) // block_size):
            previous = blake2b(previous + b"position", digest_size=16).digest()
            keys.append(previous)
        return keys

    for module in (hashing, gateway_hashes, embedded_engine, embedded_sequence):
        if hasattr(module, "hash_blocks"):
            monkeypatch.setattr(module, "hash_blocks", position_only)
    engine, server, token, log = start_server(tokenizer, tmp_path)
    try:
        client = EndpointClient(server.url, token)
        other = needle_document(1500, "0123456789abcdef")  # another user's document, cached first
        assert client.stream_message(request_body("tiny", other), "other-session").status == 200
        client.close()
        wait_idle(engine)
        gate = doctor(server.url, token, project, log, only=["quality_gate"])["quality_gate"]
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    assert gate.status == FAIL, gate.detail
    assert "the cold ask, a document never sent before, read" in gate.detail
    assert "serves blocks of other prompts" in gate.detail


def test_a_wedged_engine_behind_a_live_gateway_is_a_bounded_failure(tokenizer, tmp_path):
    """The gateway pings every stream, which resets httpx's read timeout: a request the engine
    never answers must still end within the client's bound, as an error."""
    from ikcode.doctor.client import EndpointClient
    from ikcode.engines.base import RequestStream

    class Wedged:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def submit(self, request):
            return RequestStream(request.request_id, on_abort=lambda request_id: None)

        def abort(self, request_id):
            pass

    engine = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    engine.start()
    server = serve(Wedged(engine), tokenizer, tmp_path, ping_interval_s=0.5)
    try:
        client = EndpointClient(server.url, "tok-alice", read_timeout_s=3.0)
        started = time.monotonic()
        body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
        result = client.stream_message(body)
        elapsed = time.monotonic() - started
        client.close()
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    assert result.error is not None and "no whole answer within 3 s" in result.error["error"]["message"]
    assert elapsed < 10, elapsed


def test_the_warm_hit_wanted_allows_two_blocks_of_a_short_document():
    from ikcode.doctor.quality_gate import MIN_WARM_HIT, UNKNOWN_BLOCK_SIZE, min_warm_hit

    assert min_warm_hit(2400, 16) == MIN_WARM_HIT  # the embedded engine's blocks: 95% as before
    assert abs(min_warm_hit(2654, UNKNOWN_BLOCK_SIZE) - (1 - 256 / 2654)) < 1e-9  # a front over DeepInfer
    assert min_warm_hit(64_000, 128) == MIN_WARM_HIT
    # A small window with big blocks: never below half (it went to 0.0 at 256 tokens, and under).
    assert min_warm_hit(256, 128) == min_warm_hit(200, 128) == 0.5


def test_misses_of_an_earlier_run_in_the_same_log_do_not_fail_this_one(tokenizer, tmp_path, project):
    """The request log is appended to across restarts: a silent miss logged before a fix must not
    fail the fixed server (doctor reads the records since /health's started_at)."""
    engine, server, token, log = start_server(tokenizer, tmp_path)
    earlier = [_record("old", 1000, 0, 500), _record("old", 1200, 0, 500, shared=1000, second=1)]
    earlier += [_record(f"slow{i}", 1000, 990, 600_000, second=2) for i in range(10)]  # queued warm turns
    log.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    try:
        checks = ["endpoint", "quality_gate", "silent_miss", "tail"]
        results = doctor(server.url, token, project, log, only=checks)
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    assert results["quality_gate"].status == PASS, results["quality_gate"].detail
    assert results["silent_miss"].status != FAIL, results["silent_miss"].detail
    assert results["tail"].status != FAIL, results["tail"].detail  # it read the earlier run's too
    assert analyse(earlier)["miss_count"] == 1  # the earlier run's records do hold a miss


def test_an_endpoint_that_streams_nothing_does_not_pass_the_gate(tokenizer, tmp_path, project):
    """Both answers empty compare equal: the gate passed without comparing anything (a reasoning
    model's 16 tokens of thinking, or a server streaming no text at all)."""
    from tests.test_gateway_support import ScriptedEngine

    engine = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    scripted = ScriptedEngine(engine, [tokenizer.token_to_id("<|im_end|>")])  # end of turn at once
    scripted.start()
    token = auth.load_or_create_token()
    server = serve(scripted, tokenizer, tmp_path, auth_tokens={"launcher": token})
    try:
        gate = doctor(server.url, token, project, only=["quality_gate"])["quality_gate"]
    finally:
        server.stop()
        scripted.shutdown(drain_timeout_s=1)
    assert gate.status == WARN, (gate.status, gate.detail)
    assert "streamed nothing" in gate.detail
